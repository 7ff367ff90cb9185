"""Smoke run of benchmarks/bench_model.py at tiny size: every section produces figures, the two
implementations agree (logits, greedy tokens), the outputs (table, JSON) are well formed and name the host,
and each ratio is the one of the measured figures; compare_revisions.py runs two checkouts side by side.

Speed itself is never asserted here: figures come from the benchmark, not from timed unit tests.
"""

import ast
import contextlib
import importlib.util
import io
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

import bench_model  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
import compare_revisions
import contenders
import harness
import pytest
import report
import tomllib
import torch
from conftest import made_once  # tests/ is on sys.path
from test_transformers_common import pip_or_skip

BENCHMARKS = Path(bench_model.__file__).parent


@pytest.fixture(scope="module", autouse=True)
def cpu_benchmark():
    """These test the CPU benchmark: where a CUDA device exists (bench_model's default there), they still
    run on the CPU."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        yield


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory) -> Path:
    """A folder with two tiny runs' figures (`gpt2.json`, `gpt1.json`) and what each printed (`.txt`)."""
    # GPT-2 through every section but compile (tens of seconds of inductor); GPT-1 through the three
    # where its peer differs most (no logits_to_keep, no KV cache).
    gpt2 = ["--families", "gpt2", "--sections", "prefill,ttft,decode,lowp,train,memory", "--peers", "none"]
    gpt1 = ["--families", "gpt1", "--sections", "prefill,ttft,decode", "--peers", "none"]

    def run(out):
        for name, argv in (("gpt2", gpt2), ("gpt1", gpt1)):
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                assert bench_model.main(["--tiny", *argv, "--json", str(out / f"{name}.json")]) == 0
            (out / f"{name}.txt").write_text(printed.getvalue())

    return made_once(tmp_path_factory, "bench", run)


@pytest.fixture(scope="module")
def tiny_report(tiny_runs):
    out = tiny_runs
    run_report = json.loads((out / "gpt2.json").read_text())
    run_report["rows"] += json.loads((out / "gpt1.json").read_text())["rows"]
    return run_report


@pytest.mark.slow
def test_every_section_has_both_implementations(tiny_report):
    seen = {(r["family"], r["section"], r["impl"]) for r in tiny_report["rows"]}
    for family, sections in (
        ("gpt2", ("prefill", "ttft", "decode", "train", "memory")),
        ("gpt1", ("prefill", "ttft", "decode")),
    ):
        for section in sections:
            assert (family, section, "hfgpt") in seen
            assert (family, section, "transformers") in seen
    for variant in ("hfgpt fp32", "hfgpt bf16", "hfgpt int8", "hfgpt fp32 copy", "transformers fp32"):
        assert ("gpt2", "lowp", variant) in seen


@pytest.mark.parametrize("section", ["prefill", "train"])
def test_float32_and_bf16_autocast_rows_with_their_own_matmul_rate(tiny_report, section):
    hw = tiny_report["hardware"]
    assert hw["bf16_matmul_flops_per_s"] > 0
    rows = [r for r in tiny_report["rows"] if r["section"] == section and r["family"] == "gpt2"]
    bf16 = [r for r in rows if "bf16 autocast" in r["case"]]
    assert {r["impl"] for r in bf16} == {"hfgpt", "transformers"}
    assert len(bf16) == len(rows) / 2  # every float32 case also inside autocast
    for row in rows:  # utilisation against the matmul rate of the row's own precision
        peak_key = "bf16_matmul_flops_per_s" if row in bf16 else "matmul_flops_per_s"
        assert row["extra"]["peak_key"] == peak_key
        assert row["mfu"] == pytest.approx(row["extra"]["flops"] / row["median_s"] / hw[peak_key])


def test_figures_are_finite_and_positive(tiny_report):
    hw = tiny_report["hardware"]
    assert hw["matmul_flops_per_s"] > 0 and hw["read_bytes_per_s"] > 0
    # The read rate is the better of 4 KiB pages and huge pages (hfgpt's decoding copies use the latter).
    by_pages = hw["read_bytes_per_s_by_pages"]
    assert set(by_pages) == {"4 KiB", "2 MiB"} and min(by_pages.values()) > 0
    assert hw["read_bytes_per_s"] == max(by_pages.values())
    for row in tiny_report["rows"]:
        assert row["rate"] > 0 and math.isfinite(row["rate"]), row
        if row["section"] != "memory":
            assert row["min_s"] <= row["median_s"] <= row["max_s"], row
        if row["section"] in ("prefill", "train"):
            # The matmul rate measured between the model runs, and the utilisation against it.
            ex = row["extra"]
            assert ex["concurrent_matmul_flops_per_s"] > 0, row
            assert ex["mfu_concurrent"] == pytest.approx(
                ex["flops"] / row["median_s"] / ex["concurrent_matmul_flops_per_s"]
            )
        if row["section"] in ("decode", "lowp"):
            # The decoding floor at the start-of-run read rate, and at the rate timed between the runs.
            ex = row["extra"]
            prefix = "fp32_" if row["section"] == "lowp" else ""
            bytes_key = f"{row['family']}_decode_weight_bytes"
            if bytes_key in hw:  # (the GPT-1 rows come from a run with its own hardware figures)
                assert ex[f"{prefix}floor_ms_per_step"] == pytest.approx(
                    1000 * hw[bytes_key] / hw["read_bytes_per_s"]
                )
            same_minutes = ex[f"{prefix}floor_same_minutes_ms_per_step"]
            assert 0 < same_minutes < math.inf, row


def test_same_weights_give_same_logits_and_tokens(tiny_report):
    for row in tiny_report["rows"]:
        if row["section"] == "prefill":  # float32 agrees to rounding; bfloat16 to its own precision
            bound = 0.1 if row["case"].endswith("bf16 autocast") else 1e-5
            assert row["extra"]["max_abs_logit_diff"] < bound, row
        if row["section"] in ("ttft", "decode"):
            assert row["extra"]["tokens_identical"], row


def test_low_precision_accuracy_is_measured(tiny_report):
    lowp = {
        r["impl"]: r["extra"] for r in tiny_report["rows"] if r["section"] == "lowp" and r["family"] == "gpt2"
    }
    assert lowp["hfgpt fp32"]["max_abs_logit_err"] == 0.0
    # The float32 copy computes the same numbers in another order: float rounding, the same tokens.
    assert lowp["hfgpt fp32 copy"]["max_abs_logit_err"] < 1e-5
    assert lowp["hfgpt fp32 copy"]["greedy_token_agreement"] == 1.0
    for name in ("hfgpt bf16", "hfgpt int8"):
        # Lower precision changes the logits a little, never wildly, on a tiny random model.
        assert 0.0 < lowp[name]["max_abs_logit_err"] < 0.5
        assert 0.0 <= lowp[name]["greedy_token_agreement"] <= 1.0


def test_memory_comes_from_separate_processes(tiny_report):
    rows = [r for r in tiny_report["rows"] if r["section"] == "memory"]
    for row in rows:
        # A fresh interpreter with torch and transformers imported: well above 100 MB, below the machine.
        assert 1e8 < row["extra"]["peak_rss_bytes"] < 64e9
        extra = row["extra"]
        assert extra["rss_after_imports_bytes"] <= extra["rss_with_model_bytes"] <= extra["peak_rss_bytes"]
    # Each figure is a worker's own, one fresh process a row, none of them this one (whose peak, holding
    # both models and all runs, the figures must not inherit). (Two tiny models' RSS can be equal to the
    # byte, so distinct processes are checked by their ids, not by distinct figures.)
    pids = [row["extra"]["pid"] for row in rows]
    assert len(set(pids)) == len(rows) and os.getpid() not in pids


def test_table_lists_every_measurement(tiny_report):
    table = report.format_table(tiny_report)
    gpt2 = [r for r in tiny_report["rows"] if r["family"] == "gpt2"]
    # (hfgpt's lowp variants: the transformers row is the shared reference, not a line of its own)
    lowp_variants = sum(1 for r in gpt2 if r["section"] == "lowp" and r["impl"].startswith("hfgpt"))
    # the lowp group is one line per variant (fp32, bf16 where the CPU has it, int8, fp32 copy) instead of one
    assert lowp_variants >= 3
    assert table.count("| gpt2 |") == len({(r["section"], r["case"]) for r in gpt2}) + lowp_variants - 1
    assert "tokens identical: yes" in table and "NO" not in table


def test_every_contender_is_warmed_up_once_untimed_but_the_slow_peers():
    """The decode and lowp sections time a contender's calls after one untimed warm-up, as the others
    do (without it, a median of few rounds took in a contender's first call); a slow peer, timed fewer
    rounds (`repeats_of`), runs only those."""
    calls: list[str] = []
    fns = {name: (lambda n=name: calls.append(n)) for name in ("hfgpt", "transformers", "slow")}
    timings = harness.interleaved(fns, 3, "cpu", repeats_of={"slow": 1})
    assert calls[:2] == ["hfgpt", "transformers"]  # the warm-ups, before any timed round
    assert {name: calls.count(name) for name in fns} == {"hfgpt": 4, "transformers": 4, "slow": 1}
    assert {name: len(timing.times) for name, timing in timings.items()} == {
        "hfgpt": 3, "transformers": 3, "slow": 1,
    }  # fmt: skip


def test_flop_count_matches_a_hand_count():
    # GPT-2 124M, one token, no context: 12 layers x 2 x (3E^2 + E^2 + 8E^2) + 2 x E x V (head)
    # + attention over the token itself (QK^T and AV: 2 x 2 x E per layer).
    config = contenders.our_config("gpt2", {})
    e, v = 768, 50257
    expected = 12 * 2 * 12 * e * e + 2 * e * v + 12 * 4 * e
    assert harness.forward_flops(config, 1, 1, 1) == pytest.approx(expected)


def test_unknown_section_is_a_clean_error(capsys):
    assert bench_model.main(["--tiny", "--sections", "prefil"]) == 2
    assert "error: unknown section 'prefil'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"),
    reason="--keep-freed-memory applies glibc's mallopt",
)
def test_keep_freed_memory_run_is_marked_in_the_figures_and_the_table(tmp_path):
    """`--keep-freed-memory` (in its own process: it changes that process's allocator) runs the sections
    and the memory workers with it, and says so in the JSON and in the table's first line."""
    out = tmp_path / "kept.json"
    script = Path(bench_model.__file__)
    argv = [
        "--tiny",
        "--families",
        "gpt2",
        "--sections",
        "train,memory",
        "--keep-freed-memory",
        "--peers",
        "none",
    ]
    proc = subprocess.run(
        [sys.executable, str(script), *argv, "--json", str(out)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_report = json.loads(out.read_text())
    assert run_report["machine"]["keep_freed_memory"] is True
    assert {(r["section"], r["impl"]) for r in run_report["rows"]} == {
        (section, impl) for section in ("train", "memory") for impl in ("hfgpt", "transformers")
    }
    assert "freed memory kept in the process" in proc.stdout.splitlines()[0]


def _strict_json(text: str) -> object:
    """json.loads refusing the NaN / Infinity tokens Python's json accepts and writes, which JSON lacks."""

    def refuse(token: str) -> None:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_writes_null_for_figures_not_measured(tmp_path):
    nan, inf = float("nan"), float("inf")
    run_report = {
        "rows": [{"section": "memory", "median_s": nan, "rate": 1.5, "extra": {"a": inf, "b": [2, nan]}}]
    }
    harness.write_json(tmp_path / "figures.json", run_report)
    assert _strict_json((tmp_path / "figures.json").read_text()) == {
        "rows": [{"section": "memory", "median_s": None, "rate": 1.5, "extra": {"a": None, "b": [2, None]}}]
    }


def test_memory_rows_have_null_timings_in_the_json_and_the_table_reads_them(tiny_runs):
    run_report = _strict_json((tiny_runs / "gpt2.json").read_text())
    rows = [r for r in run_report["rows"] if r["section"] == "memory"]
    assert {r["impl"] for r in rows} == {"hfgpt", "transformers"}
    for row in rows:
        assert row["median_s"] is row["min_s"] is row["max_s"] is None and row["rate"] > 0
    # the table made from the file is the one the run printed
    assert report.format_table(run_report) in (tiny_runs / "gpt2.txt").read_text()


@pytest.mark.parametrize(
    "path", sorted(Path(bench_model.__file__).parent.glob("*.json")), ids=lambda path: path.name
)
def test_committed_figure_files_are_strict_json(path):
    run_report = _strict_json(path.read_text())
    json.dumps(run_report, allow_nan=False)
    memory = [r for r in run_report.get("rows", []) if isinstance(r, dict) and r.get("section") == "memory"]
    for row in memory:  # memory rows time nothing: their timings are null, their figure is the peak
        assert row["median_s"] is row["min_s"] is row["max_s"] is None and row["rate"] > 0
    if memory:
        assert f"| {memory[0]['rate']:.2f} GB |" in report.format_table(run_report)


@pytest.mark.parametrize("option", ["--workdir", "--json"])
def test_convert_benchmark_refuses_a_missing_folder_before_running(tmp_path, capsys, monkeypatch, option):
    import bench_convert

    ran = []
    monkeypatch.setattr(bench_convert, "write_synthetic_release", lambda *args: ran.append(args) or 1)
    monkeypatch.setattr(bench_convert, "measure", lambda *args, **kw: ran.append(args) or {})
    missing = tmp_path / "missing"
    target = missing if option == "--workdir" else missing / "figures.json"
    with pytest.raises(SystemExit) as exit_info:
        bench_convert.main(["--size", "tiny", option, str(target)])
    assert exit_info.value.code == 2 and not ran and not missing.exists()
    err = capsys.readouterr().err
    assert f"{option} {target}" in err and "Traceback" not in err
    if option == "--workdir":  # the library function names it too
        with pytest.raises(NotADirectoryError, match=f"workdir {missing} is not an existing folder"):
            bench_convert.run_benchmark("tiny", workdir=str(missing), isolate=False)


@pytest.mark.slow
def test_convert_benchmark_reports_a_contender_that_fails_instead_of_waiting(tmp_path):
    import bench_convert

    with pytest.raises(RuntimeError, match="_run_hfgpt exited with 1 without figures"):
        bench_convert.measure("_run_hfgpt", str(tmp_path / "no-release"), str(tmp_path / "out"), "float32")


# --- the published figures: one file per section, and what is made from them ---------------------------

# The other scripts' figures files, one each (named by what they measure).
OTHER_FIGURES = {
    "lowp-accuracy-cpu.json",  # lowp_accuracy.py
    "figures-cuda-training.json",  # bench_cuda.py (a GPU run)
    "figures-cuda-decoding.json",  # bench_cuda.py (a GPU run)
    "profile-cuda-training.json",  # profile_cuda.py (a GPU run)
    "head-cpu.json",  # bench_head.py
    "old-new-cpu.json",  # compare_revisions.py --paired
}


def test_benchmarks_hold_one_figures_file_per_section_named_by_what_it_measures():
    folder = Path(bench_model.__file__).parent
    sections = {f"figures-cpu-{section}.json": section for section in harness.SECTIONS}
    present = {path.name for path in folder.glob("*.json")}
    assert present <= set(sections) | OTHER_FIGURES, present - set(sections) - OTHER_FIGURES
    for name, section in sections.items():
        if name not in present:
            continue
        run_report = json.loads((folder / name).read_text())
        assert run_report["section"] == section and run_report["date"]
        assert {row["section"] for row in run_report["rows"]} == {section}
        assert {"machine", "hardware", "profile"} <= set(run_report)
    if missing := sorted(set(sections) - present):  # (a section added since the last full run)
        pytest.xfail(f"no figures yet for {', '.join(missing)}: run bench_model.py --json-dir benchmarks")


def test_json_dir_writes_one_figures_file_per_section_of_the_run(tmp_path, capsys):
    argv = ["--tiny", "--families", "gpt1", "--sections", "decode,ttft", "--peers", "none"]
    assert bench_model.main([*argv, "--json-dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures-cpu-decode.json", "figures-cpu-ttft.json"]
    figures = report.load_figures(tmp_path)
    assert list(figures) == ["ttft", "decode"]  # (in the order of the sections, whatever the command's)
    started = {run_report["started"] for run_report in figures.values()}
    assert len(started) == 1  # one run: the files share its start, machine and hardware limits
    assert [run["sections"] for run in report.runs_of(figures)] == [["ttft", "decode"]]
    # The table of the saved files is the table the run printed.
    assert report.figures_table(figures).split("\n", 1)[1] in capsys.readouterr().out


def test_figures_of_several_runs_are_told_apart():
    figures = report.load_figures()
    runs = report.runs_of(figures)
    assert sorted(section for run in runs for section in run["sections"]) == sorted(figures)
    summary = report.summary_table(figures)
    if len(runs) > 1:  # until one run measures every section, the table says which run gave which
        assert f"in {len(runs)} runs:" in summary
        for run in runs:
            assert f"- {', '.join(run['sections'])}: {run['date']}" in summary
    else:
        assert f"on {runs[0]['date']}, profile" in summary


def test_summary_ratios_are_the_rows_ratios_against_transformers():
    figures = report.load_figures()
    rows = [row for run_report in figures.values() for row in run_report["rows"]]
    by_label = {line["label"]: line for line in report.summary_figures(figures)}
    decode = by_label["greedy decoding, B=1"]["gpt2"]
    ours = report._find_row(rows, "gpt2", "decode", "B=1", "hfgpt")
    peer = report._find_row(rows, "gpt2", "decode", "B=1", "transformers")
    assert ours["case"].startswith("B=1,") and decode["ratio"] == ours["rate"] / peer["rate"]
    assert decode["figure"] == f"{ours['extra']['ms_per_step']:.1f} ms a step"
    int8 = by_label["decoding copy, int8, B=1"]["gpt1"]
    lowp = {r["impl"]: r for r in rows if r["family"] == "gpt1" and r["section"] == "lowp"}
    assert int8["ratio"] == lowp["hfgpt int8"]["rate"] / lowp["transformers fp32"]["rate"]
    memory = by_label["training step, peak memory (below 1x: less)"]["gpt2"]
    assert memory["figure"].endswith(" GB") and memory["ratio"] < 1


def test_summary_table_names_the_rows_no_family_has_instead_of_a_row_of_dashes():
    figures = report.load_figures()
    bf16 = "training step, B=4 x 256, bfloat16 autocast"
    without = {
        section: {**run_report, "rows": [r for r in run_report["rows"] if "bf16" not in r["case"]]}
        for section, run_report in figures.items()
    }
    table = report.summary_table(without)
    assert f"| {bf16} |" not in table
    assert table.endswith(".") and bf16 in table.splitlines()[-1].split(": ", 1)[1]
    assert "| greedy decoding, B=1 |" in table


def test_chart_is_drawn_from_the_figures_files(tmp_path):
    from PIL import Image

    figures = report.load_figures()
    data = report.plot_ratios(figures, tmp_path / "chart.png")
    assert data == report.chart_data(figures) and data
    assert all(line["label"] != "training step, peak memory (below 1x: less)" for line in data)
    with Image.open(tmp_path / "chart.png") as image:
        assert image.format == "PNG" and json.loads(image.info["Description"]) == data
    # The committed chart was drawn from the committed figures (regenerate: bench_model.py --plot).
    with Image.open(Path(bench_model.__file__).parent / "ratios-cpu.png") as image:
        assert json.loads(image.info["Description"]) == data, "stale chart: run bench_model.py --plot"


def test_figures_options_measure_nothing_and_refuse_an_empty_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_model, "run", lambda *args, **kwargs: pytest.fail("measured"))
    assert bench_model.main(["--summary"]) == 0
    assert capsys.readouterr().out.strip() == report.summary_table(report.load_figures())
    assert bench_model.main(["--figures"]) == 0
    assert capsys.readouterr().out.strip() == report.figures_table(report.load_figures())
    assert bench_model.main(["--figures", str(tmp_path)]) == 2
    assert f"no figures-cpu-<section>.json files in {tmp_path}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--peers", "onnx"], "error: unknown peer 'onnx'; choose from compile, torchao, ctranslate2"),
        (["--json-dir", "{missing}"], "is not an existing folder"),
    ],
)
def test_bad_peers_and_json_dir_are_refused_before_running(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_model, "run", lambda *args, **kwargs: pytest.fail("measured"))
    argv = [a.replace("{missing}", str(tmp_path / "missing")) for a in argv]
    assert bench_model.main(["--tiny", "--peers", "none", *argv]) == 2
    assert message in capsys.readouterr().err


def test_peers_without_their_package_are_refused_naming_the_extra(capsys, monkeypatch):
    monkeypatch.setattr(contenders.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(bench_model, "run", lambda *args, **kwargs: pytest.fail("measured"))
    assert bench_model.main(["--tiny", "--peers", "compile,torchao,ctranslate2"]) == 2
    err = capsys.readouterr().err
    assert "--peers needs torchao, ctranslate2, not installed here: pip install 'hfgpt[bench]'" in err


# --- the other routes to speed, on tiny models -------------------------------------------------------

TINY = harness.PROFILES["tiny"]["model_overrides"]


def test_plain_hfgpt_is_a_copy_without_the_cpu_backend():
    from hfgpt.cpu import is_kernelized

    ours = contenders.build_ours("gpt2", TINY, "cpu").eval()
    assert is_kernelized(ours)  # (this module's models are built kernelized: conftest.py)
    plain = contenders.plain_hfgpt(ours)
    assert not is_kernelized(plain) and plain.config._attn_implementation == "sdpa"
    assert is_kernelized(ours)  # the original is untouched
    ids = torch.randint(0, TINY["vocab_size"], (2, 16))
    with torch.inference_mode():
        torch.testing.assert_close(plain(ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)


def test_ctranslate2_int8_decodes_the_same_weights():
    pytest.importorskip("ctranslate2")
    ours = contenders.build_ours("gpt2", TINY, "cpu").eval()
    decoder = contenders.ctranslate2_int8(contenders.build_peer(ours).eval())
    ids = torch.randint(0, TINY["vocab_size"], (2, 16))
    with torch.inference_mode():
        reference = ours(ids).logits
    logits = decoder.logits(ids)
    assert logits.shape == reference.shape
    assert (logits - reference).abs().max() < 0.5  # int8 weights and activations: close, not equal
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8
    prompts = contenders.left_padded_prompts(1, 8, TINY["vocab_size"], 0, "cpu")
    assert decoder.greedy(prompts, 6).shape == (1, 6)  # exactly the new tokens: no end token stops it
    # CTranslate2 has no converter for transformers' OpenAIGPT: no GPT-1 row.
    gpt1 = contenders.build_ours("gpt1", TINY, "cpu")
    assert contenders.ctranslate2_int8(contenders.build_peer(gpt1)) is None


def check_torchao_int8_copy() -> None:
    """The benchmark's torchao peer: every linear layer int8, the original untouched, close logits, and
    greedy decoding through the compiled static-cache step. Run where torchao imports (see below)."""
    ours = contenders.build_ours("gpt2", TINY, "cpu").eval()
    quantized, kwargs = contenders.torchao_int8(ours)
    linears = [m for m in quantized.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 * TINY["n_layer"] + 1  # c_attn, c_proj, c_fc, mlp c_proj a block, and the head
    assert all("Int8" in type(m.weight).__name__ for m in linears)
    assert not any(isinstance(m, contenders.Conv1D) for m in quantized.modules())
    assert any(isinstance(m, contenders.Conv1D) for m in ours.modules())  # the original is untouched
    ids = torch.randint(0, TINY["vocab_size"], (2, 16))
    prompts = contenders.left_padded_prompts(1, 8, TINY["vocab_size"], 0, "cpu")
    with torch.inference_mode():
        assert (quantized(ids).logits - ours(ids).logits).abs().max() < 0.5
        tokens = contenders.greedy(quantized, prompts, 6, **kwargs)
    assert kwargs == {"cache_implementation": "static"} and tokens.shape == (1, 6)


def torchao_folder(folder: Path) -> Path | None:
    """None where torchao is installed; else a folder that torchao, the `bench` extra's release, was
    installed into from the package index (no extra the suite installs brings it: once installed it prints
    errors at every import on a CPU torch). Skips, naming what it could not fetch, without an index."""
    if importlib.util.find_spec("torchao") is not None:
        return None
    extras = tomllib.loads((BENCHMARKS.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (requirement,) = (r for r in extras["bench"] if r.startswith("torchao"))
    pip_or_skip(
        ["install", "--no-deps", "--target", str(folder), requirement],
        f"{requirement} from the package index",
    )
    return folder


@pytest.mark.slow
def test_torchao_int8_copy_quantizes_every_linear_layer_and_decodes_compiled(tmp_path):
    # In a process of its own, with torchao on its path: this process stays as the suite's extras leave it.
    folder = torchao_folder(tmp_path / "site")
    paths = [str(p) for p in (folder, Path(__file__).parent, BENCHMARKS) if p is not None]
    code = "import test_benchmarks; test_benchmarks.check_torchao_int8_copy(); print('checked')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("checked"), done.stderr[-4000:]


def tiny_rows_beside_compile(tmp_path, section: str) -> list[dict]:
    """The figures rows of a tiny GPT-2 run of one `section` with the compile peer, one round."""
    argv = ["--tiny", "--families", "gpt2", "--sections", section, "--peers", "compile", "--repeats", "1"]
    assert bench_model.main([*argv, "--json", str(tmp_path / "figures.json")]) == 0
    return json.loads((tmp_path / "figures.json").read_text())["rows"]


@pytest.mark.slow
def test_compiled_plain_model_runs_beside_hfgpt_in_prefill(tmp_path, capsys):
    rows = tiny_rows_beside_compile(tmp_path, "prefill")
    compiled = [r for r in rows if r["impl"] == contenders.COMPILED]
    # Timed beside hfgpt and transformers in every float32 case, and nowhere under autocast.
    float32 = {r["case"] for r in rows if "autocast" not in r["case"]}
    assert {r["case"] for r in compiled} == float32
    for row in compiled:
        assert row["extra"]["max_abs_logit_diff_from_hfgpt"] < 1e-4 and row["rate"] > 0
    assert "| gpt2 | prefill torch.compile |" in capsys.readouterr().out


@pytest.mark.slow
def test_compiled_plain_model_decodes_beside_hfgpt_with_the_tokens_compared(tmp_path, capsys):
    rows = tiny_rows_beside_compile(tmp_path, "decode")
    compiled = [r for r in rows if r["impl"] == contenders.COMPILED]
    assert {r["case"] for r in compiled} == {r["case"] for r in rows if r["impl"] == "hfgpt"}
    for row in compiled:  # (greedy on a static cache, compiled: the eager models' tokens)
        assert row["extra"]["tokens_identical"] is True and row["extra"]["ms_per_step"] > 0
    assert "| gpt2 | decode torch.compile |" in capsys.readouterr().out


@pytest.mark.slow
def test_int8_copy_compiled_runs_beside_the_eager_copy_in_lowp(tmp_path):
    rows = {r["impl"]: r for r in tiny_rows_beside_compile(tmp_path, "lowp")}
    compiled, eager = rows[contenders.INT8_COMPILED], rows["hfgpt int8"]
    assert compiled["rate"] > 0 and compiled["case"] == eager["case"]
    # the same copy, the same tokens: compiling changes the speed only
    for measure in ("greedy_token_agreement", "greedy_first_divergence", "max_abs_logit_err"):
        assert compiled["extra"][measure] == eager["extra"][measure]


@pytest.mark.slow
def test_a_compiled_step_is_checked_against_the_same_step_run_eagerly(monkeypatch):
    from hfgpt.cpu.quantization import quantize_for_decoding

    ours = contenders.build_ours("gpt2", TINY, "cpu").eval()
    prompts = contenders.left_padded_prompts(1, 8, TINY["vocab_size"], 0, "cpu")
    int8 = quantize_for_decoding(ours)
    wrong = contenders.build_ours("gpt2", TINY, "cpu").eval()
    forward = wrong.forward

    def compiled_elsewhere(*args, **kwargs):  # other logits when compiled, as a graph whose kernel
        out = forward(*args, **kwargs)  # silently refuses its arguments would give
        if torch.compiler.is_compiling():
            out.logits = torch.ones_like(out.logits)
        return out

    monkeypatch.setattr(wrong, "forward", compiled_elsewhere)  # (what generate() compiles calls it)
    with torch.inference_mode():
        assert contenders.step_error(int8, prompts, contenders.compiled_decoding(int8)) < 1e-6
        assert contenders.step_error(wrong, prompts, contenders.compiled_decoding(wrong)) > 0.5


def test_a_row_with_wrong_results_shows_no_speed_or_ratio():
    def row(impl, rate, **extra):
        extra = {"ms_per_step": 1000 / rate, **extra}
        return dict(family="gpt2", section="lowp", case="B=1, 8+6 tokens", impl=impl, rate=rate, extra=extra)

    rows = [
        row("transformers fp32", 10.0),
        row(contenders.TORCHAO, 100.0, wrong="compiled steps' logits off"),
    ]
    line = next(
        x for x in report.summary_figures({"lowp": {"rows": rows}}) if x["label"].startswith("torchao")
    )
    assert line["gpt2"] == {"figure": "wrong results", "ratio": None}


# --- RESULTS.md and the README: their tables are made from the figures ----------------------------------

RESULTS = Path(bench_model.__file__).parent / "RESULTS.md"


def test_results_tables_are_the_ones_made_from_the_figures():
    text = RESULTS.read_text()
    first, last = report.marked_region(text, report.RESULTS_TABLE)
    stale = "stale table: run python benchmarks/bench_model.py --update-docs"
    assert text[first:last].strip() == report.figures_table(report.load_figures()), stale
    first, last = report.marked_region(text, report.ACCURACY_TABLE)
    assert text[first:last].strip() == report.accuracy_table(), stale


def test_results_is_a_current_account_not_a_diary():
    text = RESULTS.read_text()
    assert len(text.splitlines()) <= 270
    assert not re.search(r"\bsession", text, flags=re.IGNORECASE)
    hashes = [
        w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search("[a-f]", w)
    ]
    assert not hashes
    for heading in ("## Method", "## The current full table", "## Accuracy of the lower-precision copies"):
        assert heading in text
    assert "## Tried and dropped" in text


def test_update_docs_rewrites_only_the_generated_regions(tmp_path):
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    readme = f"# x\n\nbefore\n{report.README_TABLE}\nold\n{report.GENERATED_END}\nafter\n"
    results = (
        f"a\n{report.RESULTS_TABLE}\nold\n{report.GENERATED_END}\nb\n"
        f"{report.ACCURACY_TABLE}\n{report.GENERATED_END}\nc\n"
    )
    (root / "README.md").write_text(readme)
    (root / "benchmarks" / "RESULTS.md").write_text(results)
    figures = report.load_figures()
    written = report.update_docs(figures, root)
    assert [p.name for p in written] == ["ratios-cpu.png", "RESULTS.md", "README.md"]
    new_readme = (root / "README.md").read_text()
    assert new_readme.startswith("# x\n\nbefore\n") and new_readme.endswith(
        f"{report.GENERATED_END}\nafter\n"
    )
    assert report.summary_table(figures) in new_readme and "old" not in new_readme
    new_results = (root / "benchmarks" / "RESULTS.md").read_text()
    assert report.figures_table(figures) in new_results and report.accuracy_table() in new_results
    assert new_results.startswith("a\n") and new_results.endswith(f"{report.GENERATED_END}\nc\n")
    report.update_docs(figures, root)  # a second time changes nothing
    assert (root / "README.md").read_text() == new_readme
    with pytest.raises(ValueError, match="expected one"):
        report.with_region("no markers", report.README_TABLE, "x")


@pytest.mark.slow
def test_the_int8_copies_are_timed_alone_beside_ctranslate2_round_by_round(tmp_path, monkeypatch, capsys):
    """CTranslate2 beside hfgpt's int8 copies in the lowp section, each timed in fresh processes of its own, in
    alternating order. The compiled copy compiles in this process (its accuracy check); in the timing
    processes TorchDynamo is off (TORCHDYNAMO_DISABLE), which changes their figures, not their order. The
    first round's three processes run; the second round's, whose order is what it adds, replay them."""
    pytest.importorskip("ctranslate2")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    started = []
    decoder_alone = harness.decoder_alone
    first_round = {}

    def recorded(kind, family, profile, repeats, accuracy=True):
        started.append((kind, repeats, accuracy))
        if kind not in first_round:
            first_round[kind] = decoder_alone(kind, family, profile, repeats, accuracy)
        result = {k: v for k, v in first_round[kind].items() if accuracy or k != "accuracy"}
        # each process's times are its place in the order (1 to 6), so the rows' ratios show which it paired
        result["times"] = [float(len(started))] * repeats
        return result

    monkeypatch.setattr(harness, "decoder_alone", recorded)
    argv = ["--tiny", "--families", "gpt2,gpt1", "--sections", "lowp", "--peers", "compile,ctranslate2"]
    assert bench_model.main([*argv, "--repeats", "3", "--json", str(tmp_path / "figures.json")]) == 0
    ct2, int8, int8c = contenders.CTRANSLATE2, contenders.INT8, contenders.INT8_COMPILED
    assert harness.PROFILES["tiny"]["alone_rounds"] == 2
    # A B C, then C B A, each process timing all 3 runs; CTranslate2's accuracy in the first round only
    assert started == [
        (ct2, 3, True), (int8, 3, True), (int8c, 3, True), (int8c, 3, False), (int8, 3, False), (ct2, 3, False)
    ]  # fmt: skip
    all_rows = json.loads((tmp_path / "figures.json").read_text())["rows"]
    impls = {family: {r["impl"] for r in all_rows if r["family"] == family} for family in ("gpt2", "gpt1")}
    assert ct2 in impls["gpt2"] and ct2 not in impls["gpt1"]  # no GPT-1 converter in CTranslate2
    rows = {r["impl"]: r for r in all_rows if r["family"] == "gpt2"}
    assert rows[ct2]["rate"] > 0 and 0 < rows[ct2]["extra"]["max_abs_logit_err"] < 0.5
    assert rows[ct2]["extra"]["measured"].startswith("alone in fresh processes")
    assert rows[ct2]["n"] == rows[int8]["n"] == rows[int8c]["n"] == 6
    for row in (rows[ct2], rows[int8], rows[int8c]):
        assert f"2 rounds in alternating order with {ct2}, {int8}, {int8c}" in row["extra"]["measured"]
    # round by round, CTranslate2's time over the copy's: (process 1 / 2, then 6 / 5) and (1 / 3, 6 / 4)
    assert rows[int8]["extra"][contenders.VS_CTRANSLATE2] == pytest.approx([1 / 2, 6 / 5])
    assert rows[int8c]["extra"][contenders.VS_CTRANSLATE2] == pytest.approx([1 / 3, 6 / 4])
    assert contenders.VS_CTRANSLATE2 not in rows[ct2]["extra"]
    table = capsys.readouterr().out
    assert "| gpt2 | decode ctranslate2 int8 |" in table
    assert "; 0.85x CTranslate2's speed round by round (0.50-1.20, 2 rounds) |" in table
    assert report._summary_cell(rows[int8]).endswith(", 0.85x CTranslate2's speed round by round")
    # the copy's accuracy is measured here, as the eager copy's (the same copy, the same tokens)
    assert rows[int8c]["extra"]["max_abs_logit_err"] == rows["hfgpt int8"]["extra"]["max_abs_logit_err"]
    assert rows[ct2]["extra"]["max_abs_logit_err"] > 0


# --- time to first token, and the ratios made from the measured figures -----------------------------------


def test_time_to_first_token_is_generate_of_one_token_beside_transformers(tiny_report):
    prompt_len = harness.PROFILES["tiny"]["prompt_len"]
    for family in ("gpt2", "gpt1"):
        rows = {r["impl"]: r for r in tiny_report["rows"] if r["section"] == "ttft" and r["family"] == family}
        assert set(rows) == {"hfgpt", "transformers"}
        for row in rows.values():
            assert row["case"] == f"B=1, {prompt_len}-token prompt + first token"
            assert row["n"] == harness.PROFILES["tiny"]["ttft_repeats"]
            # the figures are the timed runs': a rate of first tokens a second, and the time to the first
            assert row["rate"] == pytest.approx(1 / row["median_s"])
            assert row["extra"]["ms_to_first_token"] == pytest.approx(1000 * row["median_s"])
        ours, peer = rows["hfgpt"], rows["transformers"]
        line = next(
            x for x in report.format_table(tiny_report).splitlines() if x.startswith(f"| {family} | ttft |")
        )
        assert f"| {ours['rate'] / peer['rate']:.2f}x |" in line  # transformers' time over hfgpt's
        assert (
            f"{ours['extra']['ms_to_first_token']:.1f} vs {peer['extra']['ms_to_first_token']:.1f} ms" in line
        )


def test_every_ratio_in_the_table_is_the_measured_rates_ratio(tiny_report):
    """Each hfgpt line's ratio is its rate over transformers' of the same case, as the JSON holds them."""
    table = report.format_table(tiny_report)
    for (family, section, case), by_impl in _groups(tiny_report["rows"]).items():
        if section == "lowp" or not {"hfgpt", "transformers"} <= set(by_impl):
            continue
        ratio = by_impl["hfgpt"]["rate"] / by_impl["transformers"]["rate"]
        assert f"| {family} | {section} | {case} | " in table
        line = next(x for x in table.splitlines() if x.startswith(f"| {family} | {section} | {case} | "))
        assert f"| {ratio:.2f}x" in line, line


def _groups(rows: list[dict]) -> dict[tuple[str, str, str], dict[str, dict]]:
    groups: dict[tuple[str, str, str], dict[str, dict]] = {}
    for row in rows:
        groups.setdefault((row["family"], row["section"], row["case"]), {})[row["impl"]] = row
    return groups


# --- the host, named as it is --------------------------------------------------------------------------


def _cpuinfo() -> tuple[str, set[str]]:
    text = Path("/proc/cpuinfo").read_text()
    name = re.search(r"^model name\s*:\s*(.*)$", text, flags=re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, flags=re.MULTILINE)
    return (name.group(1).strip() if name else ""), set(flags.group(1).split() if flags else [])


def _as_avx2_environment() -> dict[str, str]:
    """The variables .ci/as-avx2 exports, read from the script itself."""
    script = (BENCHMARKS.parent / ".ci" / "as-avx2").read_text()
    exported = re.search(r"^export (ATEN_CPU_CAPABILITY=.*)$", script, flags=re.MULTILINE).group(1)
    env = dict(pair.split("=", 1) for pair in exported.split())
    march = re.search(r"^export TORCHINDUCTOR_CPP_MARCH=(\S+)$", script, flags=re.MULTILINE).group(1)
    return {**env, "TORCHINDUCTOR_CPP_MARCH": march, "HFGPT_CFLAGS": f"-march={march}"}


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads /proc/cpuinfo")
def test_the_figures_and_every_table_name_the_host(tiny_report):
    machine = tiny_report["machine"]
    name, flags = _cpuinfo()
    assert machine["cpu"] == name and machine["vm"] == ("hypervisor" in flags)
    assert machine["threads"] == torch.get_num_threads() and machine["torch"] == torch.__version__
    assert machine["transformers"] == __import__("transformers").__version__
    assert machine["isa_limits"] == harness.isa_limits()[0]
    host = machine["host"]
    assert host == harness.host_line(machine)
    for part in (
        name,
        "a VM" if machine["vm"] else "not a VM",
        machine["isa_limits"],
        f"{machine['threads']} threads",
    ):
        assert part in host
    assert host in report.format_table(tiny_report).splitlines()[0]
    figures = {"ttft": {**tiny_report, "rows": [r for r in tiny_report["rows"] if r["section"] == "ttft"]}}
    assert host in report.summary_table(figures).splitlines()[0]


def test_isa_limits_say_as_on_avx2_under_the_ci_script_and_native_without(monkeypatch):
    for name in harness.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    assert harness.isa_limits() == (harness.NATIVE, {})
    as_avx2 = _as_avx2_environment()
    for name, value in as_avx2.items():
        monkeypatch.setenv(name, value)
    limits, found = harness.isa_limits()
    assert limits == "as on AVX2 (limits applied by .ci/as-avx2)" and found == as_avx2
    assert limits in harness.machine_info("cpu")["host"]
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")  # some of the limits: named as they are set
    limits, found = harness.isa_limits()
    assert limits.startswith("limited by the environment: ") and "ATEN_CPU_CAPABILITY=avx2" in limits


def test_figures_written_before_the_host_was_recorded_say_so():
    """The committed figures files may predate these fields: their lines say what is not recorded."""
    machine = {"cpu": "Some CPU", "threads": 2, "torch": "2.9", "transformers": "5.24"}
    line = harness.host_line({**machine, "hfgpt_cflags": "-march=x86-64-v3"})
    assert "VM: not recorded" in line and "ISA limits: not recorded" in line
    assert "hfgpt's kernels built with `-march=x86-64-v3`" in line


# --- the scripts' layout ---------------------------------------------------------------------------------


def _sibling_imports(path: Path) -> set[str]:
    siblings = {p.stem for p in BENCHMARKS.glob("*.py")}
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names & siblings


def test_the_benchmark_scripts_import_each_other_without_a_circle():
    graph = {path.stem: _sibling_imports(path) for path in BENCHMARKS.glob("*.py")}
    assert graph["contenders"] == set() and graph["harness"] == {"contenders"}
    assert graph["lowp_accuracy"] == {"harness"}  # the harness never imports a script back
    assert "bench_model" not in set().union(*(graph[name] for name in graph if name != "bench_model"))

    def reaches(start: str, seen: frozenset = frozenset()) -> bool:
        return any(n in seen | {start} or reaches(n, seen | {start}) for n in graph.get(start, ()))

    assert not [name for name in graph if reaches(name)]


@pytest.mark.parametrize(
    "name", ["bench_model", "contenders", "harness", "sections", "report", "compare_revisions"]
)
def test_no_benchmark_module_is_over_800_lines(name):
    assert len((BENCHMARKS / f"{name}.py").read_text().splitlines()) <= 800


# --- old against new on one host --------------------------------------------------------------------------


def _run(rates: dict[tuple[str, str], float]) -> dict:
    rows = [
        dict(family="gpt2", section=section, case="B=1", impl=impl, rate=rate, unit="x/s")
        for (section, impl), rate in rates.items()
    ]
    return {"rows": rows}


def test_comparison_ratios_are_new_over_old_round_by_round():
    old = [
        _run({("decode", "hfgpt"): 10.0, ("memory", "hfgpt"): 2.0}),
        _run({("decode", "hfgpt"): 12.0, ("memory", "hfgpt"): 2.0}),
    ]
    new = [
        _run({("decode", "hfgpt"): 9.5, ("memory", "hfgpt"): 2.1}),
        _run({("decode", "hfgpt"): 13.0, ("memory", "hfgpt"): 2.0}),
    ]
    new[1]["rows"].append(dict(family="gpt2", section="ttft", case="B=1", impl="hfgpt", rate=1.0, unit="x/s"))
    rows = {r["section"]: r for r in compare_revisions.compare(old, new)}
    assert set(rows) == {"decode", "memory"}  # a row only one arm measured is left out
    for section, row in rows.items():
        old_rates = [next(r["rate"] for r in run["rows"] if r["section"] == section) for run in old]
        new_rates = [next(r["rate"] for r in run["rows"] if r["section"] == section) for run in new]
        ratios = [n / o for n, o in zip(new_rates, old_rates, strict=True)]
        assert row["old"] == old_rates and row["new"] == new_rates
        assert row["new_over_old"] == pytest.approx(ratios)
        assert row["median_new_over_old"] == pytest.approx(statistics.median(ratios))
    assert rows["decode"]["no_worse"] == (statistics.median(rows["decode"]["new_over_old"]) >= 0.97)
    assert rows["memory"]["better"] == "lower"  # peak memory: new/old at most 1.03
    assert rows["memory"]["no_worse"] == (statistics.median(rows["memory"]["new_over_old"]) <= 1.03)


@pytest.mark.slow
def test_an_arm_imports_hfgpt_from_its_own_checkout(tmp_path):
    tree = tmp_path / "tree"
    (tree / "cpu").mkdir(parents=True)
    (tree / "cpu" / "__init__.py").write_text("")
    assert (
        compare_revisions.imported_from(compare_revisions.arm_env(tree, tmp_path)) == (tree / "cpu").resolve()
    )
    here = compare_revisions.arm_env(compare_revisions.ROOT, tmp_path)
    assert compare_revisions.imported_from(here) == (compare_revisions.ROOT / "cpu").resolve()


@pytest.mark.slow
def test_two_checkouts_run_side_by_side_in_fresh_processes(tmp_path, capsys, monkeypatch):
    """The first round's two arms run bench_model.py in fresh processes; the second round, whose order (new
    then base) is what it adds, replays their figures. Where each arm imports hfgpt from is checked for real
    by test_an_arm_imports_hfgpt_from_its_own_checkout (here both arms are this checkout)."""
    ran = []
    run_arm = compare_revisions.run_arm

    def first_round_runs(env, bench_args, out):
        ran.append(out.stem)
        arm, round_ = out.stem.split("-")
        if round_ == "0":
            return run_arm(env, bench_args, out)
        return json.loads(out.with_name(f"{arm}-0.json").read_text())

    monkeypatch.setattr(compare_revisions, "run_arm", first_round_runs)
    monkeypatch.setattr(
        compare_revisions, "imported_from", lambda env: (compare_revisions.ROOT / "cpu").resolve()
    )
    out = tmp_path / "compare.json"
    root = str(compare_revisions.ROOT)
    argv = [
        "--base",
        root,
        "--new",
        root,
        "--tiny",
        "--sections",
        "ttft",
        "--rounds",
        "2",
        "--json",
        str(out),
    ]
    assert compare_revisions.main(argv) == 0
    assert ran == ["base-0", "new-0", "new-1", "base-1"]
    result = json.loads(out.read_text())
    assert result["rounds"] == 2 and len(result["base"]["runs"]) == len(result["new"]["runs"]) == 2
    assert result["host"] == result["new"]["runs"][0]["machine"]["host"]
    rows = {(r["family"], r["impl"]): r for r in result["rows"]}
    assert set(rows) == {(family, impl) for family in ("gpt2",) for impl in ("hfgpt", "transformers")}
    for (family, impl), row in rows.items():
        rates = {
            arm: [
                next(r["rate"] for r in run["rows"] if (r["family"], r["impl"]) == (family, impl))
                for run in result[arm]["runs"]
            ]
            for arm in ("base", "new")
        }
        assert row["old"] == rates["base"] and row["new"] == rates["new"]
        assert row["new_over_old"] == pytest.approx(
            [n / o for n, o in zip(rates["new"], rates["base"], strict=True)]
        )
    assert "| gpt2 | ttft |" in capsys.readouterr().out


@pytest.mark.slow
def test_paired_processes_take_turns_and_each_ratio_is_taken_run_by_run(tmp_path, capsys, monkeypatch):
    """--paired: both arms' processes stay up and take turns one run at a time, the order alternating by
    turn and by pair; a row's ratio by pair is the median of its runs' old/new times, each arm's figure the
    median of its rates; the tokens of every run are compared across runs and arms. (Both arms are this
    checkout; where an arm imports hfgpt from is test_an_arm_imports_hfgpt_from_its_own_checkout's.)"""
    monkeypatch.setattr(
        compare_revisions, "imported_from", lambda env: (compare_revisions.ROOT / "cpu").resolve()
    )
    root = str(compare_revisions.ROOT)
    out = tmp_path / "paired.json"
    argv = [
        "--base",
        root,
        "--new",
        root,
        "--paired",
        "--tiny",
        "--pairs",
        "2",
        "--runs",
        "2",
        "--json",
        str(out),
    ]
    assert compare_revisions.main(argv) == 0
    result = json.loads(out.read_text())
    base_first, new_first = ["base", "new"], ["new", "base"]
    assert result["orders"] == [base_first, new_first, new_first, base_first]
    profile = harness.PROFILES["tiny"]
    prompt, new_tokens = profile["prompt_len"], profile["new_tokens"]
    expected = {
        ("decode", f"B={b}, {prompt}+{new_tokens} tokens", impl)
        for b in profile["decode_batches"]
        for impl in ("hfgpt", "transformers")
    }
    expected |= {("lowp", f"B=1, {prompt}+{new_tokens} tokens", contenders.INT8)}
    expected |= {("ttft", f"B=1, {prompt}-token prompt + first token", i) for i in ("hfgpt", "transformers")}
    rows = {(r["section"], r["case"], r["impl"]): r for r in result["rows"]}
    assert set(rows) == expected
    for (section, case, _), row in rows.items():
        work = 1 if section == "ttft" else int(case.split(",")[0][2:]) * new_tokens
        seconds = row["seconds"]
        assert [len(pair) for pair in seconds["base"] + seconds["new"]] == [2] * 4
        assert row["old"] == pytest.approx(
            [statistics.median(work / t for t in pair) for pair in seconds["base"]]
        )
        assert row["new"] == pytest.approx(
            [statistics.median(work / t for t in pair) for pair in seconds["new"]]
        )
        by_pair = [
            statistics.median(o / n for o, n in zip(old, new, strict=True))
            for old, new in zip(seconds["base"], seconds["new"], strict=True)
        ]
        assert row["new_over_old"] == pytest.approx(by_pair)
        assert row["tokens_identical"] is True  # one checkout in both arms: the same tokens every run
        assert len(row["tokens"]["base"]) == 1 and row["tokens"]["base"] == row["tokens"]["new"]
    assert result["host"].startswith(harness.machine_info("cpu")["cpu"])  # (the workers' threads may differ)
    shown = capsys.readouterr().out
    assert "new/old by pair" in shown and "Tokens differing between runs or arms: none." in shown


@pytest.mark.slow
def test_a_paired_worker_that_fails_is_named_with_its_error(tmp_path):
    """An arm whose hfgpt cannot run the paired tasks (here a tree whose hfgpt.cpu is empty) ends the
    comparison with an error naming the arm and showing the worker's own error, not a hang."""
    tree = tmp_path / "tree"
    (tree / "cpu").mkdir(parents=True)
    (tree / "cpu" / "__init__.py").write_text("")
    arms = {
        "base": compare_revisions.arm_env(tree, tmp_path),
        "new": compare_revisions.arm_env(compare_revisions.ROOT, tmp_path),
    }
    with pytest.raises(RuntimeError, match=r"(?s)the base arm's --paired worker ended .*ImportError"):
        compare_revisions.paired(arms, "tiny", None, pairs=1, runs=1, workdir=tmp_path)


# --- the LM head's product -----------------------------------------------------------------------------------


def test_the_head_benchmark_runs_each_arm_in_turn_and_checks_every_product(monkeypatch, tmp_path, capsys):
    """bench_head.py: each round runs every arm once, the order rotating; each arm's products are checked
    against float64's; the ratios are the other arms' medians over hfgpt's; the host is named."""
    import bench_head

    started = []

    def in_this_process(spec):
        started.append(spec["arm"])
        return bench_head.time_arm(spec["arm"], spec["rows"], tuple(spec["shape"]), spec["repeats"])

    monkeypatch.setattr(bench_head, "run_worker", in_this_process)
    path = tmp_path / "head.json"
    argv = ["--tiny", "--rows", "1,3", "--rounds", "2", "--repeats", "2", "--json", str(path)]
    assert bench_head.main(argv) == 0
    hfgpt, linear, transposed = bench_head.ARMS
    assert started == [hfgpt, linear, transposed, linear, transposed, hfgpt]
    figures = json.loads(path.read_text())
    for arm in bench_head.ARMS:
        assert figures["max_error"][arm] < 1e-4 and set(figures["medians_ms"][arm]) == {"1", "3"}
        assert len(figures["rounds"][arm]) == 2
    for arm in (linear, transposed):
        for rows in ("1", "3"):
            ratio = figures["medians_ms"][arm][rows] / figures["medians_ms"][hfgpt][rows]
            assert figures["ratios"][arm][rows] == pytest.approx(ratio)
    assert figures["machine"]["host"] in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_head.main(["--tiny", "--rows", "17"])


def test_a_head_benchmark_arm_runs_in_a_fresh_process():
    import bench_head

    result = bench_head.run_worker({"arm": "F.linear", "rows": [2], "shape": [40, 24], "repeats": 1})
    assert set(result["ms"]) == {"2"} and result["max_error"] < 1e-5
    with pytest.raises(ValueError, match="no arm 'nothing'"):
        bench_head.product("nothing")
