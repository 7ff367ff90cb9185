"""AutoTokenizer on saved GPT-1/GPT-2 checkpoints: with hfgpt registered, and where hfgpt cannot be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from transformers import GPT2Tokenizer as TransformersGPT2Tokenizer

import hfgpt.tokenization
from hfgpt.modeling import GPTConfig
from hfgpt.tokenization import GPT1Tokenizer, GPT2Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
GPT1_EXPECTED = json.loads(
    (FIXTURES / "openai-gpt1-tiny" / "expected_texts.json").read_text(encoding="utf-8")
)
GPT2_EXPECTED = json.loads(
    (FIXTURES / "openai-gpt2-tiny" / "expected_prompts.json").read_text(encoding="utf-8")
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A GPT-1 and a GPT-2 folder as a converted checkpoint has them: config.json + tokenizer files."""
    folders = {}
    for preset, tokenizer in (
        ("openai-gpt", GPT1Tokenizer(add_finetune_tokens=True)),
        ("gpt2", GPT2Tokenizer()),
    ):
        folder = tmp_path_factory.mktemp(preset)
        GPTConfig.from_preset(preset).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[preset] = folder
    return folders


def test_auto_tokenizer_with_hfgpt_registered(checkpoints: dict[str, Path]) -> None:
    hfgpt.tokenization.register(GPTConfig)
    hfgpt.tokenization.register(GPTConfig)  # idempotent: hfgpt.modeling may call it too
    gpt1 = AutoTokenizer.from_pretrained(checkpoints["openai-gpt"])
    assert type(gpt1) is GPT1Tokenizer  # the installed class, not the copy saved beside the vocabulary
    assert gpt1(GPT1_EXPECTED["texts"][0])["input_ids"] == GPT1_EXPECTED["ids"][0]
    assert gpt1.finetune_token_ids == GPT1_EXPECTED["special_tokens"]
    gpt2 = AutoTokenizer.from_pretrained(checkpoints["gpt2"])
    assert isinstance(gpt2, TransformersGPT2Tokenizer)
    assert gpt2(GPT2_EXPECTED["prompts"][2])["input_ids"] == GPT2_EXPECTED["ids"][2]
    # Registering does not take over the name "GPT2Tokenizer" for other models' folders.
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    assert tokenizer_class_from_name("GPT2Tokenizer") is TransformersGPT2Tokenizer


_WITHOUT_HFGPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["hfgpt"] = None  # the editable install's finder would find it: block it outright
    try:
        import hfgpt  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("hfgpt importable")
    from transformers import AutoTokenizer
    folder, text, trust = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)
    except Exception as error:
        print(json.dumps({"error": type(error).__name__ + ": " + str(error)}))
    else:
        print(json.dumps({"class": type(tokenizer).__module__ + "." + type(tokenizer).__name__,
                          "ids": tokenizer(text)["input_ids"]}))
    """
)


def _load_without_hfgpt(folder: Path, text: str, trust: bool, tmp_path: Path) -> dict:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
    }
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_HFGPT, str(folder), text, "1" if trust else "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_gpt1_loads_through_remote_code_without_hfgpt(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    text = GPT1_EXPECTED["texts"][2]
    loaded = _load_without_hfgpt(checkpoints["openai-gpt"], "_start_" + text, True, tmp_path)
    assert loaded["class"].endswith("tokenization_gpt1.GPT1Tokenizer")
    assert not loaded["class"].startswith("hfgpt.")
    assert loaded["ids"] == [40478, *GPT1_EXPECTED["ids"][2]]
    refused = _load_without_hfgpt(checkpoints["openai-gpt"], text, False, tmp_path)
    assert "trust_remote_code" in refused["error"]


def test_gpt2_loads_with_plain_transformers(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    text = GPT2_EXPECTED["prompts"][2]
    loaded = _load_without_hfgpt(checkpoints["gpt2"], text, False, tmp_path)
    assert loaded["class"] == "transformers.models.gpt2.tokenization_gpt2.GPT2Tokenizer"
    assert loaded["ids"] == GPT2_EXPECTED["ids"][2]
