"""The sections of `bench_model.py`, each timing hfgpt beside transformers' model on the same weights (and
the other routes to speed, `--peers`) with the harness's interleaved rounds, and `run`, which measures the
machine's limits and runs the sections asked for. What each section measures: `bench_model.py`'s docstring.
"""

from __future__ import annotations

import copy
import datetime
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from contenders import (
    COMPILED,
    CTRANSLATE2,
    FAMILIES,
    INT8,
    INT8_COMPILED,
    PEERS,
    TORCHAO,
    VS_CTRANSLATE2,
    WRONG_STEP,
    Decoder,
    build_ours,
    build_peer,
    compiled_decoding,
    compiled_plain_hfgpt,
    decoding_accuracy,
    first_token_prompt,
    greedy,
    left_padded_prompts,
    module_decoder,
    plain_hfgpt,
    torchao_int8,
)
from harness import (
    PROFILES,
    SECTIONS,
    Context,
    Row,
    Timing,
    alone_rounds,
    autocast_to,
    bfloat16_native,
    decode_weight_bytes,
    forward_flops,
    forward_pass,
    inference,
    interleaved,
    interleaved_with_floors,
    machine_info,
    make_train_step,
    measure_hardware,
    run_worker,
    with_probes,
)
from torch import nn
from transformers import CompileConfig, GPT2LMHeadModel
from transformers import logging as hf_logging

from hfgpt.cpu import quantize_for_decoding
from hfgpt.cpu.runtime import keep_freed_memory
from hfgpt.modeling import GPTForCausalLM


def prefill_rows(ctx: Context, family: str, ours: nn.Module, peer: nn.Module) -> list[Row]:
    """Forwards in float32 and inside bfloat16 autocast (MFU against the matmul rate of that precision);
    with the `compile` peer, the compiled plain model beside them in float32."""
    rows = []
    compiled = compiled_plain_hfgpt(ours) if "compile" in ctx.peers else None
    for batch, seq_len in ctx.profile["prefill_shapes"]:
        ids = torch.randint(0, ours.config.vocab_size, (batch, seq_len), device=ctx.device)
        for precision, dtype in (("", None), (", bf16 autocast", torch.bfloat16))[: 2 if ctx.bfloat16 else 1]:
            with torch.inference_mode(), autocast_to(ids.device, dtype):
                reference = ours(ids).logits.float()
                err = (reference - peer(ids).logits.float()).abs().max().item()
                # (the same call as `forward_pass`'s, so that this first call is the one that compiles)
                compiled_err = (
                    (compiled(ids).logits.float() - reference).abs().max().item()
                    if compiled is not None and dtype is None
                    else None
                )
            for keep, label in ((0, "all logits"), (1, "last logits")):
                fns = {
                    "hfgpt": lambda m=ours, k=keep, x=ids, d=dtype: forward_pass(m, x, k, d),
                    "transformers": lambda m=peer, k=keep, x=ids, d=dtype: forward_pass(m, x, k, d),
                }
                extra_of = {}
                if compiled_err is not None:
                    fns[COMPILED] = lambda m=compiled, k=keep, x=ids: forward_pass(m, x, k)
                    extra_of[COMPILED] = {"max_abs_logit_diff_from_hfgpt": compiled_err}
                flops = forward_flops(ours.config, batch, seq_len, seq_len if keep == 0 else 1)
                case = f"B={batch}x{seq_len}, {label}{precision}"
                rows += utilisation_rows(
                    ctx,
                    "prefill",
                    family,
                    case,
                    fns,
                    batch * seq_len,
                    flops,
                    dtype,
                    extra_of=extra_of,
                    max_abs_logit_diff=err,
                )
    return rows


def utilisation_rows(
    ctx: Context,
    section: str,
    family: str,
    case: str,
    fns: dict[str, Callable[[], Any]],
    tokens: int,
    flops: float,
    dtype: torch.dtype | None,
    step_time: bool = False,
    extra_of: dict[str, dict[str, Any]] | None = None,
    **extra: Any,
) -> list[Row]:
    """Times `fns` (`with_probes`) and gives one prefill or training row per implementation: tokens/s,
    and the MFU against the matmul rate of `dtype` (float32 for None), the run's and the one timed
    between the model runs; `extra` adds the rows' own figures (`extra_of` one contender's),
    `step_time` each row's s/step."""
    repeats = ctx.prefill_repeats if section == "prefill" else ctx.repeats
    timings, concurrent = with_probes(ctx, fns, dtype or torch.float32, repeats)
    peak_key = "bf16_matmul_flops_per_s" if dtype == torch.bfloat16 else "matmul_flops_per_s"
    return [
        Row(
            section,
            family,
            case,
            impl,
            **timing.summary(),
            rate=tokens / timing.median,
            unit="tok/s",
            mfu=flops / timing.median / ctx.hardware[peak_key],
            extra={
                **extra,
                **(extra_of or {}).get(impl, {}),
                **({"s_per_step": timing.median} if step_time else {}),
                "flops": flops,
                "peak_key": peak_key,
                "concurrent_matmul_flops_per_s": concurrent,
                "mfu_concurrent": flops / timing.median / concurrent,
            },
        )
        for impl, timing in timings.items()
    ]


def ttft_rows(ctx: Context, family: str, ours: nn.Module, peer: nn.Module) -> list[Row]:
    """Time to first token: `generate()` over one prompt of `prompt_len` tokens (B=1, no padding) with
    `max_new_tokens=1`, the prompt's forward and the first token as a user waits for them; the two models'
    tokens compared. A ratio is transformers' time over hfgpt's (above 1x: hfgpt answers sooner)."""
    length = ctx.profile["prompt_len"]
    prompts = first_token_prompt(length, ours.config.vocab_size, ctx.device)
    tokens: dict[str, torch.Tensor] = {}

    def first_token(name: str, model: nn.Module) -> Callable[[], None]:
        return lambda: tokens.__setitem__(name, inference(greedy, model, prompts, 1))

    fns = {"hfgpt": first_token("hfgpt", ours), "transformers": first_token("transformers", peer)}
    timings = interleaved(fns, ctx.ttft_repeats, ctx.device)
    same = bool(torch.equal(tokens["hfgpt"], tokens["transformers"]))
    return [
        Row(
            "ttft",
            family,
            f"B=1, {length}-token prompt + first token",
            impl,
            **timing.summary(),
            rate=1 / timing.median,
            unit="first tokens/s",
            extra={"ms_to_first_token": 1000 * timing.median, "tokens_identical": same},
        )
        for impl, timing in timings.items()
    ]


def decode_rows(ctx: Context, family: str, ours: nn.Module, peer: nn.Module) -> list[Row]:
    """Greedy decoding of left-padded prompts by hfgpt and transformers' model; with the `compile` peer,
    the plain model compiled beside them (its decoding step, on a static cache: `compiled_decoding`)."""
    rows = []
    new = ctx.profile["new_tokens"]
    compiled = plain_hfgpt(ours).eval() if "compile" in ctx.peers else None
    kwargs = compiled_decoding(compiled) if compiled is not None else {}
    for batch in ctx.profile["decode_batches"]:
        prompts = left_padded_prompts(batch, ctx.profile["prompt_len"], ours.config.vocab_size, 0, ctx.device)
        # The timed runs' own tokens are compared (OpenAIGPT's recomputing decode is too slow to run twice).
        tokens: dict[str, torch.Tensor] = {}

        def run(name: str, model: nn.Module, p: dict = prompts, out: dict = tokens, **kwargs: Any) -> None:
            out[name] = inference(lambda: greedy(model, p, new, **kwargs))

        fns = {"hfgpt": lambda: run("hfgpt", ours), "transformers": lambda: run("transformers", peer)}
        if compiled is not None:
            run(COMPILED, compiled, **kwargs)  # (compiles for this batch, untimed)
            fns[COMPILED] = lambda m=compiled, k=kwargs: run(COMPILED, m, **k)
        repeats_of = {"transformers": ctx.profile["slow_peer_repeats"]} if family == "gpt1" else None
        timings, floor, floor_now = interleaved_with_floors(ctx, ours, fns, repeats_of)
        same = bool(torch.equal(tokens["hfgpt"], tokens["transformers"]))
        for impl, timing in timings.items():
            rows.append(
                Row(
                    "decode",
                    family,
                    f"B={batch}, {ctx.profile['prompt_len']}+{new} tokens",
                    impl,
                    **timing.summary(),
                    rate=batch * new / timing.median,
                    unit="new tok/s",
                    extra={
                        "tokens_identical": same and bool(torch.equal(tokens[impl], tokens["hfgpt"])),
                        "ms_per_step": 1000 * timing.median / new,
                        "floor_ms_per_step": 1000 * floor,
                        "floor_same_minutes_ms_per_step": 1000 * floor_now,
                    },
                )
            )
    return rows


def lowp_rows(ctx: Context, family: str, ours: GPTForCausalLM, peer: nn.Module) -> list[Row]:
    """Decoding copies (B=1): bfloat16 weights, int8 (`Int8Linear`) and, on the CPU, the float32
    `DecodingLinear` copy (all from `quantize_for_decoding`), against float32 hfgpt and transformers,
    with the accuracy cost: logit error on a prefill and greedy agreement; with the `compile` peer, the
    int8 copy with its decoding step compiled (static cache); with the `torchao` and `ctranslate2` peers,
    their int8 decoding beside them (CTranslate2 converts GPT-2 only)."""
    new = ctx.profile["new_tokens"]
    prompts = left_padded_prompts(1, ctx.profile["prompt_len"], ours.config.vocab_size, 0, ctx.device)
    variants: dict[str, Decoder] = {
        "hfgpt fp32": module_decoder(ours),
        "transformers fp32": module_decoder(peer),
    }
    if ctx.device == "cpu":
        if ctx.bfloat16:
            variants["hfgpt bf16"] = module_decoder(quantize_for_decoding(ours, torch.bfloat16))
        variants[INT8] = module_decoder(quantize_for_decoding(ours))
        if "compile" in ctx.peers:
            int8 = quantize_for_decoding(ours)
            variants[INT8_COMPILED] = module_decoder(int8, **compiled_decoding(int8))
        variants["hfgpt fp32 copy"] = module_decoder(quantize_for_decoding(ours, torch.float32))
        if "torchao" in ctx.peers:
            quantized, kwargs = torchao_int8(ours)
            decoder = module_decoder(quantized, **kwargs)
            try:  # compiles the decoding step (untimed); a model it cannot compile gets no row
                with torch.inference_mode():
                    decoder.greedy(prompts, 2)
                variants[TORCHAO] = decoder
            except Exception as error:  # noqa: BLE001 (torch.compile's errors have no common type)
                print(f"[{family} lowp: no torchao row: {type(error).__name__}: {error}]", file=sys.stderr)
    else:
        variants["hfgpt bf16"] = module_decoder(copy.deepcopy(ours).to(torch.bfloat16))
    ids = torch.randint(0, ours.config.vocab_size, (2, min(128, ours.config.n_positions)), device=ctx.device)
    with torch.inference_mode():
        reference = ours(ids).logits.float()
        ref_tokens = greedy(ours, prompts, new)
        accuracy = {}
        # Each variant's first greedy run here is also its warm-up (and where the compiled steps compile).
        for name, decoder in variants.items():
            logits = decoder.logits(ids).to(reference.device)
            tokens = decoder.greedy(prompts, new).to(ref_tokens.device)
            accuracy[name] = decoding_accuracy(logits, reference, tokens, ref_tokens)
            if decoder.compiled_step_error is not None:
                error = decoder.compiled_step_error(prompts)
                accuracy[name]["compiled_step_rel_err"] = error
                if not error <= WRONG_STEP:
                    accuracy[name]["wrong"] = (
                        f"a compiled step's logits off the eager step's by {error:.2g}x their norm"
                    )
                    print(f"[{family} lowp: {name}: {accuracy[name]['wrong']}]", file=sys.stderr)
    # CTranslate2 is timed in processes of its own (`decoder_alone`); hfgpt's int8 copies, the contenders it
    # is set against, then are too, rather than interleaved here beside four other models.
    ctranslate2 = ctx.device == "cpu" and "ctranslate2" in ctx.peers and isinstance(peer, GPT2LMHeadModel)
    alone = (
        [CTRANSLATE2, INT8, *([INT8_COMPILED] if INT8_COMPILED in variants else [])] if ctranslate2 else []
    )
    fns = {
        name: (lambda d=decoder: inference(d.greedy, prompts, new))
        for name, decoder in variants.items()
        if name not in alone
    }
    rows = []
    # OpenAIGPT recomputes the whole sequence per token: its accuracy run above doubles as a warm-up.
    slow = {"transformers fp32": ctx.profile["slow_peer_repeats"]} if family == "gpt1" else None
    timings, floor, floor_now = interleaved_with_floors(ctx, ours, fns, slow)
    if alone:
        runs = alone_rounds(family, ctx.profile_name, alone, ctx.decode_repeats, ctx.profile["alone_rounds"])
        accuracy[CTRANSLATE2] = runs[CTRANSLATE2]["accuracy"]
        peer_rounds = runs[CTRANSLATE2]["round_medians"]
        for name in alone:
            timings[name] = Timing(runs[name]["times"])
            accuracy[name]["measured"] = runs[name]["measured"]
            if name != CTRANSLATE2:  # (>1: the copy was the faster in that round)
                accuracy[name][VS_CTRANSLATE2] = [
                    peer / own for peer, own in zip(peer_rounds, runs[name]["round_medians"], strict=True)
                ]
    for name, timing in timings.items():
        rows.append(
            Row(
                "lowp",
                family,
                f"B=1, {ctx.profile['prompt_len']}+{new} tokens",
                name,
                **timing.summary(),
                rate=new / timing.median,
                unit="new tok/s",
                extra={
                    **accuracy[name],
                    "ms_per_step": 1000 * timing.median / new,
                    "fp32_floor_ms_per_step": 1000 * floor,
                    "fp32_floor_same_minutes_ms_per_step": 1000 * floor_now,
                },
            )
        )
    return rows


def train_rows(ctx: Context, family: str, ours: nn.Module, peer: nn.Module) -> list[Row]:
    """Training steps in float32 and inside bfloat16 autocast; with the `compile` peer, the compiled plain
    model's step beside them in float32 (compiled on the warm-up step, forward and backward)."""
    batch, seq_len = ctx.profile["train_shape"]
    ids = torch.randint(0, ours.config.vocab_size, (batch, seq_len), device=ctx.device)
    flops = 3 * forward_flops(ours.config, batch, seq_len, seq_len)
    setups = [("fp32", None), ("bf16 autocast", torch.bfloat16)][: 2 if ctx.bfloat16 else 1]
    rows = []
    for label, dtype in setups:
        # Copies, so the optimizer steps do not change the weights the other sections use.
        a, b = copy.deepcopy(ours), copy.deepcopy(peer)
        fns = {"hfgpt": make_train_step(a, ids, dtype), "transformers": make_train_step(b, ids, dtype)}
        if "compile" in ctx.peers and dtype is None:
            fns[COMPILED] = make_train_step(compiled_plain_hfgpt(ours), ids)
        case = f"B={batch}x{seq_len}, {label}, fused AdamW"
        rows += utilisation_rows(
            ctx, "train", family, case, fns, batch * seq_len, flops, dtype, step_time=True
        )
        del a, b, fns
    return rows


def compile_rows(ctx: Context, family: str, ours: GPTForCausalLM, peer: nn.Module) -> list[Row]:
    """generate() with a StaticCache and the forward compiled by transformers' compile_config, for the
    plain hfgpt model (`plain_hfgpt`: what compiles is the model file) and transformers' model. OpenAIGPT
    has no cache, so for GPT-1 only hfgpt runs here."""
    new = ctx.profile["new_tokens"]
    prompts = left_padded_prompts(1, ctx.profile["prompt_len"], ours.config.vocab_size, 0, ctx.device)
    contenders = {"hfgpt": ours} if family == "gpt1" else {"hfgpt": ours, "transformers": peer}
    fns, compile_s, tokens = {}, {}, {}
    for name, model in contenders.items():
        model = (plain_hfgpt(model) if name == "hfgpt" else copy.deepcopy(model)).eval()
        config = CompileConfig(fullgraph=True, mode="default" if ctx.device == "cpu" else "reduce-overhead")
        # transformers compiles automatically on accelerators only; this opts the CPU in as well.
        config._compile_all_devices = True
        model.generation_config.compile_config = config
        kwargs = {"cache_implementation": "static"}
        start = time.perf_counter()
        with torch.inference_mode():
            tokens[name] = greedy(model, prompts, new, **kwargs)
        compile_s[name] = time.perf_counter() - start
        fns[name] = lambda m=model, k=kwargs: inference(lambda: greedy(m, prompts, new, **k))
    with torch.inference_mode():
        eager_tokens = greedy(ours, prompts, new)
    rows = []
    for name, timing in interleaved(fns, ctx.decode_repeats, ctx.device, warmup=1).items():
        rows.append(
            Row(
                "compile",
                family,
                f"B=1, {ctx.profile['prompt_len']}+{new}, static cache, compiled",
                name,
                **timing.summary(),
                rate=new / timing.median,
                unit="new tok/s",
                extra={
                    "first_call_s (compile)": compile_s[name],
                    "tokens_equal_eager_hfgpt": bool(torch.equal(tokens[name], eager_tokens)),
                    "ms_per_step": 1000 * timing.median / new,
                },
            )
        )
    return rows


def memory_rows(ctx: Context, family: str) -> list[Row]:
    """Peak memory of a training step, a prefill and a decoding run (a tiny run: the step alone), each
    contender in a fresh process of its own (`harness.memory_worker`)."""
    profile = ctx.profile
    tasks = {
        "train": f"B={profile['train_shape'][0]}x{profile['train_shape'][1]} training step",
        "prefill": "B={}x{} prefill, all logits".format(*profile["prefill_shapes"][0]),
        "decode": f"B={max(profile['decode_batches'])} greedy decoding",
    }
    if ctx.tiny:
        tasks = {"train": tasks["train"]}
    rows = []
    for task, label in tasks.items():
        for impl in ("hfgpt", "transformers"):
            spec = dict(
                device=ctx.device,
                family=family,
                profile=ctx.profile_name,
                impl=impl,
                task=task,
                keep_freed=ctx.keep_freed,
            )
            result = run_worker("memory", spec)
            peak = result.get("cuda_peak_bytes", result["peak_rss_bytes"])
            rows.append(
                Row(
                    "memory",
                    family,
                    label,
                    impl,
                    median_s=float("nan"),
                    min_s=float("nan"),
                    max_s=float("nan"),
                    n=1,
                    rate=peak / 1e9,
                    unit="GB peak",
                    extra=result,
                )
            )
    return rows


# ---------------------------------------------------------------------------------------------------
# Driver


# The sections that time models in this process, in `SECTIONS` order (memory runs in workers: `memory_rows`).
TIMED_SECTIONS: dict[str, Callable[[Context, str, GPTForCausalLM, nn.Module], list[Row]]] = {
    "prefill": prefill_rows,
    "ttft": ttft_rows,
    "decode": decode_rows,
    "lowp": lowp_rows,
    "train": train_rows,
    "compile": compile_rows,
}


def run(
    profile_name: str = "full",
    device: str | None = None,
    families: tuple[str, ...] = FAMILIES,
    sections: tuple[str, ...] = SECTIONS,
    repeats: int | None = None,
    threads: int | None = None,
    keep_freed: bool = False,
    peers: tuple[str, ...] = PEERS,
) -> dict[str, Any]:
    """Run the benchmark and return its figures (what `--json` writes). `keep_freed` applies
    `keep_freed_memory()` (the training command lines' default) to this process and the memory workers:
    it acts on both contenders alike. `peers` are the other routes to speed timed beside hfgpt (`PEERS`)."""
    hf_logging.set_verbosity_error()
    started = datetime.datetime.now(datetime.timezone.utc)
    if keep_freed and not keep_freed_memory():
        raise RuntimeError("--keep-freed-memory needs glibc's mallopt (Linux)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if threads:
        torch.set_num_threads(threads)
    profile = PROFILES[profile_name]
    tiny = profile_name == "tiny"
    # Measured before and after the models run; the better of the two is kept (a busy machine only
    # ever lowers these figures, and a higher limit makes the utilisation figures conservative).
    hardware = measure_hardware(device, 3 if tiny else 7, tiny)
    ctx = Context(
        device=device,
        profile_name=profile_name,
        profile=profile,
        repeats=repeats or profile["repeats"],
        prefill_repeats=repeats or profile["prefill_repeats"],
        ttft_repeats=repeats or profile["ttft_repeats"],
        decode_repeats=repeats or profile["decode_repeats"],
        hardware=hardware,
        tiny=tiny,
        keep_freed=keep_freed,
        peers=tuple(peers),
        bfloat16=bfloat16_native(device) or tiny,  # (a smoke run keeps every row)
    )
    rows: list[Row] = []
    timed = [section for section in TIMED_SECTIONS if section in sections]
    for family in families:
        if timed:
            ours = build_ours(family, profile["model_overrides"], device).eval()
            peer = build_peer(ours).eval()
            hardware[f"{family}_decode_weight_bytes"] = decode_weight_bytes(ours)
            for section in timed:
                torch.compiler.reset()  # (each section's compiled graphs start from a fresh cache)
                start = time.perf_counter()
                rows.extend(TIMED_SECTIONS[section](ctx, family, ours, peer))
                print(f"[{family} {section}: {time.perf_counter() - start:.0f}s]", file=sys.stderr)
            del ours, peer
        if "memory" in sections:
            rows.extend(memory_rows(ctx, family))
    again = measure_hardware(device, 3 if tiny else 7, tiny)
    for key, value in again.items():
        if isinstance(value, dict):
            hardware[key] = {k: max(hardware[key].get(k, 0.0), v) for k, v in value.items()}
        else:
            hardware[key] = max(hardware[key], value)
    _rescale(rows, hardware)
    return {
        # When the run started (UTC): the figures files of one run share it.
        "started": started.isoformat(timespec="seconds"),
        "date": started.date().isoformat(),
        "peers": list(peers),
        "machine": {**machine_info(device), "keep_freed_memory": keep_freed},
        "profile": profile_name,
        "hardware": hardware,
        "rows": [asdict(r) for r in rows],
    }


def _rescale(rows: list[Row], hardware: dict[str, float]) -> None:
    """Recompute the utilisation and floor figures against the final hardware limits."""
    for row in rows:
        if row.mfu is not None:
            peak_key = row.extra.get("peak_key", "matmul_flops_per_s")
            row.mfu = row.extra["flops"] / row.median_s / hardware[peak_key]
        for key in ("floor_ms_per_step", "fp32_floor_ms_per_step"):
            if key in row.extra:
                bytes_key = f"{row.family}_decode_weight_bytes"
                row.extra[key] = 1000 * hardware[bytes_key] / hardware["read_bytes_per_s"]
