"""Where a training step's time goes, op by op, for hfgpt and transformers side by side.

    python benchmarks/step_breakdown.py                          # GPT-2 124M, B=4x256 float32 step
    python benchmarks/step_breakdown.py --family gpt1 --top 30
    python benchmarks/step_breakdown.py --keep-freed-memory      # glibc keeps freed memory (hfgpt-train)
    python benchmarks/step_breakdown.py --tiny --json out.json   # seconds: a smoke run

The step is `bench_model.py`'s (forward with labels, backward, fused AdamW, dropout as configured). Each
contender runs a few plain steps first (timed without instrumentation), then steps under a
`TorchDispatchMode` that times every op torch dispatches and counts the minor page faults (first touches
of fresh memory) during it. An op's time includes what it runs inside C++ (oneDNN's linear op copies a
transposed input itself: that copy is part of the product here); hfgpt's C kernels (attention, the
GELU, dropout's keep masks, the LM loss's log-sum-exp and softmax gradient) are torch operators
(`hfgpt.cpu.kernels`), timed as ops of their own ("hfgpt.gelu_tanh.default", ...). Matrix products
(oneDNN's linear op, `mm`, `addmm`, `addmm_`, `bmm`, `baddbmm`) are summed apart, with their FLOPs from
the shapes, so their own rate can be set beside the rest of the step. The mode costs a few microseconds an
op, so its step total runs a little above the plain step time; compare the two contenders, and the shares,
not absolute times with
other runs (this machine's speed drifts by +-20%).
"""

from __future__ import annotations

import argparse
import copy
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import PROFILES, build_ours, build_peer, make_train_step, write_json  # noqa: E402

from hfgpt.cpu.runtime import keep_freed_memory  # noqa: E402

PRODUCTS = (
    "mkldnn._linear_pointwise",
    "aten.mm.",
    "aten.addmm.",
    "aten.addmm_.",
    "aten.bmm.",
    "aten.baddbmm.",
)


def product_flops(name: str, args: tuple[Any, ...]) -> float:
    """2 x multiply-adds of a matrix product from its operands' shapes; 0 for any other op."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name.startswith("mkldnn._linear_pointwise"):  # x (..., K), weight (N, K)
        x, weight = tensors[0], tensors[1]
        return 2.0 * x.numel() * weight.shape[0]
    if name.startswith("aten.mm."):
        a, b = tensors[0], tensors[1]
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if name.startswith(("aten.addmm.", "aten.addmm_.")):  # (the in-place one: the LM loss's on MKL)
        a, b = tensors[1], tensors[2]
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if name.startswith("aten.bmm."):
        a, b = tensors[0], tensors[1]
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if name.startswith("aten.baddbmm."):
        a, b = tensors[1], tensors[2]
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return 0.0


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class OpTimer(TorchDispatchMode):
    """Wall time, minor page faults, calls and product FLOPs per (op, input shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name = str(func)
        faults, start = _faults(), time.perf_counter()
        out = func(*args, **(kwargs or {}))
        seconds, faults = time.perf_counter() - start, _faults() - faults
        shapes = " ".join(str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor))
        entry = self.stats[(name, shapes)]
        entry[0] += seconds
        entry[1] += faults
        entry[2] += 1
        entry[3] += product_flops(name, args)
        return out


def breakdown(step: Callable[[], None], warmup: int, plain: int, measured: int) -> dict[str, Any]:
    """Plain step times (median), then `measured` steps under `OpTimer`, per step (hfgpt's C kernels
    included, as ops of their own)."""
    for _ in range(warmup):
        step()
    times, faults = [], []
    for _ in range(plain):
        f0, t0 = _faults(), time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        faults.append(_faults() - f0)
    timer = OpTimer()
    with timer:
        for _ in range(measured):
            step()
    ops = [
        {
            "op": name,
            "shapes": shapes,
            "seconds": s / measured,
            "faults": f / measured,
            "calls": c / measured,
            "flops": fl / measured,
            "product": name.startswith(PRODUCTS),
        }
        for (name, shapes), (s, f, c, fl) in timer.stats.items()
    ]
    ops.sort(key=lambda op: -op["seconds"])
    products = [op for op in ops if op["product"]]
    return {
        "step_seconds": median(times),
        "step_seconds_all": times,
        "faults_per_step": median(faults),
        "instrumented_seconds": sum(op["seconds"] for op in ops),
        "product_seconds": sum(op["seconds"] for op in products),
        "product_flops": sum(op["flops"] for op in products),
        "ops": ops,
    }


def by_op(ops: list[dict[str, Any]]) -> list[tuple[str, float, float, float]]:
    """(op, seconds, faults, calls) per step, shapes merged, slowest first."""
    merged: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for op in ops:
        entry = merged["matrix products" if op["product"] else op["op"]]
        entry[0] += op["seconds"]
        entry[1] += op["faults"]
        entry[2] += op["calls"]
    return sorted(((k, *v) for k, v in merged.items()), key=lambda row: -row[1])


def format_report(report: dict[str, Any], top: int) -> str:
    lines = []
    for impl, result in report["contenders"].items():
        rate = result["product_flops"] / result["product_seconds"] if result["product_seconds"] else 0.0
        lines += [
            "",
            f"## {impl}: {result['step_seconds']:.3f} s/step plain (runs "
            + ", ".join(f"{t:.2f}" for t in result["step_seconds_all"])
            + f"), {result['faults_per_step']:.0f} page faults a step",
            f"instrumented: {result['instrumented_seconds']:.3f} s/step; matrix products "
            f"{result['product_seconds']:.3f} s ({rate / 1e9:.0f} GFLOP/s over "
            f"{result['product_flops'] / 1e9:.0f} GFLOP), everything else "
            f"{result['instrumented_seconds'] - result['product_seconds']:.3f} s",
            "",
            "| op | ms/step | faults/step | calls/step |",
            "|---|---|---|---|",
        ]
        for name, seconds, faults, calls in by_op(result["ops"])[:top]:
            lines.append(f"| {name} | {seconds * 1e3:.1f} | {faults:.0f} | {calls:.0f} |")
        lines += ["", "| product | shapes | ms/step | GFLOP/s | faults/step |", "|---|---|---|---|---|"]
        for op in [op for op in result["ops"] if op["product"]][:top]:
            lines.append(
                f"| {op['op']} | {op['shapes']} | {op['seconds'] * 1e3:.1f} | "
                f"{op['flops'] / max(op['seconds'], 1e-12) / 1e9:.0f} | {op['faults']:.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", choices=("gpt2", "gpt1"), default="gpt2")
    parser.add_argument("--impls", default="hfgpt,transformers", help="comma-separated: hfgpt, transformers")
    parser.add_argument("--bf16", action="store_true", help="the step inside torch.autocast(bfloat16)")
    parser.add_argument("--tiny", action="store_true", help="tiny models (a smoke run of seconds)")
    parser.add_argument("--keep-freed-memory", action="store_true", help="apply keep_freed_memory() first")
    parser.add_argument("--steps", type=int, default=3, help="plain steps timed (default 3)")
    parser.add_argument("--measured", type=int, default=2, help="steps under the op timer (default 2)")
    parser.add_argument("--top", type=int, default=20, help="rows per table (default 20)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    unknown = sorted(set(impls) - {"hfgpt", "transformers"})
    if unknown or not impls:
        parser.error(f"--impls takes hfgpt and/or transformers, not {','.join(unknown) or repr(args.impls)}")
    if args.steps < 1 or args.measured < 1:
        parser.error(f"--steps and --measured take 1 or more, not {args.steps} and {args.measured}")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json {args.json}: {args.json.parent} is not an existing folder")
    if args.keep_freed_memory and not keep_freed_memory():
        parser.error("--keep-freed-memory needs glibc's mallopt (Linux)")

    profile = PROFILES["tiny" if args.tiny else "full"]
    batch, seq_len = profile["train_shape"]
    ours = build_ours(args.family, profile["model_overrides"], "cpu")
    models = {"hfgpt": ours, "transformers": build_peer(ours) if "transformers" in impls else None}
    ids = torch.randint(0, ours.config.vocab_size, (batch, seq_len))
    dtype = torch.bfloat16 if args.bf16 else None
    report: dict[str, Any] = {
        "family": args.family,
        "shape": [batch, seq_len],
        "bf16_autocast": args.bf16,
        "keep_freed_memory": args.keep_freed_memory,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "contenders": {},
    }
    for impl in impls:
        step = make_train_step(copy.deepcopy(models[impl]), ids, dtype)
        report["contenders"][impl] = breakdown(step, warmup=2, plain=args.steps, measured=args.measured)
        del step
    print(
        f"# {args.family} training step, B={batch}x{seq_len}, "
        f"{'bf16 autocast' if args.bf16 else 'float32'}, {torch.get_num_threads()} threads"
        + (", freed memory kept" if args.keep_freed_memory else ", default allocator")
    )
    print(format_report(report, args.top))
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
