"""Smoke run of benchmarks/bench_cuda.py (the GPU section) on the CPU at tiny size: every section and row
kind produces figures with sane fields, the plain-PyTorch reference computes hfgpt's loss on the same
weights, and `--update-docs` writes the README's table from a figures file.

Speed is never asserted: the figures come from a GPU run of the benchmark."""

import json
import math
from pathlib import Path

import bench_cuda  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
import pytest
import torch
from conftest import intra_op_threads, made_once  # tests/ is on sys.path

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_reports(tmp_path_factory):
    """Both sections, tiny, eager only (compiling takes tens of seconds on the CPU; one compiled row is
    run by its own test below)."""

    def run(out):
        with intra_op_threads(1):  # tiny models on a busy machine: faster without OpenMP barriers
            assert bench_cuda.main(["--tiny", "--device", "cpu", "--no-compile", "--json-dir", str(out)]) == 0

    out = made_once(tmp_path_factory, "bench-cuda", run)
    return {
        section: json.loads(bench_cuda.figures_path(out, "cpu", section).read_text())
        for section in bench_cuda.SECTIONS
    }, out


@pytest.mark.slow
def test_training_rows_have_every_eager_contender_and_sane_figures(tiny_reports):
    report = tiny_reports[0]["train"]
    assert report["errors"] == [] and report["skipped"] == [] and report["complete"] is True
    assert report["machine"]["torch"] == torch.__version__ and report["machine"]["transformers"]
    assert report["date"] and report["settings"]["mfu_formula"]
    timed = [r for r in report["rows"] if r["median_s"] is not None]
    seen = {(r["impl"], r["mode"], r["case"].rsplit(" ", 1)[1]) for r in timed}
    assert seen == {("hfgpt", "eager", "0.1"), ("transformers", "eager", "0.1"), ("reference", "eager", "0")}
    for row in timed:
        ex = row["extra"]
        assert row["min_s"] <= row["median_s"] <= row["max_s"] and row["n"] == 2
        assert row["rate"] == pytest.approx(2 * 32 / row["median_s"])
        assert ex["mfu"] == pytest.approx(
            ex["flops_per_step"] / row["median_s"] / report["hardware"]["bf16_matmul_flops_per_s"]
        )
        assert ex["peak_memory_bytes"] is None  # (no CUDA allocator to ask on the CPU)
        assert math.isfinite(ex["first_loss"])
    budget = [r for r in report["rows"] if r["case"].startswith("largest batch")]
    assert {r["impl"] for r in budget} == {"hfgpt", "transformers", "reference"}
    for row in budget:  # on the CPU every batch up to the profile's most tried fits
        assert row["extra"]["largest_batch"] == 4 and row["extra"]["capped_at_most_tried"]
    claims = {c["claim"]: c for c in report["checks"]}
    assert claims["GPT-2 124M: compiled step, hfgpt / reference speed, dropout 0"]["value"] is None
    assert claims["GPT-2 124M: eager step, hfgpt / transformers speed, dropout 0.1"]["value"] > 0


def test_decoding_rows_have_every_kind_and_the_same_tokens(tiny_reports):
    report = tiny_reports[0]["decode"]
    assert report["errors"] == [] and report["skipped"] == []
    rows = report["rows"]
    for model in ("GPT-2 124M", "GPT-1"):
        for batch in (1, 3):
            mine = {
                (r["impl"], r["mode"])
                for r in rows
                if r["model"] == model and r["case"].startswith(f"B={batch},")
            }
            # continuous batching at the profile's batch for it only (B=3 here; 16 and 64 on a GPU)
            expected = {("hfgpt", "dynamic cache"), ("hfgpt", "on-device loop")}
            expected |= {("hfgpt", "continuous batching")} if batch == 3 else set()
            if model == "GPT-1":  # transformers' GPT-1 has no cache: one row, recomputing
                expected.add(("transformers", "dynamic cache (no KV cache: recomputes)"))
            else:
                expected |= {("transformers", "dynamic cache"), ("transformers", "on-device loop")}
                expected |= {("transformers", "continuous batching")} if batch == 3 else set()
            assert mine == expected, (model, batch)
    for row in rows:
        ex = row["extra"]
        assert row["rate"] == pytest.approx(int(row["case"][2:].split(",")[0]) * 6 / row["median_s"])
        assert ex["ms_per_token_step"] == pytest.approx(1000 * row["median_s"] / 6)
        assert 0 < ex["floor_ms_per_step"] < ex["floor_with_cache_ms_per_step"]
        # float32 would agree everywhere; in bfloat16 a batch of other rows may round differently. hfgpt's
        # on-device loop runs eagerly here, on generate()'s cache: the same computation, the same tokens.
        if row["impl"] == "hfgpt" and row["mode"] in ("dynamic cache", "on-device loop"):
            assert ex["tokens_equal_hfgpt_dynamic"] is True and ex["tokens_equal_hfgpt_dynamic_first"] == 6
        assert 0 <= ex["tokens_equal_hfgpt_dynamic_first"] <= 6


def test_reference_gpt2_computes_hfgpts_loss_on_the_same_weights():
    """The plain-PyTorch contender is a real GPT-2: on transformers' weights copied into both, its loss
    equals hfgpt's (and transformers') loss, and so do the gradients of the embedding."""
    config = bench_cuda.gpt_config("gpt2", bench_cuda.PROFILES["tiny"]["model_overrides"], 0.0)
    state = bench_cuda.transformers_model(config).state_dict()
    ids = torch.randint(0, config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    losses, grads = {}, {}
    for impl in (bench_cuda.HFGPT, bench_cuda.TRANSFORMERS, bench_cuda.REFERENCE):
        model = bench_cuda.build_contender(impl, config, state).train()
        loss = bench_cuda.loss_of(model, ids)
        loss.backward()
        losses[impl] = loss.detach()
        wte = model.wte if impl == bench_cuda.REFERENCE else model.transformer.wte
        grads[impl] = wte.weight.grad
    torch.testing.assert_close(losses["reference"], losses["hfgpt"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses["transformers"], losses["hfgpt"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads["reference"], grads["hfgpt"], rtol=1e-4, atol=1e-6)


def test_hfgpt_contenders_with_options_set_them_for_their_own_steps(monkeypatch):
    """A training contender with a loss slice size runs its steps with hfgpt's fused-loss setting at that many
    logits (read as the loss runs: on the CPU, `LOSS_CHUNK_ELEMENTS`), leaving the setting as it was between
    steps; one with a padded vocabulary trains the padded model. Their rows say so beside the default
    contender's, and the table's line lists them beside the reference."""
    from hfgpt.modeling import modeling_hfgpt

    setting = bench_cuda.loss_slice_setting("cpu")
    default = getattr(modeling_hfgpt, setting)
    seen = []
    real = bench_cuda.loss_of

    def spy(model, ids, attention_mask=None):
        model_ = getattr(model, "_orig_mod", model)
        embeddings = (
            model_.wte if isinstance(model_, bench_cuda.ReferenceGPT2) else model_.get_input_embeddings()
        )
        vocab = embeddings.weight.shape[0]
        seen.append((getattr(modeling_hfgpt, setting), vocab))
        return real(model, ids, attention_mask)

    monkeypatch.setattr(bench_cuda, "loss_of", spy)
    profile = bench_cuda.PROFILES["tiny"]
    hfgpt, eager = bench_cuda.HFGPT, bench_cuda.EAGER
    groups = ((0.0, ((hfgpt, eager), (hfgpt, eager, {"loss_slice": 1 << 12}), (hfgpt, eager, {"pad_vocab_to": 64}),
                     (bench_cuda.REFERENCE, eager))),)  # fmt: skip
    ctx = bench_cuda.Context("cpu", "tiny", {**profile, "train_groups": groups}, {"bf16_matmul_flops_per_s": 1e9},
                             False, 1.0, deadline=math.inf)  # fmt: skip
    with bench_cuda.loss_slices("cpu", 1 << 12):
        assert getattr(modeling_hfgpt, setting) == 1 << 12
    assert getattr(modeling_hfgpt, setting) == default
    bench_cuda.train_rows(ctx, "gpt2")
    assert ctx.errors == [] and getattr(modeling_hfgpt, setting) == default
    rows = {(r.impl, r.mode): r.extra for r in ctx.rows}
    vocab, padded = 1000, 1024  # (tiny's vocabulary, and the next multiple of 64)
    assert (rows["hfgpt", "eager"]["loss_slice_elements"], rows["hfgpt", "eager"]["vocab_rows"]) == (
        default,
        vocab,
    )
    sliced = rows["hfgpt", "eager, loss slices of 2**12 logits"]
    assert (sliced["loss_slice_elements"], sliced["vocab_rows"]) == (1 << 12, vocab)
    assert rows["hfgpt", "eager, vocabulary padded to a multiple of 64"]["vocab_rows"] == padded
    assert rows["reference", "eager"]["loss_slice_elements"] is None
    # each contender's steps: its first, its warm-ups, the one measured for memory, the timed ones
    steps = 1 + (profile["train_warmup"] - 1) + 1 + profile["train_repeats"]
    assert seen.count((1 << 12, vocab)) == steps and seen.count((default, padded)) == steps
    assert (
        seen.count((default, vocab)) == 2 * steps == len(seen) - 2 * steps
    )  # (hfgpt's default, the reference)
    line = bench_cuda.variant_lines([vars(r) for r in ctx.rows])[0]
    assert line.startswith("Eager steps, GPT-2 124M, B=2x32, bf16 autocast, dropout 0, ms: ")
    assert (
        "(loss slices of 2**12, 1000 vocabulary rows)" in line
        and "(loss slices of 2**26, 1024 vocabulary rows)" in line
    )
    assert "reference" in line


def test_the_claims_profile_runs_its_decoding_plan(tmp_path, monkeypatch):
    """The `claims` profile's decoding rows, at tiny size on the CPU without compiling (so without the static
    cache and CUDA graphs): GPT-2 at B=1 and B=64 (the on-device loop hfgpt's only), GPT-1 at B=64 only; and the
    claims of the loop at B=1, the best at B=64 and GPT-1's against transformers' have their figures."""
    tiny = bench_cuda.PROFILES["tiny"]
    sizes = ("prompt_len", "new_tokens", "model_overrides", "matmul_size", "read_bytes")
    profile = {
        **bench_cuda.PROFILES["claims"],
        **{k: tiny[k] for k in sizes},
        "decode_repeats": 1,
        "slow_repeats": 1,
    }
    monkeypatch.setitem(bench_cuda.PROFILES, "claims-tiny", profile)
    with intra_op_threads(1):
        report = bench_cuda.run("claims-tiny", "cpu", ("decode",), compile=False, json_dir=tmp_path)["decode"]
    assert report["errors"] == [] and report["skipped"] == []
    seen = {(r["model"], r["case"].split(",")[0], r["impl"], r["mode"]) for r in report["rows"]}
    gpt2 = {("hfgpt", "dynamic cache"), ("transformers", "dynamic cache"), ("hfgpt", "on-device loop")}
    assert seen == {
        *{("GPT-2 124M", "B=1", *c) for c in gpt2},
        *{("GPT-2 124M", "B=64", *c) for c in gpt2},
        ("GPT-1", "B=64", "hfgpt", "dynamic cache"),
        ("GPT-1", "B=64", "hfgpt", "on-device loop"),
        ("GPT-1", "B=64", "transformers", "dynamic cache (no KV cache: recomputes)"),
    }
    claims = {c["claim"]: c for c in report["checks"]}
    for claim in (
        "GPT-2 124M B=1: on-device loop, hfgpt ms per token",
        "GPT-2 124M B=64: best hfgpt / best transformers throughput",
        "GPT-1 B=64: best hfgpt with its cache / transformers (no cache)",
    ):
        assert claims[claim]["value"] > 0, claim


def test_largest_fitting_doubles_then_bisects():
    limit = 37
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= limit

    assert bench_cuda.largest_fitting(fits, 8, 512, 1) == limit
    assert tried[:4] == [8, 16, 32, 64]  # doubling until the first failure, then halving the gap
    assert bench_cuda.largest_fitting(lambda b: b <= 3, 8, 512, 1) == 3  # below the first try
    assert bench_cuda.largest_fitting(lambda b: True, 8, 100, 1) == 100  # capped at the most tried
    assert bench_cuda.largest_fitting(lambda b: False, 8, 100, 1) == 0


@pytest.mark.slow
def test_a_compiled_training_row_and_compiled_decoding_rows_run(tmp_path):
    """One compiled training contender, and the static-cache and CUDA-graph decoding rows (on the CPU the
    latter compiles without graphs), through the same functions as the GPU run."""
    profile = bench_cuda.PROFILES["tiny"]
    ctx = bench_cuda.Context(
        device="cpu",
        profile_name="tiny",
        profile={
            **profile,
            "train_groups": ((0.0, ((bench_cuda.REFERENCE, bench_cuda.COMPILED),)),),
            "decode_kinds": {"gpt2": (bench_cuda.DYNAMIC, bench_cuda.STATIC)},
            "decode_batches": (2,),
        },
        hardware=bench_cuda.measure_hardware("cpu", profile),
        compile=True,
        memory_budget_gib=1.0,
        deadline=math.inf,
    )
    bench_cuda.train_rows(ctx, "gpt2")
    bench_cuda.decode_rows(ctx, "gpt2")
    assert ctx.errors == []
    modes = {(r["section"], r["impl"], r["mode"]) for r in map(vars, ctx.rows)}
    assert ("train", "reference", "compiled") in modes
    assert {("decode", impl, "static cache + compile") for impl in ("hfgpt", "transformers")} <= modes
    for row in ctx.rows:
        ex = row.extra
        if row.mode == "static cache + compile":
            assert ex["first_call_s (compile)"] > 0 and ex["tokens_equal_hfgpt_dynamic"] is not None
        if row.section == "train":
            assert ex["first_step_s (compile)"] > row.median_s


def test_out_of_time_rows_are_named_as_skipped():
    ctx = bench_cuda.Context("cpu", "tiny", bench_cuda.PROFILES["tiny"], {}, False, 1.0, deadline=-math.inf)
    bench_cuda.train_rows(ctx, "gpt2")
    assert ctx.rows == [] and len(ctx.skipped) == 3  # (the eager contenders: compile is off here)
    assert all(s.startswith("train gpt2") for s in ctx.skipped)


def test_update_docs_writes_the_table_from_the_figures(tiny_reports, tmp_path):
    _, figures_dir = tiny_reports
    readme = tmp_path / "README.md"
    readme.write_text(
        f"# x\n\n{bench_cuda.README_GPU_TABLE}\nold\n<!-- end of generated table -->\n\nafter\n"
    )
    cuda_dir = tmp_path / "figures"
    cuda_dir.mkdir()
    for section in bench_cuda.SECTIONS:  # (the tiny run's files, as if a GPU had made them)
        src = bench_cuda.figures_path(figures_dir, "cpu", section)
        bench_cuda.figures_path(cuda_dir, "cuda", section).write_text(src.read_text())
    bench_cuda.update_docs(cuda_dir, readme)
    text = readme.read_text()
    assert "\nold\n" not in text and text.endswith("<!-- end of generated table -->\n\nafter\n")
    assert "| training step, bf16 autocast: ms, MFU, peak GiB | hfgpt eager | transformers eager |" in text
    assert "| GPT-2 124M, B=1, 6+6 tokens, bf16 weights |" not in text  # (8 prompt tokens in tiny)
    assert "| GPT-2 124M, B=1, 8+6 tokens, bf16 weights |" in text and "| GPT-1, B=3, 8+6 tokens" in text
    assert "largest batch x32 in 40 GiB" in text and "Claims of the issues" not in text  # (printed only)
    assert "Claims of the issues that hold:" in bench_cuda.gpu_table(bench_cuda.load_figures(cuda_dir))
    # Without figures the region says so, and invents nothing.
    empty = tmp_path / "empty"
    empty.mkdir()
    bench_cuda.update_docs(empty, readme)
    assert bench_cuda.NO_RUN_YET in readme.read_text() and "| training step" not in readme.read_text()


def test_readme_has_the_gpu_region_made_from_the_committed_figures():
    text = (ROOT / "README.md").read_text()
    first, last = bench_cuda.marked_region(text, bench_cuda.README_GPU_TABLE)
    assert text[first:last].strip() == bench_cuda.gpu_table(bench_cuda.load_figures(), claims=False), (
        "stale table: run python benchmarks/bench_cuda.py --update-docs"
    )


def test_cuda_is_refused_where_there_is_none(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_cuda.main(["--tiny"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_a_run_stopped_mid_section_leaves_the_rows_it_measured(tmp_path, monkeypatch):
    """A lent GPU's time limit kills the run from outside: the figures file already holds the rows measured
    so far, marked incomplete, and the README's table says so."""

    def killed(ctx, preset):
        raise KeyboardInterrupt  # (what a run stopped between its training rows and the budget search sees)

    monkeypatch.setattr(bench_cuda, "budget_rows", killed)
    with pytest.raises(KeyboardInterrupt):
        bench_cuda.main(
            ["--tiny", "--device", "cpu", "--no-compile", "--sections", "train", "--json-dir", str(tmp_path)]
        )
    report = json.loads(bench_cuda.figures_path(tmp_path, "cpu", "train").read_text())
    assert report["complete"] is False
    assert {(r["impl"], r["mode"]) for r in report["rows"]} == {
        ("hfgpt", "eager"),
        ("transformers", "eager"),
        ("reference", "eager"),
    }
    assert "Stopped before the section's end" in bench_cuda.gpu_table({"train": report})


@pytest.mark.slow
def test_the_profile_script_times_each_contender_kernel_by_kernel(tmp_path):
    import profile_cuda  # benchmarks/profile_cuda.py

    argv = ["--tiny", "--device", "cpu", "--no-compile", "--repeats", "2", "--json-dir", str(tmp_path)]
    assert profile_cuda.main(argv) == 0
    report = json.loads((tmp_path / "profile-cpu-training.json").read_text())
    assert set(report["contenders"]) == set(profile_cuda.CONTENDERS)
    for contender in report["contenders"].values():
        assert contender["step_ms_median"] > 0 and contender["top_kernels"]
        kinds = contender["by_kind_ms_per_step"]
        assert sum(kinds.values()) == pytest.approx(contender["device_ms_per_step"])
    # the plain-loss contender takes transformers' cross-entropy on the full logits; hfgpt does not
    ops = {
        c: {k["name"] for k in report["contenders"][c]["top_kernels"]}
        for c in ("hfgpt", "hfgpt (plain loss)")
    }
    assert "aten::cross_entropy_loss" in ops["hfgpt (plain loss)"]
    assert "aten::cross_entropy_loss" not in ops["hfgpt"]
    assert profile_cuda.main(["--contenders", "hfgpt,nobody", "--json-dir", str(tmp_path)]) == 2


@pytest.mark.parametrize(
    "name, kind",
    [  # kernel names from a compiled GPT-2 training step on an H200
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64", "attention"),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_NNT", "matrix products"),
        (
            "triton_red_fused__log_softmax__to_copy__unsafe_view_mm_prepare_softmax_online_view_21",
            "cross-entropy",
        ),
        (
            "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>",
            "optimizer",
        ),
        ("triton_poi_fused_gelu_gelu_backward_view_8", "elementwise and other"),
    ],
)
def test_the_profile_sorts_kernels_by_kind(name, kind):
    import profile_cuda

    assert profile_cuda.kind_of(name) == kind


def test_models_and_decoding_batches_narrow_a_run(tmp_path, capsys):
    argv = ["--tiny", "--device", "cpu", "--no-compile", "--sections", "decode", "--json-dir", str(tmp_path)]
    assert bench_cuda.main([*argv, "--models", "openai-gpt", "--decode-batches", "2"]) == 0
    report = json.loads(bench_cuda.figures_path(tmp_path, "cpu", "decode").read_text())
    assert report["rows"] and {(r["model"], r["case"].split(",")[0]) for r in report["rows"]} == {
        ("GPT-1", "B=2")
    }
    assert report["settings"]["decode_families"] == ["openai-gpt"] and report["settings"][
        "decode_batches"
    ] == [2]
    capsys.readouterr()
    assert bench_cuda.main([*argv, "--models", "gpt3"]) == 2
    assert "gpt3" in capsys.readouterr().err
    assert bench_cuda.main([*argv, "--decode-batches", "1,zero"]) == 2
    assert "--decode-batches '1,zero'" in capsys.readouterr().err


def test_a_time_budget_keeps_room_for_the_timed_rounds(tmp_path, monkeypatch):
    """Decoding times its contenders together once each has run once: a contender is started only while
    the timed rounds of those started before it still fit in the budget, and one left out is named."""
    real = bench_cuda.decode_run

    def slow_run(ctx, model, kind, prompts, new):
        run = real(ctx, model, kind, prompts, new)

        def timed_run():
            clock["ahead"] += 10.0  # each run takes 10 s more on the benchmark's clock
            return run()

        return timed_run

    clock = {"ahead": 0.0}
    perf_counter = bench_cuda.time.perf_counter
    monkeypatch.setattr(bench_cuda.time, "perf_counter", lambda: perf_counter() + clock["ahead"])
    monkeypatch.setattr(bench_cuda, "decode_run", slow_run)
    # 35 s: the first contender's first call (10 s) leaves 25 s, but its 1 timed round (10 s) is kept in
    # reserve, so the second starts (at 10 + 10 < 35) and the third does not (20 + 2 x 10 > 35).
    bench_cuda.run(
        "tiny", "cpu", ("decode",), compile=False, time_budget_s=35.0, json_dir=tmp_path,
        models=("gpt2",), decode_batches=(2,),
    )  # fmt: skip
    report = json.loads(bench_cuda.figures_path(tmp_path, "cpu", "decode").read_text())
    assert [r["impl"] + " " + r["mode"] for r in report["rows"]] == [
        "hfgpt dynamic cache",
        "transformers dynamic cache",
    ]
    assert [s.rsplit(" ", 3)[-3:] for s in report["skipped"]] == [
        ["hfgpt", "on-device", "loop"],
        ["transformers", "on-device", "loop"],
        ["hfgpt", "continuous", "batching"],
        ["transformers", "continuous", "batching"],
    ]
