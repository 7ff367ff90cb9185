"""The measuring machinery of `bench_model.py`: profiles, interleaved rounds, the machine's limits (matmul and
memory read rates), the host as it is (CPU model, ISA limits applied, VM or not), fresh-process arms (peak
memory, decoders timed alone) and the figures' JSON. The sections (`sections.py`) are built on it; the tables
and the docs made from the figures are `report.py`'s. It imports no other script, so every script may import it.

    python benchmarks/harness.py --worker SPEC     # one fresh-process arm (what run_worker starts)
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from contenders import (
    CTRANSLATE2,
    INT8,
    INT8_COMPILED,
    build_ours,
    build_peer,
    compiled_decoding,
    ctranslate2_int8,
    decoding_accuracy,
    greedy,
    left_padded_prompts,
    module_decoder,
    our_config,
    peer_config,
)
from torch import nn
from transformers import GPT2LMHeadModel, OpenAIGPTLMHeadModel

from hfgpt.cpu import quantize_for_decoding
from hfgpt.cpu.huge_pages import huge_page_buffer
from hfgpt.cpu.runtime import keep_freed_memory
from hfgpt.modeling import GPTConfig, GPTForCausalLM

SECTIONS = ("prefill", "ttft", "decode", "lowp", "train", "memory", "compile")

# shrinks the models themselves (hidden 32, 2 layers) for the test suite's smoke runs.
PROFILES: dict[str, dict[str, Any]] = {
    "full": dict(
        prefill_shapes=[(1, 512), (4, 256)],
        decode_batches=[1, 8],
        prompt_len=64,
        new_tokens=128,
        train_shape=(4, 256),
        repeats=5,
        prefill_repeats=11,  # a forward takes seconds, and one busy second moves a median of five
        ttft_repeats=31,  # a prompt and its first token: tens of milliseconds a run
        decode_repeats=3,
        alone_rounds=4,  # rounds of fresh processes for CTranslate2 and the int8 copies (`alone_rounds`)
        slow_peer_repeats=1,  # OpenAIGPT recomputes the whole sequence per token
        model_overrides={},
    ),
    "quick": dict(
        prefill_shapes=[(1, 512), (4, 256)],
        decode_batches=[1, 8],
        prompt_len=64,
        new_tokens=32,
        train_shape=(4, 256),
        repeats=3,
        prefill_repeats=5,
        ttft_repeats=11,
        decode_repeats=3,
        alone_rounds=4,
        slow_peer_repeats=1,
        model_overrides={},
    ),
    "tiny": dict(
        prefill_shapes=[(2, 16)],
        decode_batches=[1, 3],
        prompt_len=8,
        new_tokens=6,
        train_shape=(2, 16),
        repeats=2,
        prefill_repeats=2,
        ttft_repeats=3,
        decode_repeats=1,
        alone_rounds=2,
        slow_peer_repeats=1,
        model_overrides=dict(n_embd=32, n_layer=2, n_head=2, vocab_size=1000, n_positions=64),
    ),
}

# ---------------------------------------------------------------------------------------------------
# FLOPs and the hardware limits


def forward_flops(config: GPTConfig, batch: int, seq_len: int, logit_positions: int) -> float:
    """Matmul FLOPs of one forward: 2 per multiply-add of the linear layers, causal attention (QK^T and
    AV, half of the T x T square on average) and the LM head at `logit_positions` positions per row."""
    embd, inner, layers = config.n_embd, config.inner_size, config.n_layer
    per_token_linear = 2 * (embd * 3 * embd + embd * embd + 2 * embd * inner) * layers
    per_token_attention = 2 * 2 * embd * (seq_len + 1) / 2 * layers
    head = 2 * embd * config.vocab_size * logit_positions * batch
    return batch * seq_len * (per_token_linear + per_token_attention) + head


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes one decoding step must stream: every parameter except the position table (one row read)."""
    seen: set[int] = set()
    total = 0
    for name, param in model.named_parameters():
        if name.endswith("wpe.weight") or id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel() * param.element_size()
    return total


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


PROBE = "matmul rate"  # names the `matmul_probes` contenders in the prefill and training rounds


def matmul_shapes(tiny: bool) -> list[tuple[int, int, int]]:
    """(m, k, n) of the GEMMs that measure the matmul rate: GPT-2-like shapes (MLP in, MLP out, square)."""
    return [(256, 64, 256)] if tiny else [(2048, 768, 3072), (2048, 3072, 768), (2048, 2048, 2048)]


def matmul_probes(device: str, dtype: torch.dtype, tiny: bool) -> dict[str, tuple[Callable[[], Any], float]]:
    """`measure_hardware`'s GEMMs (`torch.mm`, what every contender's products run) as contenders for
    `interleaved` (name: (callable, FLOPs)). Timed between the model runs, the best of them is the matmul
    rate of those same minutes."""
    probes = {}
    for m, k, n in matmul_shapes(tiny):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        probes[f"{PROBE} {m}x{k}x{n}"] = (lambda a=a, b=b: a @ b, 2.0 * m * k * n)
    return probes


READ_PROBE = "read rate"  # names the `read_probe` contender in the decoding rounds
READ_PROBE_SUMS = 3  # sums of the buffer per probe run


def read_buffer(numel: int, device: str, huge_pages: bool = True) -> torch.Tensor:
    """Ones to stream with a `sum`. On the CPU by default in transparent huge pages, which a CPU reads
    faster than 4 KiB pages (one TLB miss every 2 MiB): the decoding floor is then the strictest one,
    and hfgpt's decoding copies keep their weights that way too (`quantize_for_decoding`)."""
    if device != "cpu" or not huge_pages:
        return torch.ones(numel, device=device)
    return huge_page_buffer(numel * 4)[0].view(torch.float32).fill_(1.0)


def read_probe(nbytes: int, device: str) -> tuple[Callable[[], Any], int]:
    """`measure_hardware`'s way of timing the read rate, a `sum` streaming a `read_buffer` (here of the
    model's weight bytes, `READ_PROBE_SUMS` times a run, no warm-up of its own), as a contender for
    `interleaved`, with the bytes it reads: timed between the decoding runs, it gives the read rate, and
    so the decoding floor, of those same minutes (a shared host's bandwidth moves with its load)."""
    buffer = read_buffer(max(nbytes // 4, 1), device)

    def probe() -> None:
        for _ in range(READ_PROBE_SUMS):
            buffer.sum()

    return probe, READ_PROBE_SUMS * buffer.numel() * 4


def interleaved_with_floors(
    ctx: Context, ours: nn.Module, fns: dict[str, Callable[[], Any]], repeats_of: dict[str, int] | None
) -> tuple[dict[str, Timing], float, float]:
    """`interleaved` decoding runs (one untimed warm-up each, as in every section: a contender's first
    call at a batch size pays first-use costs that no later call does) with a `read_probe` of `ours`'
    decoding weight bytes as the last contender: the runs' timings (the probe's taken out), and the
    decoding floor (seconds a step) at the start-of-run read rate and at the probe's, of the same minutes."""
    weight_bytes = decode_weight_bytes(ours)
    probe, probe_bytes = read_probe(weight_bytes, ctx.device)
    timings = interleaved({**fns, READ_PROBE: probe}, ctx.decode_repeats, ctx.device, repeats_of=repeats_of)
    floor = weight_bytes / ctx.hardware["read_bytes_per_s"]
    return timings, floor, weight_bytes / (probe_bytes / timings.pop(READ_PROBE).median)


def measure_hardware(device: str, repeats: int, tiny: bool) -> dict[str, float]:
    """The matmul rate (`torch.mm`'s best median over GPT-2-like shapes; fp32, and bf16 for the bf16
    rows) and the memory read rate."""
    out: dict[str, Any] = {}
    precisions = [("matmul_flops_per_s", torch.float32)]
    if bfloat16_native(device) or tiny:  # (tiny shapes: fast even on torch's reference loop)
        precisions.append(("bf16_matmul_flops_per_s", torch.bfloat16))
    for key, dtype in precisions:
        best = 0.0
        for fn, flops in matmul_probes(device, dtype, tiny).values():
            times = []
            for _ in range(repeats + 2):
                synchronize(device)
                start = time.perf_counter()
                for _ in range(4):
                    fn()
                synchronize(device)
                times.append((time.perf_counter() - start) / 4)
            best = max(best, flops / statistics.median(times[2:]))
        out[key] = best
    # Read bandwidth: sum over a buffer the size of GPT-2 124M's weights (a reduction streams it once),
    # on the CPU from 4 KiB pages and from huge pages, alternately; the rate is the better of the two.
    numel = (1 << 16) if tiny else 494_000_000 // 4
    pages = {"2 MiB": True, "4 KiB": False} if device == "cpu" else {"device": True}
    buffers = {name: read_buffer(numel, device, huge) for name, huge in pages.items()}
    times: dict[str, list[float]] = {name: [] for name in buffers}
    for _ in range(repeats + 2):
        for name, buffer in buffers.items():
            synchronize(device)
            start = time.perf_counter()
            buffer.sum()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    by_pages = {name: numel * 4 / statistics.median(t[2:]) for name, t in times.items()}
    if device == "cpu":
        out["read_bytes_per_s_by_pages"] = by_pages
    return {**out, "read_bytes_per_s": max(by_pages.values())}


# ---------------------------------------------------------------------------------------------------
# Timing


@dataclass
class Timing:
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def summary(self) -> dict[str, float]:
        return {
            "median_s": self.median,
            "min_s": min(self.times),
            "max_s": max(self.times),
            "n": len(self.times),
        }


def interleaved(
    fns: dict[str, Callable[[], Any]],
    repeats: int,
    device: str,
    warmup: int = 1,
    repeats_of: dict | None = None,
) -> dict[str, Timing]:
    """Time each callable `repeats` times after `warmup` untimed calls, alternating the order every round
    (ABBA...) so that drift in the machine's speed hits every contender alike. `repeats_of` lowers the
    count for slow ones, which get no warm-up either (OpenAIGPT's recomputing decoding: tens of seconds a
    run, of which a first call's own costs are a small part)."""
    timings = {name: Timing() for name in fns}
    for name, fn in fns.items():
        for _ in range(0 if repeats_of and name in repeats_of else warmup):
            fn()
    for round_ in range(repeats):
        order = list(fns) if round_ % 2 == 0 else list(reversed(fns))
        for name in order:
            if repeats_of and round_ >= repeats_of.get(name, repeats):
                continue
            synchronize(device)
            start = time.perf_counter()
            fns[name]()
            synchronize(device)
            timings[name].times.append(time.perf_counter() - start)
    return timings


def with_probes(
    ctx: Context, fns: dict[str, Callable[[], Any]], dtype: torch.dtype, repeats: int
) -> tuple[dict[str, Timing], float]:
    """`interleaved(fns)` with `matmul_probes` among them, `repeats` rounds: the timings of `fns` and the
    best rate of the probes, measured in the same rounds."""
    probes = matmul_probes(ctx.device, dtype, ctx.tiny)
    timings = interleaved({**fns, **{name: fn for name, (fn, _) in probes.items()}}, repeats, ctx.device)
    rate = max(flops / timings.pop(name).median for name, (_, flops) in probes.items())
    return timings, rate


@dataclass
class Row:
    """One measurement of one contender: a line of the figures' `rows`."""

    section: str
    family: str
    case: str
    impl: str
    median_s: float
    min_s: float
    max_s: float
    n: int
    rate: float  # tokens/s, new tokens/s, first tokens/s or GB peak, as `unit` says
    unit: str
    mfu: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------
# What the contenders run: a forward, a training step


def autocast_to(device: torch.device | str, dtype: torch.dtype | None) -> torch.autocast:
    """`torch.autocast` to `dtype` on the device's type; disabled (a no-op) for None."""
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None)


def forward_pass(model: nn.Module, ids: torch.Tensor, keep: int, autocast: torch.dtype | None = None) -> None:
    """A forward without gradients, logits at every position (`keep=0`) or the last `keep`."""
    with torch.inference_mode(), autocast_to(ids.device, autocast):
        if keep and isinstance(model, OpenAIGPTLMHeadModel):
            # OpenAIGPT's forward has no logits_to_keep: it always computes every position.
            model(ids)
        elif keep:
            model(ids, logits_to_keep=keep)
        else:
            model(ids)


def inference(fn: Callable, *args: Any) -> Any:
    """`fn(*args)` under `torch.inference_mode()`."""
    with torch.inference_mode():
        return fn(*args)


def make_train_step(
    model: nn.Module, ids: torch.Tensor, autocast_dtype: torch.dtype | None = None
) -> Callable:
    """One training step of `model` on `ids` (forward with the loss, backward, fused AdamW), as a callable."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step() -> None:
        with autocast_to(ids.device, autocast_dtype):
            loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# ---------------------------------------------------------------------------------------------------
# Fresh-process arms: decoders timed alone (`decoder_worker`), peak memory (`memory_worker`)


def decoder_alone(
    kind: str, family: str, profile_name: str, repeats: int, accuracy: bool = True
) -> dict[str, Any]:
    """A decoder of the lowp section (`CTRANSLATE2`, `INT8` or `INT8_COMPILED`) timed `repeats` times in a
    fresh process of its own (`decoder_worker`): CTranslate2's OpenMP threads, beside torch's in one process,
    left every other contender of the section about 1.3-1.8x slower (GPT-2 on a 2-core Xeon: hfgpt's int8
    copy 13.0 ms a step alone, 22.9 with CTranslate2 loaded), so it is not interleaved with them; and a
    contender interleaved with four other models in one process ran 5-15% slower than alone (another model
    compiled in the process, another's weights streamed between its runs), so the int8 copies set against
    CTranslate2 are timed alone as well. The same weights (`build_ours`'s seed), prompts and accuracy
    measures as the section's other rows (CTranslate2's accuracy measured where `accuracy`)."""
    spec = dict(kind=kind, family=family, profile=profile_name, repeats=repeats, accuracy=accuracy)
    return run_worker(kind, {**spec, "threads": torch.get_num_threads()})


def alone_rounds(
    family: str, profile_name: str, kinds: list[str], repeats: int, rounds: int
) -> dict[str, dict[str, Any]]:
    """`decoder_alone` for each of `kinds` in `rounds` rounds of fresh processes, `repeats` timed runs each,
    the order alternating (A B C, then C B A, ...) so that a drift of the machine's speed weighs on each
    alike. Per kind: its times, its median in each round (`round_medians`: the int8 copies' rows compare
    them with CTranslate2's of the same round), the first process's accuracy where it has one, and how it
    was run.

    A round's processes run within a minute or two, and a shared machine's speed can move by tens of
    percent between the minutes of a run: round by round, CTranslate2 and an int8 copy meet the same
    minutes, which medians over the whole run do not ensure."""
    runs: dict[str, dict[str, Any]] = {kind: {"times": [], "round_medians": []} for kind in kinds}
    for round_ in range(rounds):
        for kind in kinds if round_ % 2 == 0 else reversed(kinds):
            result = decoder_alone(kind, family, profile_name, repeats, accuracy=round_ == 0)
            runs[kind]["times"] += result["times"]
            runs[kind]["round_medians"].append(statistics.median(result["times"]))
            if "accuracy" in result:
                runs[kind]["accuracy"] = result["accuracy"]
    measured = f"alone in fresh processes, {rounds} rounds in alternating order with {', '.join(kinds)}"
    return {kind: {**run, "measured": measured} for kind, run in runs.items()}


def run_worker(what: str, spec: dict[str, Any], script: str = __file__) -> dict[str, Any]:
    """`script --worker spec` in a fresh process (by default this one's: `memory_worker` or
    `decoder_worker`): its JSON result (the last line it prints), or an error naming `what` and the worker's
    last output."""
    out = subprocess.run(
        [sys.executable, script, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
    )
    if out.returncode != 0:
        raise RuntimeError(f"{what} worker {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def decoder_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """`decoder_alone`'s process: `repeats` timed greedy runs after an untimed one (which compiles the
    compiled int8 copy's step), and for CTranslate2 where `spec["accuracy"]` the accuracy of its int8 copy
    against hfgpt's float32 model on the same weights."""
    torch.set_num_threads(spec["threads"])
    profile = PROFILES[spec["profile"]]
    ours = build_ours(spec["family"], profile["model_overrides"], "cpu").eval()
    new = profile["new_tokens"]
    prompts = left_padded_prompts(1, profile["prompt_len"], ours.config.vocab_size, 0, "cpu")
    result: dict[str, Any] = {}
    if spec["kind"] == CTRANSLATE2:
        decoder = ctranslate2_int8(build_peer(ours))
        if spec["accuracy"]:
            ids = torch.randint(0, ours.config.vocab_size, (2, min(128, ours.config.n_positions)))
            with torch.inference_mode():
                reference, ref_tokens = ours(ids).logits.float(), greedy(ours, prompts, new)
                logits, tokens = decoder.logits(ids), decoder.greedy(prompts, new)
            result["accuracy"] = decoding_accuracy(logits, reference, tokens, ref_tokens)
    else:
        int8 = quantize_for_decoding(ours)
        decoder = module_decoder(int8, **(compiled_decoding(int8) if spec["kind"] == INT8_COMPILED else {}))
    with torch.inference_mode():
        decoder.greedy(prompts, new)  # (untimed; compiles the compiled copy's step)
    del ours
    times = []
    with torch.inference_mode():
        for _ in range(spec["repeats"]):
            start = time.perf_counter()
            decoder.greedy(prompts, new)
            times.append(time.perf_counter() - start)
    return {**result, "times": times}


def memory_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs inside a fresh process: build one model, run one task twice, report the process's peak.

    The peak is VmHWM, reset to the current RSS (writing 5 to /proc/self/clear_refs, proc(5)) just
    before the model is built: `ru_maxrss` would not do, Linux carries it over from the parent across
    fork + exec, so every worker would report the benchmark's own peak.
    """
    device, family, profile = spec["device"], spec["family"], PROFILES[spec["profile"]]
    import gc

    if spec.get("keep_freed"):
        keep_freed_memory()
    rss_after_imports = _reset_peak_rss()
    config = our_config(family, profile["model_overrides"])
    torch.manual_seed(0)
    if spec["impl"] == "transformers":
        # Random weights of its own: values do not change memory, and no second model is ever resident.
        peer_cls = GPT2LMHeadModel if family == "gpt2" else OpenAIGPTLMHeadModel
        model = peer_cls(peer_config(config)).to(device)
    else:
        model = GPTForCausalLM(config).to(device)
    model.eval()
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    rss_with_model = _current_rss()
    task = spec["task"]
    if task == "train":
        batch, seq_len = profile["train_shape"]
        ids = torch.randint(0, config.vocab_size, (batch, seq_len), device=device)
        fn = make_train_step(model, ids)
    elif task == "prefill":
        batch, seq_len = profile["prefill_shapes"][0]
        ids = torch.randint(0, config.vocab_size, (batch, seq_len), device=device)
        fn = lambda: forward_pass(model, ids, 0)
    else:
        batch = max(profile["decode_batches"])
        prompts = left_padded_prompts(batch, profile["prompt_len"], config.vocab_size, 0, device)
        fn = lambda: inference(greedy, model, prompts, profile["new_tokens"])
    fn()
    fn()
    result = {
        "peak_rss_bytes": _status_bytes("VmHWM"),
        "rss_after_imports_bytes": rss_after_imports,
        "rss_with_model_bytes": rss_with_model,
        "pid": os.getpid(),  # (the process measured: one fresh worker per row)
    }
    if device.startswith("cuda"):
        result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    return result


def _reset_peak_rss() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return _current_rss()


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {key}")


def _current_rss() -> int:
    return _status_bytes("VmRSS")


@dataclass
class Context:
    """What every section reads: the device, the profile's sizes and repeats, the machine's limits, peers."""

    device: str
    profile_name: str
    profile: dict[str, Any]
    repeats: int
    prefill_repeats: int
    ttft_repeats: int
    decode_repeats: int
    hardware: dict[str, float]
    tiny: bool
    keep_freed: bool = False
    peers: tuple[str, ...] = ()
    bfloat16: bool = True  # the bfloat16 rows: where `bfloat16_native`


# ---------------------------------------------------------------------------------------------------
# The host as it is: every figures file and every line of a table made from one names it (`host_line`)

# The instruction sets that decide which of hfgpt's CPU paths run (AVX-512 for the C kernels, VNNI for int8,
# BF16 / AMX for bfloat16), as /proc/cpuinfo names them.
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
# What .ci/as-avx2 sets for the command it runs: each caps one library at AVX2 (hfgpt's own kernels are built
# for x86-64-v3 through HFGPT_CFLAGS). It also hides the AVX-512, AMX and VNNI flags in /proc/cpuinfo.
AS_AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "avx2",
    "CT2_FORCE_CPU_ISA": "avx2",
    "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3",
}
ISA_ENV = (*AS_AVX2_ENV, "HFGPT_CFLAGS")
AS_AVX2 = "as on AVX2 (limits applied by .ci/as-avx2)"
NATIVE = "native (no ISA limits applied)"


def cpuinfo(path: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU's model name and flags as /proc/cpuinfo gives them (under .ci/as-avx2, its copy without
    AVX-512, AMX and VNNI flags); empty where there is none."""
    name, flags = "", set()
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"name": name or platform.processor() or platform.machine(), "flags": flags}


def isa_limits(environ: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """Which ISA limits the environment applies, in words, with the variables that say so: `AS_AVX2` where
    every one .ci/as-avx2 sets is there, `NATIVE` where none is, else the variables themselves."""
    environ = os.environ if environ is None else environ
    found = {name: environ[name] for name in ISA_ENV if environ.get(name)}
    if not found:
        return NATIVE, found
    as_avx2 = all(environ.get(name, "").lower() == value for name, value in AS_AVX2_ENV.items())
    if as_avx2 and "x86-64-v3" in environ.get("HFGPT_CFLAGS", ""):
        return AS_AVX2, found
    return "limited by the environment: " + ", ".join(f"{k}={v}" for k, v in found.items()), found


def machine_info(device: str) -> dict[str, Any]:
    """The host of a run: CPU model, the ISA limits applied, VM or not (/proc/cpuinfo's `hypervisor` flag),
    threads, versions; `host` the line that the tables print."""
    cpu = cpuinfo()
    limits, isa_env = isa_limits()
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "device": device,
        "threads": torch.get_num_threads(),
        "cpu": cpu["name"],
        "cpu_features": [name for name in CPU_FEATURES if name in cpu["flags"]],
        "vm": "hypervisor" in cpu["flags"],
        "isa_limits": limits,
        "isa_env": isa_env,
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    if os.environ.get("HFGPT_CFLAGS"):  # kernels built for another CPU than this one (.ci/as-avx2)
        info["hfgpt_cflags"] = os.environ["HFGPT_CFLAGS"]
    return {**info, "host": host_line(info)}


def host_line(machine: dict[str, Any]) -> str:
    """The host in one line: CPU model (its flags that matter here), VM or not, the ISA limits, threads and
    versions. Figures written before these were recorded say what they lack rather than guess."""
    features = f" ({', '.join(machine['cpu_features'])})" if machine.get("cpu_features") else ""
    vm = {True: "a VM", False: "not a VM", None: "VM: not recorded"}[machine.get("vm")]
    limits = machine.get("isa_limits") or "ISA limits: not recorded"
    if machine.get("hfgpt_cflags") and limits != AS_AVX2:
        limits += f", hfgpt's kernels built with `{machine['hfgpt_cflags']}`"
    gpu = f", {machine['gpu']}" if machine.get("gpu") else ""
    return (
        f"{machine['cpu']}{features}, {vm}, {limits}, {machine['threads']} threads{gpu}; "
        f"torch {machine['torch']}, transformers {machine['transformers']}"
    )


def bfloat16_native(device: str) -> bool:
    """Whether the device computes bfloat16 products natively: a GPU, or a CPU with AVX-512 BF16 or AMX.
    Elsewhere torch's bfloat16 products run a slow reference loop, and the bfloat16 rows are left out
    (they would time that loop, not hfgpt)."""
    if not device.startswith("cpu"):
        return True
    return bool({"avx512_bf16", "amx_bf16"} & cpuinfo()["flags"])


# ---------------------------------------------------------------------------------------------------
# The figures as JSON


def json_figures(value: Any) -> Any:
    """`value` with each NaN or infinite float (a figure not measured, such as a memory row's timings)
    replaced by None: json.dumps would write bare NaN / Infinity tokens, which are not JSON (strict
    parsers, jq and JavaScript refuse the file)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_figures(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_figures(item) for item in value]
    return value


def write_json(path: Path, report: dict[str, Any]) -> None:
    """`report` as JSON at `path` (missing figures as null), written next to it first and moved into place
    once complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(json_figures(report), indent=1, allow_nan=False))
    tmp.replace(path)


def publish(table: str, report: dict[str, Any], path: Path | None) -> None:
    """Print the table for people and, where asked, write the figures for machines (`write_json`)."""
    print(table)
    if path:
        write_json(path, report)


def worker_main(argv: list[str] | None = None) -> int:
    """`--worker SPEC`: one fresh-process arm (`run_worker`), its result as JSON on the last line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "--worker":
        print("usage: harness.py --worker SPEC (started by bench_model.py)", file=sys.stderr)
        return 2
    spec = json.loads(args[1])
    kind = spec.get("kind")
    print(
        json.dumps(
            decoder_worker(spec) if kind in (CTRANSLATE2, INT8, INT8_COMPILED) else memory_worker(spec)
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
