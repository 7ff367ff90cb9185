"""Where a training step's GPU time goes, kernel by kernel: hfgpt beside the plain-PyTorch reference GPT-2
and transformers' GPT-2, on the same weights, each compiled (or eager with `--no-compile`), in bfloat16
autocast with fused AdamW, as `bench_cuda.py`'s training rows run them.

For each contender: the step's median time (CUDA events around whole steps), then the profiler's device
time of a few steps, per kernel and per kind of kernel (matrix products, attention, the optimizer, the
rest: mostly inductor's fused elementwise kernels), per step. `hfgpt (mask tensor)` is hfgpt given an
all-ones attention mask: the causal mask as a tensor, which is what a compiled step built before hfgpt
passed sdpa `is_causal` itself. `hfgpt (plain loss)` is hfgpt with the causal-LM loss of transformers on its
full logits instead of its fused linear + cross-entropy (a user's own `loss_function` turns the fused loss
off).

    python benchmarks/profile_cuda.py --json-dir benchmarks          # GPT-2 124M, 16 x 1024, on CUDA
    python benchmarks/profile_cuda.py --tiny --device cpu --no-compile --json-dir /tmp  # the smoke run
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_cuda import (
    HFGPT,
    PROFILES,
    REFERENCE,
    TRANSFORMERS,
    argument_refusal,
    free_memory,
    gpt_config,
    machine,
    median_time,
    synchronize,
    training_step,
    transformers_model,
)
from harness import write_json
from torch.profiler import ProfilerActivity, profile
from transformers.loss.loss_utils import ForCausalLMLoss

MASKED = "hfgpt (mask tensor)"
PLAIN_LOSS = "hfgpt (plain loss)"
CONTENDERS = (HFGPT, REFERENCE, TRANSFORMERS, MASKED, PLAIN_LOSS)
# Kinds of kernel, by name: the first pattern that matches names the kind.
KINDS = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient", re.I)),
    ("matrix products", re.compile(r"gemm|cutlass|xmma|nvjet|sm90|wgmma|matmul|addmm|\bmm\b|bmm", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("cross-entropy", re.compile(r"log_softmax|nll_loss|cross_entropy|logsumexp", re.I)),
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "elementwise and other")


def peak_memory(device: str, step: Callable[[], None]) -> float | None:
    """GiB allocated at most during one step (model, optimizer state and activations), on CUDA."""
    if not device.startswith("cuda"):
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats()
    step()
    synchronize(device)
    return torch.cuda.max_memory_allocated() / 2**30


def kernel_table(step: Callable[[], None], device: str, steps: int) -> dict[str, Any]:
    """The device time (CPU time without CUDA) of `steps` steps under the profiler, per kernel and per
    kind, divided by `steps`."""
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if cuda and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and event.cpu_parent is not None:  # (top-level CPU ops only, not their children)
            continue
        duration = event.time_range.elapsed_us() if cuda else event.cpu_time_total
        per_kernel[event.name][0] += duration / 1000 / steps  # us -> ms a step
        per_kernel[event.name][1] += 1
    kinds: dict[str, float] = defaultdict(float)
    for name, (ms, _) in per_kernel.items():
        kinds[kind_of(name)] += ms
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "device_ms_per_step": sum(ms for ms, _ in per_kernel.values()),
        "kernels_per_step": sum(n for _, n in per_kernel.values()) / steps,
        "by_kind_ms_per_step": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "top_kernels": [
            {"name": name[:160], "ms_per_step": ms, "calls_per_step": n / steps} for name, (ms, n) in top
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help="a preset: gpt2 (default), gpt2-medium, ...")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--tiny", action="store_true", help="bench_cuda's tiny sizes (the smoke run)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma list")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps (after 3 untimed)")
    parser.add_argument("--json-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    contenders = tuple(c for c in args.contenders.split(",") if c)
    if refusal := argument_refusal(args.device, contenders, CONTENDERS, "contender"):
        print(refusal, file=sys.stderr)
        return 2
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    profile_name = "tiny" if args.tiny else "full"
    overrides = PROFILES[profile_name]["model_overrides"]
    batch = PROFILES["tiny"]["train_batch"] if args.tiny else args.batch
    config = gpt_config(args.model, overrides, args.dropout)
    seq_len = PROFILES["tiny"]["seq_len"] if args.tiny else config.n_positions
    state = {k: v.clone() for k, v in transformers_model(config).state_dict().items()}
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(2))
    ids = ids.to(args.device)
    report: dict[str, Any] = {
        "what": f"{args.model} training step, B={batch}x{seq_len}, bf16 autocast, dropout {args.dropout:g}, "
        + ("eager" if args.no_compile else "torch.compile"),
        "machine": machine(args.device),
        "contenders": {},
    }
    for impl in contenders:
        mask = torch.ones_like(ids) if impl == MASKED else None
        step, keep = training_step(
            impl if impl in (REFERENCE, TRANSFORMERS) else HFGPT,
            config,
            state,
            ids,
            args.device,
            not args.no_compile,
            mask,
        )
        if impl == PLAIN_LOSS:
            keep[0].loss_function = functools.partial(ForCausalLMLoss)  # not ForCausalLMLoss itself
        step_ms = 1000 * median_time(step, args.device, args.repeats)
        peak = peak_memory(args.device, step)
        table = kernel_table(step, args.device, steps=3)
        report["contenders"][impl] = {"step_ms_median": step_ms, "peak_gib": peak, **table}
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in table["by_kind_ms_per_step"].items())
        print(f"{impl}: {step_ms:.2f} ms a step, peak {peak or 0:.2f} GiB; device ms a step: {kinds}")
        del step, keep
        free_memory(args.device)
        torch.compiler.reset()
    path = args.json_dir / f"profile-{args.device.split(':')[0]}-training.json"
    write_json(path, report)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
