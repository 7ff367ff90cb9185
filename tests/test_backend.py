"""The CPU backend (hfgpt.cpu) plugs into the plain model from outside: the model files never import it,
every new causal LM is kernelized by default, `HFGPT_CPU_BACKEND=0` turns that off, `unkernelize` gives back
exactly the plain model, and a kernelized model computes the plain model's values."""

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hfgpt.cpu import backend, is_kernelized, kernelize, kernels, unkernelize
from hfgpt.modeling import (
    GPTConfig,
    GPTDoubleHeadsModel,
    GPTForCausalLM,
    GPTForQuestionAnswering,
    GPTForSequenceClassification,
    GPTForTokenClassification,
    GPTModel,
)
from hfgpt.modeling.modeling_hfgpt import eager_attention_forward

MODELING_DIR = Path(__file__).parent.parent / "modeling"
MODEL_FILES = ("modeling_hfgpt.py", "configuration_hfgpt.py")
TINY = dict(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2)
# Heads of 64: decoding steps run in one call (`hfgpt.cpu.decoding`)
WIDE = dict(TINY, n_embd=128)
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)


def instance_methods(model: torch.nn.Module) -> list[str]:
    return [
        f"{name}.{attr}"
        for name, module in model.named_modules()
        for attr in ("forward", "_auxiliary_lm_loss", "train")
        if attr in module.__dict__
    ]


@pytest.mark.parametrize("name", MODEL_FILES)
def test_the_model_files_use_public_apis_and_never_the_backend(name):
    source = (MODELING_DIR / name).read_text()
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
    for pattern in (r"torch\._", r"_global_", r"ctypes", r"_python_dispatch"):
        assert not re.search(pattern, code), f"{name} matches {pattern}"
    imports = re.findall(r"^\s*(?:from|import)\s+(\S+)", code, flags=re.M)
    allowed = {"contextlib", "inspect", "os", "re", "shutil", "warnings", "collections", "dataclasses", "pathlib", "typing",
               "torch", "transformers", "huggingface_hub"}  # fmt: skip
    assert all(i.split(".")[0] in allowed or i == ".configuration_hfgpt" for i in imports), imports


def test_the_model_files_together_stay_close_to_the_length_of_transformers_gpt2():
    """hfgpt's two model files hold both decoders, every head, GPT-1's recipe and the fused training loss:
    at most 15% longer than transformers' GPT-2 model and config files (of the installed version)."""
    import transformers.models.gpt2 as gpt2

    theirs = sum(
        len((Path(gpt2.__file__).parent / name).read_text().splitlines())
        for name in ("modeling_gpt2.py", "configuration_gpt2.py")
    )
    lines = sum(len((MODELING_DIR / name).read_text().splitlines()) for name in MODEL_FILES)
    assert lines <= 1.15 * theirs, (lines, theirs)


def test_new_models_are_kernelized_and_unkernelize_gives_back_the_plain_model(monkeypatch):
    """A new causal LM runs the backend; `unkernelize` and `kernelize` switch its flag, nothing else is set
    on its modules, and the logits and greedy tokens are the plain model's."""
    steps = []
    step = kernels.float_decode_step
    monkeypatch.setattr(kernels, "float_decode_step", lambda *args: steps.append(1) or step(*args))
    torch.manual_seed(0)
    model = GPTForCausalLM(GPTConfig(**WIDE, **NO_DROPOUT)).eval()
    assert is_kernelized(model) and model.config._attn_implementation == "sdpa"
    assert instance_methods(model) == []
    plain = unkernelize(copy.deepcopy(model))
    assert not is_kernelized(plain) and instance_methods(plain) == []
    assert plain.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 96, (2, 20))
    settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)  # (a prompt: the model file's forward)
        tokens = model.generate(ids, **settings)
        assert len(steps) == 4
        assert torch.equal(tokens, plain.generate(ids, **settings)) and len(steps) == 4
    assert kernelize(plain) is plain and is_kernelized(plain)
    assert instance_methods(plain) == []
    with torch.no_grad():
        assert torch.equal(plain.generate(ids, **settings), tokens) and len(steps) == 8


@pytest.mark.parametrize("head", [GPTForCausalLM, GPTForSequenceClassification, GPTDoubleHeadsModel])
def test_a_kernelized_training_step_gives_the_plain_gradients(head):
    torch.manual_seed(0)
    config = GPTConfig(**TINY, **NO_DROPOUT, lm_loss_weight=0.5, pad_token_id=0, num_labels=3)
    fast = head(config).train()
    plain = unkernelize(copy.deepcopy(fast))
    ids = torch.randint(1, 96, (2, 24))
    inputs = {
        GPTForCausalLM: {"input_ids": ids, "labels": ids},
        GPTForSequenceClassification: {"input_ids": ids, "labels": torch.tensor([0, 2])},
        GPTDoubleHeadsModel: {"input_ids": ids[None], "mc_labels": torch.tensor([1])},
    }[head]
    for model in (fast, plain):
        model(**inputs).loss.backward()
    for (name, got), expected in zip(fast.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(
            got.grad, expected.grad, atol=1e-5, rtol=1e-4, msg=f"{head.__name__} {name}"
        )


HEADS = (
    GPTModel,
    GPTForCausalLM,
    GPTForSequenceClassification,
    GPTDoubleHeadsModel,
    GPTForTokenClassification,
    GPTForQuestionAnswering,
)


@pytest.mark.parametrize("norm", ["post", "pre"])  # GPT-1, GPT-2
@pytest.mark.parametrize("head", HEADS)
def test_the_backend_keeps_the_attention_implementation_asked_for(head, norm, tmp_path):
    """transformers' common test `test_sdpa_can_dispatch_non_composite_models`, with the backend on: a model
    loaded by default or with `attn_implementation="sdpa"` says `sdpa`, one loaded with `"eager"` says
    `eager` and has no attention layer whose config says `sdpa`; each runs the attention its config names
    (the causal LM kernelized), with the same values."""
    torch.manual_seed(0)
    head(GPTConfig(**TINY, layer_norm_position=norm, pad_token_id=0)).save_pretrained(tmp_path)
    default = head.from_pretrained(tmp_path).eval()
    sdpa = head.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    eager = head.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert default.config._attn_implementation == sdpa.config._attn_implementation == "sdpa"
    assert eager.config._attn_implementation == "eager"
    for name, submodule in eager.named_modules():
        if type(submodule).__name__.endswith("Attention") and getattr(submodule, "config", None):
            assert submodule.config._attn_implementation == "eager", name
    assert is_kernelized(sdpa) == is_kernelized(eager) == (head is GPTForCausalLM)
    attention = [m for m in sdpa.modules() if type(m).__name__ == "GPTAttention"]
    assert attention and all(m.attention_interface() is sdpa_attention_forward for m in attention)
    assert all(
        m.attention_interface() is eager_attention_forward
        for m in eager.modules()
        if type(m).__name__ == "GPTAttention"
    )
    ids = torch.randint(1, 96, (2, 10))
    inputs = ids[:, None] if head is GPTDoubleHeadsModel else ids
    with torch.no_grad():
        got, expected = sdpa(inputs), eager(inputs)
    key = "last_hidden_state" if head is GPTModel else next(iter(expected.keys()))
    torch.testing.assert_close(got[key], expected[key], atol=2e-5, rtol=1e-4)
    sdpa.set_attn_implementation("eager")
    assert sdpa.config._attn_implementation == "eager"
    assert all(m.attention_interface() is eager_attention_forward for m in attention)


def test_transformers_own_sdpa_is_untouched():
    """The backend registers no attention function and never replaces transformers' `sdpa` entry, which
    transformers' own models (GPT2LMHeadModel, ...) call."""
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    assert not any("hfgpt" in name for name in ALL_ATTENTION_FUNCTIONS.valid_keys())


def test_a_kernelized_model_off_float32_computes_the_plain_model():
    """float64 (as on any device the backend does not serve) runs every layer's own forward."""
    torch.manual_seed(0)
    model = GPTForCausalLM(GPTConfig(**TINY)).eval().double()
    plain = unkernelize(copy.deepcopy(model))
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_a_kernelized_model_moved_off_the_cpu_runs_the_plain_model(monkeypatch):
    """A model built on the CPU and moved to another device (a GPU; the meta device here) runs the plain
    model there, a prompt and a decoding step alike, without a call into C; nothing on its modules changes,
    and back on the CPU its steps run in one call again."""
    torch.manual_seed(0)
    model = GPTForCausalLM(GPTConfig(**WIDE)).eval()
    assert is_kernelized(model)
    model.to("meta")
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(kernels, "_library", lambda name: pytest.fail(f"C kernel {name} called"))
        out = model(torch.zeros(1, 5, dtype=torch.long, device="meta"), use_cache=True)
        assert out.logits.shape == (1, 5, TINY["vocab_size"]) and out.logits.is_meta
        step = model(torch.zeros(1, 1, dtype=torch.long, device="meta"), cache=out.past_key_values)
    assert step.logits.shape == (1, 1, TINY["vocab_size"]) and step.logits.is_meta
    assert is_kernelized(model) and instance_methods(model) == []
    model.to_empty(device="cpu")
    ids = torch.zeros(1, 5, dtype=torch.long)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        assert backend.decoding_step(model.transformer, ids[:, :1], cache, None, None, True, {}) is not None


def test_a_kernelized_model_saves_the_plain_code_and_reloads_kernelized(tmp_path):
    torch.manual_seed(0)
    model = GPTForCausalLM(GPTConfig(**TINY)).eval()
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.py")) == sorted(MODEL_FILES)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved.get("_attn_implementation_internal") in (None, "sdpa")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert is_kernelized(reloaded)
    ids = torch.randint(0, 96, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


SWITCHED_OFF = textwrap.dedent(
    """
    import torch
    from hfgpt.cpu import is_kernelized
    from hfgpt.modeling import GPTConfig, GPTForCausalLM
    model = GPTForCausalLM(GPTConfig(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2))
    print(is_kernelized(model), model.config._attn_implementation)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(("setting", "expected"), [("0", "False sdpa"), ("1", "True sdpa")])
def test_the_environment_switch(setting, expected):
    env = {**os.environ, "HFGPT_CPU_BACKEND": setting}
    out = subprocess.run([sys.executable, "-c", SWITCHED_OFF], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == expected


def test_an_empty_sequence_is_refused_by_name():
    model = GPTForCausalLM(GPTConfig(**TINY)).eval()
    with pytest.raises(ValueError, match=r"The input has no tokens \(shape \(2, 0\)\)"):
        model(torch.zeros(2, 0, dtype=torch.long))


def test_generate_on_an_empty_batch_is_refused_by_name():
    model = GPTForCausalLM(GPTConfig(**TINY)).eval()
    ids = torch.zeros(0, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"generate\(\) got a batch of 0 sequences \(input shape \(0, 4\)\)"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
