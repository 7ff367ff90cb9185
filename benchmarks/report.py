"""The views of `bench_model.py`'s figures: the full table of a run, the figures files (one per section),
the README's table and chart made from them, and the generated regions of README.md and RESULTS.md
(`--update-docs`). It measures nothing; every line that gives figures names the host they come from
(`harness.host_line`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import lowp_accuracy
from contenders import COMPILED, CTRANSLATE2, FAMILIES, INT8, INT8_COMPILED, TORCHAO, VS_CTRANSLATE2
from harness import SECTIONS, host_line, write_json


def format_table(report: dict[str, Any]) -> str:
    """A Markdown table: hfgpt beside transformers per measurement, medians with (min-max) spread."""
    hw = report["hardware"]
    m = report["machine"]
    lines = [
        (f"Run of {report['date']}" if "date" in report else "An undated run")
        + (f" ({', '.join(report['sections'])})" if "sections" in report else "")
        + f". Host: {host_line(m)}; device {m['device']}; profile `{report['profile']}`"
        + (
            "; freed memory kept in the process (`--keep-freed-memory`)."
            if m.get("keep_freed_memory")
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
        "Ratios: hfgpt / transformers throughput (>1 = hfgpt faster; for the time to first token, "
        "transformers' time over hfgpt's); for memory, hfgpt / transformers peak (<1 = hfgpt smaller). "
        "Cells: median rate (min-max over runs)."
    )
    return "\n".join(lines)


def _best_of(by: dict[str, float] | None, cell: str) -> str:
    """The table's suffix naming the rates a headline figure is the best of, e.g. ` (best of 2 MiB pages
    68.4, 4 KiB pages 62.2)`; empty where there are not several."""
    if not by or len(by) < 2:
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
    if section == "ttft":
        return (
            f"{ours['extra']['ms_to_first_token']:.1f} vs {peer['extra']['ms_to_first_token']:.1f} ms to the "
            f"first token; tokens identical: {'yes' if ex['tokens_identical'] else 'NO'}"
        )
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
    ("time to first token: generate(), 64-token prompt + 1 token", "ttft", "B=1", "hfgpt"),
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
    if row["section"] == "ttft":
        return f"{ex['ms_to_first_token']:.1f} ms"
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
    hw = run_["hardware"]
    rates = f"float32 matmul {hw['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s"
    if "bf16_matmul_flops_per_s" in hw:
        rates += f", bfloat16 {hw['bf16_matmul_flops_per_s'] / 1e9:.0f} GFLOP/s"
    rates += f", memory read {hw['read_bytes_per_s'] / 1e9:.1f} GB/s"
    return (
        f"{run_.get('date', 'an undated run')}, profile `{run_['profile']}`: {host_line(run_['machine'])} "
        f"({run_['machine']['device']}); measured {rates}"
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
    hosts = sorted({host_line(run_["machine"]).split(";")[0] for run_ in runs}) or ["?"]
    dates = sorted({run_.get("date", "?") for run_ in runs})
    ax.set_title(f"hfgpt on {' / '.join(hosts)}, {', '.join(dates)}", fontsize=9, wrap=True)
    ax.legend(loc="lower right", fontsize=8)
    fig.savefig(path, dpi=100, metadata={"Description": json.dumps(data)})
    return data


# The regions of README.md and benchmarks/RESULTS.md that `--update-docs` writes: each between its start
# marker and GENERATED_END, both HTML comments (invisible on GitHub).
README_TABLE = "<!-- README table: python benchmarks/bench_model.py --update-docs -->"
RESULTS_TABLE = "<!-- full table: python benchmarks/bench_model.py --update-docs -->"
ACCURACY_TABLE = "<!-- accuracy table: python benchmarks/bench_model.py --update-docs -->"
ACCURACY_FIGURES = FIGURES_DIR / "lowp-accuracy-cpu.json"  # lowp_accuracy.py's figures
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
    README's table, and RESULTS.md's full table and accuracy table (from `lowp_accuracy.py`'s figures).
    Returns the files written."""
    chart = root / "benchmarks" / "ratios-cpu.png"
    plot_ratios(figures, chart)
    results = root / "benchmarks" / "RESULTS.md"
    text = with_region(results.read_text(), RESULTS_TABLE, figures_table(figures))
    results.write_text(with_region(text, ACCURACY_TABLE, accuracy_table()))
    readme = root / "README.md"
    readme.write_text(with_region(readme.read_text(), README_TABLE, summary_table(figures)))
    return [chart, results, readme]


def accuracy_table(path: Path = ACCURACY_FIGURES) -> str:
    """`lowp_accuracy.py`'s table of its figures file."""
    return lowp_accuracy.format_report(json.loads(path.read_text()))
