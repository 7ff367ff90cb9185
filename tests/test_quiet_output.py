"""What users see on their terminal: no false alarms from hfgpt's supported routes, and a command's own
error first.

Each check runs in a fresh interpreter, with stderr as a user's terminal gets it (transformers' logging and
any third-party import-time output included), in the environment the `test` extra installs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
BIN = Path(sys.executable).parent
# transformers' warning for a config of another model type than the class's (configuration_utils.py).
MODEL_TYPE_WARNING = "You are using a model of type"


def run(argv: list[str], folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def run_python(code: str, folder: Path) -> subprocess.CompletedProcess:
    result = run([sys.executable, "-c", textwrap.dedent(code)], folder)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.slow
def test_convert_on_a_damaged_release_prints_its_error_first(tmp_path):
    release = tmp_path / "124M"
    shutil.copytree(FIXTURES / "openai-gpt2-tiny", release)
    data = release / "model.ckpt.data-00000-of-00001"
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    data.write_bytes(bytes(damaged))
    result = run([str(BIN / "hfgpt-convert"), str(release), str(tmp_path / "out")], tmp_path)
    assert result.returncode == 4, result.stderr
    # The error is the whole of stderr: nothing from torchao (or anything else) before it.
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checksum mismatch for tensor "), result.stderr
    assert data.name in lines[0] and result.stdout == ""
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_loading_transformers_checkpoints_into_hfgpt_prints_no_model_type_warning(tmp_path):
    result = run_python(
        """
        import sys

        from transformers import GPT2Config, GPT2LMHeadModel, OpenAIGPTConfig, OpenAIGPTLMHeadModel

        from hfgpt.modeling import GPTConfig, GPTForCausalLM, GPTForSequenceClassification

        sizes = dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=99)
        GPT2LMHeadModel(GPT2Config(**sizes)).save_pretrained("gpt2")
        OpenAIGPTLMHeadModel(OpenAIGPTConfig(**sizes)).save_pretrained("openai-gpt")
        print("--- loading", file=sys.stderr)
        for folder, norm in (("gpt2", "pre"), ("openai-gpt", "post")):
            for cls in (GPTForCausalLM, GPTForSequenceClassification):
                model = cls.from_pretrained(folder)
                assert model.config.layer_norm_position == norm, (folder, model.config)
            assert GPTConfig.from_pretrained(folder).model_type == "hfgpt"
        """,
        tmp_path,
    )
    loading = result.stderr.split("--- loading\n", 1)[1]
    assert MODEL_TYPE_WARNING not in loading and "not supported" not in loading, loading


@pytest.mark.slow
def test_other_model_types_still_get_transformers_warning(tmp_path):
    # Only gpt2 and openai-gpt configs are read as hfgpt's on purpose: a config of another model type
    # keeps transformers' warning.
    (tmp_path / "other").mkdir()
    config = dict(model_type="gptj", n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=99)
    (tmp_path / "other" / "config.json").write_text(json.dumps(config))
    result = run_python(
        """
        from hfgpt.modeling import GPTConfig

        GPTConfig.from_pretrained("other")
        """,
        tmp_path,
    )
    assert f"{MODEL_TYPE_WARNING} `gptj` to instantiate a model of type `hfgpt`" in result.stderr
