"""hfgpt's float32 CPU products through oneDNN (`use_onednn_products`, ops_hfgpt.py): the same values
and gradients as transformers' `Conv1D` / `F.linear` to float rounding, used where it applies and
nowhere else."""

import pytest
import torch
from test_performance import conv1d_pair  # tests/ is on sys.path (pytest's default import mode)

from hfgpt.cpu import ops as ops_hfgpt
from hfgpt.cpu.layers import conv1d_activated
from hfgpt.cpu.ops import onednn_products_apply, use_onednn_products
from hfgpt.modeling import GPTConfig, GPTForCausalLM
from hfgpt.modeling.interop import to_transformers

TINY = dict(
    vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None
)


@pytest.fixture
def onednn_recorded(monkeypatch) -> list[tuple[int, ...]]:
    """The input shapes of every oneDNN product, recorded (and still computed), in the current setting."""
    if ops_hfgpt._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN")
    calls, op = [], ops_hfgpt._ONEDNN_LINEAR
    monkeypatch.setattr(
        ops_hfgpt, "_ONEDNN_LINEAR", lambda x, *args: calls.append(tuple(x.shape)) or op(x, *args)
    )
    return calls


@pytest.fixture
def onednn_calls(onednn_recorded) -> list[tuple[int, ...]]:
    """`onednn_recorded` with the products on oneDNN at every size (`use_onednn_products(True)`)."""
    with ops_hfgpt.onednn_products(True):
        yield onednn_recorded


@pytest.mark.parametrize("shape", [(1, 1, 32), (2, 1, 32), (3, 40, 32)])
@pytest.mark.parametrize("wrt", ["input", "weight", "all"])
def test_conv1d_equals_transformers_conv1d_in_values_and_gradients(shape, wrt, cpu_products):
    ours, theirs = conv1d_pair()
    x = torch.randn(shape, requires_grad=wrt != "weight")
    if wrt == "input":
        for layer in (ours, theirs):
            layer.requires_grad_(False)
    got, expected = ours(x), theirs(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)
    upstream = torch.randn(got.shape)
    inputs = {"input": [x], "weight": [], "all": [x]}[wrt]
    ours_wrt = inputs + ([] if wrt == "input" else [ours.weight, ours.bias])
    theirs_wrt = inputs + ([] if wrt == "input" else [theirs.weight, theirs.bias])
    for g, e in zip(
        torch.autograd.grad((got * upstream).sum(), ours_wrt),
        torch.autograd.grad((expected * upstream).sum(), theirs_wrt),
        strict=True,
    ):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_conv1d_second_derivatives_equal_transformers_conv1d(cpu_products):
    """A backward with create_graph=True (a gradient penalty) differentiates through the gradients."""
    ours, theirs = conv1d_pair()
    penalties = []
    for layer in (ours, theirs):
        x = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        (grad_x,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
        grad_x.square().sum().backward()
        penalties.append((x.grad, layer.weight.grad, layer.bias.grad))
    for got, expected in zip(*penalties, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bias_view", ["strided", "expanded"])
def test_conv1d_with_a_bias_that_is_not_contiguous_equals_transformers_conv1d(bias_view, onednn_calls):
    """oneDNN's op reads the bias as contiguous: a strided bias (a parametrization's view, or one sliced
    from a larger tensor) gave other elements' values, an expanded one memory past its end. It is copied
    first: values and gradients are Conv1D's, in the product, with autograd and with the fused GELU."""
    ours, theirs = conv1d_pair()
    bias = theirs.bias.detach()
    if bias_view == "strided":
        ours.bias = torch.nn.Parameter(torch.stack([bias, torch.full_like(bias, 1e3)], 1)[:, 0])
    else:
        bias = bias[:1].expand(48)
        ours.bias, theirs.bias = torch.nn.Parameter(bias), torch.nn.Parameter(bias.contiguous())
    assert not ours.bias.is_contiguous()
    x = torch.randn(3, 40, 32, requires_grad=True)
    got, expected = ours(x), theirs(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    got.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(ours.bias.grad, theirs.bias.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, atol=1e-4, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)
        gelu = ops_hfgpt.gelu_tanh
        torch.testing.assert_close(conv1d_activated(ours, x, gelu), gelu(expected), atol=1e-5, rtol=1e-5)
    assert len(onednn_calls) == 5  # all on oneDNN: forward, the two of backward, without autograd, fused


def test_onednn_runs_every_float32_product_of_a_forward_backward_and_decoding(onednn_calls):
    torch.manual_seed(0)
    model = GPTForCausalLM(GPTConfig(**TINY))
    ids = torch.randint(0, 96, (2, 10))
    with torch.no_grad():
        model(ids)
    # c_attn, attn.c_proj, c_fc, mlp.c_proj in each of the two blocks, then the head: 20 rows each.
    block = [(20, 32), (20, 32), (20, 32), (20, 128)]
    assert onednn_calls == block * 2 + [(20, 32)]
    onednn_calls.clear()
    model(ids, labels=ids).loss.backward()
    # Forward as above; backward: each input gradient, and the weight gradients wider than tall
    # (`weight_gradient`): c_attn's 32 x 96 and c_fc's 32 x 128, not the two c_proj's or the head's.
    assert onednn_calls[:9] == block * 2 + [(20, 32)]
    assert len(onednn_calls) == 9 + 9 + 2 * 2
    onednn_calls.clear()
    model.eval()
    prompts = torch.randint(0, 96, (4, 5))
    with torch.no_grad():
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=3, do_sample=False)
    # The prompt's 20 rows (its head: the last position of each row), then two decoding steps of 4 rows,
    # the head included (oneDNN from 4 rows on).
    assert [shape[0] for shape in onednn_calls] == [20] * 8 + [4] + [4] * 18


@pytest.mark.parametrize(("width", "onednn"), [(24, True), (8, False), (16, False)])
def test_weight_gradient_is_the_transposed_product_on_onednn_only_for_a_wide_result(
    width, onednn, onednn_calls
):
    """`inputs.T @ grads`, [16, width], into `out` when given: oneDNN where the result is wider than
    tall, MKL's sgemm otherwise."""
    generator = torch.Generator().manual_seed(0)
    inputs, grads = torch.randn(40, 16, generator=generator), torch.randn(40, width, generator=generator)
    expected = (inputs.double().T @ grads.double()).float()
    torch.testing.assert_close(ops_hfgpt.weight_gradient(inputs, grads), expected)
    out = torch.full((3, 16, width), float("nan"))
    assert ops_hfgpt.weight_gradient(inputs, grads, out=out[1]).data_ptr() == out[1].data_ptr()
    torch.testing.assert_close(out[1], expected)
    assert out[0].isnan().all() and out[2].isnan().all()
    # No rows: the zero sum, not oneDNN's refusal of an empty product
    assert torch.equal(ops_hfgpt.weight_gradient(inputs[:0], grads[:0]), torch.zeros(16, width))
    assert len(onednn_calls) == (2 if onednn else 0)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # mkldnn.flags' own warning
def test_one_row_autocast_and_turning_it_off_keep_the_plain_products(onednn_calls):
    ours, theirs = conv1d_pair()
    with torch.no_grad():
        # One row: MKL's one-row kernel (its partial sums split between the threads), not oneDNN.
        one = torch.randn(1, 1, 32)
        torch.testing.assert_close(ours(one), theirs(one), rtol=1e-6, atol=1e-6)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours(torch.randn(5, 32))
        ours.double()(torch.randn(5, 32, dtype=torch.float64))
        ours.float()
        with torch.backends.mkldnn.flags(enabled=False):  # the user's switch for torch's own oneDNN use
            ours(torch.randn(5, 32))
        assert onednn_calls == []
        ours(torch.randn(5, 32))
        assert onednn_calls == [(5, 32)]
        onednn_calls.clear()
        use_onednn_products(False)
        x = torch.randn(5, 32)
        assert torch.equal(ours.float()(x), theirs(x))  # exactly addmm
        assert onednn_calls == []
        assert not onednn_products_apply(x, ours.weight)


@pytest.mark.parametrize("intel", [True, False])
@pytest.mark.parametrize("avx512", [True, False])
def test_the_default_setting_runs_onednn_at_every_size_only_where_torch_runs_avx512(
    avx512, intel, monkeypatch
):
    """`use_onednn_products(None)` (the default): oneDNN for products of two or more rows where torch's
    kernels run AVX-512 (`avx512_cpu`); where they stop at AVX2, only up to `FEW_ROWS` rows (a decoding
    step) and the LM head's product (`head=True`) on AMD's CPUs, and nowhere on Intel's
    (`mkl_decodes_fast`), MKL otherwise. True runs oneDNN at every size whatever the CPU, False nowhere."""
    if ops_hfgpt._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setattr(ops_hfgpt, "avx512_cpu", lambda: avx512)
    monkeypatch.setattr(ops_hfgpt, "mkl_decodes_fast", lambda: intel)
    weight = torch.randn(32, 8)
    few, many = ops_hfgpt.FEW_ROWS, ops_hfgpt.FEW_ROWS + 1
    with ops_hfgpt.onednn_products(None) as may_run:
        assert may_run and ops_hfgpt._cpu_products["onednn"] is None
        assert not onednn_products_apply(torch.randn(1, 32), weight)  # one row: MKL's one-row kernel
        assert onednn_products_apply(torch.randn(2, 32), weight) == (avx512 or not intel)
        # rows across batch and time
        assert onednn_products_apply(torch.randn(2, few // 2, 32), weight) == (avx512 or not intel)
        assert onednn_products_apply(torch.randn(many, 32), weight) == avx512
        assert onednn_products_apply(torch.randn(4, 128, 32), weight) == avx512
        assert onednn_products_apply(torch.randn(4, 128, 32), weight, head=True) == (avx512 or not intel)
        assert not onednn_products_apply(torch.randn(1, 32), weight, head=True)
    with ops_hfgpt.onednn_products(True):
        assert onednn_products_apply(torch.randn(4, 128, 32), weight)
    with ops_hfgpt.onednn_products(False) as may_run:
        assert not may_run and not onednn_products_apply(torch.randn(2, 32), weight)
        assert not onednn_products_apply(torch.randn(4, 128, 32), weight, head=True)


@pytest.mark.parametrize("intel", [True, False])
def test_the_default_setting_without_avx512_keeps_onednn_for_decoding_steps_and_the_head(
    intel, onednn_recorded, monkeypatch
):
    """Where torch's kernels stop at AVX2, a kernelized model's prefill and training products run on MKL
    (as the plain model's do), and its batched decoding steps and its LM head's forward product (where
    no loss computes the head itself) on oneDNN on AMD's CPUs, on MKL too on Intel's (`mkl_decodes_fast`),
    with the same logits."""
    monkeypatch.setattr(ops_hfgpt, "avx512_cpu", lambda: False)
    monkeypatch.setattr(ops_hfgpt, "mkl_decodes_fast", lambda: intel)
    torch.manual_seed(0)
    model = GPTForCausalLM(GPTConfig(**TINY))
    peer = to_transformers(model).eval()
    ids = torch.randint(0, 96, (2, 10))
    assert ops_hfgpt._cpu_products["onednn"] is None  # the default setting
    model(ids, labels=ids).loss.backward()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, peer(ids).logits, atol=1e-5, rtol=1e-5)
    # The training step's products on MKL (its loss reads the head's weight itself); the forward's too,
    # but for its head's (20 rows) on AMD's CPUs
    assert [shape[0] for shape in onednn_recorded] == ([] if intel else [20])
    onednn_recorded.clear()
    prompts = torch.randint(0, 96, (4, 5))
    with torch.no_grad():
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=3, do_sample=False)
    # The prompt's 20 rows on MKL, its head (the last position of each row: 4 rows) and two decoding
    # steps of 4 rows on oneDNN (AMD), or nothing on oneDNN (Intel).
    assert [shape[0] for shape in onednn_recorded] == ([] if intel else [4] + [4] * 18)


def test_use_onednn_products_stays_off_without_onednn(monkeypatch):
    before = ops_hfgpt._cpu_products["onednn"]
    monkeypatch.setattr(ops_hfgpt, "_ONEDNN_LINEAR", None)
    with ops_hfgpt.onednn_products(True) as runs_onednn:
        assert runs_onednn is False
        assert not onednn_products_apply(torch.randn(4, 8), torch.randn(8, 3))
    # Restored as it was, though oneDNN is still patched away here: a leak would switch oneDNN off for
    # every later test in the process (it did, until session 8).
    assert ops_hfgpt._cpu_products["onednn"] == before


@pytest.mark.parametrize("layer_norm_position", ["pre", "post"])
def test_models_match_transformers_in_inference(layer_norm_position, cpu_products):
    """Prefill and decoding logits; the training gradients are compared in test_performance.py
    (`test_tied_head_and_embedding_gradients_meet_in_place_and_equal_transformers`, both backends)."""
    torch.manual_seed(0)
    ours = GPTForCausalLM(GPTConfig(**TINY, layer_norm_position=layer_norm_position)).eval()
    peer = to_transformers(ours).eval()
    ids = torch.randint(0, 96, (5, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, peer(ids).logits, atol=1e-5, rtol=1e-5)
        step = ours(ids[:, :16], use_cache=True)
        last = ours(ids[:, 16:], past_key_values=step.past_key_values).logits
        torch.testing.assert_close(last, peer(ids).logits[:, 16:], atol=1e-5, rtol=1e-5)


def test_lm_head_second_derivatives_equal_the_linear_heads(cpu_products):
    """`project_to_vocab` with gradients (no labels), differentiated twice like `F.linear`."""
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 500, bias=False)
    results = []
    for fn in (ops_hfgpt.project_to_vocab, lambda h, head: head(h)):
        head.weight.grad = None
        hidden = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        (grad,) = torch.autograd.grad(fn(hidden, head).square().sum(), hidden, create_graph=True)
        grad.square().sum().backward()
        results.append((hidden.grad, head.weight.grad))
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize(
    ("activation_function", "post_op"), [("gelu_new", ("gelu", "tanh")), ("relu", ("relu", ""))]
)
def test_the_mlp_activation_runs_inside_the_onednn_product_without_autograd_or_hooks(
    activation_function, post_op, monkeypatch
):
    """c_fc's product applies the activation (a oneDNN post-op) in inference; with autograd, or with a hook on
    c_fc that must see its plain output, the activation runs separately. The logits agree either way."""
    if ops_hfgpt._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN")
    post_ops, op = [], ops_hfgpt._ONEDNN_LINEAR
    monkeypatch.setattr(
        ops_hfgpt,
        "_ONEDNN_LINEAR",
        lambda x, w, b, attr, scalars, algo: (
            post_ops.append((attr, algo)) or op(x, w, b, attr, scalars, algo)
        ),
    )
    torch.manual_seed(0)
    model = GPTForCausalLM(GPTConfig(**TINY, activation_function=activation_function)).eval()
    ids = torch.randint(0, 96, (2, 10))
    with ops_hfgpt.onednn_products(True):
        expected = model(ids).logits  # autograd on: no fused activation
        assert post_ops.count(post_op) == 0 and len(post_ops) == 9
        post_ops.clear()
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected.detach(), atol=1e-5, rtol=1e-5)
            assert post_ops.count(post_op) == 2  # c_fc of each block
            post_ops.clear()
            model.transformer.h[1].mlp.c_fc.register_forward_pre_hook(lambda module, args: None)
            torch.testing.assert_close(model(ids).logits, expected.detach(), atol=1e-5, rtol=1e-5)
            assert post_ops.count(post_op) == 1  # block 0 only
