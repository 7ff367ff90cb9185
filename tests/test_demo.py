"""hfgpt-demo in a reduced-steps mode: the whole pipeline (tokenizer, Trainer, save, reload through the
Auto classes, generate, pictures) runs and its outputs are real. The full run's >= 0.99 accuracy is
checked by hand (see the README), not here: it takes minutes."""

import random
import struct
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hfgpt.modeling import GPTForCausalLM
from hfgpt.scripts.demo import (
    DemoError,
    DemoSettings,
    build_char_tokenizer,
    encode_example,
    main,
    make_sequences,
    run_demo,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_tokenizer_round_trips_and_reloads_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = build_char_tokenizer("0123456789>")
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = reloaded("<s>3141>1134</s>", add_special_tokens=False)["input_ids"]
    assert len(ids) == 11 and ids[0] == reloaded.bos_token_id and ids[-1] == reloaded.eos_token_id
    assert reloaded.decode(ids, skip_special_tokens=True) == "3141>1134"
    assert reloaded.convert_ids_to_tokens(ids[1:5]) == ["3", "1", "4", "1"]


def test_loss_covers_only_the_sorted_half():
    tokenizer = build_char_tokenizer("0123456789>")
    example = encode_example(tokenizer, "312")
    tokens = tokenizer.convert_ids_to_tokens(example["input_ids"])
    assert tokens == ["<s>", "3", "1", "2", ">", "1", "2", "3", "</s>"]
    assert example["labels"][:5] == [-100] * 5 and example["labels"][5:] == example["input_ids"][5:]


@pytest.mark.slow
def test_demo_pipeline_in_reduced_mode(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["--output-dir", str(out), "--steps", "40", "--n-train", "512", "--n-test", "20", "--length", "5"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    line = next(ln for ln in printed.splitlines() if ln.startswith("exact-match accuracy: "))
    assert 0.0 <= float(line.split(": ")[1]) <= 1.0
    for name in ("loss_curve.png", "attention_last_layer.png"):
        assert str(out / name) in printed
        width, height = _png_size(out / name)
        assert width > 300 and height > 200
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert isinstance(model, GPTForCausalLM) and model.config.n_positions == 2 * 5 + 3
    assert AutoTokenizer.from_pretrained(out / "model").pad_token == "<pad>"


def test_run_demo_learns_and_reports(tmp_path):
    settings = DemoSettings(steps=150, n_train=512, n_test=20, length=4, n_embd=32)
    result = run_demo(tmp_path, settings)
    # The loss on the sorted half falls well below chance (ln 11 ~ 2.4 over 10 digits + EOS).
    assert result["final_loss"] < 1.0
    # Sorting 4 digits is easy enough that this short run already sorts most held-out sequences.
    assert result["accuracy"] >= 0.8
    assert Path(result["loss_curve"]).is_file() and Path(result["attention"]).is_file()


def test_settings_too_small_are_refused(tmp_path, capsys):
    with pytest.raises(DemoError, match="steps 0: train at least 1 step"):
        run_demo(tmp_path, DemoSettings(steps=0))
    with pytest.raises(DemoError, match="n_test 0: the accuracy needs at least 1 held-out sequence"):
        run_demo(tmp_path, DemoSettings(n_test=0))
    assert main(["--output-dir", str(tmp_path), "--length", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["--output-dir", str(tmp_path), "--length", "10000000"]) == 2  # once 8 s in 10**length
    assert capsys.readouterr().err.startswith("error: length 10000000: at most 64 digits")


def test_more_sequences_than_the_length_allows_are_refused(tmp_path, capsys):
    # 10**4 = 10000 strings of 4 digits, fewer than the default 20000 + 500: make_sequences drew forever.
    assert main(["--output-dir", str(tmp_path / "out"), "--length", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: n_train + n_test = 20500 distinct sequences, but only 10000 of length 4")
    assert not (tmp_path / "out").exists()
    # 100 strings of 2 digits, 10 excluded: 90 can be drawn, 91 cannot.
    excluded = {f"{i:02d}" for i in range(10)}
    drawn = make_sequences(90, 2, random.Random(0), exclude=excluded)
    assert len(set(drawn)) == 90 and not set(drawn) & excluded
    with pytest.raises(DemoError, match=r"91 distinct sequences of 2 digits asked for, but only 90 are left"):
        make_sequences(91, 2, random.Random(0), exclude=excluded)


@pytest.mark.parametrize("flag", ["--n-test", "--threads", "--steps", "--n-train"])
def test_counts_below_one_are_usage_errors(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error
        main(["--output-dir", str(tmp_path / "out"), flag, "0"])
    assert exit_info.value.code == 2
    assert f"error: argument {flag}: must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
