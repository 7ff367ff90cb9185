"""trust_remote_code: a checkpoint saved by hfgpt loads and runs with plain transformers in a Python where
hfgpt cannot be imported, and gives hfgpt's own results. The code files written beside the checkpoint are
plain transformers/torch code: no torch internals, no native libraries, no dispatch hooks, no hfgpt."""

import ast
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hfgpt.modeling import GPTConfig, GPTForCausalLM, GPTForSequenceClassification

TINY = dict(n_embd=32, n_layer=2, n_head=2, vocab_size=99, n_positions=64)
# Larger weights than the default 0.02 so that greedy decoding's top two logits are far apart: tokens then
# depend on the arithmetic only, not on which summation order a kernel happens to use.
INIT = dict(initializer_range=0.5, bos_token_id=None, eos_token_id=None, pad_token_id=0)
# Two rows, the first left-padded, so the attention mask matters.
INPUT_IDS = [[0, 0, 17, 42, 5, 88, 23, 61], [3, 14, 15, 92, 65, 35, 89, 79]]
ATTENTION_MASK = [[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]]
NEW_TOKENS = 12
FORBIDDEN = ("torch._", "_global_", "ctypes", "_python_dispatch")

# Run in a fresh, isolated interpreter (-I: no PYTHON* variables, no user site, neither the working
# directory nor the script's on sys.path). hfgpt is installed in this environment's site-packages, so -I
# alone would still find it: a meta-path finder placed before every other finder (the editable install's
# included) refuses `hfgpt` and everything under it, and the script checks that the refusal works and that
# no module from hfgpt's source tree was loaded by the end.
SCRIPT = textwrap.dedent(
    """
    import importlib.abc, json, os, sys

    class BlockHfgpt(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hfgpt" or name.startswith("hfgpt."):
                raise ModuleNotFoundError(f"blocked: {name}", name=name)
            return None

    sys.meta_path.insert(0, BlockHfgpt())
    sys.modules.pop("hfgpt", None)
    for name in ("hfgpt", "hfgpt.modeling", "hfgpt.cpu"):
        try:
            __import__(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"{name} is importable: the block does not work")

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    kind, path, sources = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    ids = torch.tensor(json.loads(sys.argv[4]))
    mask = torch.tensor(json.loads(sys.argv[5]))
    if kind == "causal-lm":
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=int(sys.argv[6]), pad_token_id=0
            )
        result = out.tolist()
    elif kind == "causal-lm-logits":
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
        with torch.no_grad():
            result = model(ids, attention_mask=mask).logits.tolist()
    else:
        model = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=True).eval()
        with torch.no_grad():
            result = model(ids, attention_mask=mask).logits.tolist()

    loaded = [
        name
        for name, module in list(sys.modules.items())
        if name == "hfgpt" or name.startswith("hfgpt.")
        or any(
            os.path.abspath(getattr(module, "__file__", None) or os.devnull).startswith(source + os.sep)
            for source in sources
        )
    ]
    print(json.dumps({
        "class": type(model).__name__,
        "module": type(model).__module__,
        "config_module": type(model.config).__module__,
        "hfgpt_modules": loaded,
        "result": result,
    }))
    """
)


def hfgpt_sources() -> list[str]:
    """The folders hfgpt's packages are imported from (its source tree under an editable install)."""
    folders = set()
    for name in ("hfgpt.modeling", "hfgpt.cpu", "hfgpt.tokenization", "hfgpt.scripts", "hfgpt.model_cards"):
        folders.update(os.path.abspath(p) for p in importlib.import_module(name).__path__)
    return sorted(folders)


def save_tiny(head: type, path: Path, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    model = head(GPTConfig(**TINY, **INIT, **extra)).eval()
    model.save_pretrained(path)
    return model


def run_without_hfgpt(tmp_path: Path, kind: str, ckpt: Path) -> dict:
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf_home"),  # a fresh transformers_modules cache
        "HF_HUB_OFFLINE": "1",
    }
    result = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            SCRIPT,
            kind,
            str(ckpt),
            json.dumps(hfgpt_sources()),
            json.dumps(INPUT_IDS),
            json.dumps(ATTENTION_MASK),
            str(NEW_TOKENS),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    # The classes came from the checkpoint's own code files, and nothing of hfgpt's was loaded.
    assert out["module"].startswith("transformers_modules."), out["module"]
    assert out["config_module"].startswith("transformers_modules."), out["config_module"]
    assert out["hfgpt_modules"] == [], out["hfgpt_modules"]
    return out


def imported_modules(tree: ast.AST) -> list[tuple[str, int]]:
    """(module, level) for every import statement and every importlib.import_module / __import__ call
    with a literal name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.args[0].value, 0))
    return found


def check_code_files(ckpt: Path) -> None:
    files = sorted(ckpt.glob("*.py"))
    names = {f.name for f in files}
    assert {"configuration_hfgpt.py", "modeling_hfgpt.py"} <= names, names
    auto_map = json.loads((ckpt / "config.json").read_text())["auto_map"]
    for target in auto_map.values():
        assert target.split(".")[0] + ".py" in names, (target, names)
    for file in files:
        text = file.read_text()
        for word in FORBIDDEN:
            assert word not in text, f"{file.name} contains {word!r}"
        for module, level in imported_modules(ast.parse(text, filename=file.name)):
            top = module.split(".")[0]
            assert top != "hfgpt", f"{file.name} imports {module}"
            if level:  # a relative import must name a code file saved beside the checkpoint
                assert level == 1 and f"{top}.py" in names, f"{file.name}: from {'.' * level}{module}"


@pytest.mark.slow
def test_causal_lm_generates_the_same_tokens_without_hfgpt(tmp_path):
    ckpt = tmp_path / "lm"
    ours = save_tiny(GPTForCausalLM, ckpt)
    check_code_files(ckpt)
    ids, mask = torch.tensor(INPUT_IDS), torch.tensor(ATTENTION_MASK)
    with torch.no_grad():
        expected = ours.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0
        )
    assert expected.shape == (2, len(INPUT_IDS[0]) + NEW_TOKENS)
    out = run_without_hfgpt(tmp_path, "causal-lm", ckpt)
    assert out["class"] == "GPTForCausalLM"
    assert out["result"] == expected.tolist()


@pytest.mark.slow
def test_sequence_classification_gives_the_same_logits_without_hfgpt(tmp_path):
    ckpt = tmp_path / "clf"
    ours = save_tiny(GPTForSequenceClassification, ckpt, num_labels=3)
    check_code_files(ckpt)
    with torch.no_grad():
        expected = ours(torch.tensor(INPUT_IDS), attention_mask=torch.tensor(ATTENTION_MASK)).logits
    assert expected.shape == (2, 3)
    out = run_without_hfgpt(tmp_path, "sequence-classification", ckpt)
    assert out["class"] == "GPTForSequenceClassification"
    torch.testing.assert_close(torch.tensor(out["result"]), expected, atol=1e-5, rtol=1e-5)
