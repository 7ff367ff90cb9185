"""hfgpt with its float32 CPU products through oneDNN at every size (`use_onednn_products(True)`), through
MKL's `addmm` (`use_onednn_products(False)`, the products transformers' `Conv1D` runs), and in its default
setting (`use_onednn_products(None)`: oneDNN only where it was measured the faster on such a CPU), interleaved
in one process: prefill, greedy decoding and a training step of GPT-2 124M shapes (random weights).

    python benchmarks/ab_cpu_products.py --json benchmarks/ab-cpu-products-gpt2.json
    python benchmarks/ab_cpu_products.py --tiny              # the test suite's smoke run

Ratios are MKL time / oneDNN time and MKL time / the default's time (>1: the other faster than MKL). The
decoding rows also say whether the three produced the same greedy tokens (they round differently, so on
random weights a near-tie can flip).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from bench_model import (
    FAMILIES,
    PROFILES,
    _forward,
    build_ours,
    greedy,
    interleaved,
    left_padded_prompts,
    machine_info,
    make_train_step,
    publish,
)

from hfgpt.cpu import ops as ops_hfgpt

# hfgpt's settings compared: `use_onednn_products(...)` by name.
SETTINGS: dict[str, bool | None] = {"onednn": True, "mkl": False, "default": None}
BACKENDS = tuple(SETTINGS)


def on(backend: str, fn) -> Any:
    """`fn` run with hfgpt's products on `backend` (a name of `SETTINGS`)."""

    def run() -> Any:
        with ops_hfgpt.onednn_products(SETTINGS[backend]):
            return fn()

    return run


def ab(name: str, fns: dict[str, Any], repeats: int, unit_count: float, unit: str) -> dict[str, Any]:
    timings = interleaved(fns, repeats, "cpu")
    row = {"case": name, "unit": unit}
    for backend, timing in timings.items():
        row[backend] = {**timing.summary(), "rate": unit_count / timing.median}
    row["mkl_over_onednn"] = timings["mkl"].median / timings["onednn"].median
    row["mkl_over_default"] = timings["mkl"].median / timings["default"].median
    return row


def run(tiny: bool, family: str, repeats: int | None) -> dict[str, Any]:
    profile = PROFILES["tiny" if tiny else "full"]
    repeats = repeats or (2 if tiny else 7)
    model = build_ours(family, profile["model_overrides"], "cpu").eval()
    vocab = model.config.vocab_size
    rows = []
    for batch, seq_len in profile["prefill_shapes"]:
        ids = torch.randint(0, vocab, (batch, seq_len))
        for keep, label in ((0, "all logits"), (1, "last logits")):
            fns = {b: on(b, lambda ids=ids, keep=keep: _forward(model, ids, keep)) for b in BACKENDS}
            rows.append(ab(f"prefill B={batch}x{seq_len}, {label}", fns, repeats, batch * seq_len, "tok/s"))
    new = profile["new_tokens"]
    for batch in profile["decode_batches"]:
        prompts = left_padded_prompts(batch, profile["prompt_len"], vocab, 0, "cpu")
        tokens: dict[str, torch.Tensor] = {}

        def decode(backend: str, p: dict = prompts, out: dict = tokens) -> None:
            with torch.inference_mode():
                out[backend] = greedy(model, p, new)

        fns = {b: on(b, lambda b=b: decode(b)) for b in BACKENDS}
        row = ab(
            f"decode B={batch}, {profile['prompt_len']}+{new} tokens", fns, repeats, batch * new, "new tok/s"
        )
        row["tokens_identical"] = all(torch.equal(tokens["mkl"], tokens[b]) for b in BACKENDS)
        rows.append(row)
    batch, seq_len = profile["train_shape"]
    ids = torch.randint(0, vocab, (batch, seq_len))
    steps = {b: on(b, make_train_step(model, ids)) for b in BACKENDS}  # one model: both step it alike
    rows.append(ab(f"train B={batch}x{seq_len}, fp32, fused AdamW", steps, repeats, batch * seq_len, "tok/s"))
    return {"machine": machine_info("cpu"), "family": family, "rows": rows}


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"hfgpt {report['family']}: float32 CPU products on oneDNN, on MKL and as by default, interleaved in"
        " one process",
        "",
        "| case | oneDNN | MKL | default | MKL time / oneDNN time | MKL time / default's time | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        cells = [f"{row[b]['rate']:.3g} {row['unit']} ({row[b]['median_s'] * 1000:.0f} ms)" for b in BACKENDS]
        notes = (
            f"tokens identical: {'yes' if row['tokens_identical'] else 'no'}"
            if "tokens_identical" in row
            else ""
        )
        ratios = f"{row['mkl_over_onednn']:.2f}x | {row['mkl_over_default']:.2f}x"
        lines.append(f"| {row['case']} | {' | '.join(cells)} | {ratios} | {notes} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model: a smoke run")
    parser.add_argument("--family", default="gpt2", choices=FAMILIES)
    parser.add_argument("--repeats", type=int, help="timed repeats per case (default 7; tiny 2)")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    if ops_hfgpt._ONEDNN_LINEAR is None:
        print("error: this torch build has no oneDNN: nothing to compare", file=sys.stderr)
        return 2
    report = run(args.tiny, args.family, args.repeats)
    publish(format_table(report), report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
