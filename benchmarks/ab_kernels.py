"""Each of hfgpt's C kernels against what runs without it, on this CPU: the model with every kernel beside
the same model with one kernel switched off (its callers then run torch's ops), in a prefill forward, a
training step and greedy decoding, interleaved in one process.

    python benchmarks/ab_kernels.py --json benchmarks/ab-kernels-cpu.json
    .ci/as-avx2 python benchmarks/ab_kernels.py --json benchmarks/ab-kernels-cpu-avx2.json  # as on AVX2
    python benchmarks/ab_kernels.py --tiny                          # seconds: a smoke run

A kernel's ratio is the task's median time without it over the median with it: above 1x the kernel makes
the task faster on this CPU, below 1x it makes it slower and should step aside here. Each task times only
the kernels it calls (found by running it once with every kernel on). The kernels are portable C, built
for this CPU's widest vectors (`-march=native`; `HFGPT_CFLAGS` narrows them, as `.ci/as-avx2` does); the
int8 kernel is left out: without it the int8 copy runs a torch version written for tests, not for speed.
The shapes and step are `bench_model.py`'s (GPT-2 124M or GPT-1, random weights, dropout 0.1 in training).
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import (  # noqa: E402
    PROFILES,
    build_ours,
    greedy,
    interleaved,
    left_padded_prompts,
    machine_info,
    make_train_step,
    write_json,
)

from hfgpt.cpu import kernels  # noqa: E402

KERNELS = ("attention", "gelu", "loss", "row_product", "dropout")
ALL_ON = "every kernel"


@contextmanager
def switched_off(name: str | None):
    """`kernels.available(name)` False inside (every other kernel as it was): hfgpt's callers of that kernel
    run torch's ops instead, as they do where it cannot be built."""
    available = kernels.available
    if name is not None:
        kernels.available = lambda kernel: kernel != name and available(kernel)
    try:
        yield
    finally:
        kernels.available = available


@contextmanager
def recording_calls():
    """The names of the kernels whose library hfgpt's operators ask for inside."""
    called, library = set(), kernels._library

    def spied(name: str):
        called.add(name)
        return library(name)

    kernels._library = spied
    try:
        yield called
    finally:
        kernels._library = library


def tasks(family: str, profile: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The three tasks as callables: prefill and greedy decoding on one model, the training step (whose
    optimizer changes the weights) on a copy of it."""
    model = build_ours(family, profile["model_overrides"], "cpu").eval()
    vocab = model.config.vocab_size
    batch, length = profile["prefill_shapes"][0]
    generator = torch.Generator().manual_seed(0)
    prefill_ids = torch.randint(0, vocab, (batch, length), generator=generator)
    train_ids = torch.randint(0, vocab, profile["train_shape"], generator=generator)
    prompts = left_padded_prompts(1, profile["prompt_len"], vocab, 0, "cpu")

    def prefill() -> None:
        with torch.no_grad():
            model(prefill_ids)

    def decode() -> None:
        with torch.no_grad():
            greedy(model, prompts, profile["new_tokens"])

    return {
        f"prefill B={batch}x{length}": prefill,
        f"train B={train_ids.shape[0]}x{train_ids.shape[1]}, fp32, fused AdamW": make_train_step(
            copy.deepcopy(model), train_ids
        ),
        f"decode B=1, {profile['prompt_len']}+{profile['new_tokens']} tokens": decode,
    }


def kernel_rows(family: str, task: str, fn: Callable[[], Any], repeats: int) -> list[dict[str, Any]]:
    """`fn` with every kernel and with each kernel it calls switched off, interleaved: one row a kernel."""
    with recording_calls() as called:
        fn()
    used = [name for name in KERNELS if name in called]
    if not used:
        return []

    def variant(name: str | None) -> Callable[[], None]:
        def run() -> None:
            with switched_off(name):
                fn()

        return run

    timings = interleaved({ALL_ON: variant(None), **{name: variant(name) for name in used}}, repeats, "cpu")
    with_all = timings.pop(ALL_ON)
    rows = []
    for name, without in timings.items():
        rows.append(
            {
                "family": family,
                "task": task,
                "kernel": name,
                "with_median_s": with_all.median,
                "without_median_s": without.median,
                "with_s": with_all.times,
                "without_s": without.times,
                "ratio": without.median / with_all.median,
            }
        )
        print(
            f"{family} | {task} | {name}: {1000 * with_all.median:.1f} ms with, "
            f"{1000 * without.median:.1f} ms without: {rows[-1]['ratio']:.2f}x",
            flush=True,
        )
    return rows


def build_label(machine: dict[str, Any]) -> str:
    """How a run's kernels were built and what torch ran: natively, or as on an AVX2 CPU (HFGPT_CFLAGS
    narrowed, AVX-512 hidden, as `.ci/as-avx2` does)."""
    flags = machine.get("hfgpt_cflags") or "-march=native"
    isa = "AVX-512" if "avx512f" in (machine.get("cpu_features") or []) else "AVX2"
    return f"`{flags}`, {isa}"


def figures_table(reports: list[dict[str, Any]]) -> str:
    """RESULTS.md's view of figures files: the machine, then one table of every run's rows."""
    machines = {f"{r['machine']['cpu']}, {r['machine']['threads']} threads" for r in reports}
    rows = [{**row, "build": build_label(report["machine"])} for report in reports for row in report["rows"]]
    return f"Machine: {', '.join(sorted(machines))}.\n\n{markdown(rows)}"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (with a column for how the kernels were built, where rows say)."""
    build = any("build" in row for row in rows)
    lines = [
        ("| kernels built, torch | " if build else "| ")
        + "family | task | kernel | with it | without it | ratio |",
        "|---" * (7 if build else 6) + "|",
    ]
    for row in rows:
        lines.append(
            (f"| {row['build']} " if build else "")
            + f"| {row['family']} | {row['task']} | {row['kernel']} | {1000 * row['with_median_s']:.1f} ms | "
            f"{1000 * row['without_median_s']:.1f} ms | {row['ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="tiny models (hidden 32, 2 layers): a smoke run")
    size.add_argument("--repeats", type=int, default=5, help="interleaved rounds per task (default 5)")
    parser.add_argument("--families", default="gpt2", help="comma list of gpt2,gpt1 (default gpt2)")
    parser.add_argument("--tasks", default="prefill,train,decode", help="comma list of prefill,train,decode")
    parser.add_argument("--prompt-len", type=int, default=None, help="decoding's prompt length (default 64)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows and the machine here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not all(kernels.available(name) for name in KERNELS):
        parser.error("hfgpt's C kernels are not available here (no C compiler, or HFGPT_NATIVE=0)")
    profile = dict(PROFILES["tiny" if args.tiny else "quick"])
    if args.prompt_len:
        profile["prompt_len"] = args.prompt_len
    repeats = 2 if args.tiny else args.repeats
    rows = []
    for family in args.families.split(","):
        for task, fn in tasks(family, profile).items():
            if task.split()[0] in args.tasks.split(","):
                rows += kernel_rows(family, task, fn, repeats)
    print(markdown(rows))
    if args.json:  # (machine_info records HFGPT_CFLAGS where it is set)
        write_json(args.json, {"machine": machine_info("cpu"), "repeats": repeats, "rows": rows})
    losers = [row for row in rows if row["ratio"] < 1]
    if losers:
        print("slower with the kernel: " + ", ".join(f"{r['kernel']} in {r['task']}" for r in losers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
