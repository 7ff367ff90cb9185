"""Training without the by-products of inference: no key-value cache in a training forward, the causal-LM
loss through `linear_cross_entropy` (the head and its loss together, never the full float32 logits), a
training step that compiles as one graph, and the memory that saves against transformers' GPT-2."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_modeling import NORMS, TINY, make_pair, random_ids
from transformers.loss.loss_utils import ForCausalLMLoss

from hfgpt.cpu import kernelize, unkernelize
from hfgpt.modeling import GPTConfig, GPTForCausalLM, GPTModel, modeling_hfgpt
from hfgpt.modeling.modeling_hfgpt import CACHE_FIELD, linear_cross_entropy

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def plain_model(norm: str, **extra) -> GPTForCausalLM:
    """An hfgpt causal LM computing its model file alone (the CPU backend taken out), in training mode."""
    _, ours = make_pair(GPTForCausalLM, norm, **NO_DROPOUT, **extra)
    return unkernelize(ours).train()


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    model.zero_grad()
    return grads


@pytest.fixture
def small_chunks(monkeypatch):
    """Slices of 5 rows in `LinearCrossEntropy` (with TINY's 96-token vocabulary), so that a few tokens
    already take several slices and a last, shorter one."""
    monkeypatch.setattr(modeling_hfgpt, "LOSS_CHUNK_ELEMENTS", 5 * TINY["vocab_size"])


# --- no cache in training -------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", NORMS)
def test_a_training_forward_builds_no_cache(norm, monkeypatch):
    model = plain_model(norm)
    built = []
    original = modeling_hfgpt.DynamicCache.__init__

    def spy(self, *args, **kwargs):
        built.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(modeling_hfgpt.DynamicCache, "__init__", spy)
    ids = random_ids(2, 8)
    out = model(ids, labels=ids)
    out.loss.backward()
    assert built == [] and getattr(out, CACHE_FIELD) is None
    # Asked for, a training forward still keeps one; evaluation and no-grad forwards keep the default.
    assert getattr(model(ids, use_cache=True), CACHE_FIELD) is not None
    with torch.no_grad():
        assert getattr(model(ids), CACHE_FIELD) is not None
    assert getattr(model.eval()(ids), CACHE_FIELD) is not None
    assert len(built) == 3


def test_the_base_model_in_training_builds_no_cache():
    model = GPTModel(GPTConfig(**TINY)).train()
    out = model(random_ids(2, 8))
    assert getattr(out, CACHE_FIELD) is None
    assert getattr(model.eval()(random_ids(2, 8)), CACHE_FIELD) is not None


# --- the fused loss ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", NORMS)
def test_the_fused_loss_and_every_gradient_equal_the_plain_loss(norm, small_chunks):
    """A training forward (fused) against the same model's forward with the plain head and
    transformers' ForCausalLMLoss (evaluation mode, gradients on): loss and every gradient within 1e-5."""
    model = plain_model(norm)
    ids = random_ids(3, 13)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt not counted
    labels[2, -3:] = -100  # right padding
    fused = model(ids, labels=labels)
    assert fused.logits is None  # the full logits are never formed in training
    fused.loss.backward()
    fused_grads = gradients(model)

    model.eval()
    plain = model(ids, labels=labels)
    assert plain.logits is not None
    plain.loss.backward()
    plain_grads = gradients(model)
    torch.testing.assert_close(fused.loss, plain.loss, atol=1e-5, rtol=1e-5)
    assert fused_grads.keys() == plain_grads.keys() and "transformer.wte.weight" in fused_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_the_fused_loss_equals_transformers_loss_function_with_its_arguments(small_chunks):
    """`linear_cross_entropy` takes ForCausalLMLoss's arguments: num_items_in_batch (Trainer's gradient
    accumulation), shift_labels, ignore_index."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(TINY["vocab_size"], 16, requires_grad=True)
    labels = torch.randint(0, TINY["vocab_size"], (2, 9))
    labels[1, 5:] = -1
    cases = [
        dict(ignore_index=-1),
        dict(ignore_index=-1, num_items_in_batch=torch.tensor(40)),
        dict(shift_labels=labels.roll(-1, 1), ignore_index=-1),
    ]
    for kwargs in cases:
        expected = ForCausalLMLoss(hidden @ weight.T, labels, TINY["vocab_size"], **kwargs)
        expected_grads = torch.autograd.grad(expected, (hidden, weight))
        got = linear_cross_entropy(hidden, weight, labels, **kwargs)
        got_grads = torch.autograd.grad(got, (hidden, weight))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for g, e in zip(got_grads, expected_grads, strict=True):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_the_fused_loss_under_bfloat16_autocast_stays_close_to_the_plain_one(small_chunks):
    model = plain_model("pre")
    ids = random_ids(2, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = model(ids, labels=ids)
    fused.loss.backward()
    fused_grads = gradients(model)
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(ids, labels=ids)
    plain.loss.backward()
    torch.testing.assert_close(fused.loss, plain.loss, atol=2e-2, rtol=1e-2)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(fused_grads[name], grad, atol=2e-2, rtol=5e-2, msg=name)


def test_the_compiled_fused_loss_equals_the_eager_one(small_chunks):
    """Under torch.compile the softmax's gradient takes its one-pass form (the one-hot as a comparison, not
    a scatter): the loss and gradients of the eager in-place form, ignored labels and a short last slice
    included."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 13, 16, requires_grad=True)
    weight = torch.randn(TINY["vocab_size"], 16, requires_grad=True)
    labels = torch.randint(0, TINY["vocab_size"], (2, 13))
    labels[0, :4] = -100
    eager = linear_cross_entropy(hidden, weight, labels)
    eager.backward()
    expected = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(linear_cross_entropy, fullgraph=True)(hidden, weight, labels)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hidden.grad, expected[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(weight.grad, expected[1], atol=1e-6, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "device, rows, slices",
    [  # GPT-2's vocabulary at 16 x 1024 tokens: 13 slices on the CPU, one on an accelerator (meta here)
        ("cpu", 16 * 1024, 13),
        ("meta", 16 * 1024, 1),
        ("meta", 3 * ((1 << 30) // 50257) + 1, 4),
    ],
)
def test_the_fused_loss_takes_large_slices_off_the_cpu(device, rows, slices, monkeypatch):
    """A GPU runs the head's products far below its rate on small slices: off the CPU a slice holds about
    2**30 logits, on the CPU 2**26."""
    taken = []
    log_softmax = torch.log_softmax
    monkeypatch.setattr(
        torch, "log_softmax", lambda x, *a, **k: taken.append(x.shape[0]) or log_softmax(x, *a, **k)
    )
    hidden = torch.zeros(rows, 8, device=device)
    weight = torch.zeros(50257, 8, device=device)
    labels = torch.zeros(1, rows, dtype=torch.long, device=device)
    linear_cross_entropy(hidden, weight, labels)
    assert len(taken) == slices and sum(taken) == rows


def test_the_fused_loss_with_a_frozen_head_gives_no_weight_gradient():
    model = plain_model("pre")
    model.transformer.wte.weight.requires_grad_(False)
    ids = random_ids(2, 8)
    model(ids, labels=ids).loss.backward()
    assert model.lm_head.weight.grad is None
    assert model.transformer.h[0].attn.c_attn.weight.grad is not None


def test_the_fused_loss_refuses_labels_of_another_length():
    model = plain_model("pre")
    with pytest.raises(ValueError, match=r"labels hold 14 positions but the hidden states 16"):
        model(random_ids(2, 8), labels=random_ids(2, 7))


def test_a_custom_loss_function_and_logits_to_keep_take_the_plain_path():
    model = plain_model("pre")
    ids = random_ids(2, 8)
    model.loss_function = lambda logits, labels, **kwargs: logits.float().mean()
    out = model(ids, labels=ids)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, out.logits.mean())


def test_the_fused_loss_applies_to_a_kernelized_model():
    """A model built on the CPU, as `from_pretrained` builds it, runs the CPU backend, which sets nothing on
    its LM head: its training forward (the model file's) fuses the head and its loss. A head whose forward a
    user replaced keeps the plain path."""
    model = kernelize(plain_model("pre"))
    assert "forward" not in model.lm_head.__dict__  # (nothing of the backend's on the head)
    ids = random_ids(2, 8)
    fused = model(ids, labels=ids)
    assert fused.logits is None
    head = model.lm_head
    head.forward = lambda hidden: torch.nn.functional.linear(hidden, head.weight)
    plain = model(ids, labels=ids)
    assert plain.logits is not None
    torch.testing.assert_close(fused.loss, plain.loss, atol=1e-5, rtol=1e-5)


# --- compiled training step -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["plain", "kernelized"])
def test_a_training_step_compiles_as_one_graph(backend):
    """torch.compile(fullgraph=True) of a training forward (no cache, the fused loss) and its backward:
    one graph, no break, and the loss and gradients of the eager step."""
    model = plain_model("pre")
    if backend == "kernelized":
        kernelize(model)
    ids = random_ids(2, 8)
    eager = model(ids, labels=ids)
    eager.loss.backward()
    expected = gradients(model)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(ids, labels=ids)
    out.loss.backward()
    counters = torch._dynamo.utils.counters
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(out.loss, eager.loss, atol=1e-5, rtol=1e-5)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, expected[name], atol=1e-5, rtol=1e-5, msg=name)


def sdpa_calls_when_compiled(model, *args, **kwargs) -> list[dict]:
    """The keyword arguments (mask and causality) of each `scaled_dot_product_attention` call in the graph
    that torch.compile traces of `model(*args, **kwargs)`."""
    calls = []

    def inspecting_backend(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.target is torch.nn.functional.scaled_dot_product_attention:
                mask = node.kwargs.get("attn_mask")
                calls.append({"mask": mask is not None, "is_causal": node.kwargs.get("is_causal")})
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(model, backend=inspecting_backend, fullgraph=True)(*args, **kwargs)
    return calls


@pytest.mark.parametrize("norm", NORMS)
def test_a_compiled_training_step_leaves_the_causal_mask_to_sdpa(norm):
    """Without padding, a cache or position ids, sdpa gets no mask tensor but `is_causal=True` under
    torch.compile as in eager (its flash kernels; transformers' mask builder makes a (T, T) mask there
    before torch 2.14). With an attention mask, or position ids that may restart (packed sequences), the
    mask is built as before."""
    model = plain_model(norm)
    ids = random_ids(2, 8)
    calls = sdpa_calls_when_compiled(model, ids, labels=ids)
    assert calls == [{"mask": False, "is_causal": True}] * TINY["n_layer"]
    padded = torch.ones_like(ids)
    padded[1, :3] = 0
    assert all(call["mask"] for call in sdpa_calls_when_compiled(model, ids, attention_mask=padded))
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)
    assert all(call["mask"] for call in sdpa_calls_when_compiled(model, ids, position_ids=packed))


# --- memory -------------------------------------------------------------------------------------------------

# One training step (forward, backward) in a fresh process, its peak RSS above what the process held once
# the model was built (VmHWM, reset by writing 5 to /proc/self/clear_refs, proc(5)).
_PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, transformers
    from hfgpt.modeling import GPTConfig, GPTForCausalLM

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    torch.manual_seed(0)
    size = dict(n_layer=1, n_embd=64, n_head=4, n_positions=512, vocab_size=50257)
    dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if sys.argv[1] == "hfgpt":
        model = GPTForCausalLM(GPTConfig(**size, **dropout))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=64, n_head=4, n_positions=512, vocab_size=50257, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0))
    model.train()
    ids = torch.randint(0, 50257, (4, 512))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    model(ids, labels=ids).loss.backward()
    print(json.dumps({"peak": status("VmHWM") - before}))
    """
)


def _training_peak(which: str) -> int:
    env = {**os.environ, "HFGPT_CPU_BACKEND": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, which], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["peak"]


@pytest.mark.slow
def test_a_head_dominated_training_step_peaks_at_half_of_transformers_memory():
    """1 layer, n_embd 64, GPT-2's 50,257 tokens, B x T = 4 x 512, the CPU backend off: the logits are
    most of a step's memory, and the fused loss never holds them."""
    ours, theirs = _training_peak("hfgpt"), _training_peak("transformers")
    assert ours <= 0.5 * theirs, (ours, theirs)
    assert theirs > 2 * 4 * 512 * 50257 * 4  # transformers holds at least two float32 logit tensors
