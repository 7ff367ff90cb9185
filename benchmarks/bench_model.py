"""Speed and memory of hfgpt beside transformers' own GPT-2 / GPT-1, on identical random weights.

What is measured, each as a ratio against transformers' model in the same run (the sections):

* prefill: a forward over B x T tokens, with logits at every position and at the last one only
  (`logits_to_keep=1`), in float32 and inside bfloat16 autocast, tokens/s and model FLOPs utilisation
  (MFU) against the measured matmul rate of that precision;
* decode: greedy `generate()` from left-padded prompts of different lengths (with attention_mask),
  new tokens/s, the generated tokens checked identical, beside the bandwidth floor of one step (the
  weight bytes a step reads / the measured memory read rate);
* lowp: decoding copies at batch size 1 (`quantize_for_decoding`: float32, bfloat16, int8; with the
  `compile` peer, the int8 copy also with its step compiled on a static cache), with their accuracy cost
  against the float32 model (logit error, top-1 and greedy agreement);
* train: forward, backward and fused AdamW, s/step and MFU, in float32 and inside bfloat16 autocast;
* memory: peak memory of a training step, a prefill and a decoding run, each in a fresh subprocess
  (peak RSS on the CPU, `torch.cuda.max_memory_allocated` on CUDA);
* compile: `StaticCache` + `torch.compile` generation of both models (compile time reported apart).

Other ways to make the same model fast run beside them as extra contenders (`--peers`), so that the
backend is judged against them and not only against eager transformers: the plain hfgpt model (hfgpt's
CPU backend taken out, `hfgpt.cpu.unkernelize`) under `torch.compile` in prefill and training, and in
the lowp section torchao's int8 (dynamic int8 activations, int8 weights, compiled) and CTranslate2's
int8 generator on the same weights (`pip install 'hfgpt[bench]'`).

Timings on a shared machine drift, so the contenders run interleaved (A B, B A, ...) and the medians and
spreads (min-max) are reported; the matmul and read rates are also timed between the model runs, so
each utilisation figure can be set against the machine's speed in the same minutes.

    python benchmarks/bench_model.py --json-dir benchmarks     # the full run: figures-cpu-<section>.json
    python benchmarks/bench_model.py --quick                    # fewer repeats and tokens
    python benchmarks/bench_model.py --tiny --peers none        # the test suite's smoke run
    python benchmarks/bench_model.py --figures                  # the full table of the saved figures
    python benchmarks/bench_model.py --summary                  # the README's table of them
    python benchmarks/bench_model.py --plot                     # the README's chart of them
    python benchmarks/bench_model.py --update-docs              # chart, README and RESULTS.md tables
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    CompileConfig,
    GPT2Config,
    GPT2LMHeadModel,
    OpenAIGPTConfig,
    OpenAIGPTLMHeadModel,
    PreTrainedModel,
)
from transformers import logging as hf_logging
from transformers.pytorch_utils import Conv1D

from hfgpt.cpu import ops as ops_hfgpt
from hfgpt.cpu import unkernelize
from hfgpt.cpu.huge_pages import huge_page_buffer
from hfgpt.cpu.quantization import quantize_for_decoding
from hfgpt.cpu.runtime import keep_freed_memory
from hfgpt.modeling import GPTConfig, GPTForCausalLM
from hfgpt.modeling.interop import to_transformers, to_transformers_config

FAMILIES = ("gpt2", "gpt1")
SECTIONS = ("prefill", "decode", "lowp", "train", "memory", "compile")
# Other routes to a fast model, timed as extra contenders (`--peers`): the plain hfgpt model under
# torch.compile (prefill, train; in lowp, the int8 copy's step compiled), torchao's int8 and CTranslate2's
# int8 generator (lowp). The last two need `pip install 'hfgpt[bench]'`.
PEERS = ("compile", "torchao", "ctranslate2")
PEER_PACKAGES = {"torchao": "torchao", "ctranslate2": "ctranslate2"}
# The contenders' names in the figures (a row's `impl`).
COMPILED = "torch.compile"
TORCHAO = "torchao int8"
INT8 = "hfgpt int8"
INT8_COMPILED = "hfgpt int8 compiled"
# A compiled decoding step whose logits are further than this (relative) from the same step run eagerly
# computes something else: its row says so instead of a speed (`step_error`). (An int8 copy's step can be a
# few percent off: another summation order in a float op moves an activation across a rounding boundary
# of its int8 copy now and then. A step that skips its products is off by orders of magnitude.)
WRONG_STEP = 0.25
CTRANSLATE2 = "ctranslate2 int8"
# An int8 copy's row: CTranslate2's median time over the copy's, round by round (`alone_rounds`)
VS_CTRANSLATE2 = "ctranslate2_time_over_own_by_round"

# Sizes per profile. `full` gives the published figures; `quick` trims repeats and decoding length; `tiny`
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
        decode_repeats=1,
        alone_rounds=2,
        slow_peer_repeats=1,
        model_overrides=dict(n_embd=32, n_layer=2, n_head=2, vocab_size=1000, n_positions=64),
    ),
}


# ---------------------------------------------------------------------------------------------------
# Models


def our_config(family: str, overrides: dict[str, Any]) -> GPTConfig:
    return GPTConfig.from_preset("gpt2" if family == "gpt2" else "openai-gpt", **overrides)


def peer_config(config: GPTConfig) -> GPT2Config | OpenAIGPTConfig:
    """transformers' config of the same model (`interop.to_transformers_config`), GPT-2 on sdpa.
    OpenAIGPT's `afn="gelu"` is the tanh GELU."""
    peer = to_transformers_config(config)
    if isinstance(peer, GPT2Config):
        peer._attn_implementation = "sdpa"
    return peer


def build_ours(family: str, overrides: dict[str, Any], device: str, seed: int = 0) -> GPTForCausalLM:
    torch.manual_seed(seed)
    return GPTForCausalLM(our_config(family, overrides)).to(device)


def build_peer(ours: GPTForCausalLM) -> PreTrainedModel:
    """transformers' model of the same shape holding a copy of `ours`' weights (`interop.to_transformers`,
    which refuses an incomplete transfer), GPT-2 on sdpa."""
    peer = to_transformers(ours)
    if isinstance(peer, GPT2LMHeadModel):
        peer.set_attn_implementation("sdpa")
    return peer.to(ours.device)


def plain_hfgpt(model: GPTForCausalLM) -> GPTForCausalLM:
    """A copy of `model` that computes the plain model file: hfgpt's CPU backend taken out
    (`hfgpt.cpu.unkernelize`), attention on transformers' sdpa."""
    return unkernelize(copy.deepcopy(model))


def compiled_plain_hfgpt(model: GPTForCausalLM) -> nn.Module:
    """`plain_hfgpt(model)` under `torch.compile` (inductor, default mode): what compiling the model file
    gives without hfgpt's backend. It compiles on its first call (the warm-up, untimed)."""
    return torch.compile(plain_hfgpt(model))


def conv1d_as_linear(model: nn.Module) -> nn.Module:
    """Turn every transformers `Conv1D` of `model` into the equivalent `nn.Linear` (the weight
    transposed), in place: torchao's `quantize_` replaces `nn.Linear` layers only."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                linear = nn.Linear(child.weight.shape[0], child.weight.shape[1], device=child.weight.device)
                linear.weight = nn.Parameter(child.weight.detach().t().contiguous())
                linear.bias = nn.Parameter(child.bias.detach().clone())
                setattr(module, name, linear)
    return model


def torchao_int8(model: GPTForCausalLM) -> tuple[GPTForCausalLM, dict[str, Any]]:
    """torchao's int8 copy of the plain model: `quantize_` with `Int8DynamicActivationInt8WeightConfig`
    (int8 weights per channel, activations quantised per token at run time) on every linear layer, the
    tied LM head included (the embedding lookup stays float32); `generate()` then compiles its decoding
    step with a static cache, as torchao's own examples run it. Returns the copy and the `generate()`
    arguments that turn compilation on."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantized = conv1d_as_linear(plain_hfgpt(model)).eval()
    quantize_(quantized, Int8DynamicActivationInt8WeightConfig())
    return quantized, compiled_decoding(quantized)


def compiled_decoding(model: nn.Module) -> dict[str, Any]:
    """Set `model` to compile its decoding step in `generate()` on any device (transformers' compile_config)
    and return the `generate()` arguments that turn compilation on: a static cache."""
    compile_config = CompileConfig(fullgraph=True, mode="default")
    compile_config._compile_all_devices = True  # transformers compiles on accelerators only by default
    model.generation_config.compile_config = compile_config
    return {"cache_implementation": "static"}


@dataclass
class Decoder:
    """A contender of the lowp section: its logits for a batch of ids, and greedy decoding from
    left-padded prompts (the new tokens only)."""

    logits: Callable[[torch.Tensor], torch.Tensor]
    greedy: Callable[[dict[str, torch.Tensor], int], torch.Tensor]
    # For a compiled decoding step: how far its logits are from the same step run eagerly (`step_error`).
    compiled_step_error: Callable[[dict[str, torch.Tensor]], float] | None = None


def module_decoder(model: nn.Module, **generate_kwargs: Any) -> Decoder:
    compiled = generate_kwargs.get("cache_implementation") == "static"
    return Decoder(
        logits=lambda ids: model(ids).logits.float(),
        greedy=lambda prompts, new: greedy(model, prompts, new, **generate_kwargs),
        compiled_step_error=(lambda prompts: step_error(model, prompts, generate_kwargs))
        if compiled
        else None,
    )


def step_error(model: nn.Module, prompts: dict[str, torch.Tensor], generate_kwargs: dict[str, Any]) -> float:
    """The relative error of the logits of `model`'s first compiled decoding step against the same step run
    eagerly (`disable_compile`): the prompt runs eagerly in both, so the step's input is the same. A
    compiled graph can compute something else than the eager model; the speed of a step that does is not
    a figure (torch's `_int_mm` on the CPU returns without computing when inductor hands it a single row
    with stride 0, pytorch/pytorch#195066: what torchao's compiled int8 decoding does)."""
    common = dict(
        max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
        return_dict_in_generate=True, **generate_kwargs,
    )  # fmt: skip
    compiled = model.generate(**prompts, **common)
    eager = model.generate(**prompts, **common, disable_compile=True)
    step, reference = compiled.logits[1].float(), eager.logits[1].float()
    return ((step - reference).norm() / reference.norm()).item()


def ctranslate2_int8(peer: PreTrainedModel) -> Decoder | None:
    """CTranslate2's int8 generator on `peer`'s weights (transformers' `GPT2LMHeadModel`, which
    `ctranslate2.converters.TransformersConverter` converts; it has no converter for GPT-1, so None
    there). Weights int8 per output channel, `compute_type="int8"`, on torch's thread count.

    The converter reads a tokenizer only for its vocabulary; random weights have none, so the vocabulary
    is the token ids written as strings, and prompts go in and tokens come out as ids."""
    if not isinstance(peer, GPT2LMHeadModel):
        return None
    import tempfile

    import ctranslate2
    import numpy as np

    class IdVocabulary:
        """What the converter's GPT-2 loader reads from a tokenizer."""

        def __init__(self, size: int, eos: int) -> None:
            self.size, self.bos_token = size, str(eos)
            self.eos_token = self.unk_token = self.bos_token

        def get_vocab(self) -> dict[str, int]:
            return {str(i): i for i in range(self.size)}

    class Converter(ctranslate2.converters.TransformersConverter):
        def load_tokenizer(self, *args: Any, **kwargs: Any) -> IdVocabulary:
            config = peer.config
            eos = config.eos_token_id if config.eos_token_id is not None else config.vocab_size - 1
            return IdVocabulary(config.vocab_size, min(eos, config.vocab_size - 1))

    with tempfile.TemporaryDirectory(prefix="hfgpt-bench-ct2-") as tmp:
        peer.save_pretrained(f"{tmp}/transformers")
        Converter(f"{tmp}/transformers").convert(f"{tmp}/ctranslate2", quantization="int8")
        generator = ctranslate2.Generator(
            f"{tmp}/ctranslate2", device="cpu", compute_type="int8", intra_threads=torch.get_num_threads()
        )

    def logits(ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(generator.forward_batch(ids.tolist()))).float()

    def generate(prompts: dict[str, torch.Tensor], new: int) -> torch.Tensor:
        rows = [
            [str(token) for token, keep in zip(ids.tolist(), mask.tolist(), strict=True) if keep]
            for ids, mask in zip(prompts["input_ids"], prompts["attention_mask"], strict=True)
        ]
        # end_token=[]: no token ends a row, so every run is exactly `new` steps (as eos_token_id=None).
        results = generator.generate_batch(
            rows, max_length=new, end_token=[], include_prompt_in_result=False, sampling_topk=1
        )
        return torch.tensor([result.sequences_ids[0] for result in results])

    return Decoder(logits=logits, greedy=generate)


def missing_peer_packages(peers: tuple[str, ...]) -> list[str]:
    """The packages `peers` need that cannot be imported here."""
    return [
        PEER_PACKAGES[peer]
        for peer in peers
        if peer in PEER_PACKAGES and importlib.util.find_spec(PEER_PACKAGES[peer]) is None
    ]


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


def matmul_kernels(a: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """`a @ b` by each library torch offers here: `torch.mm` (MKL's sgemm for float32 on the CPU) and,
    for float32 on a CPU with oneDNN, oneDNN's product (what hfgpt runs, `use_onednn_products`). The
    machine's matmul rate is the best of them: where oneDNN's float32 rate is the higher (as on AMD
    CPUs), an MFU against MKL's alone would flatter hfgpt."""
    kernels = {"torch.mm": lambda: a @ b}
    if a.device.type == "cpu" and a.dtype == torch.float32 and ops_hfgpt._ONEDNN_LINEAR is not None:
        b_t = b.t().contiguous()
        kernels["onednn"] = lambda: ops_hfgpt.onednn_mm(a, b_t)
    return kernels


def matmul_probes(device: str, dtype: torch.dtype, tiny: bool) -> dict[str, tuple[Callable[[], Any], float]]:
    """`measure_hardware`'s GEMMs as contenders for `interleaved` (name: (callable, FLOPs)). Timed
    between the model runs, the best of them is the matmul rate of those same minutes."""
    probes = {}
    for m, k, n in matmul_shapes(tiny):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        for kernel, fn in matmul_kernels(a, b).items():
            probes[f"{PROBE} {kernel} {m}x{k}x{n}"] = (fn, 2.0 * m * k * n)
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
    """The matmul rate (best median over GPT-2-like shapes and `matmul_kernels`; fp32, and bf16 for the
    bf16 rows), each kernel's best fp32 rate, and the memory read rate."""
    shapes = matmul_shapes(tiny)
    out: dict[str, Any] = {"fp32_matmul_flops_per_s_by_kernel": {}}
    precisions = [("matmul_flops_per_s", torch.float32)]
    if bfloat16_native(device) or tiny:  # (tiny shapes: fast even on torch's reference loop)
        precisions.append(("bf16_matmul_flops_per_s", torch.bfloat16))
    for key, dtype in precisions:
        best = 0.0
        for m, k, n in shapes:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            for kernel, fn in matmul_kernels(a, b).items():
                times = []
                for _ in range(repeats + 2):
                    synchronize(device)
                    start = time.perf_counter()
                    for _ in range(4):
                        fn()
                    synchronize(device)
                    times.append((time.perf_counter() - start) / 4)
                rate = 2 * m * k * n / statistics.median(times[2:])
                best = max(best, rate)
                if dtype == torch.float32:
                    by_kernel = out["fp32_matmul_flops_per_s_by_kernel"]
                    by_kernel[kernel] = max(by_kernel.get(kernel, 0.0), rate)
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


def left_padded_prompts(
    batch: int, length: int, vocab: int, pad_id: int, device: str
) -> dict[str, torch.Tensor]:
    """Prompts of different lengths (the longest `length`), left-padded, with their attention mask."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(batch):
        pad = (row * length) // (2 * max(batch, 1))  # rows lose up to half of their length
        ids[row, :pad] = pad_id
        mask[row, :pad] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def greedy(
    model: nn.Module, prompts: dict[str, torch.Tensor], new_tokens: int, **kwargs: Any
) -> torch.Tensor:
    # eos_token_id=None keeps every run at exactly `new_tokens` steps even when a row picks EOS. (Not
    # min_new_tokens: its logits processor scans the whole vocabulary at every step, for both models
    # alike, time that a plain generate() call does not spend.)
    return model.generate(
        **prompts,
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        **kwargs,
    )[:, prompts["input_ids"].shape[1] :]


# ---------------------------------------------------------------------------------------------------
# Sections


@dataclass
class Row:
    section: str
    family: str
    case: str
    impl: str
    median_s: float
    min_s: float
    max_s: float
    n: int
    rate: float  # tokens/s, new tokens/s or steps/s depending on `unit`
    unit: str
    mfu: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


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
                # (the same call as `_forward`'s, so that this first call is the one that compiles)
                compiled_err = (
                    (compiled(ids).logits.float() - reference).abs().max().item()
                    if compiled is not None and dtype is None
                    else None
                )
            for keep, label in ((0, "all logits"), (1, "last logits")):
                fns = {
                    "hfgpt": lambda m=ours, k=keep, x=ids, d=dtype: _forward(m, x, k, d),
                    "transformers": lambda m=peer, k=keep, x=ids, d=dtype: _forward(m, x, k, d),
                }
                extra_of = {}
                if compiled_err is not None:
                    fns[COMPILED] = lambda m=compiled, k=keep, x=ids: _forward(m, x, k)
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


def autocast_to(device: torch.device | str, dtype: torch.dtype | None) -> torch.autocast:
    """`torch.autocast` to `dtype` on the device's type; disabled (a no-op) for None."""
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None)


def _forward(model: nn.Module, ids: torch.Tensor, keep: int, autocast: torch.dtype | None = None) -> None:
    with torch.inference_mode(), autocast_to(ids.device, autocast):
        if keep and isinstance(model, OpenAIGPTLMHeadModel):
            # OpenAIGPT's forward has no logits_to_keep: it always computes every position.
            model(ids)
        elif keep:
            model(ids, logits_to_keep=keep)
        else:
            model(ids)


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
            out[name] = _no_grad(lambda: greedy(model, p, new, **kwargs))

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


def _no_grad(fn: Callable, *args: Any) -> Any:
    with torch.inference_mode():
        return fn(*args)


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
        name: (lambda d=decoder: _no_grad(d.greedy, prompts, new))
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


def decoding_accuracy(
    logits: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor, ref_tokens: torch.Tensor
) -> dict[str, float | int]:
    """A decoding copy's logits and greedy tokens against the float32 model's."""
    agree = (tokens == ref_tokens).float()
    return {
        "max_abs_logit_err": (logits - reference).abs().max().item(),
        "rel_logit_err": ((logits - reference).norm() / reference.norm()).item(),
        "top1_agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        "greedy_token_agreement": agree.mean().item(),
        "greedy_first_divergence": int((agree == 0).nonzero()[0, 1])
        if (agree == 0).any()
        else tokens.shape[1],
    }


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


def run_worker(what: str, spec: dict[str, Any]) -> dict[str, Any]:
    """This script's `--worker spec` in a fresh process (`memory_worker` or `decoder_worker`): its
    JSON result, or an error naming `what` and the worker's last output."""
    out = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
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


def make_train_step(
    model: nn.Module, ids: torch.Tensor, autocast_dtype: torch.dtype | None = None
) -> Callable:
    model.train()
    fused = True
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)

    def step() -> None:
        with autocast_to(ids.device, autocast_dtype):
            loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


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
        fns[name] = lambda m=model, k=kwargs: _no_grad(lambda: greedy(m, prompts, new, **k))
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


# ---------------------------------------------------------------------------------------------------
# Peak memory, one subprocess per measurement


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
    ops_hfgpt.use_onednn_products(spec.get("onednn"))
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
        fn = lambda: _forward(model, ids, 0)
    else:
        batch = max(profile["decode_batches"])
        prompts = left_padded_prompts(batch, profile["prompt_len"], config.vocab_size, 0, device)
        fn = lambda: _no_grad(greedy, model, prompts, profile["new_tokens"])
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


def memory_rows(ctx: Context, family: str) -> list[Row]:
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
                onednn=ctx.onednn,
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


@dataclass
class Context:
    device: str
    profile_name: str
    profile: dict[str, Any]
    repeats: int
    prefill_repeats: int
    decode_repeats: int
    hardware: dict[str, float]
    tiny: bool
    keep_freed: bool = False
    onednn: bool | None = None
    peers: tuple[str, ...] = ()
    bfloat16: bool = True  # the bfloat16 rows: where `bfloat16_native`


def run(
    profile_name: str = "full",
    device: str | None = None,
    families: tuple[str, ...] = FAMILIES,
    sections: tuple[str, ...] = SECTIONS,
    repeats: int | None = None,
    threads: int | None = None,
    keep_freed: bool = False,
    onednn: bool | None = None,
    peers: tuple[str, ...] = PEERS,
) -> dict[str, Any]:
    """Run the benchmark and return its figures (what `--json` writes). `keep_freed` applies
    `keep_freed_memory()` (the training command lines' default) to this process and the memory workers:
    it acts on both contenders alike. `onednn` is hfgpt's `use_onednn_products` for the run: None (its
    default) where oneDNN is the faster on this CPU, False through MKL's `addmm`, as transformers' run.
    `peers` are the other routes to speed timed beside hfgpt (`PEERS`)."""
    hf_logging.set_verbosity_error()
    started = datetime.datetime.now(datetime.timezone.utc)
    # The setting for this run only.
    with ops_hfgpt.onednn_products(onednn) as runs_onednn:
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
            decode_repeats=repeats or profile["decode_repeats"],
            hardware=hardware,
            tiny=tiny,
            keep_freed=keep_freed,
            onednn=onednn,
            peers=tuple(peers),
            bfloat16=bfloat16_native(device) or tiny,  # (a smoke run keeps every row)
        )
        rows: list[Row] = []
        timing_sections = [s for s in sections if s != "memory"]
        for family in families:
            if timing_sections:
                ours = build_ours(family, profile["model_overrides"], device).eval()
                peer = build_peer(ours).eval()
                hardware[f"{family}_decode_weight_bytes"] = decode_weight_bytes(ours)
                for section, fn in (
                    ("prefill", prefill_rows),
                    ("decode", decode_rows),
                    ("lowp", lowp_rows),
                    ("train", train_rows),
                    ("compile", compile_rows),
                ):
                    if section in sections:
                        torch.compiler.reset()  # (each section's compiled graphs start from a fresh cache)
                        start = time.perf_counter()
                        rows.extend(fn(ctx, family, ours, peer))
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
            "machine": {
                **machine_info(device),
                "keep_freed_memory": keep_freed,
                "hfgpt_cpu_products": cpu_products_label(onednn if runs_onednn else False),
            },
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


def cpu_products_label(onednn: bool | None) -> str:
    """What hfgpt's float32 CPU products ran on under `use_onednn_products(onednn)`: "onednn", "mkl", or
    by the number of rows where the default setting splits them (`ops.onednn_products_apply`)."""
    if onednn is False:
        return "mkl"
    if onednn or ops_hfgpt.avx512_cpu():
        return "onednn"
    return f"onednn up to {ops_hfgpt.FEW_ROWS} rows, mkl above"


def machine_info(device: str) -> dict[str, Any]:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "device": device,
        "threads": torch.get_num_threads(),
        "cpu": _cpu_name(),
        "cpu_features": _cpu_features(),
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    if os.environ.get("HFGPT_CFLAGS"):  # kernels built for another CPU than this one (.ci/as-avx2)
        info["hfgpt_cflags"] = os.environ["HFGPT_CFLAGS"]
    return info


# The instruction sets that decide which of hfgpt's CPU paths run (AVX-512 for the C kernels, VNNI for int8,
# BF16 / AMX for bfloat16), as /proc/cpuinfo names them.
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def bfloat16_native(device: str) -> bool:
    """Whether the device computes bfloat16 products natively: a GPU, or a CPU with AVX-512 BF16 or AMX.
    Elsewhere torch's bfloat16 products run a slow reference loop, and the bfloat16 rows are left out
    (they would time that loop, not hfgpt)."""
    if not device.startswith("cpu"):
        return True
    return any(name in _cpu_features() for name in ("avx512_bf16", "amx_bf16"))


def _cpu_features() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return [name for name in CPU_FEATURES if name in flags]
    except OSError:
        pass
    return []


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def format_table(report: dict[str, Any]) -> str:
    """A Markdown table: hfgpt beside transformers per measurement, medians with (min-max) spread."""
    hw = report["hardware"]
    m = report["machine"]
    lines = [
        (
            f"Run of {report['date']}"
            + (f" ({', '.join(report['sections'])})" if "sections" in report else "")
            + ". "
            if "date" in report
            else ""
        )
        + f"Machine: {m['cpu']}"
        + (f" ({', '.join(m['cpu_features'])})" if m.get("cpu_features") else "")
        + f", {m['threads']} threads, device {m['device']}"
        + (f" ({m['gpu']})" if "gpu" in m else "")
        + f"; torch {m['torch']}, transformers {m['transformers']}; profile `{report['profile']}`"
        + ("; freed memory kept in the process (`--keep-freed-memory`)" if m.get("keep_freed_memory") else "")
        + (
            "; hfgpt's float32 CPU products through MKL (`--mkl-products`)."
            if m.get("hfgpt_cpu_products") == "mkl"
            else "."
        ),
        f"Measured fp32 matmul rate: {hw['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s"
        + _best_of(hw.get("fp32_matmul_flops_per_s_by_kernel"), "{} {:.0f}")
        + "; memory read rate: "
        f"{hw['read_bytes_per_s'] / 1e9:.1f} GB/s"
        + _best_of(hw.get("read_bytes_per_s_by_pages"), "{} pages {:.1f}")
        + (
            f"; bf16 matmul rate {hw['bf16_matmul_flops_per_s'] / 1e9:.0f} GFLOP/s."
            if "bf16_matmul_flops_per_s" in hw
            else "."
        ),
        "",
        "| family | section | case | hfgpt | transformers | ratio | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = report["rows"]
    groups: dict[tuple[str, str, str], dict[str, dict]] = {}
    for row in rows:
        groups.setdefault((row["family"], row["section"], row["case"]), {})[row["impl"]] = row
    for (family, section, case), by_impl in groups.items():
        if section == "lowp":
            ref = by_impl.get("transformers fp32")
            for name, row in by_impl.items():
                if name == "transformers fp32":
                    continue
                ex = row["extra"]
                compiled = ""
                if "compiled_step_rel_err" in ex:
                    compiled = f"; compiled step vs eager: rel err {ex['compiled_step_rel_err']:.1e}"
                    compiled += f", **wrong results: {ex['wrong']}**" if "wrong" in ex else ""
                ratio = "wrong" if "wrong" in ex else f"{row['rate'] / ref['rate']:.2f}x"
                lines.append(
                    f"| {family} | decode {name} | {case} | {_cell(row)} | {_cell(ref)} | "
                    f"{ratio} | {ex['ms_per_step']:.1f} ms/step (fp32 floor "
                    f"{ex['fp32_floor_ms_per_step']:.1f}"
                    f"{_same_minutes(ex, 'fp32_floor_same_minutes_ms_per_step')}); "
                    f"max logit err {ex['max_abs_logit_err']:.2g}, "
                    f"top-1 {100 * ex['top1_agreement']:.1f}%, greedy agree "
                    f"{100 * ex['greedy_token_agreement']:.0f}%{compiled}{_vs_ctranslate2(ex, long=True)} |"
                )
            continue
        ours, peer = by_impl.get("hfgpt"), by_impl.get("transformers")
        ratio = f"{ours['rate'] / peer['rate']:.2f}x" if ours and peer else "-"
        if section == "memory" and ours and peer:
            ratio = f"{ours['rate'] / peer['rate']:.2f}x mem"
        notes = _notes(section, ours, peer)
        lines.append(f"| {family} | {section} | {case} | {_cell(ours)} | {_cell(peer)} | {ratio} | {notes} |")
        for name, other in by_impl.items():  # the other routes to speed (`--peers`), against transformers
            if name in ("hfgpt", "transformers"):
                continue
            ratio = f"{other['rate'] / peer['rate']:.2f}x" if peer else "-"
            lines.append(
                f"| {family} | {section} {name} | {case} | {_cell(other)} | {_cell(peer)} | {ratio} | "
                f"{_peer_notes(section, other)} |"
            )
    lines.append("")
    lines.append(
        "Ratios: hfgpt / transformers throughput (>1 = hfgpt faster); for memory, hfgpt / transformers "
        "peak (<1 = hfgpt smaller). Cells: median rate (min-max over runs)."
    )
    return "\n".join(lines)


def _best_of(by: dict[str, float] | None, cell: str) -> str:
    """The table's suffix naming the rates a headline figure is the best of, e.g. ` (best of torch.mm 199,
    onednn 219)`; empty where there are none."""
    if not by:
        return ""
    return " (best of " + ", ".join(cell.format(name, rate / 1e9) for name, rate in by.items()) + ")"


def _same_minutes(extra: dict, key: str) -> str:
    """The floor at the read rate timed between the decoding runs, where the figures have it (figures
    written before the read probe existed lack it)."""
    return f", same minutes {extra[key]:.1f}" if key in extra else ""


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["section"] == "memory":
        return f"{row['rate']:.2f} GB"
    low, high = row["rate"] * row["median_s"] / row["max_s"], row["rate"] * row["median_s"] / row["min_s"]
    text = f"{_num(row['rate'])} {row['unit']} ({_num(low)}-{_num(high)})"
    if row["mfu"] is not None:
        text += f", MFU {100 * row['mfu']:.0f}%"
    return text


def _num(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def _notes(section: str, ours: dict | None, peer: dict | None) -> str:
    row = ours or peer
    ex = row["extra"]
    if section == "prefill":
        return f"max logit diff {ex['max_abs_logit_diff']:.1e}; {_concurrent(ours, peer)}"
    if section == "decode":
        floor = ex["floor_ms_per_step"]
        text = f"{ours['extra']['ms_per_step']:.1f} vs {peer['extra']['ms_per_step']:.1f} ms/step"
        if ours["case"].startswith("B=1,"):
            text += f" (floor {floor:.1f}{_same_minutes(ex, 'floor_same_minutes_ms_per_step')})"
        return text + f"; tokens identical: {'yes' if ex['tokens_identical'] else 'NO'}"
    if section == "train":
        return f"{ours['median_s']:.2f} vs {peer['median_s']:.2f} s/step; {_concurrent(ours, peer)}"
    if section == "compile":
        parts = [
            f"{name}: compile {r['extra']['first_call_s (compile)']:.0f}s, "
            f"tokens = eager: {'yes' if r['extra']['tokens_equal_eager_hfgpt'] else 'NO'}"
            for name, r in (("hfgpt", ours), ("transformers", peer))
            if r
        ]
        return "; ".join(parts)
    if section == "memory":
        if "cuda_peak_bytes" in ex:
            return "torch.cuda.max_memory_allocated"
        above = [
            (r["extra"]["peak_rss_bytes"] - r["extra"]["rss_with_model_bytes"]) / 1e9
            for r in (ours, peer)
            if r
        ]
        return "peak RSS of a fresh process; above the loaded model: " + " vs ".join(
            f"{a:.2f} GB" for a in above
        )
    return ""


def _peer_notes(section: str, row: dict) -> str:
    ex = row["extra"]
    notes = []
    if "max_abs_logit_diff_from_hfgpt" in ex:
        notes.append(f"max logit diff from hfgpt {ex['max_abs_logit_diff_from_hfgpt']:.1e}")
    if "s_per_step" in ex:
        notes.append(f"{ex['s_per_step']:.2f} s/step")
    if "mfu_concurrent" in ex:
        notes.append(f"MFU {100 * ex['mfu_concurrent']:.0f}% against the matmul rate between the runs")
    if section == "decode":
        notes.append(
            f"{ex['ms_per_step']:.1f} ms/step; tokens identical: {'yes' if ex['tokens_identical'] else 'NO'}"
        )
    return "; ".join(notes)


def _concurrent(ours: dict, peer: dict) -> str:
    """The MFU of both against the matmul rate measured between their runs."""
    rate = ours["extra"]["concurrent_matmul_flops_per_s"]
    unit, scale = ("TFLOP/s", 1e12) if rate >= 1e12 else ("GFLOP/s", 1e9)
    return (
        f"matmul rate between the runs {rate / scale:.0f} {unit}: MFU "
        f"{100 * ours['extra']['mfu_concurrent']:.0f}% vs {100 * peer['extra']['mfu_concurrent']:.0f}%"
    )


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


# ---------------------------------------------------------------------------------------------------
# The figures files, and the README's table and chart made from them

FIGURES_DIR = Path(__file__).resolve().parent  # where the published figures live (benchmarks/)


def figures_path(directory: Path, device: str, section: str) -> Path:
    """The figures file of one section: named by what it measures (`figures-cpu-prefill.json`)."""
    return Path(directory) / f"figures-{device}-{section}.json"


def split_by_section(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One report per section of `report`: that section's rows with the run's date, machine, profile
    and hardware limits."""
    head = {key: value for key, value in report.items() if key != "rows"}
    parts: dict[str, dict[str, Any]] = {}
    for row in report["rows"]:
        parts.setdefault(row["section"], {"section": row["section"], **head, "rows": []})["rows"].append(row)
    return parts


def write_sections(directory: Path, report: dict[str, Any]) -> list[Path]:
    """`report` as one figures file per section in `directory` (`--json-dir`), each replacing the
    section's previous file."""
    device = report["machine"]["device"].split(":")[0]
    paths = []
    for section, part in split_by_section(report).items():
        paths.append(figures_path(directory, device, section))
        write_json(paths[-1], part)
    return paths


def load_figures(directory: Path = FIGURES_DIR, device: str = "cpu") -> dict[str, dict[str, Any]]:
    """The figures files of `directory` (section -> report), in `SECTIONS` order, for those it has."""
    paths = {section: figures_path(directory, device, section) for section in SECTIONS}
    return {section: json.loads(path.read_text()) for section, path in paths.items() if path.exists()}


def runs_of(figures: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The sections of `figures` grouped by the run that measured them (the same start time; for files
    without one, the same date and measured hardware limits), each group one report with `sections`."""
    runs: dict[str, dict[str, Any]] = {}
    for section, report in figures.items():
        key = report.get("started") or json.dumps([report.get("date"), report["hardware"]], sort_keys=True)
        head = {k: v for k, v in report.items() if k not in ("rows", "section")}
        run_ = runs.setdefault(key, {**head, "sections": [], "rows": []})
        run_["sections"].append(section)
        run_["rows"] += report["rows"]
    return list(runs.values())


def figures_table(figures: dict[str, dict[str, Any]]) -> str:
    """The full tables of the figures files (`--figures`), one per run that measured them."""
    return "\n\n".join(format_table(run_) for run_ in runs_of(figures))


# The README's table, one line a measurement: (label, section, case, contender). A case names a row's
# case exactly or its beginning up to a comma ("B=1" is "B=1, 64+128 tokens"); each ratio is against
# transformers' model in the same section and case (in `compile`, transformers compiled too).
SUMMARY_ROWS: list[tuple[str, str, str, str]] = [
    ("prefill, B=1 x 512 tokens, float32", "prefill", "B=1x512, all logits", "hfgpt"),
    ("prefill, B=4 x 256 tokens, float32", "prefill", "B=4x256, all logits", "hfgpt"),
    (
        "prefill, B=4 x 256 tokens, bfloat16 autocast",
        "prefill",
        "B=4x256, all logits, bf16 autocast",
        "hfgpt",
    ),
    ("training step, B=4 x 256, float32", "train", "B=4x256, fp32, fused AdamW", "hfgpt"),
    ("training step, B=4 x 256, bfloat16 autocast", "train", "B=4x256, bf16 autocast, fused AdamW", "hfgpt"),
    ("training step, peak memory (below 1x: less)", "memory", "B=4x256 training step", "hfgpt"),
    ("greedy decoding, B=1", "decode", "B=1", "hfgpt"),
    ("greedy decoding, B=8", "decode", "B=8", "hfgpt"),
    ("decoding copy, float32, B=1", "lowp", "B=1", "hfgpt fp32 copy"),
    ("decoding copy, bfloat16, B=1", "lowp", "B=1", "hfgpt bf16"),
    ("decoding copy, int8, B=1", "lowp", "B=1", INT8),
    ("decoding copy, int8 + torch.compile (static cache), B=1", "lowp", "B=1", INT8_COMPILED),
    ("decoding, both compiled (static cache), B=1", "compile", "B=1", "hfgpt"),
    ("plain hfgpt + torch.compile: prefill, B=1 x 512", "prefill", "B=1x512, all logits", COMPILED),
    ("plain hfgpt + torch.compile: training step", "train", "B=4x256, fp32, fused AdamW", COMPILED),
    ("plain hfgpt + torch.compile (static cache): greedy decoding, B=1", "decode", "B=1", COMPILED),
    ("torchao int8 + torch.compile: decoding, B=1", "lowp", "B=1", TORCHAO),
    ("CTranslate2 int8: decoding, B=1", "lowp", "B=1", CTRANSLATE2),
]


def _find_row(rows: list[dict], family: str, section: str, case: str, impl: str) -> dict | None:
    mine = [r for r in rows if (r["family"], r["section"], r["impl"]) == (family, section, impl)]
    exact = [r for r in mine if r["case"] == case]
    return (exact or [r for r in mine if r["case"].startswith(case + ",")] or [None])[0]


def summary_figures(figures: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """`SUMMARY_ROWS` measured in `figures`: per line its label, section, and per family the contender's
    figure (text) and its ratio against transformers (None where either is missing)."""
    rows = [row for report in figures.values() for row in report["rows"]]
    lines = []
    for label, section, case, impl in SUMMARY_ROWS:
        line: dict[str, Any] = {"label": label, "section": section}
        for family in FAMILIES:
            row = _find_row(rows, family, section, case, impl)
            peer_impl = "transformers fp32" if section == "lowp" else "transformers"
            peer = _find_row(rows, family, section, case, peer_impl)
            line[family] = {
                "figure": _summary_cell(row) if row else None,
                "ratio": row["rate"] / peer["rate"] if row and peer and "wrong" not in row["extra"] else None,
            }
        lines.append(line)
    return lines


def _summary_cell(row: dict) -> str:
    ex = row["extra"]
    if "wrong" in ex:  # (what is wrong: the full table's notes)
        return "wrong results"
    if row["section"] == "memory":
        return f"{row['rate']:.2f} GB"
    if row["section"] in ("prefill", "train"):
        speed = f"{ex['s_per_step']:.2f} s a step" if "s_per_step" in ex else f"{row['rate']:.0f} tok/s"
        return speed + (f", MFU {100 * row['mfu']:.0f}%" if row["mfu"] is not None else "")
    return f"{ex['ms_per_step']:.1f} ms a step{_vs_ctranslate2(ex)}"


def _vs_ctranslate2(ex: dict[str, Any], long: bool = False) -> str:
    """An int8 copy's speed against CTranslate2's round by round (`VS_CTRANSLATE2`): the median of the
    rounds' ratios (>1x: the copy the faster), with their range and count where `long`; "" elsewhere."""
    ratios = ex.get(VS_CTRANSLATE2)
    if not ratios:
        return ""
    median = f"{statistics.median(ratios):.2f}x CTranslate2's speed round by round"
    return (
        f"; {median} ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds)" if long else f", {median}"
    )


def _run_line(run_: dict[str, Any]) -> str:
    hw, m = run_["hardware"], run_["machine"]
    rates = f"float32 matmul {hw['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s"
    if "bf16_matmul_flops_per_s" in hw:
        rates += f", bfloat16 {hw['bf16_matmul_flops_per_s'] / 1e9:.0f} GFLOP/s"
    rates += f", memory read {hw['read_bytes_per_s'] / 1e9:.1f} GB/s"
    features = f" ({', '.join(m['cpu_features'])})" if m.get("cpu_features") else ""
    if m.get("hfgpt_cflags"):
        features += f", hfgpt's kernels built with `{m['hfgpt_cflags']}`"
    return (
        f"{run_.get('date', 'an undated run')}, profile `{run_['profile']}`: {m['cpu']}{features}, "
        f"{m['threads']} threads ({m['device']}), torch {m['torch']}, transformers {m['transformers']}; "
        f"measured {rates}"
    )


def summary_table(figures: dict[str, dict[str, Any]]) -> str:
    """The README's performance table: `SUMMARY_ROWS` from the figures files, with the run (date,
    machine, versions, measured limits) they come from; "-" where one family's figure is missing, and a
    line naming the rows that no family has (the bfloat16 rows run only where the CPU has bfloat16
    arithmetic: `bfloat16_native`)."""
    runs = runs_of(figures)
    if len(runs) == 1:
        header = [f"Measured by `benchmarks/bench_model.py` on {_run_line(runs[0])}."]
    else:
        header = [f"Measured by `benchmarks/bench_model.py` in {len(runs)} runs:"] + [
            f"- {', '.join(run_['sections'])}: {_run_line(run_)}." for run_ in runs
        ]
    lines = [
        *header,
        "",
        "| measurement | GPT-2 124M, hfgpt | hfgpt / transformers | GPT-1, hfgpt | hfgpt / transformers |",
        "|---|---|---|---|---|",
    ]
    unmeasured = []
    for line in summary_figures(figures):
        if all(line[family]["figure"] is None for family in FAMILIES):
            unmeasured.append(line["label"])  # (bfloat16 rows where the CPU lacks it, a peer not installed)
            continue
        cells = []
        for family in FAMILIES:
            figure, ratio = line[family]["figure"], line[family]["ratio"]
            cells += [figure or "-", f"{ratio:.2f}x" if ratio is not None else "-"]
        lines.append(f"| {line['label']} | " + " | ".join(cells) + " |")
    if unmeasured:
        lines += ["", f"Not measured in this run: {'; '.join(unmeasured)}."]
    return "\n".join(lines)


def chart_data(figures: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """What `plot_ratios` draws: each summary line's ratios against transformers (peak memory left out:
    a ratio where less is better does not share an axis with speed-ups)."""
    return [
        {"label": line["label"], **{family: line[family]["ratio"] for family in FAMILIES}}
        for line in summary_figures(figures)
        if line["section"] != "memory" and any(line[family]["ratio"] is not None for family in FAMILIES)
    ]


def plot_ratios(figures: dict[str, dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    """Draw the README's chart: hfgpt / transformers (and the other routes / transformers) per summary
    line, GPT-2 and GPT-1 side by side on a log axis, into the PNG `path`. The plotted numbers are
    written into the PNG's `Description` text as JSON, so that a test can check the chart against the
    figures files. Returns them."""
    from matplotlib.figure import Figure  # (no pyplot: no global backend state)
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    data = chart_data(figures)
    runs = runs_of(figures)
    fig = Figure(figsize=(9, 0.42 * len(data) + 1.6), layout="constrained")
    ax = fig.add_subplot()
    height = 0.38
    colours = {"gpt2": "#3b6ea8", "gpt1": "#e08a2c"}
    names = {"gpt2": "GPT-2 124M", "gpt1": "GPT-1"}
    for offset, family in ((-height / 2, "gpt2"), (height / 2, "gpt1")):
        ys = [i + offset for i, line in enumerate(data) if line[family] is not None]
        values = [line[family] for line in data if line[family] is not None]
        ax.barh(ys, values, height=height, color=colours[family], label=names[family])
        for y, value in zip(ys, values, strict=True):
            ax.annotate(
                f"{value:.2f}x",
                (value, y),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ratios = [line[f] for line in data for f in FAMILIES if line[f] is not None] or [1.0]
    ax.set_xlim(min(0.8, min(ratios) / 1.25), max(ratios) * 1.8)  # room for the labels at the bars' ends
    ticks = [
        t for t in (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200) if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]
    ]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}x"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_yticks(range(len(data)), [line["label"] for line in data], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("hfgpt / transformers, log scale (right of the line: faster than transformers)")
    machine = runs[0]["machine"] if runs else {}
    dates = sorted({run_.get("date", "?") for run_ in runs})
    ax.set_title(
        f"hfgpt on {machine.get('cpu', '?')}, {machine.get('threads', '?')} threads, {', '.join(dates)}",
        fontsize=10,
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.savefig(path, dpi=100, metadata={"Description": json.dumps(data)})
    return data


# The regions of README.md and benchmarks/RESULTS.md that `--update-docs` writes: each between its start
# marker and GENERATED_END, both HTML comments (invisible on GitHub).
README_TABLE = "<!-- README table: python benchmarks/bench_model.py --update-docs -->"
RESULTS_TABLE = "<!-- full table: python benchmarks/bench_model.py --update-docs -->"
ACCURACY_TABLE = "<!-- accuracy table: python benchmarks/bench_model.py --update-docs -->"
ACCURACY_FIGURES = FIGURES_DIR / "lowp-accuracy-cpu.json"  # lowp_accuracy.py's figures
KERNELS_TABLE = "<!-- kernels table: python benchmarks/bench_model.py --update-docs -->"
# ab_kernels.py's figures: natively built kernels, and the same run under .ci/as-avx2
KERNELS_FIGURES = (FIGURES_DIR / "ab-kernels-cpu.json", FIGURES_DIR / "ab-kernels-cpu-avx2.json")
GENERATED_END = "<!-- end of generated table -->"


def marked_region(text: str, start: str) -> tuple[int, int]:
    """Where the generated region after `start` lies in `text` (its first and last character + 1)."""
    if text.count(start) != 1 or GENERATED_END not in text.split(start, 1)[1]:
        raise ValueError(f"expected one {start!r} followed by {GENERATED_END!r}")
    first = text.index(start) + len(start) + 1
    return first, text.index(GENERATED_END, first)


def with_region(text: str, start: str, content: str) -> str:
    """`text` with the region after `start` replaced by `content`."""
    first, last = marked_region(text, start)
    return text[:first] + content.rstrip("\n") + "\n" + text[last:]


def update_docs(figures: dict[str, dict[str, Any]], root: Path = FIGURES_DIR.parent) -> list[Path]:
    """Make the published views of the figures files: the chart (`benchmarks/ratios-cpu.png`), the
    README's table, and RESULTS.md's full table, accuracy table (from `lowp_accuracy.py`'s figures) and
    kernels table (from `ab_kernels.py`'s). Returns the files written."""
    chart = root / "benchmarks" / "ratios-cpu.png"
    plot_ratios(figures, chart)
    results = root / "benchmarks" / "RESULTS.md"
    text = with_region(results.read_text(), RESULTS_TABLE, figures_table(figures))
    text = with_region(text, ACCURACY_TABLE, accuracy_table())
    results.write_text(with_region(text, KERNELS_TABLE, kernels_table()))
    readme = root / "README.md"
    readme.write_text(with_region(readme.read_text(), README_TABLE, summary_table(figures)))
    return [chart, results, readme]


def kernels_table(paths: tuple[Path, ...] = KERNELS_FIGURES) -> str:
    """`ab_kernels.py`'s tables of its figures files."""
    import ab_kernels  # the sibling script (it imports this one: loaded here, when both are)

    return ab_kernels.figures_table([json.loads(path.read_text()) for path in paths])


def accuracy_table(path: Path = ACCURACY_FIGURES) -> str:
    """`lowp_accuracy.py`'s table of its figures file."""
    import lowp_accuracy  # the sibling script (it imports this one: loaded here, when both are)

    return lowp_accuracy.format_report(json.loads(path.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer repeats, 32 new tokens")
    size.add_argument("--tiny", action="store_true", help="tiny models (hidden 32, 2 layers): a smoke run")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma list of gpt2,gpt1")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {','.join(SECTIONS)}")
    parser.add_argument("--repeats", type=int, help="timed repeats per measurement (default per profile)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="apply hfgpt.cpu.runtime.keep_freed_memory() first, as hfgpt-train does (glibc)",
    )
    parser.add_argument(
        "--mkl-products",
        action="store_true",
        help="hfgpt's float32 CPU products through MKL's addmm instead of oneDNN (use_onednn_products(False))",
    )
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"other routes to speed timed beside hfgpt: comma list of {','.join(PEERS)}, or none "
        "(torchao and ctranslate2: pip install 'hfgpt[bench]')",
    )
    parser.add_argument(
        "--json-dir",
        type=Path,
        help="write one figures file per section here (figures-<device>-<section>.json)",
    )
    parser.add_argument(
        "--figures",
        type=Path,
        nargs="?",
        const=FIGURES_DIR,
        help="measure nothing: print the table of the figures files in this folder (default benchmarks/)",
    )
    parser.add_argument("--summary", action="store_true", help="with the figures files: the README's table")
    parser.add_argument(
        "--plot",
        type=Path,
        nargs="?",
        const=FIGURES_DIR / "ratios-cpu.png",
        help="with the figures files: draw the README's chart to this PNG (default benchmarks/ratios-cpu.png)",
    )
    parser.add_argument(
        "--update-docs",
        action="store_true",
        help="measure nothing: remake the chart, the README's table and RESULTS.md's table from benchmarks/",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one memory measurement
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        print(
            json.dumps(
                decoder_worker(spec)
                if spec.get("kind") in (CTRANSLATE2, INT8, INT8_COMPILED)
                else memory_worker(spec)
            )
        )
        return 0
    if args.update_docs:
        for path in update_docs(load_figures(FIGURES_DIR, args.device or "cpu")):
            print(f"wrote {path}", file=sys.stderr)
        return 0
    if args.figures or args.summary or args.plot:
        return show_figures(args.figures or FIGURES_DIR, args.device or "cpu", args.summary, args.plot)
    families = tuple(f for f in args.families.split(",") if f)
    sections = tuple(s for s in args.sections.split(",") if s)
    peers = tuple(p for p in args.peers.split(",") if p and p != "none")
    for name, given, allowed in (
        ("family", families, FAMILIES),
        ("section", sections, SECTIONS),
        ("peer", peers, PEERS),
    ):
        bad = [x for x in given if x not in allowed]
        if bad:
            print(f"error: unknown {name} {bad[0]!r}; choose from {', '.join(allowed)}", file=sys.stderr)
            return 2
    if missing := missing_peer_packages(peers):
        print(
            f"error: --peers needs {', '.join(missing)}, not installed here: pip install 'hfgpt[bench]', "
            "or leave it out of --peers",
            file=sys.stderr,
        )
        return 2
    if args.json_dir and not args.json_dir.is_dir():
        print(f"error: --json-dir {args.json_dir} is not an existing folder", file=sys.stderr)
        return 2
    profile = "tiny" if args.tiny else "quick" if args.quick else "full"
    report = run(
        profile,
        args.device,
        families,
        sections,
        args.repeats,
        args.threads,
        args.keep_freed_memory,
        onednn=False if args.mkl_products else None,
        peers=peers,
    )
    publish(format_table(report), report, args.json)
    if args.json_dir:
        for path in write_sections(args.json_dir, report):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def show_figures(directory: Path, device: str, summary: bool, plot: Path | None) -> int:
    """`--figures` / `--summary` / `--plot`: the tables or the chart of saved figures files."""
    figures = load_figures(directory, device)
    if not figures:
        print(f"error: no figures-{device}-<section>.json files in {directory}", file=sys.stderr)
        return 2
    if plot:
        plot_ratios(figures, plot)
        print(f"wrote {plot}", file=sys.stderr)
    if summary:
        print(summary_table(figures))
    elif not plot:
        print(figures_table(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
