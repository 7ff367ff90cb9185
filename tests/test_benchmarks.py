"""Smoke run of benchmarks/bench_model.py at tiny size: every section produces figures, the two
implementations agree (logits, greedy tokens), and the outputs (table, JSON) are well formed.

Speed itself is never asserted here: figures come from the benchmark, not from timed unit tests.
"""

import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import bench_model  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def cpu_benchmark():
    """These test the CPU benchmark: where a CUDA device exists (bench_model's default there), they still
    run on the CPU."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        yield


@pytest.fixture(scope="module")
def bench():
    return bench_model


@pytest.fixture(scope="module")
def tiny_report(bench, tmp_path_factory):
    # GPT-2 through every section but compile (tens of seconds of inductor); GPT-1 through the two
    # where its peer differs most (no logits_to_keep, no KV cache).
    out = tmp_path_factory.mktemp("bench")
    gpt2 = ["--families", "gpt2", "--sections", "prefill,decode,lowp,train,memory", "--peers", "none"]
    gpt1 = ["--families", "gpt1", "--sections", "prefill,decode", "--peers", "none"]
    assert bench.main(["--tiny", *gpt2, "--json", str(out / "gpt2.json")]) == 0
    assert bench.main(["--tiny", *gpt1, "--json", str(out / "gpt1.json")]) == 0
    report = json.loads((out / "gpt2.json").read_text())
    report["rows"] += json.loads((out / "gpt1.json").read_text())["rows"]
    return report


def test_every_section_has_both_implementations(tiny_report):
    seen = {(r["family"], r["section"], r["impl"]) for r in tiny_report["rows"]}
    for family, sections in (
        ("gpt2", ("prefill", "decode", "train", "memory")),
        ("gpt1", ("prefill", "decode")),
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
    # The fp32 matmul rate is the best of torch.mm's and (where torch has it) oneDNN's, hfgpt's kernel.
    by_kernel = hw["fp32_matmul_flops_per_s_by_kernel"]
    onednn = bench_model.ops_hfgpt._ONEDNN_LINEAR is not None
    assert set(by_kernel) == ({"torch.mm", "onednn"} if onednn else {"torch.mm"})
    assert hw["matmul_flops_per_s"] == max(by_kernel.values())
    default = "onednn" if bench_model.ops_hfgpt.avx512_cpu() else "onednn up to 16 rows, mkl above"
    assert tiny_report["machine"]["hfgpt_cpu_products"] == (default if onednn else "mkl")
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
        if row["section"] == "decode":
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


def test_table_lists_every_measurement(bench, tiny_report):
    table = bench.format_table(tiny_report)
    gpt2 = [r for r in tiny_report["rows"] if r["family"] == "gpt2"]
    # (hfgpt's lowp variants: the transformers row is the shared reference, not a line of its own)
    lowp_variants = sum(1 for r in gpt2 if r["section"] == "lowp" and r["impl"].startswith("hfgpt"))
    # the lowp group is one line per variant (fp32, bf16 where the CPU has it, int8, fp32 copy) instead of one
    assert lowp_variants >= 3
    assert table.count("| gpt2 |") == len({(r["section"], r["case"]) for r in gpt2}) + lowp_variants - 1
    assert "tokens identical: yes" in table and "NO" not in table


def test_every_contender_is_warmed_up_once_untimed_but_the_slow_peers(bench):
    """The decode and lowp sections time a contender's calls after one untimed warm-up, as the others
    do (without it, a median of few rounds took in a contender's first call); a slow peer, timed fewer
    rounds (`repeats_of`), runs only those."""
    calls: list[str] = []
    fns = {name: (lambda n=name: calls.append(n)) for name in ("hfgpt", "transformers", "slow")}
    timings = bench.interleaved(fns, 3, "cpu", repeats_of={"slow": 1})
    assert calls[:2] == ["hfgpt", "transformers"]  # the warm-ups, before any timed round
    assert {name: calls.count(name) for name in fns} == {"hfgpt": 4, "transformers": 4, "slow": 1}
    assert {name: len(timing.times) for name, timing in timings.items()} == {
        "hfgpt": 3, "transformers": 3, "slow": 1,
    }  # fmt: skip


def test_flop_count_matches_a_hand_count(bench):
    # GPT-2 124M, one token, no context: 12 layers x 2 x (3E^2 + E^2 + 8E^2) + 2 x E x V (head)
    # + attention over the token itself (QK^T and AV: 2 x 2 x E per layer).
    config = bench.our_config("gpt2", {})
    e, v = 768, 50257
    expected = 12 * 2 * 12 * e * e + 2 * e * v + 12 * 4 * e
    assert bench.forward_flops(config, 1, 1, 1) == pytest.approx(expected)


def test_unknown_section_is_a_clean_error(bench, capsys):
    assert bench.main(["--tiny", "--sections", "prefil"]) == 2
    assert "error: unknown section 'prefil'" in capsys.readouterr().err


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
    report = json.loads(out.read_text())
    assert report["machine"]["keep_freed_memory"] is True
    assert {(r["section"], r["impl"]) for r in report["rows"]} == {
        (section, impl) for section in ("train", "memory") for impl in ("hfgpt", "transformers")
    }
    assert "freed memory kept in the process" in proc.stdout.splitlines()[0]


@pytest.mark.parametrize("avx512", [True, False])
def test_the_products_label_names_where_the_default_setting_runs_onednn(avx512, monkeypatch):
    monkeypatch.setattr(bench_model.ops_hfgpt, "avx512_cpu", lambda: avx512)
    label = bench_model.cpu_products_label
    assert label(None) == ("onednn" if avx512 else "onednn up to 16 rows, mkl above")
    assert (label(True), label(False)) == ("onednn", "mkl")


def test_mkl_products_run_is_marked_and_leaves_the_setting_as_it_was(tmp_path, capsys):
    from hfgpt.cpu import ops as ops_hfgpt

    with ops_hfgpt.onednn_products(True) as runs_onednn:
        out = tmp_path / "mkl.json"
        argv = ["--tiny", "--families", "gpt2", "--sections", "prefill", "--mkl-products", "--peers", "none"]
        argv += ["--json", str(out)]
        assert bench_model.main(argv) == 0
        assert json.loads(out.read_text())["machine"]["hfgpt_cpu_products"] == "mkl"
        assert "through MKL (`--mkl-products`)" in capsys.readouterr().out.splitlines()[0]
        assert ops_hfgpt._cpu_products["onednn"] == runs_onednn == (ops_hfgpt._ONEDNN_LINEAR is not None)


@pytest.mark.skipif(
    bench_model.ops_hfgpt._ONEDNN_LINEAR is None, reason="compares oneDNN with MKL: needs oneDNN"
)
def test_cpu_products_ab_times_each_setting_on_every_path(tmp_path, capsys):
    import ab_cpu_products

    from hfgpt.cpu import ops as ops_hfgpt

    with ops_hfgpt.onednn_products(True):
        assert ab_cpu_products.main(["--tiny", "--json", str(tmp_path / "ab.json")]) == 0
        # Each timed call runs on its own backend, and the setting is as it was after it.
        setting = lambda: ops_hfgpt._cpu_products["onednn"]  # noqa: E731
        assert ab_cpu_products.on("mkl", setting)() is False
        assert ab_cpu_products.on("onednn", setting)() is True
        assert ab_cpu_products.on("default", setting)() is None
        assert ops_hfgpt._cpu_products["onednn"] is True
    report = json.loads((tmp_path / "ab.json").read_text())
    cases = [row["case"] for row in report["rows"]]
    assert [c.split()[0] for c in cases] == ["prefill", "prefill", "decode", "decode", "train"]
    for row in report["rows"]:
        for backend in ("onednn", "mkl", "default"):
            assert row[backend]["rate"] > 0 and row[backend]["n"] == 2
        assert row["mkl_over_onednn"] == pytest.approx(row["mkl"]["median_s"] / row["onednn"]["median_s"])
        assert row["mkl_over_default"] == pytest.approx(row["mkl"]["median_s"] / row["default"]["median_s"])
    assert all(isinstance(row["tokens_identical"], bool) for row in report["rows"] if "decode" in row["case"])
    table = capsys.readouterr().out
    assert table.count("\n| ") == 1 + len(cases)  # the header row and one row a case


def test_kernels_ab_times_each_kernel_a_task_calls_against_the_task_without_it(tmp_path, capsys, monkeypatch):
    import ab_kernels

    from hfgpt.cpu import kernels
    from hfgpt.cpu import ops as ops_hfgpt

    monkeypatch.setattr(ops_hfgpt, "mkl_decodes_fast", lambda: False)  # (decoding's products on the kernel)
    if not all(kernels.available(name) for name in ab_kernels.KERNELS):
        pytest.skip("no C compiler: hfgpt's kernels are not built here")
    available = kernels.available
    with ab_kernels.switched_off("gelu"):
        assert not kernels.available("gelu") and kernels.available("loss")
    assert kernels.available is available and kernels.available("gelu")
    tasks = ab_kernels.tasks("gpt2", bench_model.PROFILES["tiny"])
    train = next(fn for task, fn in tasks.items() if task.startswith("train"))
    for off in (None, "gelu"):
        with ab_kernels.recording_calls() as called, ab_kernels.switched_off(off):
            train()
        assert ("gelu" in called) == (off is None) and {"loss", "dropout"} <= called

    with ops_hfgpt.onednn_products(False):  # (products on MKL, on any CPU: the GELU then runs in place)
        assert ab_kernels.main(["--tiny", "--json", str(tmp_path / "ab.json")]) == 0
    report = json.loads((tmp_path / "ab.json").read_text())
    # (the tiny model's heads of 16 are not the attention kernel's 64)
    found = {(row["task"].split()[0], row["kernel"]) for row in report["rows"]}
    assert found == {
        ("prefill", "gelu"),
        ("train", "gelu"),
        ("train", "loss"),
        ("train", "dropout"),
        ("decode", "gelu"),
        ("decode", "row_product"),
    }
    for row in report["rows"]:
        assert len(row["with_s"]) == len(row["without_s"]) == 2
        assert row["ratio"] == pytest.approx(row["without_median_s"] / row["with_median_s"])
    assert report["machine"]["threads"] >= 1
    assert report["machine"].get("hfgpt_cflags") == (os.environ.get("HFGPT_CFLAGS") or None)
    assert capsys.readouterr().out.count("\n| ") == 1 + len(found)  # the header row and one row a kernel


def _strict_json(text: str) -> object:
    """json.loads refusing the NaN / Infinity tokens Python's json accepts and writes, which JSON lacks."""

    def refuse(token: str) -> None:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_writes_null_for_figures_not_measured(tmp_path):
    nan, inf = float("nan"), float("inf")
    report = {
        "rows": [{"section": "memory", "median_s": nan, "rate": 1.5, "extra": {"a": inf, "b": [2, nan]}}]
    }
    bench_model.write_json(tmp_path / "figures.json", report)
    assert _strict_json((tmp_path / "figures.json").read_text()) == {
        "rows": [{"section": "memory", "median_s": None, "rate": 1.5, "extra": {"a": None, "b": [2, None]}}]
    }


def test_memory_rows_have_null_timings_in_the_json_and_the_table_reads_them(tmp_path, capsys):
    out = tmp_path / "memory.json"
    argv = ["--tiny", "--families", "gpt2", "--sections", "memory", "--peers", "none", "--json", str(out)]
    assert bench_model.main(argv) == 0
    printed = capsys.readouterr().out
    report = _strict_json(out.read_text())
    rows = report["rows"]
    assert {r["impl"] for r in rows} == {"hfgpt", "transformers"}
    for row in rows:
        assert row["median_s"] is row["min_s"] is row["max_s"] is None and row["rate"] > 0
    assert bench_model.format_table(report) in printed  # the table from the file is the one printed


@pytest.mark.parametrize(
    "path", sorted(Path(bench_model.__file__).parent.glob("*.json")), ids=lambda path: path.name
)
def test_committed_figure_files_are_strict_json(path):
    report = _strict_json(path.read_text())
    json.dumps(report, allow_nan=False)
    memory = [r for r in report.get("rows", []) if isinstance(r, dict) and r.get("section") == "memory"]
    for row in memory:  # memory rows time nothing: their timings are null, their figure is the peak
        assert row["median_s"] is row["min_s"] is row["max_s"] is None and row["rate"] > 0
    if memory:
        assert f"| {memory[0]['rate']:.2f} GB |" in bench_model.format_table(report)


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


def test_convert_benchmark_reports_a_contender_that_fails_instead_of_waiting(tmp_path):
    import bench_convert

    with pytest.raises(RuntimeError, match="_run_hfgpt exited with 1 without figures"):
        bench_convert.measure("_run_hfgpt", str(tmp_path / "no-release"), str(tmp_path / "out"), "float32")


def test_step_breakdown_times_both_steps_op_by_op_and_counts_their_products(tmp_path, capsys):
    import step_breakdown

    out = tmp_path / "breakdown.json"
    assert step_breakdown.main(["--tiny", "--steps", "1", "--measured", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    table = capsys.readouterr().out
    config = bench_model.our_config("gpt2", bench_model.PROFILES["tiny"]["model_overrides"])
    (batch, seq_len), embd, layers = report["shape"], config.n_embd, config.n_layer
    # Forward, then the input and weight gradients: 3x the forward's products. At 16 positions both run
    # attention over the whole T x T square (hfgpt's bands start at 128).
    linear = 2 * (embd * 3 * embd + embd * embd + 2 * embd * config.inner_size) * layers * batch * seq_len
    head = 2 * embd * config.vocab_size * batch * seq_len
    attention = 2 * 2 * batch * seq_len * seq_len * embd * layers
    assert set(report["contenders"]) == {"hfgpt", "transformers"}
    for impl, result in report["contenders"].items():
        assert result["product_flops"] == 3 * (linear + head + attention), impl
        assert 0 < result["product_seconds"] < result["instrumented_seconds"]
        assert result["step_seconds"] > 0 and result["faults_per_step"] >= 0
        assert any(op["op"].startswith("aten.randint") for op in result["ops"]) == (impl == "hfgpt")
        assert f"## {impl}: " in table


def test_step_breakdown_times_hfgpts_c_kernels_as_ops_of_their_own():
    """hfgpt's C kernels are torch operators, which the dispatch mode times as ops of their own: the
    attention kernel's and the GELU's forward and backward, the keep-mask draws and the LM loss's two
    kernels (a GPT-2-shaped layer with heads of 64 at 128 positions: dropout draws once on the embeddings,
    and in the layer once per band of 64 query rows and twice on the residual branch; a vocabulary of 1,000
    is one block of the log-sum-exp and one slice of the softmax gradient)."""
    import step_breakdown

    from hfgpt.cpu import kernels

    if not kernels.available("attention"):
        pytest.skip("no C compiler: the attention kernel is not built here")
    overrides = dict(n_embd=128, n_layer=1, n_head=2, vocab_size=1000, n_positions=128)
    model = bench_model.build_ours("gpt2", overrides, "cpu")
    step = bench_model.make_train_step(model, torch.randint(0, 1000, (1, 128)))
    result = step_breakdown.breakdown(step, warmup=0, plain=1, measured=1)
    calls = {op["op"]: op["calls"] for op in result["ops"] if op["op"].startswith("hfgpt.")}
    assert calls == {
        "hfgpt.attention_train_forward.default": 1,
        "hfgpt.attention_train_backward.default": 1,
        "hfgpt.keep_mask.default": 1 + 2 + 2,
        "hfgpt.gelu_tanh.default": 1,
        "hfgpt.gelu_tanh_backward.default": 1,
        "hfgpt.lse_block.default": 1,
        "hfgpt.softmax_grad.default": 1,
    }
    assert all(op["seconds"] > 0 for op in result["ops"] if op["op"] in calls)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--impls", "hfgpt,peer"], "--impls takes hfgpt and/or transformers, not peer"),
        (["--steps", "0"], "--steps and --measured take 1 or more"),
        (["--json", "{missing}/out.json"], "is not an existing folder"),
    ],
)
def test_step_breakdown_refuses_bad_arguments_before_building_models(
    argv, message, tmp_path, capsys, monkeypatch
):
    import step_breakdown

    built = []
    monkeypatch.setattr(step_breakdown, "build_ours", lambda *args: built.append(args))
    argv = [a.replace("{missing}", str(tmp_path / "missing")) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        step_breakdown.main(["--tiny", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and not built and message in err and "Traceback" not in err


# --- the published figures: one file per section, and what is made from them ---------------------------

# The other scripts' figures files, one each (named by what they measure).
OTHER_FIGURES = {
    "ab-cpu-products-gpt1.json",  # ab_cpu_products.py --family gpt1
    "ab-cpu-products-gpt2.json",  # ab_cpu_products.py --family gpt2
    "ab-cpu-products-gpt1-avx2.json",  # .ci/as-avx2 python benchmarks/ab_cpu_products.py --family gpt1
    "ab-cpu-products-gpt2-avx2.json",  # .ci/as-avx2 python benchmarks/ab_cpu_products.py --family gpt2
    "ab-kernels-cpu.json",  # ab_kernels.py
    "ab-kernels-cpu-avx2.json",  # .ci/as-avx2 python benchmarks/ab_kernels.py
    "lowp-accuracy-cpu.json",  # lowp_accuracy.py
    "step-breakdown-gpt2.json",  # step_breakdown.py
    "figures-cuda-training.json",  # bench_cuda.py (a GPU run)
    "figures-cuda-decoding.json",  # bench_cuda.py (a GPU run)
    "profile-cuda-training.json",  # profile_cuda.py (a GPU run)
}


def test_benchmarks_hold_one_figures_file_per_section_named_by_what_it_measures():
    folder = Path(bench_model.__file__).parent
    sections = {f"figures-cpu-{section}.json": section for section in bench_model.SECTIONS}
    present = {path.name for path in folder.glob("*.json")}
    assert present <= set(sections) | OTHER_FIGURES, present - set(sections) - OTHER_FIGURES
    assert set(sections) <= present  # every section of bench_model.py has its current figures
    for name, section in sections.items():
        report = json.loads((folder / name).read_text())
        assert report["section"] == section and report["date"]
        assert {row["section"] for row in report["rows"]} == {section}
        assert {"machine", "hardware", "profile"} <= set(report)


def test_json_dir_writes_one_figures_file_per_section_of_the_run(tmp_path, capsys):
    argv = ["--tiny", "--families", "gpt1", "--sections", "prefill,decode", "--peers", "none"]
    assert bench_model.main([*argv, "--json-dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "figures-cpu-decode.json",
        "figures-cpu-prefill.json",
    ]
    figures = bench_model.load_figures(tmp_path)
    assert list(figures) == ["prefill", "decode"]
    started = {report["started"] for report in figures.values()}
    assert len(started) == 1  # one run: the files share its start, machine and hardware limits
    assert [run["sections"] for run in bench_model.runs_of(figures)] == [["prefill", "decode"]]
    # The table of the saved files is the table the run printed.
    assert bench_model.figures_table(figures).split("\n", 1)[1] in capsys.readouterr().out


def test_figures_of_several_runs_are_told_apart():
    figures = bench_model.load_figures()
    runs = bench_model.runs_of(figures)
    assert sorted(section for run in runs for section in run["sections"]) == sorted(figures)
    summary = bench_model.summary_table(figures)
    if len(runs) > 1:  # until one run measures every section, the table says which run gave which
        assert f"in {len(runs)} runs:" in summary
        for run in runs:
            assert f"- {', '.join(run['sections'])}: {run['date']}" in summary
    else:
        assert f"on {runs[0]['date']}, profile" in summary


def test_summary_ratios_are_the_rows_ratios_against_transformers():
    figures = bench_model.load_figures()
    rows = [row for report in figures.values() for row in report["rows"]]
    by_label = {line["label"]: line for line in bench_model.summary_figures(figures)}
    decode = by_label["greedy decoding, B=1"]["gpt2"]
    ours = bench_model._find_row(rows, "gpt2", "decode", "B=1", "hfgpt")
    peer = bench_model._find_row(rows, "gpt2", "decode", "B=1", "transformers")
    assert ours["case"].startswith("B=1,") and decode["ratio"] == ours["rate"] / peer["rate"]
    assert decode["figure"] == f"{ours['extra']['ms_per_step']:.1f} ms a step"
    int8 = by_label["decoding copy, int8, B=1"]["gpt1"]
    lowp = {r["impl"]: r for r in rows if r["family"] == "gpt1" and r["section"] == "lowp"}
    assert int8["ratio"] == lowp["hfgpt int8"]["rate"] / lowp["transformers fp32"]["rate"]
    memory = by_label["training step, peak memory (below 1x: less)"]["gpt2"]
    assert memory["figure"].endswith(" GB") and memory["ratio"] < 1


def test_summary_table_names_the_rows_no_family_has_instead_of_a_row_of_dashes():
    figures = bench_model.load_figures()
    bf16 = "training step, B=4 x 256, bfloat16 autocast"
    without = {
        section: {**report, "rows": [r for r in report["rows"] if "bf16" not in r["case"]]}
        for section, report in figures.items()
    }
    table = bench_model.summary_table(without)
    assert f"| {bf16} |" not in table
    assert table.endswith(".") and bf16 in table.splitlines()[-1].split(": ", 1)[1]
    assert "| greedy decoding, B=1 |" in table


def test_chart_is_drawn_from_the_figures_files(tmp_path):
    from PIL import Image

    figures = bench_model.load_figures()
    data = bench_model.plot_ratios(figures, tmp_path / "chart.png")
    assert data == bench_model.chart_data(figures) and data
    assert all(line["label"] != "training step, peak memory (below 1x: less)" for line in data)
    with Image.open(tmp_path / "chart.png") as image:
        assert image.format == "PNG" and json.loads(image.info["Description"]) == data
    # The committed chart was drawn from the committed figures (regenerate: bench_model.py --plot).
    with Image.open(Path(bench_model.__file__).parent / "ratios-cpu.png") as image:
        assert json.loads(image.info["Description"]) == data, "stale chart: run bench_model.py --plot"


def test_figures_options_measure_nothing_and_refuse_an_empty_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_model, "run", lambda *args, **kwargs: pytest.fail("measured"))
    assert bench_model.main(["--summary"]) == 0
    assert capsys.readouterr().out.strip() == bench_model.summary_table(bench_model.load_figures())
    assert bench_model.main(["--figures"]) == 0
    assert capsys.readouterr().out.strip() == bench_model.figures_table(bench_model.load_figures())
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
    monkeypatch.setattr(bench_model.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(bench_model, "run", lambda *args, **kwargs: pytest.fail("measured"))
    assert bench_model.main(["--tiny", "--peers", "compile,torchao,ctranslate2"]) == 2
    err = capsys.readouterr().err
    assert "--peers needs torchao, ctranslate2, not installed here: pip install 'hfgpt[bench]'" in err


# --- the other routes to speed, on tiny models -------------------------------------------------------

TINY = bench_model.PROFILES["tiny"]["model_overrides"]


def test_plain_hfgpt_is_a_copy_without_the_cpu_backend():
    from hfgpt.cpu import is_kernelized

    ours = bench_model.build_ours("gpt2", TINY, "cpu").eval()
    assert is_kernelized(ours)  # (this module's models are built kernelized: conftest.py)
    plain = bench_model.plain_hfgpt(ours)
    assert not is_kernelized(plain) and plain.config._attn_implementation == "sdpa"
    assert is_kernelized(ours)  # the original is untouched
    ids = torch.randint(0, TINY["vocab_size"], (2, 16))
    with torch.inference_mode():
        torch.testing.assert_close(plain(ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)


def test_ctranslate2_int8_decodes_the_same_weights():
    pytest.importorskip("ctranslate2")
    ours = bench_model.build_ours("gpt2", TINY, "cpu").eval()
    decoder = bench_model.ctranslate2_int8(bench_model.build_peer(ours).eval())
    ids = torch.randint(0, TINY["vocab_size"], (2, 16))
    with torch.inference_mode():
        reference = ours(ids).logits
    logits = decoder.logits(ids)
    assert logits.shape == reference.shape
    assert (logits - reference).abs().max() < 0.5  # int8 weights and activations: close, not equal
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8
    prompts = bench_model.left_padded_prompts(1, 8, TINY["vocab_size"], 0, "cpu")
    assert decoder.greedy(prompts, 6).shape == (1, 6)  # exactly the new tokens: no end token stops it
    # CTranslate2 has no converter for transformers' OpenAIGPT: no GPT-1 row.
    gpt1 = bench_model.build_ours("gpt1", TINY, "cpu")
    assert bench_model.ctranslate2_int8(bench_model.build_peer(gpt1)) is None


@pytest.mark.slow
def test_torchao_int8_copy_quantizes_every_linear_layer_and_decodes_compiled():
    pytest.importorskip("torchao")
    ours = bench_model.build_ours("gpt2", TINY, "cpu").eval()
    quantized, kwargs = bench_model.torchao_int8(ours)
    linears = [m for m in quantized.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 * TINY["n_layer"] + 1  # c_attn, c_proj, c_fc, mlp c_proj a block, and the head
    assert all("Int8" in type(m.weight).__name__ for m in linears)
    assert not any(isinstance(m, bench_model.Conv1D) for m in quantized.modules())
    assert any(isinstance(m, bench_model.Conv1D) for m in ours.modules())  # the original is untouched
    ids = torch.randint(0, TINY["vocab_size"], (2, 16))
    prompts = bench_model.left_padded_prompts(1, 8, TINY["vocab_size"], 0, "cpu")
    with torch.inference_mode():
        assert (quantized(ids).logits - ours(ids).logits).abs().max() < 0.5
        tokens = bench_model.greedy(quantized, prompts, 6, **kwargs)
    assert kwargs == {"cache_implementation": "static"} and tokens.shape == (1, 6)


def tiny_rows_beside_compile(tmp_path, section: str) -> list[dict]:
    """The figures rows of a tiny GPT-2 run of one `section` with the compile peer, one round."""
    argv = ["--tiny", "--families", "gpt2", "--sections", section, "--peers", "compile", "--repeats", "1"]
    assert bench_model.main([*argv, "--json", str(tmp_path / "figures.json")]) == 0
    return json.loads((tmp_path / "figures.json").read_text())["rows"]


@pytest.mark.slow
def test_compiled_plain_model_runs_beside_hfgpt_in_prefill(tmp_path, capsys):
    rows = tiny_rows_beside_compile(tmp_path, "prefill")
    compiled = [r for r in rows if r["impl"] == bench_model.COMPILED]
    # Timed beside hfgpt and transformers in every float32 case, and nowhere under autocast.
    float32 = {r["case"] for r in rows if "autocast" not in r["case"]}
    assert {r["case"] for r in compiled} == float32
    for row in compiled:
        assert row["extra"]["max_abs_logit_diff_from_hfgpt"] < 1e-4 and row["rate"] > 0
    assert "| gpt2 | prefill torch.compile |" in capsys.readouterr().out


@pytest.mark.slow
def test_compiled_plain_model_decodes_beside_hfgpt_with_the_tokens_compared(tmp_path, capsys):
    rows = tiny_rows_beside_compile(tmp_path, "decode")
    compiled = [r for r in rows if r["impl"] == bench_model.COMPILED]
    assert {r["case"] for r in compiled} == {r["case"] for r in rows if r["impl"] == "hfgpt"}
    for row in compiled:  # (greedy on a static cache, compiled: the eager models' tokens)
        assert row["extra"]["tokens_identical"] is True and row["extra"]["ms_per_step"] > 0
    assert "| gpt2 | decode torch.compile |" in capsys.readouterr().out


@pytest.mark.slow
def test_int8_copy_compiled_runs_beside_the_eager_copy_in_lowp(tmp_path):
    rows = {r["impl"]: r for r in tiny_rows_beside_compile(tmp_path, "lowp")}
    compiled, eager = rows[bench_model.INT8_COMPILED], rows["hfgpt int8"]
    assert compiled["rate"] > 0 and compiled["case"] == eager["case"]
    # the same copy, the same tokens: compiling changes the speed only
    for measure in ("greedy_token_agreement", "greedy_first_divergence", "max_abs_logit_err"):
        assert compiled["extra"][measure] == eager["extra"][measure]


@pytest.mark.slow
def test_a_compiled_step_is_checked_against_the_same_step_run_eagerly(monkeypatch):
    from hfgpt.cpu.quantization import quantize_for_decoding

    ours = bench_model.build_ours("gpt2", TINY, "cpu").eval()
    prompts = bench_model.left_padded_prompts(1, 8, TINY["vocab_size"], 0, "cpu")
    int8 = quantize_for_decoding(ours)
    wrong = bench_model.build_ours("gpt2", TINY, "cpu").eval()
    forward = wrong.forward

    def compiled_elsewhere(*args, **kwargs):  # other logits when compiled, as a graph whose kernel
        out = forward(*args, **kwargs)  # silently refuses its arguments would give
        if torch.compiler.is_compiling():
            out.logits = torch.ones_like(out.logits)
        return out

    monkeypatch.setattr(wrong, "forward", compiled_elsewhere)  # (what generate() compiles calls it)
    with torch.inference_mode():
        assert bench_model.step_error(int8, prompts, bench_model.compiled_decoding(int8)) < 1e-6
        assert bench_model.step_error(wrong, prompts, bench_model.compiled_decoding(wrong)) > 0.5


def test_a_row_with_wrong_results_shows_no_speed_or_ratio():
    def row(impl, rate, **extra):
        extra = {"ms_per_step": 1000 / rate, **extra}
        return dict(family="gpt2", section="lowp", case="B=1, 8+6 tokens", impl=impl, rate=rate, extra=extra)

    rows = [
        row("transformers fp32", 10.0),
        row(bench_model.TORCHAO, 100.0, wrong="compiled steps' logits off"),
    ]
    line = next(
        x for x in bench_model.summary_figures({"lowp": {"rows": rows}}) if x["label"].startswith("torchao")
    )
    assert line["gpt2"] == {"figure": "wrong results", "ratio": None}


# --- RESULTS.md and the README: their tables are made from the figures ----------------------------------

RESULTS = Path(bench_model.__file__).parent / "RESULTS.md"


def test_results_tables_are_the_ones_made_from_the_figures():
    text = RESULTS.read_text()
    first, last = bench_model.marked_region(text, bench_model.RESULTS_TABLE)
    stale = "stale table: run python benchmarks/bench_model.py --update-docs"
    assert text[first:last].strip() == bench_model.figures_table(bench_model.load_figures()), stale
    first, last = bench_model.marked_region(text, bench_model.ACCURACY_TABLE)
    assert text[first:last].strip() == bench_model.accuracy_table(), stale
    first, last = bench_model.marked_region(text, bench_model.KERNELS_TABLE)
    assert text[first:last].strip() == bench_model.kernels_table(), stale


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
    readme = f"# x\n\nbefore\n{bench_model.README_TABLE}\nold\n{bench_model.GENERATED_END}\nafter\n"
    results = (
        f"a\n{bench_model.RESULTS_TABLE}\nold\n{bench_model.GENERATED_END}\nb\n"
        f"{bench_model.ACCURACY_TABLE}\n{bench_model.GENERATED_END}\nc\n"
        f"{bench_model.KERNELS_TABLE}\n{bench_model.GENERATED_END}\nd\n"
    )
    (root / "README.md").write_text(readme)
    (root / "benchmarks" / "RESULTS.md").write_text(results)
    figures = bench_model.load_figures()
    written = bench_model.update_docs(figures, root)
    assert [p.name for p in written] == ["ratios-cpu.png", "RESULTS.md", "README.md"]
    new_readme = (root / "README.md").read_text()
    assert new_readme.startswith("# x\n\nbefore\n") and new_readme.endswith(
        f"{bench_model.GENERATED_END}\nafter\n"
    )
    assert bench_model.summary_table(figures) in new_readme and "old" not in new_readme
    new_results = (root / "benchmarks" / "RESULTS.md").read_text()
    assert bench_model.figures_table(figures) in new_results and bench_model.accuracy_table() in new_results
    assert bench_model.kernels_table() in new_results and new_results.endswith(
        f"{bench_model.GENERATED_END}\nd\n"
    )
    bench_model.update_docs(figures, root)  # a second time changes nothing
    assert (root / "README.md").read_text() == new_readme
    with pytest.raises(ValueError, match="expected one"):
        bench_model.with_region("no markers", bench_model.README_TABLE, "x")


def test_ctranslate2_runs_beside_hfgpts_decoding_copies_in_the_lowp_section(tmp_path, capsys):
    pytest.importorskip("ctranslate2")
    argv = ["--tiny", "--sections", "lowp", "--peers", "ctranslate2", "--repeats", "1"]
    assert bench_model.main([*argv, "--json", str(tmp_path / "figures.json")]) == 0
    rows = json.loads((tmp_path / "figures.json").read_text())["rows"]
    impls = {family: {r["impl"] for r in rows if r["family"] == family} for family in ("gpt2", "gpt1")}
    assert bench_model.CTRANSLATE2 in impls["gpt2"]
    assert bench_model.CTRANSLATE2 not in impls["gpt1"]  # no GPT-1 converter in CTranslate2
    ct2 = next(r for r in rows if r["impl"] == bench_model.CTRANSLATE2)
    assert ct2["rate"] > 0 and 0 < ct2["extra"]["max_abs_logit_err"] < 0.5
    # timed in processes of its own (its OpenMP threads slowed the others in one process): `--repeats` runs
    # in each of the tiny profile's 2 rounds
    assert ct2["extra"]["measured"].startswith("alone in fresh processes") and ct2["n"] == 2
    assert "| gpt2 | decode ctranslate2 int8 |" in capsys.readouterr().out


@pytest.mark.slow
def test_the_int8_copies_are_timed_alone_beside_ctranslate2_round_by_round(tmp_path, monkeypatch, capsys):
    pytest.importorskip("ctranslate2")
    started = []
    decoder_alone = bench_model.decoder_alone

    def recorded(kind, family, profile, repeats, accuracy=True):
        started.append((kind, repeats, accuracy))
        result = decoder_alone(kind, family, profile, repeats, accuracy)
        # each process's times are its place in the order (1 to 6), so the rows' ratios show which it paired
        result["times"] = [float(len(started))] * repeats
        return result

    monkeypatch.setattr(bench_model, "decoder_alone", recorded)
    argv = ["--tiny", "--families", "gpt2", "--sections", "lowp", "--peers", "compile,ctranslate2"]
    assert bench_model.main([*argv, "--repeats", "3", "--json", str(tmp_path / "figures.json")]) == 0
    ct2, int8, int8c = bench_model.CTRANSLATE2, bench_model.INT8, bench_model.INT8_COMPILED
    assert bench_model.PROFILES["tiny"]["alone_rounds"] == 2
    # A B C, then C B A, each process timing all 3 runs; CTranslate2's accuracy in the first round only
    assert started == [
        (ct2, 3, True), (int8, 3, True), (int8c, 3, True), (int8c, 3, False), (int8, 3, False), (ct2, 3, False)
    ]  # fmt: skip
    rows = {r["impl"]: r for r in json.loads((tmp_path / "figures.json").read_text())["rows"]}
    assert rows[ct2]["n"] == rows[int8]["n"] == rows[int8c]["n"] == 6
    for row in (rows[ct2], rows[int8], rows[int8c]):
        assert f"2 rounds in alternating order with {ct2}, {int8}, {int8c}" in row["extra"]["measured"]
    # round by round, CTranslate2's time over the copy's: (process 1 / 2, then 6 / 5) and (1 / 3, 6 / 4)
    assert rows[int8]["extra"][bench_model.VS_CTRANSLATE2] == pytest.approx([1 / 2, 6 / 5])
    assert rows[int8c]["extra"][bench_model.VS_CTRANSLATE2] == pytest.approx([1 / 3, 6 / 4])
    assert bench_model.VS_CTRANSLATE2 not in rows[ct2]["extra"]
    table = capsys.readouterr().out
    assert "; 0.85x CTranslate2's speed round by round (0.50-1.20, 2 rounds) |" in table
    assert bench_model._summary_cell(rows[int8]).endswith(", 0.85x CTranslate2's speed round by round")
    # the copy's accuracy is measured here, as the eager copy's (the same copy, the same tokens)
    assert rows[int8c]["extra"]["max_abs_logit_err"] == rows["hfgpt int8"]["extra"]["max_abs_logit_err"]
    assert rows[ct2]["extra"]["max_abs_logit_err"] > 0


def test_a_run_with_kernels_built_for_another_cpu_says_so_in_its_machine_line(monkeypatch):
    """Under HFGPT_CFLAGS (`.ci/as-avx2` narrows the kernels to x86-64-v3), the figures' machine records
    the flags and the README's run line names them; without it, neither does."""
    run = bench_model.runs_of(bench_model.load_figures())[0]
    monkeypatch.delenv("HFGPT_CFLAGS", raising=False)
    assert "hfgpt_cflags" not in bench_model.machine_info("cpu")
    assert "kernels built" not in bench_model._run_line({**run, "machine": bench_model.machine_info("cpu")})
    monkeypatch.setenv("HFGPT_CFLAGS", "-march=x86-64-v3")
    machine = bench_model.machine_info("cpu")
    assert machine["hfgpt_cflags"] == "-march=x86-64-v3"
    assert "hfgpt's kernels built with `-march=x86-64-v3`" in bench_model._run_line(
        {**run, "machine": machine}
    )
