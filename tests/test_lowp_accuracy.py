"""Smoke run of benchmarks/lowp_accuracy.py at tiny size: a model is trained, saved, and its
lower-precision copies compared with it; the saved model, evaluated again through `--model`, gives the
same reference figures; bad input names what is at fault."""

import json
import math

import harness
import lowp_accuracy  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
import pytest
from conftest import made_once  # tests/ is on sys.path


def train(out):
    args = ["--tiny", "--steps", "40", "--save", str(out / "model"), "--json", str(out / "trained.json")]
    assert lowp_accuracy.main(args) == 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = made_once(tmp_path_factory, "lowp", train)
    return out, json.loads((out / "trained.json").read_text())


@pytest.mark.slow
def test_training_lowers_the_loss_and_every_copy_is_compared(trained):
    _, report = trained
    assert report["training"]["last_loss"] < report["training"]["first_loss"] - 0.5
    figures = report["figures"]
    assert set(figures) == {"float32", "float32 copy", "bfloat16", "int8 weights"}
    for name, f in figures.items():
        assert math.isfinite(f["loss"]) and f["perplexity"] == pytest.approx(math.exp(f["loss"]))
        if name != "float32":
            assert 0.0 <= f["top1_agreement"] <= 1.0 and 0.0 <= f["greedy_token_agreement"] <= 1.0
            assert 0.0 <= f["greedy_mean_first_divergence"] <= report["greedy"]["new_tokens"]


def test_float32_copy_changes_nothing_and_low_precision_changes_something(trained):
    figures = trained[1]["figures"]
    same = figures["float32 copy"]
    assert same["rel_logit_err"] < 1e-5 and same["top1_agreement"] == 1.0
    assert same["greedy_prompts_identical"] == 1.0 and same["loss"] == pytest.approx(
        figures["float32"]["loss"]
    )
    for name in ("bfloat16", "int8 weights"):
        assert 0.0 < figures[name]["rel_logit_err"] < 0.5


def test_a_saved_model_evaluated_through_model_gives_the_same_reference(trained, capsys):
    out, report = trained
    assert (
        lowp_accuracy.main(["--tiny", "--model", str(out / "model"), "--json", str(out / "again.json")]) == 0
    )
    again = json.loads((out / "again.json").read_text())
    assert again["training"] is None and again["model"] == str(out / "model")
    assert again["figures"]["float32"]["loss"] == pytest.approx(
        report["figures"]["float32"]["loss"], rel=1e-5
    )
    printed = capsys.readouterr().out
    assert "| int8 weights |" in printed
    # the figures name the host they were measured on, and the table's first line says it
    assert again["machine"]["cpu"] == harness.cpuinfo()["name"] and again["machine"]["threads"] >= 1
    assert f"Host: {again['machine']['host']}." in printed.splitlines()[0]


def test_bad_input_names_the_path(tmp_path, capsys):
    with pytest.raises(SystemExit, match="cannot load --model .*nowhere"):
        lowp_accuracy.main(["--tiny", "--model", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match="cannot read --text file .*missing.txt"):
        lowp_accuracy.main(["--tiny", "--text", str(tmp_path / "missing.txt")])
    with pytest.raises(SystemExit):
        lowp_accuracy.main(["--tiny", "--save", str(tmp_path)])  # exists: nothing is overwritten
    assert f"--save {tmp_path} exists already" in capsys.readouterr().err
