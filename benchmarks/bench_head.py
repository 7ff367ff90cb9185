"""The LM head's product at a decoding step's few rows, side by side on this host: hfgpt's C row product
(`hfgpt.cpu.products.few_rows_product`, what the CPU backend runs for 1 to 16 rows) against torch's
`F.linear` (what transformers' head runs) and `weight @ rows^T`, on GPT-2's 50257 x 768 head with random
weights. Each arm runs in fresh processes, in rounds whose arm order rotates; a figure is the median over the
rounds of each process's median time. Ratios: the other arm's time over hfgpt's (>1 = hfgpt faster). The
backend runs the kernel wherever it builds; a host where a ratio here is below 1 is one to revisit that on.

    python benchmarks/bench_head.py --json head-cpu.json
    .ci/as-avx2 python benchmarks/bench_head.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HFGPT, LINEAR, TRANSPOSED = "hfgpt", "F.linear", "weight @ rows^T"
ARMS = (HFGPT, LINEAR, TRANSPOSED)
SHAPES = {"gpt2": (50257, 768), "tiny": (500, 64)}  # the head's (out, in)


def product(arm: str):
    """The arm's `rows @ weight.T` as a function of (rows, weight)."""
    if arm == HFGPT:
        from hfgpt.cpu.products import few_rows_applies, few_rows_product

        def hfgpt_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            if not few_rows_applies(rows, weight):
                raise RuntimeError("hfgpt's row product does not apply here (no C compiler, HFGPT_NATIVE=0)")
            return few_rows_product(rows, weight)

        return hfgpt_product
    if arm == LINEAR:
        return F.linear
    if arm == TRANSPOSED:
        return lambda rows, weight: torch.mm(weight, rows.T).T.contiguous()
    raise ValueError(f"no arm {arm!r}: one of {', '.join(ARMS)}")


def time_arm(arm: str, rows: list[int], shape: tuple[int, int], repeats: int) -> dict[str, Any]:
    """One arm's median milliseconds per product at each row count (after one untimed call), and its
    largest error against the float64 product."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator)
    run, times, error = product(arm), {}, 0.0
    with torch.no_grad():
        for count in rows:
            x = torch.randn(count, shape[1], generator=generator)
            got = run(x, weight)
            error = max(error, (got.double() - F.linear(x.double(), weight.double())).abs().max().item())
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                run(x, weight)
                samples.append((time.perf_counter() - start) * 1e3)
            times[str(count)] = statistics.median(samples)
    return {"ms": times, "max_error": error}


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """`time_arm` in a fresh process: this script's `--worker`, run by `harness.run_worker`."""
    from harness import run_worker as run_script  # (not in the workers: it imports every contender)

    return run_script(f"the {spec['arm']} arm", spec, script=__file__)


def measure(rows: list[int], shape: tuple[int, int], rounds: int, repeats: int) -> dict[str, Any]:
    """Every arm once a round, the order rotating; the medians over rounds and hfgpt's ratios."""
    per_round: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for index in range(rounds):
        for arm in ARMS[index % len(ARMS) :] + ARMS[: index % len(ARMS)]:
            spec = {"arm": arm, "rows": rows, "shape": list(shape), "repeats": repeats}
            per_round[arm].append(run_worker(spec))
    medians = {
        arm: {str(n): statistics.median(r["ms"][str(n)] for r in results) for n in rows}
        for arm, results in per_round.items()
    }
    ratios = {arm: {str(n): medians[arm][str(n)] / medians[HFGPT][str(n)] for n in rows} for arm in ARMS[1:]}
    errors = {arm: max(r["max_error"] for r in results) for arm, results in per_round.items()}
    return {"medians_ms": medians, "ratios": ratios, "max_error": errors, "rounds": per_round}


def table(report: dict[str, Any]) -> str:
    rows = list(report["medians_ms"][HFGPT])
    lines = [
        f"The LM head's product, {report['shape'][0]} x {report['shape'][1]}, {report['rounds_run']} rounds "
        f"of fresh processes. Host: {report['machine']['host']}.",
        "",
        "| rows | "
        + " | ".join(f"{arm} ms" for arm in ARMS)
        + " | "
        + " | ".join(f"{arm} / hfgpt" for arm in ARMS[1:])
        + " |",
        "|---" * (2 * len(ARMS)) + "|",
    ]
    for n in rows:
        times = " | ".join(f"{report['medians_ms'][arm][n]:.2f}" for arm in ARMS)
        ratios = " | ".join(f"{report['ratios'][arm][n]:.2f}x" for arm in ARMS[1:])
        lines.append(f"| {n} | {times} | {ratios} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16", help="comma list of row counts (default 1,2,4,8,16)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of fresh processes (default 3)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls a row count (default 20)")
    parser.add_argument("--tiny", action="store_true", help="a 500 x 64 head: a smoke run")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(time_arm(spec["arm"], spec["rows"], tuple(spec["shape"]), spec["repeats"])))
        return 0
    from harness import machine_info, publish  # (not in the workers: it imports every contender)

    rows = [int(n) for n in args.rows.split(",")]
    if not rows or min(rows) < 1 or max(rows) > 16 or args.rounds < 1 or args.repeats < 1:
        parser.error("--rows takes 1 to 16 rows; --rounds and --repeats at least 1")
    shape = SHAPES["tiny" if args.tiny else "gpt2"]
    report = {
        "shape": list(shape), "rounds_run": args.rounds, "machine": machine_info("cpu"),
        **measure(rows, shape, args.rounds, args.repeats),
    }  # fmt: skip
    publish(table(report), report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
