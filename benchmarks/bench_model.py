"""Speed and memory of hfgpt beside transformers' own GPT-2 / GPT-1, on identical random weights.

What is measured, each as a ratio against transformers' model in the same run (the sections):

* prefill: a forward over B x T tokens, with logits at every position and at the last one only
  (`logits_to_keep=1`), in float32 and inside bfloat16 autocast, tokens/s and model FLOPs utilisation
  (MFU) against the measured matmul rate of that precision;
* ttft: time to first token, `generate()` over a 64-token prompt with `max_new_tokens=1` (B=1);
* decode: greedy `generate()` from left-padded prompts of different lengths (with attention_mask),
  B=1 and B=8, new tokens/s, the generated tokens checked identical, beside the bandwidth floor of one
  step (the weight bytes a step reads / the measured memory read rate);
* lowp: decoding copies at batch size 1 (`quantize_for_decoding`: float32, bfloat16, int8; with the
  `compile` peer, the int8 copy also with its step compiled on a static cache), with their accuracy cost
  against the float32 model (logit error, top-1 and greedy agreement);
* train: forward, backward and fused AdamW, s/step and MFU, in float32 and inside bfloat16 autocast;
* memory: peak memory of a training step, a prefill and a decoding run, each in a fresh subprocess
  (peak RSS on the CPU, `torch.cuda.max_memory_allocated` on CUDA);
* compile: `StaticCache` + `torch.compile` generation of both models (compile time reported apart).

Other ways to make the same model fast run beside them as extra contenders (`--peers`), so that the
backend is judged against them and not only against eager transformers: the plain hfgpt model (hfgpt's
CPU backend taken out, `unkernelize(copy.deepcopy(model))`) under `torch.compile` in prefill, decoding and
training, and in the lowp section torchao's int8 (dynamic int8 activations, int8 weights, compiled) and
CTranslate2's int8 generator on the same weights (`pip install 'hfgpt[bench]'`).

Timings on a shared machine drift, so the contenders run interleaved (A B, B A, ...) and the medians and
spreads (min-max) are reported; the matmul and read rates are also timed between the model runs, so
each utilisation figure can be set against the machine's speed in the same minutes. Every figures file
and table names the host: CPU model, ISA limits applied (`.ci/as-avx2` or native), VM or not, threads,
versions.

This file is the command line: the measuring is `harness.py` (rounds, limits, host, fresh-process arms),
`contenders.py` (the models) and `sections.py`; the tables, chart and docs are `report.py`'s.

    python benchmarks/bench_model.py --json-dir benchmarks     # the full run: figures-cpu-<section>.json
    .ci/as-avx2 python benchmarks/bench_model.py --json-dir DIR # the same as on an AVX2 CPU
    python benchmarks/bench_model.py --quick --sections ttft,prefill,decode --families gpt2
    python benchmarks/bench_model.py --tiny --peers none        # the test suite's smoke run
    python benchmarks/bench_model.py --figures                  # the full table of the saved figures
    python benchmarks/bench_model.py --summary                  # the README's table of them
    python benchmarks/bench_model.py --plot                     # the README's chart of them
    python benchmarks/bench_model.py --update-docs              # chart, README and RESULTS.md tables
    python benchmarks/compare_revisions.py --base REV           # two revisions of hfgpt on this host
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from contenders import FAMILIES, PEERS, missing_peer_packages
from harness import SECTIONS, publish
from report import (
    FIGURES_DIR,
    README_TABLE,  # noqa: F401  (tests/test_readme.py reads the README's region through this script)
    figures_table,
    format_table,
    load_figures,
    marked_region,  # noqa: F401  (as README_TABLE)
    plot_ratios,
    summary_table,
    update_docs,
    write_sections,
)
from sections import run


def parser() -> argparse.ArgumentParser:
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
        help="measure nothing: remake the chart, the README's table and RESULTS.md's tables from benchmarks/",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
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
        profile, args.device, families, sections, args.repeats, args.threads, args.keep_freed_memory, peers
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
