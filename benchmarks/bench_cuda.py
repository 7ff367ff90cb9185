"""Speed of hfgpt on a GPU beside transformers' GPT-2 / GPT-1 and a plain-PyTorch GPT-2, on identical weights.

Two sections (`--sections`), each written to its own figures file (`figures-<device>-training.json`,
`figures-<device>-decoding.json`, named so as not to meet `bench_model.py`'s per-section files):

* train: one training step (forward, backward, AdamW, fused on CUDA) inside bfloat16 autocast, for GPT-2
  124M and 355M at B x 1024 tokens, by three contenders on the same weights: hfgpt's `GPTForCausalLM`,
  transformers' `GPT2LMHeadModel` (sdpa), and `ReferenceGPT2`, a minimal plain-PyTorch GPT-2 kept in this
  file (the ceiling: what the frameworks cost above it is the margin to win). Each eager and under
  `torch.compile` (whole model, default mode), at dropout 0 (against the reference) and at GPT-2's own
  dropout 0.1 (against transformers); hfgpt compiled again with its fused loss in other slice sizes
  (`ACCELERATOR_LOSS_CHUNK_ELEMENTS`: logits a slice) and with its vocabulary padded to a multiple of 64
  (docs/gpu.md's recipe), beside the reference. Step time, tokens/s, MFU against the bf16 matmul rate measured in
  the same run, and each contender's peak memory (`torch.cuda.max_memory_allocated`, its model, its
  optimizer state and the step); then, per model, the largest batch whose training step fits in
  `--memory-budget-gib` (eager, dropout 0.1).
* decode: greedy decoding of 64 prompt + 256 new tokens from left-padded prompts, bfloat16 weights, B=1
  and B=64, GPT-2 124M and GPT-1, hfgpt beside transformers' `GPT2LMHeadModel` / `OpenAIGPTLMHeadModel`:
  `generate()` with its dynamic cache, static cache + `torch.compile` (transformers' `CompileConfig`,
  mode "default"), CUDA graphs (mode "reduce-overhead"), hfgpt's on-device loop
  (`generate(custom_generate=hfgpt.modeling.generation.decode_on_device)`, its whole step one CUDA graph; it
  runs transformers' GPT-2 too), and continuous batching (`generate_batch`, at B=16 and B=64: it is built for
  many requests).
  ms a token step, new tokens/s, and the bandwidth floor of a step (bytes a step must read / the device
  read rate measured in the run). transformers' GPT-1 has no KV cache: its one row recomputes the
  sequence at every step.

The contenders of one measurement run interleaved (A B C, C B A, ...); medians and spreads (min-max) are
reported; warm-up steps are untimed, and a compiled contender's first call (its compilation) is reported
apart. Each row names the GPU, torch and transformers versions and the date. A row that fails is recorded
with its error and the run goes on; `--time-budget-s` skips (and names) what would not fit, most
important rows first, so that a run on a lent GPU always writes its figures.

    python benchmarks/bench_cuda.py                      # the full run on CUDA: ~10 min on an H100
    python benchmarks/bench_cuda.py --quick              # the main rows, fewer repeats: ~6 min
    python benchmarks/bench_cuda.py --profile claims --sections decode,train --time-budget-s 400  # one call
    python benchmarks/bench_cuda.py --tiny --device cpu  # the smoke run (tests/test_bench_cuda.py)
    python benchmarks/bench_cuda.py --update-docs        # the README's "Speed on a GPU" from the figures
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from contenders import greedy, left_padded_prompts
from harness import Timing, decode_weight_bytes, forward_flops, interleaved, write_json
from report import marked_region, with_region
from torch import nn
from transformers import (
    CompileConfig,
    ContinuousBatchingConfig,
    GenerationConfig,
    GPT2LMHeadModel,
    OpenAIGPTLMHeadModel,
    PreTrainedModel,
)
from transformers import logging as hf_logging

from hfgpt.cpu import unkernelize
from hfgpt.modeling import GPTConfig, modeling_hfgpt
from hfgpt.modeling.generation import decode_on_device
from hfgpt.modeling.interop import from_transformers, to_transformers_config

SECTIONS = ("train", "decode")
FILE_NAMES = {"train": "training", "decode": "decoding"}  # figures-<device>-<name>.json
FIGURES_DIR = Path(__file__).resolve().parent
# The presets (hfgpt.modeling.PRESETS) and the names the figures give them.
MODELS = {"gpt2": "GPT-2 124M", "gpt2-medium": "GPT-2 355M", "openai-gpt": "GPT-1"}
HFGPT, TRANSFORMERS, REFERENCE = "hfgpt", "transformers", "reference"
EAGER, COMPILED = "eager", "compiled"
# Decoding rows (`decode_row`), in the order they run.
DYNAMIC, STATIC, GRAPHS, LOOP, CONTINUOUS = (
    "dynamic cache",
    "static cache + compile",
    "CUDA graphs",
    "on-device loop",
    "continuous batching",
)
DECODE_KINDS = (DYNAMIC, STATIC, GRAPHS, LOOP, CONTINUOUS)
COMPILED_KINDS = (STATIC, GRAPHS)  # (left out with --no-compile; the loop then runs eagerly)

# Sizes per profile, `quick`, `claims` and `tiny` written as changes to `full`. `full` measures everything;
# `quick` the main rows with fewer repeats; `claims` the rows the open claims need (README.md's GPU table),
# medians of 5, the most important first so that a time budget leaves out the least; `tiny` shrinks the models
# (hidden 32, 2 layers) for the CPU smoke run. A training contender is (implementation, mode) or (implementation,
# mode, options): hfgpt with its fused loss in slices of `loss_slice` logits, or its vocabulary padded to a
# multiple of `pad_vocab_to` (`resize_token_embeddings`, docs/gpu.md). Decoding runs each kind of `decode_kinds` at its batch sizes:
# `decode_kind_batches[kind]`, else `decode_family_batches[model]`, else `decode_batches`; and for the
# implementations of `decode_impls[kind]` (default both).
FULL_PROFILE: dict[str, Any] = dict(
    train_models=("gpt2", "gpt2-medium"),
    train_batch=16,
    seq_len=1024,
    # (dropout, contenders): GPT-2's own dropout 0.1 for hfgpt against transformers, 0 against the reference.
    train_groups=(
        (0.1, ((HFGPT, COMPILED), (TRANSFORMERS, COMPILED), (HFGPT, EAGER), (TRANSFORMERS, EAGER))),
        (
            0.0,
            (
                (HFGPT, COMPILED),
                (REFERENCE, COMPILED),
                (TRANSFORMERS, COMPILED),
                (REFERENCE, EAGER),
                (HFGPT, COMPILED, {"loss_slice": 1 << 26}),
                (HFGPT, COMPILED, {"loss_slice": 1 << 28}),
                (HFGPT, COMPILED, {"pad_vocab_to": 64}),
            ),
        ),
    ),
    train_warmup=2,
    train_repeats=10,
    budget_models=("gpt2", "gpt2-medium"),
    budget_impls=(HFGPT, TRANSFORMERS, REFERENCE),
    budget_batches=(8, 512),  # first try, most tried
    budget_step=4,  # the search stops when fit and unfit batches are this close
    decode_families=("gpt2", "openai-gpt"),
    decode_kinds={"gpt2": DECODE_KINDS, "openai-gpt": DECODE_KINDS},
    decode_batches=(1, 64),
    decode_kind_batches={CONTINUOUS: (16, 64)},
    prompt_len=64,
    new_tokens=256,
    decode_repeats=5,
    slow_repeats=3,  # transformers' GPT-1, which recomputes the sequence at every step
    matmul_size=8192,
    read_bytes=1 << 30,
    model_overrides={},
)
PROFILES: dict[str, dict[str, Any]] = {
    "full": FULL_PROFILE,
    "quick": {
        **FULL_PROFILE,
        "train_groups": (  # the ceiling first: a run cut short by a lent GPU's time limit keeps it
            (0.0, ((HFGPT, COMPILED), (REFERENCE, COMPILED))),
            FULL_PROFILE["train_groups"][0],
        ),
        "train_repeats": 6,
        "budget_models": ("gpt2",),
        "budget_impls": (HFGPT, TRANSFORMERS),
        "budget_batches": (16, 256),
        "budget_step": 8,
        "decode_kinds": {"gpt2": DECODE_KINDS, "openai-gpt": (DYNAMIC,)},
        "decode_repeats": 2,
        "slow_repeats": 1,
    },
    # What one 10-minute call on an H100 or H200 can hold, with --sections decode,train --time-budget-s 400
    # (on an H200 compiling a decoding contender took about 10 s, a training one 20-40 s, and a run of
    # continuous batching 15 s at B=1, so it is left to `full`): GPT-2 at B=1 (the on-device loop, CUDA graphs,
    # the dynamic cache's tokens) and B=64 (transformers' dynamic, static and CUDA-graph configurations against
    # hfgpt's), GPT-1 at B=64 with its cache against transformers' recomputing; then training against the
    # reference at dropout 0, against transformers at dropout 0.1, and hfgpt with its vocabulary padded and its
    # fused loss in slices of 2**28 logits beside the reference again (the first left out by a budget).
    "claims": {
        **FULL_PROFILE,
        "train_models": ("gpt2",),
        "train_groups": (
            (0.0, ((HFGPT, COMPILED), (REFERENCE, COMPILED))),
            (0.1, ((HFGPT, COMPILED), (TRANSFORMERS, COMPILED))),
            (
                0.0,
                (
                    (HFGPT, COMPILED, {"pad_vocab_to": 64}),
                    (REFERENCE, COMPILED),
                    (HFGPT, COMPILED, {"loss_slice": 1 << 28}),
                ),
            ),
        ),
        "train_repeats": 5,
        "budget_models": (),
        "decode_kinds": {"gpt2": (DYNAMIC, LOOP, GRAPHS, STATIC), "openai-gpt": (DYNAMIC, LOOP)},
        "decode_batches": (1, 64),
        "decode_family_batches": {"openai-gpt": (64,)},
        "decode_kind_batches": {STATIC: (64,)},
        "decode_impls": {LOOP: (HFGPT,)},
        "decode_repeats": 5,
        "slow_repeats": 2,
    },
    "tiny": {
        **FULL_PROFILE,
        "train_models": ("gpt2",),
        "train_batch": 2,
        "seq_len": 32,
        "train_warmup": 1,
        "train_repeats": 2,
        "budget_models": ("gpt2",),
        "budget_batches": (1, 4),
        "budget_step": 1,
        "decode_batches": (1, 3),
        "decode_kind_batches": {CONTINUOUS: (3,)},
        "prompt_len": 8,
        "new_tokens": 6,
        "decode_repeats": 1,
        "matmul_size": 256,
        "read_bytes": 1 << 20,
        "model_overrides": dict(
            n_embd=32,
            n_layer=2,
            n_head=2,
            vocab_size=1000,
            n_positions=64,
            bos_token_id=999,
            eos_token_id=999,
        ),
    },
}


# ---------------------------------------------------------------------------------------------------
# The plain-PyTorch reference: GPT-2 as nanoGPT writes it (module names those of transformers' GPT-2, so
# that its state dict loads with one transpose per linear weight)


class ReferenceAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, n_embd = x.shape
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (t.view(batch, seq_len, self.n_head, -1).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(batch, seq_len, n_embd)))


class ReferenceMLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's GELU is the tanh approximation (transformers' "gelu_new").
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class ReferenceBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, eps: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=eps)
        self.attn = ReferenceAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd, eps=eps)
        self.mlp = ReferenceMLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ReferenceGPT2(nn.Module):
    """GPT-2 in plain PyTorch: nn.Linear layers, `F.scaled_dot_product_attention(is_causal=True)`, the LM
    head tied to the token embedding, and the loss as transformers computes it (float32 logits, labels
    shifted inside, the mean over the counted positions). `forward(ids, labels)` returns the loss."""

    def __init__(self, config: GPTConfig, dropout: float) -> None:
        super().__init__()
        embd = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, embd)
        self.wpe = nn.Embedding(config.n_positions, embd)
        self.drop = nn.Dropout(dropout)
        eps = config.layer_norm_epsilon
        self.h = nn.ModuleList(
            ReferenceBlock(embd, config.n_head, dropout, eps) for _ in range(config.n_layer)
        )
        self.ln_f = nn.LayerNorm(embd, eps=eps)
        self.lm_head = nn.Linear(embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(positions))  # (B, T, E)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x)).float()  # (B, T, V)
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # position t predicts token t + 1
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def load_gpt2_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load transformers' `GPT2LMHeadModel` state dict: `transformer.` dropped, Conv1D weights
        (in, out) transposed to nn.Linear's (out, in); every key must be used (strict)."""
        conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        mine = {}
        for key, value in state.items():
            key = key.removeprefix("transformer.")
            mine[key] = value.t() if key.endswith(conv1d) else value
        self.load_state_dict(mine, strict=True)


# ---------------------------------------------------------------------------------------------------
# Contenders


def gpt_config(preset: str, overrides: dict[str, Any], dropout: float | None = None) -> GPTConfig:
    drop = {} if dropout is None else dict(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return GPTConfig.from_preset(preset, **overrides, **drop)


def transformers_model(config: GPTConfig, seed: int = 0) -> PreTrainedModel:
    """transformers' own model of `config` (GPT2LMHeadModel on sdpa, or OpenAIGPTLMHeadModel), with its
    own random initialisation: the weights every contender copies."""
    peer_config = to_transformers_config(config)
    torch.manual_seed(seed)
    cls = OpenAIGPTLMHeadModel if config.layer_norm_position == "post" else GPT2LMHeadModel
    model = cls(peer_config)
    if cls is GPT2LMHeadModel:
        model.set_attn_implementation("sdpa")
    return model


def build_contender(impl: str, config: GPTConfig, state: dict[str, torch.Tensor]) -> nn.Module:
    """`impl`'s model of `config` holding `state` (transformers' GPT-2 state dict), on the CPU in float32:
    hfgpt through `interop.from_transformers` (which refuses an incomplete copy), the reference through
    `ReferenceGPT2.load_gpt2_state` (strict)."""
    peer = transformers_model(config)
    peer.load_state_dict(state)
    if impl == TRANSFORMERS:
        return peer
    if impl == HFGPT:
        return from_transformers(peer)
    reference = ReferenceGPT2(config, config.resid_pdrop)
    reference.load_gpt2_state(state)
    return reference


def loss_of(model: nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The training loss of `model` (or of its `torch.compile` wrapper) on `ids` as inputs and labels (with
    `attention_mask`, which the reference, always causal and unpadded, does not take)."""
    if isinstance(getattr(model, "_orig_mod", model), ReferenceGPT2):
        if attention_mask is not None:
            raise ValueError("the reference GPT-2 takes no attention mask")
        return model(ids, ids)
    return model(input_ids=ids, attention_mask=attention_mask, labels=ids).loss


def training_step(
    impl: str,
    config: GPTConfig,
    state: dict[str, torch.Tensor],
    ids: torch.Tensor,
    device: str,
    compiled: bool,
    attention_mask: torch.Tensor | None = None,
    loss_slice: int | None = None,
    pad_vocab_to: int | None = None,
) -> tuple[Callable[[], torch.Tensor], tuple[Any, ...]]:
    """`impl` built on `device` in train mode (compiled or not) with its AdamW (fused on CUDA): its training
    step (forward in bf16 autocast, backward, optimizer step; returns the loss, unsynchronised), and the
    objects the step needs kept alive (model, compiled wrapper, optimizer). `loss_slice`: the logits a slice of
    hfgpt's fused loss during this step (the model's setting for the device, `loss_slice_setting`);
    `pad_vocab_to`: the vocabulary padded to a multiple of it, as docs/gpu.md's recipe pads it."""
    model = build_contender(impl, config, state)
    if pad_vocab_to is not None:
        model.resize_token_embeddings(pad_to_multiple_of=pad_vocab_to)
    model = model.to(device).train()
    run = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.startswith("cuda"))

    def step() -> torch.Tensor:
        with loss_slices(device, loss_slice), torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = loss_of(run, ids, attention_mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step, (model, run, optimizer)


def loss_slice_setting(device: str) -> str:
    """The name, in `hfgpt.modeling.modeling_hfgpt`, of the logits a slice of the fused loss on `device`."""
    return "LOSS_CHUNK_ELEMENTS" if torch.device(device).type == "cpu" else "ACCELERATOR_LOSS_CHUNK_ELEMENTS"


@contextlib.contextmanager
def loss_slices(device: str, elements: int | None) -> Iterator[None]:
    """hfgpt's fused loss in slices of `elements` logits inside the block (read as the loss runs, and guarded
    by a compiled step, which compiles again for another value); None leaves the setting as it is."""
    if elements is None:
        yield
        return
    name = loss_slice_setting(device)
    before = getattr(modeling_hfgpt, name)
    setattr(modeling_hfgpt, name, elements)
    try:
        yield
    finally:
        setattr(modeling_hfgpt, name, before)


def contender_mode(mode: str, options: dict[str, int]) -> str:
    """A training row's mode: `mode`, then what the contender's options change."""
    shown = [mode]
    if "loss_slice" in options:
        shown.append(f"loss slices of 2**{int(math.log2(options['loss_slice']))} logits")
    if "pad_vocab_to" in options:
        shown.append(f"vocabulary padded to a multiple of {options['pad_vocab_to']}")
    return ", ".join(shown)


# ---------------------------------------------------------------------------------------------------
# The device's limits


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_hardware(device: str, profile: dict[str, Any]) -> dict[str, float]:
    """The bf16 matmul rate (one n x n x n product, median of 10 after 3 untimed) and the read rate (a
    `sum` streaming a float32 buffer larger than the caches)."""
    n = profile["matmul_size"]
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    matmul = median_time(lambda: a @ b, device, 10)
    buffer = torch.ones(profile["read_bytes"] // 4, device=device)
    read = median_time(buffer.sum, device, 10)
    return {"bf16_matmul_flops_per_s": 2.0 * n**3 / matmul, "read_bytes_per_s": buffer.numel() * 4 / read}


def median_time(fn: Callable[[], Any], device: str, repeats: int) -> float:
    """The median seconds of `repeats` calls of `fn`, each synchronised, after 3 untimed ones."""
    times = []
    for i in range(repeats + 3):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def free_memory(device: str) -> None:
    """On a GPU, what the last contender held goes back to the device: reference cycles collected, then the
    caching allocator's free blocks released. (On the CPU, where tensors are freed as their last reference
    goes, a full collection is skipped: with torch and transformers loaded it takes about 0.4 s.)"""
    if device.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()


def allocated(device: str) -> int | None:
    return torch.cuda.memory_allocated() if device.startswith("cuda") else None


def train_flops(config: GPTConfig, batch: int, seq_len: int) -> float:
    """FLOPs of a training step: 3x the forward's matmuls (backward = 2x forward), the forward counted by
    `harness.forward_flops`: 2 per multiply-add of the blocks' linear layers and of the LM head at every
    position, and causal attention's QK^T and AV (half the T x T square on average). That is
    6 * N * tokens + 6 * n_layer * n_embd * (T + 1) * tokens, N the blocks' and the head's matmul weights
    (embeddings, layer norms and biases not counted)."""
    return 3 * forward_flops(config, batch, seq_len, seq_len)


# ---------------------------------------------------------------------------------------------------
# The run's bookkeeping


@dataclass
class Row:
    section: str
    model: str
    case: str
    impl: str
    mode: str
    median_s: float | None
    min_s: float | None
    max_s: float | None
    n: int
    rate: float | None  # tokens/s (train) or new tokens/s (decode)
    unit: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Context:
    device: str
    profile_name: str
    profile: dict[str, Any]
    hardware: dict[str, float]
    compile: bool
    memory_budget_gib: float
    deadline: float  # time.perf_counter() after which nothing new starts
    rows: list[Row] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    checkpoint: Callable[[], None] = field(default=lambda: None)  # writes the rows so far (`run`)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def time_left(self, what: str, reserve_s: float = 0.0) -> bool:
        """Whether there is time for `what`, `reserve_s` seconds kept for what must still run after it (the
        timed rounds of what was started already); where not, it is named in the figures as skipped."""
        if time.perf_counter() + reserve_s < self.deadline:
            return True
        self.skipped.append(what)
        print(f"[skipped, out of time: {what}]", file=sys.stderr)
        return False

    def guarded(self, what: str, fn: Callable[[], Any]) -> Any:
        """`fn()`, or None with the error recorded (a failing row must not cost the run's other rows)."""
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 (compile, CUDA and generation errors share no type)
            message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            self.errors.append({"what": what, "error": message[:500]})
            print(f"[error in {what}: {message[:300]}]", file=sys.stderr)
            self.checkpoint()
            free_memory(self.device)
            return None


# ---------------------------------------------------------------------------------------------------
# Training


@dataclass
class TrainContender:
    name: str  # "<impl> <mode>"
    impl: str
    mode: str
    step: Callable[[], torch.Tensor]  # (returns the loss)
    first_step_s: float
    peak_bytes: int | None
    loss: float
    keep: tuple[Any, ...]  # the model and optimizer, alive while timed
    options: dict[str, int] = field(default_factory=dict)  # (what `contender_mode` names)


def make_train_contender(
    ctx: Context,
    impl: str,
    mode: str,
    config: GPTConfig,
    state: dict,
    ids: torch.Tensor,
    options: dict[str, int] | None = None,
) -> TrainContender:
    """Build `impl` on the device, its AdamW (fused on CUDA), and its step in bf16 autocast; run the
    untimed warm-up steps (the first compiles a compiled contender: its time is reported apart), the last
    of them measured for the contender's peak memory above what was allocated before it was built."""
    free_memory(ctx.device)
    before = allocated(ctx.device)
    options = options or {}
    step, keep = training_step(impl, config, state, ids, ctx.device, mode == COMPILED, **options)
    start = time.perf_counter()
    first_loss = step().item()
    synchronize(ctx.device)
    first = time.perf_counter() - start
    for _ in range(ctx.profile["train_warmup"] - 1):
        step()
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    step()
    synchronize(ctx.device)
    peak = torch.cuda.max_memory_allocated() - before if ctx.cuda else None
    shown = contender_mode(mode, options)
    return TrainContender(f"{impl} {shown}", impl, shown, step, first, peak, first_loss, keep, options)


def train_rows(ctx: Context, preset: str) -> None:
    """The training rows of one model: per dropout group, its contenders built one after the other (each
    one's peak memory measured as it warms up), then timed interleaved."""
    profile = ctx.profile
    batch, seq_len = profile["train_batch"], min(profile["seq_len"], _positions(preset, ctx))
    base = gpt_config(preset, profile["model_overrides"])
    state = {k: v.clone() for k, v in transformers_model(base).state_dict().items()}
    ids = torch.randint(0, base.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(2))
    ids = ids.to(ctx.device)
    flops = train_flops(base, batch, seq_len)
    for group, (dropout, contenders) in enumerate(profile["train_groups"]):
        case = f"B={batch}x{seq_len}, bf16 autocast, dropout {dropout:g}"
        config = gpt_config(preset, profile["model_overrides"], dropout)
        built: dict[str, TrainContender] = {}
        for impl, mode, *more in contenders:
            if mode == COMPILED and not ctx.compile:
                continue
            options = more[0] if more else {}
            what = f"train {preset} {case} {impl} {contender_mode(mode, options)}"
            if not ctx.time_left(what):
                continue
            contender = ctx.guarded(
                what,
                lambda i=impl, m=mode, c=config, o=options: make_train_contender(ctx, i, m, c, state, ids, o),
            )
            if contender is not None:
                built[contender.name] = contender
                print(f"[{what}: first step {contender.first_step_s:.1f}s]", file=sys.stderr)
        if built:
            timings = ctx.guarded(
                f"train {preset} {case} timing",
                lambda b=built: interleaved(
                    {name: c.step for name, c in b.items()}, profile["train_repeats"], ctx.device, warmup=0
                ),
            )
            for name, contender in built.items():
                if timings is not None:
                    row = train_row(ctx, preset, case, contender, timings[name], batch * seq_len, flops)
                    row.extra["group"] = group  # (contenders of one group were timed interleaved)
                    ctx.rows.append(row)
            ctx.checkpoint()
        del built
        free_memory(ctx.device)
        torch.compiler.reset()


def _positions(preset: str, ctx: Context) -> int:
    return ctx.profile["model_overrides"].get("n_positions") or gpt_config(preset, {}).n_positions


def train_row(
    ctx: Context, preset: str, case: str, c: TrainContender, timing: Timing, tokens: int, flops: float
) -> Row:
    return Row(
        "train",
        MODELS[preset],
        case,
        c.impl,
        c.mode,
        **timing.summary(),
        rate=tokens / timing.median,
        unit="tok/s",
        extra={
            "ms_per_step": 1000 * timing.median,
            "mfu": flops / timing.median / ctx.hardware["bf16_matmul_flops_per_s"],
            "flops_per_step": flops,
            "peak_memory_bytes": c.peak_bytes,
            "first_step_s (compile)" if c.mode.startswith(COMPILED) else "first_step_s": c.first_step_s,
            "first_loss": c.loss,
            # (hfgpt's fused loss: the logits a slice, its own setting where the contender sets none)
            "loss_slice_elements": c.options.get(
                "loss_slice", getattr(modeling_hfgpt, loss_slice_setting(ctx.device))
            )
            if c.impl == HFGPT
            else None,
            "vocab_rows": c.keep[0].get_input_embeddings().num_embeddings if c.impl == HFGPT else None,
        },
    )


def budget_rows(ctx: Context, preset: str) -> None:
    """The largest batch (at the profile's T) whose training step, eager in bf16 autocast at dropout 0.1,
    fits in `--memory-budget-gib`, for each contender: batches doubled from the first try until one does not
    fit, then halved intervals between the last fitting and the first failing batch. A batch fits when two
    steps (the second with the optimizer state resident) run without `torch.OutOfMemoryError` under
    `torch.cuda.set_per_process_memory_fraction(budget / device memory)` and peak below the budget. On
    the CPU there is no such allocator: a batch fits when it runs, up to the profile's most tried."""
    profile = ctx.profile
    seq_len = min(profile["seq_len"], _positions(preset, ctx))
    config = gpt_config(preset, profile["model_overrides"], 0.1)
    state = {k: v.clone() for k, v in transformers_model(config).state_dict().items()}
    budget = int(ctx.memory_budget_gib * (1 << 30))
    first, most = profile["budget_batches"]
    for impl in profile["budget_impls"]:
        what = f"budget {preset} {impl}"
        if not ctx.time_left(what):
            continue
        tried: dict[int, int | None] = {}  # batch -> peak bytes (None on the CPU), absent where it failed

        def fits(batch: int, impl: str = impl, tried: dict = tried) -> bool:
            ok, peak = _budget_try(ctx, impl, config, state, batch, seq_len, budget)
            if ok:
                tried[batch] = peak
            return ok

        start = time.perf_counter()
        best = ctx.guarded(what, lambda f=fits: largest_fitting(f, first, most, profile["budget_step"]))
        if best is None:
            continue
        ctx.rows.append(
            Row(
                "train",
                MODELS[preset],
                f"largest batch x{seq_len} in {ctx.memory_budget_gib:g} GiB, eager, bf16 autocast, dropout 0.1",
                impl,
                EAGER,
                None,
                None,
                None,
                0,
                rate=float(best),
                unit="sequences",
                extra={
                    "largest_batch": best,
                    "peak_memory_bytes": tried.get(best),
                    "batches_that_fit": sorted(tried),
                    "capped_at_most_tried": best >= most,
                    "budget_bytes": budget,
                    "search_s": time.perf_counter() - start,
                },
            )
        )
        ctx.checkpoint()


def largest_fitting(fits: Callable[[int], bool], first: int, most: int, step: int) -> int:
    """The largest batch in [1, most] for which `fits` holds, assuming it holds up to some batch and not
    beyond: doubling from `first`, then bisection until the interval is `step` wide (0 where none fits)."""
    low, high = 0, None  # largest known fit, smallest known failure
    batch = first
    while batch <= most:
        if fits(batch):
            low = batch
            if batch == most:
                return most
            batch = min(2 * batch, most)
        else:
            high = batch
            break
    if high is None:
        return low
    while high - low > step:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    if low == 0 and first > 1:  # not even the first try fits: look below it
        return largest_fitting(fits, 1, first - 1, step)
    return low


def _budget_try(
    ctx: Context, impl: str, config: GPTConfig, state: dict, batch: int, seq_len: int, budget: int
) -> tuple[bool, int | None]:
    free_memory(ctx.device)
    step = keep = ids = None
    if ctx.cuda:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
        torch.cuda.reset_peak_memory_stats()
    try:
        ids = torch.randint(0, config.vocab_size, (batch, seq_len), device=ctx.device)
        step, keep = training_step(impl, config, state, ids, ctx.device, compiled=False)
        for _ in range(2):
            step()  # (its loss dropped at once)
        synchronize(ctx.device)
        peak = torch.cuda.max_memory_allocated() if ctx.cuda else None
        return peak is None or peak <= budget, peak
    except torch.OutOfMemoryError:
        return False, None
    finally:
        del step, keep, ids
        if ctx.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
        free_memory(ctx.device)


# ---------------------------------------------------------------------------------------------------
# Decoding


def decode_rows(ctx: Context, preset: str) -> None:
    """The decoding rows of one model, per batch size: each (implementation, kind) of the profile run once
    untimed (its compilation, reported apart), then all timed interleaved; tokens compared with hfgpt's
    dynamic-cache tokens."""
    profile = ctx.profile
    config = gpt_config(preset, profile["model_overrides"])
    peer = transformers_model(config)
    ours = from_transformers(peer)
    peer = peer.to(ctx.device, torch.bfloat16).eval()
    ours = ours.to(ctx.device, torch.bfloat16).eval()
    weight_bytes = decode_weight_bytes(ours)
    has_cache = not isinstance(peer, OpenAIGPTLMHeadModel)
    kinds = [k for k in profile["decode_kinds"][preset] if ctx.compile or k not in COMPILED_KINDS]
    # One model per (implementation, kind): transformers keeps a compiled forward per model.
    models: dict[tuple[str, str], nn.Module] = {}
    for kind in kinds:
        for impl, model in ((HFGPT, ours), (TRANSFORMERS, peer)):
            if kind != DYNAMIC and not has_cache and impl == TRANSFORMERS:
                continue  # transformers' GPT-1 has no cache to make static, page or capture
            if impl not in profile.get("decode_impls", {}).get(kind, (HFGPT, TRANSFORMERS)):
                continue
            copy_ = model if kind == DYNAMIC else copy.deepcopy(model)
            if kind == CONTINUOUS and impl == HFGPT:
                copy_ = unkernelize(copy_)  # continuous batching refuses the CPU backend's attention
            models[impl, kind] = copy_
    new = profile["new_tokens"]
    for batch in decode_batches_of(profile, preset, kinds):
        prompts = left_padded_prompts(batch, profile["prompt_len"], config.vocab_size, 0, ctx.device)
        case = f"B={batch}, {profile['prompt_len']}+{new} tokens, bf16 weights"
        runs: dict[str, Callable[[], torch.Tensor]] = {}
        first_s: dict[str, float] = {}
        tokens: dict[str, torch.Tensor] = {}
        # The timed rounds run once every contender's first call has: their time is kept in reserve, each
        # contender's runs estimated by its first call (a compiled one's by its implementation's first
        # dynamic-cache call, which compiling makes no slower), so that a time budget leaves them room.
        reserve_s = 0.0
        for (impl, kind), model in models.items():
            if batch not in decode_batches_of(profile, preset, (kind,)):
                continue
            name = f"{impl} {kind}"
            what = f"decode {preset} {case} {name}"
            if not ctx.time_left(what, reserve_s):
                continue
            run = decode_run(ctx, model, kind, prompts, new)
            start = time.perf_counter()
            out = ctx.guarded(what, run)
            if out is None:
                continue
            synchronize(ctx.device)
            first_s[name], tokens[name], runs[name] = time.perf_counter() - start, out, run
            print(f"[{what}: first call {first_s[name]:.1f}s]", file=sys.stderr)
            compiles = kind in COMPILED_KINDS or (kind == LOOP and ctx.cuda and ctx.compile)
            one_run = first_s.get(f"{impl} {DYNAMIC}", first_s[name]) if compiles else first_s[name]
            recomputes = not has_cache and impl == TRANSFORMERS  # (timed `slow_repeats` times, below)
            reserve_s += profile["slow_repeats" if recomputes else "decode_repeats"] * one_run
        if not runs:
            continue
        slow = {f"{TRANSFORMERS} {DYNAMIC}": profile["slow_repeats"]} if not has_cache else None
        timings = ctx.guarded(
            f"decode {preset} {case} timing",
            lambda r=runs, s=slow: interleaved(
                r, profile["decode_repeats"], ctx.device, warmup=0, repeats_of=s
            ),
        )
        if timings is None:
            continue
        reference = tokens.get(f"{HFGPT} {DYNAMIC}")
        floor = weight_bytes / ctx.hardware["read_bytes_per_s"]
        cache_bytes = mean_cache_bytes(config, batch, profile["prompt_len"], new)
        for name, timing in timings.items():
            impl, kind = name.split(" ", 1)
            ctx.rows.append(
                Row(
                    "decode",
                    MODELS[preset],
                    case,
                    impl,
                    kind if (has_cache or impl == HFGPT) else f"{kind} (no KV cache: recomputes)",
                    **timing.summary(),
                    rate=batch * new / timing.median,
                    unit="new tok/s",
                    extra={
                        "ms_per_token_step": 1000 * timing.median / new,
                        "floor_ms_per_step": 1000 * floor,
                        "floor_with_cache_ms_per_step": 1000
                        * (weight_bytes + cache_bytes)
                        / ctx.hardware["read_bytes_per_s"],
                        "weight_bytes": weight_bytes,
                        "mean_cache_bytes_per_step": cache_bytes,
                        "first_call_s (compile)"
                        if kind in COMPILED_KINDS or (kind == LOOP and ctx.cuda and ctx.compile)
                        else "first_call_s": first_s[name],
                        "tokens_equal_hfgpt_dynamic": None
                        if reference is None
                        else bool(torch.equal(tokens[name].to(reference.device), reference)),
                        # (in bfloat16 a near tie may go the other way; the leading tokens equal in every row)
                        "tokens_equal_hfgpt_dynamic_first": None
                        if reference is None
                        else matching_prefix(tokens[name].to(reference.device), reference),
                    },
                )
            )
        ctx.checkpoint()
        del runs, tokens
    for (impl, kind), model in models.items():
        if kind == CONTINUOUS and hasattr(model, "destroy_cached_continuous_batching_manager"):
            ctx.guarded(f"decode {preset} {impl} cleanup", model.destroy_cached_continuous_batching_manager)
    del models, ours, peer
    free_memory(ctx.device)
    torch.compiler.reset()


def matching_prefix(tokens: torch.Tensor, reference: torch.Tensor) -> int:
    """How many leading new tokens (B, N) equal `reference`'s in every row."""
    if tokens.shape != reference.shape:
        return 0
    return int((tokens == reference).long().cumprod(dim=1).sum(dim=1).min())


def decode_batches_of(profile: dict[str, Any], preset: str, kinds: Iterable[str]) -> list[int]:
    """The batch sizes at which any of `kinds` runs for `preset`, in increasing order: a kind's own
    (`decode_kind_batches`), else the model's (`decode_family_batches`), else the profile's `decode_batches`."""
    own, family = profile.get("decode_kind_batches", {}), profile.get("decode_family_batches", {})
    default = family.get(preset, profile["decode_batches"])
    return sorted({b for kind in kinds for b in own.get(kind, default)})


def mean_cache_bytes(config: GPTConfig, batch: int, prompt_len: int, new: int) -> int:
    """Bytes of bf16 keys and values a decoding step reads on average: every layer's cache of the
    prompt and the tokens so far (a dynamic cache's length; a static cache holds and may read more)."""
    mean_len = prompt_len + (new - 1) / 2
    return int(2 * config.n_layer * config.n_embd * 2 * batch * mean_len)


def decode_run(
    ctx: Context, model: nn.Module, kind: str, prompts: dict[str, torch.Tensor], new: int
) -> Callable[[], torch.Tensor]:
    """A call that decodes `new` greedy tokens from `prompts` by `kind` and returns them (B, new)."""
    if kind == CONTINUOUS:
        return continuous_run(ctx, model, prompts, new)
    kwargs: dict[str, Any] = {}
    if kind == LOOP:
        # (compiled whole on CUDA: one CUDA graph a token; eager elsewhere, or with --no-compile)
        kwargs.update(custom_generate=decode_on_device, compile_step=ctx.cuda and ctx.compile)
    if kind == DYNAMIC and isinstance(model, OpenAIGPTLMHeadModel):
        kwargs["use_cache"] = False  # (it has none; said so, for transformers' generate() not to look)
    if kind in (STATIC, GRAPHS):
        config = CompileConfig(
            fullgraph=True, mode="default" if kind == STATIC else "reduce-overhead", dynamic=False
        )
        config._compile_all_devices = True  # transformers compiles on accelerators only by default
        model.generation_config.compile_config = config
        kwargs["cache_implementation"] = "static"

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return greedy(model, prompts, new, **kwargs)

    return run


def continuous_batching_config(ctx: Context, rows: list[list[int]], new: int) -> ContinuousBatchingConfig:
    """The paged cache's size: on CUDA transformers' own choice within 30% of the free memory; on the CPU,
    where transformers would size it by the host's whole memory, the pages these requests need. No switch to
    flash attention (it would fetch a kernel: the benchmark times sdpa, the models' attention elsewhere)."""
    if ctx.cuda:
        return ContinuousBatchingConfig(max_memory_percent=0.3, auto_switch_to_flash=False)
    page = 16
    pages = sum(math.ceil((len(row) + new) / page) for row in rows)
    return ContinuousBatchingConfig(
        page_size=page,
        num_blocks=2 * pages,
        max_batch_tokens=sum(len(row) for row in rows),
        auto_switch_to_flash=False,
    )


def continuous_run(
    ctx: Context, model: nn.Module, prompts: dict[str, torch.Tensor], new: int
) -> Callable[[], torch.Tensor]:
    """`generate_batch` over the prompts' unpadded token lists, the manager kept between calls
    (`persistent_manager`: it is sized for this workload on the first, untimed, call). Missing or failed
    requests raise (transformers only logs them)."""
    rows = [
        ids[mask.bool()].tolist()
        for ids, mask in zip(prompts["input_ids"].cpu(), prompts["attention_mask"].cpu(), strict=True)
    ]
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb_config = continuous_batching_config(ctx, rows, new)

    def run() -> torch.Tensor:
        with torch.inference_mode():
            results = model.generate_batch(
                rows,
                generation_config=config,
                continuous_batching_config=cb_config,
                persistent_manager=True,
                warmup=ctx.cuda,
            )
        outputs = list(results.values())
        if len(outputs) != len(rows) or any(o.error is not None for o in outputs):
            errors = [o.error for o in outputs if o.error is not None]
            raise RuntimeError(
                f"generate_batch returned {len(outputs)} of {len(rows)} requests; errors: {errors[:2]}"
            )
        return torch.tensor([o.generated_tokens for o in outputs])

    return run


# ---------------------------------------------------------------------------------------------------
# Driver


def machine(device: str) -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {
        "device": device,
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if device.startswith("cuda"):
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return info


def run(
    profile_name: str = "full",
    device: str = "cuda",
    sections: tuple[str, ...] = SECTIONS,
    compile: bool = True,
    memory_budget_gib: float = 40.0,
    time_budget_s: float | None = None,
    json_dir: Path | None = None,
    models: tuple[str, ...] | None = None,
    decode_batches: tuple[int, ...] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run the sections; returns one report per section (what `json_dir` receives: each file rewritten as
    its measurements end, and complete when its section ends). `models` keeps the profile's models among
    those presets only, `decode_batches` replaces its decoding batch sizes."""
    hf_logging.set_verbosity_error()
    started = datetime.datetime.now(datetime.timezone.utc)
    profile = dict(PROFILES[profile_name])
    if models is not None:
        for key in ("train_models", "budget_models", "decode_families"):
            profile[key] = tuple(m for m in profile[key] if m in models)
    if decode_batches is not None:  # (every kind at these batch sizes)
        profile["decode_batches"] = decode_batches
        profile["decode_kind_batches"], profile["decode_family_batches"] = {}, {}
    if device.startswith("cuda"):
        # TF32 for the float32 matmuls left inside autocast (none of the models' products): the usual setting.
        torch.backends.cuda.matmul.allow_tf32 = True
    hardware = measure_hardware(device, profile)
    ctx = Context(
        device=device,
        profile_name=profile_name,
        profile=profile,
        hardware=hardware,
        compile=compile,
        memory_budget_gib=memory_budget_gib,
        deadline=time.perf_counter() + (time_budget_s if time_budget_s is not None else math.inf),
    )
    settings = {
        "compile": compile,
        "memory_budget_gib": memory_budget_gib,
        "time_budget_s": time_budget_s,
        **{
            k: v
            for k, v in profile.items()
            if k.startswith(("train", "seq", "decode", "prompt", "new", "budget"))
        },
        "model_overrides": profile["model_overrides"],
        "hfgpt_cpu_backend": "as built (on CUDA it takes itself out at the model's first train(), eval() or forward); "
        "taken out for continuous batching",
        "mfu_formula": train_flops.__doc__.split("\n\n")[0].split(": ", 1)[1],
    }
    reports = {}
    for section in sections:
        ctx.rows, ctx.errors, ctx.skipped = [], [], []
        start = time.perf_counter()

        def report(complete: bool, section: str = section, start: float = start) -> dict[str, Any]:
            return {
                "section": section,
                "started": started.isoformat(timespec="seconds"),
                "date": started.date().isoformat(),
                "profile": profile_name,
                "complete": complete,
                "machine": machine(device),
                "settings": settings,
                "hardware": dict(hardware),
                "section_s": time.perf_counter() - start,
                "rows": [asdict(r) for r in ctx.rows],
                "errors": ctx.errors,
                "skipped": ctx.skipped,
            }

        if json_dir is not None:
            # The rows so far, written as each measurement ends: a run stopped from outside (a lent GPU's
            # time limit) still leaves what it measured, marked "complete": false.
            path = figures_path(json_dir, device, section)
            ctx.checkpoint = lambda report=report, path=path: write_json(path, report(False))
        if section == "train":
            for preset in profile["train_models"]:
                train_rows(ctx, preset)
            for preset in profile["budget_models"]:
                budget_rows(ctx, preset)
        else:
            for preset in profile["decode_families"]:
                decode_rows(ctx, preset)
        again = measure_hardware(device, profile)  # the better of the start's and the end's
        for key, value in again.items():
            hardware[key] = max(hardware[key], value)
        _rescale(ctx.rows, hardware)
        reports[section] = report(True)
        reports[section]["checks"] = claims(reports[section])
        print(f"[{section}: {reports[section]['section_s']:.0f}s]", file=sys.stderr)
        if json_dir is not None:
            write_json(path, reports[section])
            print(f"wrote {path}", file=sys.stderr)
        ctx.checkpoint = lambda: None
    return reports


def _rescale(rows: list[Row], hardware: dict[str, float]) -> None:
    """Utilisation and floors against the run's final (best) limits."""
    for row in rows:
        ex = row.extra
        if "mfu" in ex and row.median_s:
            ex["mfu"] = ex["flops_per_step"] / row.median_s / hardware["bf16_matmul_flops_per_s"]
        if "floor_ms_per_step" in ex:
            ex["floor_ms_per_step"] = 1000 * ex["weight_bytes"] / hardware["read_bytes_per_s"]
            ex["floor_with_cache_ms_per_step"] = (
                1000 * (ex["weight_bytes"] + ex["mean_cache_bytes_per_step"]) / hardware["read_bytes_per_s"]
            )


def figures_path(directory: Path, device: str, section: str) -> Path:
    return Path(directory) / f"figures-{device.split(':')[0]}-{FILE_NAMES[section]}.json"


# ---------------------------------------------------------------------------------------------------
# The issues' claims, checked on the figures


def _find(rows: list[dict], model: str, impl: str, mode: str, case: str) -> dict | None:
    """The timed row of `model`, `impl`, `mode` whose case is `case` or begins with `case` and a comma."""
    found = [
        r
        for r in rows
        if (r["model"], r["impl"], r["mode"]) == (model, impl, mode)
        and (r["case"] == case or r["case"].startswith(case + ","))
        and r["median_s"] is not None
    ]
    return found[0] if found else None


def _ratio(a: dict | None, b: dict | None, key: str = "rate") -> float | None:
    if a is None or b is None:
        return None
    x, y = (a[key], b[key]) if key == "rate" else (a["extra"][key], b["extra"][key])
    return None if x is None or y is None or not y else x / y


def claims(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The open claims (README.md's GPU table), each with its figure from `report` (None where not measured),
    its target and whether it holds."""
    rows = report["rows"]
    out: list[dict[str, Any]] = []

    def claim(text: str, value: float | None, target: float, below: bool = False) -> None:
        holds = None if value is None else (value <= target if below else value >= target)
        relation = "<=" if below else ">="
        out.append({"claim": text, "value": value, "relation": relation, "target": target, "holds": holds})

    if report["section"] == "train":
        for model in ("GPT-2 124M", "GPT-2 355M"):
            rows_m = [r for r in rows if r["model"] == model]
            if not rows_m:
                continue
            batch = rows_m[0]["case"].split(",")[0]  # "B=16x1024"
            d0, d1 = f"{batch}, bf16 autocast, dropout 0", f"{batch}, bf16 autocast, dropout 0.1"
            claim(
                f"{model}: compiled step, hfgpt / reference speed, dropout 0",
                _ratio(_find(rows, model, HFGPT, COMPILED, d0), _find(rows, model, REFERENCE, COMPILED, d0)),
                1.0,
            )
            claim(
                f"{model}: compiled step, hfgpt / transformers speed, dropout 0.1",
                _ratio(
                    _find(rows, model, HFGPT, COMPILED, d1), _find(rows, model, TRANSFORMERS, COMPILED, d1)
                ),
                1.2,
            )
            claim(
                f"{model}: compiled step, hfgpt / transformers peak memory, dropout 0.1",
                _ratio(
                    _find(rows, model, HFGPT, COMPILED, d1),
                    _find(rows, model, TRANSFORMERS, COMPILED, d1),
                    "peak_memory_bytes",
                ),
                0.6,
                below=True,
            )
            claim(
                f"{model}: eager step, hfgpt / transformers speed, dropout 0.1",
                _ratio(_find(rows, model, HFGPT, EAGER, d1), _find(rows, model, TRANSFORMERS, EAGER, d1)),
                1.3,
            )
            budget = {
                r["impl"]: r["extra"]["largest_batch"]
                for r in rows
                if r["model"] == model and r["case"].startswith("largest batch")
            }
            if HFGPT in budget and TRANSFORMERS in budget:
                claim(
                    f"{model}: largest batch in the budget, hfgpt / transformers",
                    budget[HFGPT] / max(budget[TRANSFORMERS], 1),
                    1.0 + 1e-9,
                )
        row = _find(rows, "GPT-2 124M", HFGPT, COMPILED, "B=16x1024, bf16 autocast, dropout 0")
        claim(
            "GPT-2 124M: MFU of hfgpt compiled at 16x1024, dropout 0",
            row["extra"]["mfu"] if row else None,
            0.5,
        )
    else:
        for model in ("GPT-2 124M", "GPT-1"):
            batches = sorted(
                {r["case"].split(",")[0] for r in rows if r["model"] == model}, key=lambda c: int(c[2:])
            )
            for batch in batches:
                mine = [r for r in rows if r["model"] == model and r["case"].startswith(batch + ",")]
                ours = {r["mode"]: r for r in mine if r["impl"] == HFGPT}
                theirs = [r for r in mine if r["impl"] == TRANSFORMERS]
                best_theirs = max(theirs, key=lambda r: r["rate"]) if theirs else None
                if model == "GPT-2 124M" and batch == "B=1":
                    claim(
                        f"{model} {batch}: static cache + compile, hfgpt / transformers speed",
                        _ratio(ours.get(STATIC), _find(mine, model, TRANSFORMERS, STATIC, batch)),
                        1.0,
                    )
                    loop = ours.get(LOOP)
                    claim(
                        f"{model} {batch}: on-device loop, hfgpt ms per token",
                        loop["extra"]["ms_per_token_step"] if loop else None,
                        0.8,
                        below=True,
                    )
                if batch == "B=64" and model == "GPT-2 124M":
                    best_ours = max(ours.values(), key=lambda r: r["rate"]) if ours else None
                    claim(
                        f"{model} {batch}: best hfgpt / best transformers throughput",
                        _ratio(best_ours, best_theirs),
                        1.2,
                    )
                if model == "GPT-1" and batch == "B=64":
                    best_ours = max(ours.values(), key=lambda r: r["rate"]) if ours else None
                    claim(
                        f"{model} {batch}: best hfgpt with its cache / transformers (no cache)",
                        _ratio(best_ours, best_theirs),
                        3.0,
                    )
    return out


# ---------------------------------------------------------------------------------------------------
# The README's table


README_GPU_TABLE = "<!-- GPU table: python benchmarks/bench_cuda.py --update-docs -->"
NO_RUN_YET = "No GPU run yet: `python benchmarks/bench_cuda.py` on a CUDA machine writes the figures this table is made from."


def load_figures(directory: Path = FIGURES_DIR, device: str = "cuda") -> dict[str, dict[str, Any]]:
    paths = {section: figures_path(directory, device, section) for section in SECTIONS}
    return {section: json.loads(path.read_text()) for section, path in paths.items() if path.exists()}


def _ms(row: dict | None) -> str:
    return "-" if row is None else f"{row['extra']['ms_per_token_step']:.2f}"


def gpu_table(figures: dict[str, dict[str, Any]], claims: bool = True) -> str:
    """The README's "Speed on a GPU": from the figures files, the run they come from, the training and
    decoding rows of hfgpt beside transformers (and the reference), and (`claims`, printed after a run but
    left out of the README) the issues' claims checked."""
    if not figures:
        return NO_RUN_YET
    lines = []
    for section, report in figures.items():
        m, hw = report["machine"], report["hardware"]
        lines.append(
            f"{'Training' if section == 'train' else 'Decoding'}: `benchmarks/bench_cuda.py`, {report['date']}, "
            f"profile `{report['profile']}`, {m['gpu'] or m['device']}, torch {m['torch']}, transformers "
            f"{m['transformers']}; measured bf16 matmul {hw['bf16_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, "
            f"read {hw['read_bytes_per_s'] / 1e9:.0f} GB/s."
            + (
                ""
                if report.get("complete", True)
                else " Stopped before the section's end: the rows it measured."
            )
        )
    lines.append("")
    if "train" in figures:
        rows = [r for r in figures["train"]["rows"] if r["median_s"] is not None]
        contenders = [(i, m) for i in (HFGPT, TRANSFORMERS, REFERENCE) for m in (EAGER, COMPILED)]
        contenders = [c for c in contenders if any((r["impl"], r["mode"]) == c for r in rows)]
        lines += [
            "| training step, bf16 autocast: ms, MFU, peak GiB | "
            + " | ".join(f"{i} {m}" for i, m in contenders)
            + " |",
            "|---" * (len(contenders) + 1) + "|",
        ]
        for model, case in sorted({(r["model"], r["case"]) for r in rows}, key=lambda mc: (mc[0], mc[1])):
            cells = []
            for impl, mode in contenders:
                row = _find(rows, model, impl, mode, case)
                peak = row and row["extra"]["peak_memory_bytes"]
                cells.append(
                    "-"
                    if row is None
                    else f"{row['extra']['ms_per_step']:.0f}, {100 * row['extra']['mfu']:.0f}%"
                    + (f", {peak / 2**30:.1f}" if peak else "")
                )
            lines.append(f"| {model}, {case} | " + " | ".join(cells) + " |")
        budget = [r for r in figures["train"]["rows"] if r["case"].startswith("largest batch")]
        for model, case in sorted({(r["model"], r["case"]) for r in budget}):
            found = {
                r["impl"]: r["extra"]["largest_batch"]
                for r in budget
                if (r["model"], r["case"]) == (model, case)
            }
            cells = [str(found[i]) if i in found and m == EAGER else "-" for i, m in contenders]
            lines.append(f"| {model}, {case} | " + " | ".join(cells) + " |")
        lines.append("")
        lines += variant_lines(rows)
    if "decode" in figures:
        rows = [r for r in figures["decode"]["rows"] if r["median_s"] is not None]
        kinds = [k for k in DECODE_KINDS if any(r["mode"].startswith(k) for r in rows)]
        lines += [
            "| greedy decoding, ms a token: hfgpt (transformers) | floor | " + " | ".join(kinds) + " |",
            "|---" * (len(kinds) + 2) + "|",
        ]
        for model, case in sorted({(r["model"], r["case"]) for r in rows}):
            mine = [r for r in rows if (r["model"], r["case"]) == (model, case)]
            cells = []
            for kind in kinds:
                ours = next((r for r in mine if r["impl"] == HFGPT and r["mode"] == kind), None)
                theirs = next(
                    (r for r in mine if r["impl"] == TRANSFORMERS and r["mode"].startswith(kind)), None
                )
                cells.append(f"{_ms(ours)} ({_ms(theirs)})")
            floor = mine[0]["extra"]["floor_with_cache_ms_per_step"]
            lines.append(f"| {model}, {case} | {floor:.2f} | " + " | ".join(cells) + " |")
        lines.append("")
    checks = [c for report in figures.values() for c in report.get("checks", [])]
    if checks and claims:
        held = [c for c in checks if c["holds"]]
        lines.append(
            f"Claims of the issues that hold: {len(held)} of {len(checks)} ("
            + "; ".join(
                f"{c['claim']}: {_claim_value(c)} (target {c['relation']} {c['target']:g})"
                for c in checks
                if not c["holds"]
            )
            + ")."
            if len(held) < len(checks)
            else f"Claims of the issues that hold: all {len(checks)}."
        )
    return "\n".join(lines).rstrip("\n")


def variant_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Where a run timed hfgpt with options (its fused loss in other slice sizes, a padded vocabulary): per model,
    case and mode (compiled or eager), a line of the steps' ms, fastest first, each hfgpt row with its slices
    and vocabulary rows, beside the reference's."""
    lines = []
    varied = {(r["model"], r["case"], r["mode"].split(", ")[0]) for r in rows if ", " in r["mode"]}
    for model, case, mode in sorted(varied):
        timed = [
            r
            for r in rows
            if (r["model"], r["case"]) == (model, case)
            and r["mode"].split(", ")[0] == mode
            and r["impl"] in (HFGPT, REFERENCE)
        ]
        cells = [
            f"{r['impl']} {r['extra']['ms_per_step']:.1f}"
            + (
                f" (loss slices of 2**{int(math.log2(r['extra']['loss_slice_elements']))}, "
                f"{r['extra']['vocab_rows']} vocabulary rows)"
                if r["impl"] == HFGPT
                else ""
            )
            for r in sorted(timed, key=lambda r: r["median_s"])
        ]
        lines += [f"{mode.capitalize()} steps, {model}, {case}, ms: " + "; ".join(cells) + ".", ""]
    return lines


def _claim_value(check: dict[str, Any]) -> str:
    return "not measured" if check["value"] is None else f"{check['value']:.2f}"


def update_docs(directory: Path = FIGURES_DIR, readme: Path = FIGURES_DIR.parent / "README.md") -> Path:
    """Remake the README's "Speed on a GPU" region from the figures files of `directory`."""
    text = readme.read_text()
    marked_region(text, README_GPU_TABLE)  # (refuses a README without the region)
    readme.write_text(with_region(text, README_GPU_TABLE, gpu_table(load_figures(directory), claims=False)))
    return readme


def argument_refusal(device: str, chosen: tuple[str, ...], allowed: tuple[str, ...], what: str) -> str | None:
    """The error line for a command line that names an unknown `what` (section, contender) or CUDA where
    there is none (also for profile_cuda.py); None where it is fine."""
    if bad := [c for c in chosen if c not in allowed]:
        return f"error: unknown {what} {bad[0]!r}; choose from {', '.join(allowed)}"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "error: no CUDA device here; --device cpu runs the smoke run (with --tiny)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--profile", choices=tuple(PROFILES), help="the sizes and rows to run (default: full)")
    size.add_argument(
        "--quick", action="store_true", help="--profile quick: the main rows (~6 min on an H100)"
    )
    size.add_argument(
        "--tiny", action="store_true", help="--profile tiny: hidden 32, 2 layers, the smoke run"
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (for the smoke run)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {','.join(SECTIONS)}")
    parser.add_argument(
        "--no-compile", action="store_true", help="leave out the compiled contenders and rows"
    )
    parser.add_argument(
        "--memory-budget-gib", type=float, default=40.0, help="the largest-batch search's budget"
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        help="start nothing new after this many seconds (what is skipped is named in the figures)",
    )
    parser.add_argument("--models", help=f"comma list: only these of {','.join(MODELS)}")
    parser.add_argument("--decode-batches", help="comma list of decoding batch sizes (default: 1,64)")
    parser.add_argument("--json-dir", type=Path, default=FIGURES_DIR, help="where the figures files go")
    parser.add_argument(
        "--update-docs",
        action="store_true",
        help="measure nothing: remake the README's 'Speed on a GPU' table from --json-dir's figures files",
    )
    args = parser.parse_args(argv)
    if args.update_docs:
        print(f"wrote {update_docs(args.json_dir)}", file=sys.stderr)
        return 0
    sections = tuple(s for s in args.sections.split(",") if s)
    if refusal := argument_refusal(args.device, sections, SECTIONS, "section"):
        print(refusal, file=sys.stderr)
        return 2
    models = tuple(m for m in args.models.split(",") if m) if args.models else None
    if models is not None and (refusal := argument_refusal(args.device, models, tuple(MODELS), "model")):
        print(refusal, file=sys.stderr)
        return 2
    batches = None
    if args.decode_batches:
        try:
            batches = tuple(int(b) for b in args.decode_batches.split(","))
        except ValueError:
            batches = ()
    if batches is not None and (not batches or min(batches) < 1):
        print(
            f"error: --decode-batches {args.decode_batches!r} is not a comma list of positive integers",
            file=sys.stderr,
        )
        return 2
    if not args.json_dir.is_dir():
        print(f"error: --json-dir {args.json_dir} is not an existing folder", file=sys.stderr)
        return 2
    profile = args.profile or ("tiny" if args.tiny else "quick" if args.quick else "full")
    reports = run(
        profile,
        args.device,
        sections,
        compile=not args.no_compile,
        memory_budget_gib=args.memory_budget_gib,
        time_budget_s=args.time_budget_s,
        json_dir=args.json_dir,
        models=models,
        decode_batches=batches,
    )
    print(gpu_table(reports))
    failed = sum(len(r["errors"]) for r in reports.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
