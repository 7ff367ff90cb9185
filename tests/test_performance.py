"""The CPU speed-ups in hfgpt.cpu (ops.py, and the layers kernelize swaps into a model) compute what the plain PyTorch / transformers code computes:
the LM head (`project_to_vocab`), the head with the causal-LM loss (`lm_logits_and_loss`, `log_sum_exp`),
dropout (`dropout`, `GPTDropout`, `masked_scale`), training attention with dropout
(`cpu_dropout_attention`), inference attention in bands (`cpu_banded_attention`), the in-place MLP
activation and weight casts into a `workspace` under autocast (`GPTConv1D`, `weight_blocks`)."""

import copy
import pickle
import threading
from types import MethodType

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.pytorch_utils import Conv1D

from hfgpt.cpu import kernels
from hfgpt.cpu import ops as ops_hfgpt
from hfgpt.cpu.layers import conv1d_forward
from hfgpt.cpu.ops import (
    banded_attention_applies,
    blockwise_logits_and_lse,
    cpu_banded_attention,
    cpu_dropout_attention,
    dropout,
    keep_mask,
    lm_logits_and_loss,
    log_sum_exp,
    masked_scale,
    one_row_conv1d,
    one_row_parts,
    one_row_product,
    onednn_products,
    project_to_vocab,
    weighted_lm_loss,
    workspace,
)
from hfgpt.modeling import (
    GPTConfig,
    GPTForCausalLM,
)
from hfgpt.modeling.interop import to_transformers

TINY = dict(
    vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None
)


def GPTConv1D(nf: int, nx: int) -> Conv1D:  # noqa: N802  (named as the layer it builds)
    """transformers' `Conv1D` with hfgpt's CPU forward swapped in, as `hfgpt.cpu.kernelize` does in a model."""
    layer = Conv1D(nf, nx)
    layer.forward = MethodType(conv1d_forward, layer)
    return layer


@pytest.mark.parametrize("rows", [1, 2, 8, 16, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_project_to_vocab_equals_the_linear_head(rows, bias, cpu_products):
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 500, bias=bias)
    hidden = torch.randn(rows, 1, 32, requires_grad=True)  # (batch, position, E)
    expected = head(hidden)
    got = project_to_vocab(hidden, head)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    # What the loss and users do with logits: flatten the positions.
    torch.testing.assert_close(got.view(-1, 500), expected.view(-1, 500), atol=1e-6, rtol=1e-6)
    # Gradients flow the same way, to the hidden states and to the (tied) weight.
    upstream = torch.randn_like(expected)
    grads = torch.autograd.grad((got * upstream).sum(), (hidden, head.weight))
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (hidden, head.weight))
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("torch_threads", [2, 3], indirect=True)
@pytest.mark.parametrize("out", [96, 97, 500])  # divides among the threads, or leaves rows over
def test_one_row_product_splits_the_weight_rows_between_threads(out, torch_threads, monkeypatch):
    """... and the LM head at one row takes it, but on Intel's CPUs (`mkl_decodes_fast`), where MKL's
    `flat @ weight.T` runs."""
    torch.manual_seed(0)
    weight, x = torch.randn(out, 48), torch.randn(1, 48)
    got = one_row_product(x, weight)
    assert got.shape == (1, out) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5, rtol=1e-5)
    # The LM head at one row (a decoding step at batch size 1) takes it.
    results = []
    monkeypatch.setattr(
        ops_hfgpt, "one_row_product", lambda *args: results.append(one_row_product(*args)) or results[-1]
    )
    head = torch.nn.Linear(48, out, bias=False)
    monkeypatch.setattr(ops_hfgpt, "mkl_decodes_fast", lambda: False)
    with torch.no_grad():
        head.weight.copy_(weight)
        torch.testing.assert_close(project_to_vocab(x[None], head)[0], got, atol=0, rtol=0)
    assert len(results) == 1 and torch.equal(results[0], got)
    monkeypatch.setattr(ops_hfgpt, "mkl_decodes_fast", lambda: True)
    with torch.no_grad():
        torch.testing.assert_close(project_to_vocab(x[None], head)[0], x @ weight.T, atol=0, rtol=0)
    assert len(results) == 1


@pytest.mark.parametrize("kernel", [True, False])  # csrc/row_product.c, else torch's split
@pytest.mark.parametrize("torch_threads", [2, 3], indirect=True)
@pytest.mark.parametrize("width", [48, 45])  # 45 rows do not divide between two threads: Conv1D's addmm
def test_conv1d_at_one_row_splits_its_weight_rows_between_threads(width, torch_threads, kernel, monkeypatch):
    """Without the C kernel, torch's split applies where the rows divide evenly between the threads (on
    AMD's CPUs: on Intel's, MKL's product, `mkl_decodes_fast`)."""
    monkeypatch.setattr(ops_hfgpt, "mkl_decodes_fast", lambda: False)
    if kernel and not kernels.available("row_product"):
        pytest.skip("no C compiler: the row product kernel is not built here")
    if not kernel:
        available = kernels.available
        monkeypatch.setattr(kernels, "available", lambda name: name != "row_product" and available(name))
    torch.manual_seed(0)
    out = 40
    theirs = Conv1D(out, width)
    torch.nn.init.normal_(theirs.bias)
    ours = GPTConv1D(out, width)
    ours.load_state_dict(theirs.state_dict())
    results = []
    monkeypatch.setattr(
        ops_hfgpt, "one_row_conv1d", lambda *args: results.append(one_row_conv1d(*args)) or results[-1]
    )
    x = torch.randn(1, 1, width)
    with torch.no_grad():
        got = ours(x)
        torch.testing.assert_close(got, theirs(x), atol=1e-6, rtol=1e-6)
        assert got.shape == (1, 1, out) and got.is_contiguous()
        # Without a bias too.
        unbiased = one_row_conv1d(x[0], ours.weight, None)
        if unbiased is not None:
            torch.testing.assert_close(unbiased, x[0] @ ours.weight, atol=1e-6, rtol=1e-6)
    split = kernel or width % torch_threads == 0
    assert [r is not None for r in results] == [split]
    # With gradients it is Conv1D's product, and the gradients are Conv1D's.
    results.clear()
    x.requires_grad_(True)
    (ours(x) * torch.arange(out)).sum().backward()
    (theirs(x) * torch.arange(out)).sum().backward()
    assert results == [None]
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad)


def test_one_row_split_applies_to_float32_cpu_inference_on_several_threads():
    x, weight, bias = torch.randn(1, 32), torch.randn(48, 32), torch.randn(48)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert one_row_parts(x, weight, bias) == one_row_parts(x, weight, None) == 2
        assert one_row_parts(x.bfloat16(), weight.bfloat16(), bias.bfloat16()) == 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert one_row_parts(x, weight, bias) == 0
        weight.requires_grad_(True)
        assert one_row_parts(x, weight, bias) == 0
        with torch.no_grad():
            assert one_row_parts(x, weight, bias) == 2
        with torch.no_grad():  # weights that are not contiguous (a transposed view): the plain products
            assert one_row_product(x, weight.T.contiguous().T) is None
            assert one_row_conv1d(x, weight.contiguous().T, bias) is None
            assert one_row_conv1d(x, weight.T.contiguous(), bias) is not None
        torch.set_num_threads(1)
        with torch.no_grad():
            assert one_row_parts(x, weight, bias) == 0
            assert one_row_product(x, weight) is None and one_row_conv1d(x, weight.T, bias) is None
    finally:
        torch.set_num_threads(before)


def test_project_to_vocab_pads_rows_of_many_positions_for_mkl(cpu_products):
    head = torch.nn.Linear(32, 500, bias=False)
    with torch.no_grad():
        logits = project_to_vocab(torch.randn(2, 20, 32), head)
    if cpu_products == "mkl":
        # Rows of the padded buffer start every 512 floats (a multiple of 64).
        assert logits.stride() == (20 * 512, 512, 1)
    else:
        assert logits.is_contiguous()
    # Decoding steps are contiguous either way.
    with torch.no_grad():
        assert project_to_vocab(torch.randn(8, 1, 32), head).is_contiguous()


@pytest.mark.parametrize("shape", [(1, 32), (3, 1, 32), (16, 32), (2, 20, 32)])
def test_project_to_vocab_under_bf16_autocast(shape):
    """Inside CPU autocast to bfloat16 the logits are bfloat16, as autocast's `F.linear` gives. Decoding
    steps (up to 16 rows) come from the float32 weight, rounded once (so within a bfloat16 step of the
    float32 logits, closer than autocast's bfloat16 product); more rows from autocast's product itself."""
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 500, bias=False)
    hidden = torch.randn(*shape, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = project_to_vocab(hidden, head)
        autocast_logits = head(hidden)
    assert got.dtype == torch.bfloat16 and got.shape == autocast_logits.shape
    exact = F.linear(hidden, head.weight).detach()
    if hidden.numel() // 32 <= 16:
        torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-6)
        assert (got.float() - exact).abs().max() < (autocast_logits.float() - exact).abs().max()
        (got.float() * exact).sum().backward()  # gradients reach the float32 hidden states and weight
        torch.testing.assert_close(hidden.grad, exact @ head.weight.detach(), rtol=1e-2, atol=1e-2)
        assert head.weight.grad is not None and head.weight.grad.dtype == torch.float32
    else:
        torch.testing.assert_close(got, autocast_logits)


@pytest.mark.parametrize("block_rows", [128, 4096])
def test_project_to_vocab_without_gradients_under_bf16_autocast_casts_the_head_in_blocks(
    block_rows, monkeypatch
):
    """A prefill inside CPU autocast without gradients casts the float32 head to bfloat16 a block of
    rows at a time into one reused buffer, rather than as a whole fresh copy every forward: the logits
    are still exactly autocast's `F.linear`, also across block edges (500 rows in blocks of 128)."""
    torch.manual_seed(0)
    monkeypatch.setattr(ops_hfgpt, "CAST_BLOCK_ROWS", block_rows)
    blocks, weight_blocks = [], ops_hfgpt.weight_blocks

    def recording_blocks(weight, dtype, rows):
        for start, stop, block in weight_blocks(weight, dtype, rows):
            blocks.append((stop - start, block.dtype))
            yield start, stop, block

    monkeypatch.setattr(ops_hfgpt, "weight_blocks", recording_blocks)
    head = torch.nn.Linear(32, 500, bias=False)
    hidden = torch.randn(2, 20, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = project_to_vocab(hidden, head)
        expected = head(hidden)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)
    assert blocks == [(min(block_rows, 500 - start), torch.bfloat16) for start in range(0, 500, block_rows)]


def conv1d_pair(seed: int = 0) -> tuple[GPTConv1D, Conv1D]:
    torch.manual_seed(seed)
    theirs = Conv1D(48, 32)
    torch.nn.init.normal_(theirs.bias)
    ours = GPTConv1D(48, 32)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


@pytest.mark.parametrize("shape", [(1, 1, 32), (8, 1, 32), (2, 20, 32)])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_conv1d_without_gradients_under_bf16_autocast_casts_into_the_workspace(shape, mode):
    """Inference inside CPU autocast: the weight is cast into this thread's reused workspace (not a
    fresh copy every call), with exactly the values of transformers' Conv1D in autocast."""
    ours, theirs = conv1d_pair()
    x = torch.randn(shape)
    workspace(ours.weight.shape, torch.bfloat16, x.device).zero_()
    with mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = ours(x), theirs(x)
        scratch = workspace(ours.weight.shape, torch.bfloat16, x.device)
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == expected.shape
    assert torch.equal(got, expected)
    assert torch.equal(scratch, ours.weight.to(torch.bfloat16))  # the cast that was multiplied
    # The workspace made inside inference mode is a normal tensor: usable outside it too.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(ours(x), expected)


def test_workspace_is_reused_on_a_thread_and_separate_between_threads():
    first = workspace((4, 8), torch.bfloat16, torch.device("cpu"))
    smaller = workspace((2, 3), torch.bfloat16, torch.device("cpu"))
    assert smaller.data_ptr() == first.data_ptr() and smaller.shape == (2, 3)
    assert workspace((4, 8), torch.float32, torch.device("cpu")).data_ptr() != first.data_ptr()
    other = []
    thread = threading.Thread(
        target=lambda: other.append(workspace((4, 8), torch.bfloat16, torch.device("cpu")))
    )
    thread.start()
    thread.join()
    assert other[0].data_ptr() != first.data_ptr()


@pytest.mark.parametrize("needs_grad", ["input", "weight"])
def test_conv1d_with_gradients_under_bf16_autocast_is_autocasts_conv1d(needs_grad):
    """Where autograd saves the cast weight for backward, the layer leaves the cast to autocast (a reused
    workspace would be overwritten before backward): same values and gradients as Conv1D."""
    ours, theirs = conv1d_pair()
    x = torch.randn(2, 20, 32, requires_grad=needs_grad == "input")
    if needs_grad == "input":
        for layer in (ours, theirs):
            layer.requires_grad_(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = ours(x), theirs(x)
        with torch.no_grad():
            GPTConv1D(48, 32)(x)  # overwrites the workspace, were ours using it
    assert torch.equal(got, expected)
    upstream = torch.randn(got.shape)
    wrt = (x,) if needs_grad == "input" else (ours.weight, ours.bias)
    wrt_theirs = (x,) if needs_grad == "input" else (theirs.weight, theirs.bias)
    for g, e in zip(
        torch.autograd.grad((got.float() * upstream).sum(), wrt),
        torch.autograd.grad((expected.float() * upstream).sum(), wrt_theirs),
        strict=True,
    ):
        assert torch.equal(g, e)


def head_and_loss_pair(
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    logits_weight: float = 0.0,
    autocast: torch.dtype | None = None,
    **kwargs,
):
    """Our (logits, loss, gradients) and those of F.linear + transformers' ForCausalLMLoss, for the same
    hidden states and head weight, both forwards inside CPU autocast to `autocast` where given.
    `logits_weight` also back-propagates through the returned logits."""
    torch.manual_seed(1)
    weight = torch.randn(500, hidden.shape[-1])
    results = []
    for fused in (True, False):
        h = hidden.detach().clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        head = torch.nn.Linear(h.shape[-1], 500, bias=False)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            if fused:
                head.weight = torch.nn.Parameter(w)
                logits, loss = lm_logits_and_loss(h, head, labels, vocab_size=500, **kwargs)
                w = head.weight
            else:
                logits = F.linear(h, w)
                loss = ForCausalLMLoss(logits, labels, vocab_size=500, **kwargs)
        upstream = torch.linspace(-1, 1, logits.numel()).view(logits.shape)
        (3.0 * loss + logits_weight * (logits * upstream).sum()).backward()
        results.append((logits.detach(), loss.detach(), h.grad, w.grad))
    return results


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"num_items_in_batch": torch.tensor(7)}, {"num_items_in_batch": 5}, {"ignore_index": 3}],
)
@pytest.mark.parametrize("slice_elements", [4 << 20, 27 * 128])  # one vocabulary slice, or four
@pytest.mark.parametrize("logits_weight", [0.0, 0.5])
def test_lm_logits_and_loss_equal_the_head_and_transformers_loss(
    kwargs, slice_elements, logits_weight, cpu_products, monkeypatch
):
    monkeypatch.setattr(ops_hfgpt, "HEAD_SLICE_ELEMENTS", slice_elements)
    torch.manual_seed(0)
    hidden = torch.randn(3, 9, 32) * 2
    labels = torch.randint(0, 500, (3, 9))
    labels[0, :4] = kwargs.get("ignore_index", -100)
    labels[2, 5] = 3
    ours, theirs = head_and_loss_pair(hidden, labels, logits_weight, **kwargs)
    for got, expected in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_lm_logits_and_loss_take_shift_labels():
    torch.manual_seed(0)
    shift = torch.randint(0, 500, (2, 12))
    shift[1, -3:] = -100
    ours, theirs = head_and_loss_pair(torch.randn(2, 12, 32), None, shift_labels=shift)
    for got, expected in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_lm_logits_and_loss_back_propagate_through_the_logits_alone(autocast, cpu_products):
    """With labels given, a backward through the logits alone (a distillation loss on them, the LM loss
    unused): the loss gets no gradient, and the gradients are F.linear's (it raised a TypeError)."""
    torch.manual_seed(0)
    hidden, labels = torch.randn(3, 9, 32), torch.randint(0, 500, (3, 9))
    weight = torch.randn(500, 32)
    grads = []
    for fused in (True, False):
        h, head = hidden.clone().requires_grad_(True), torch.nn.Linear(32, 500, bias=False)
        head.weight = torch.nn.Parameter(weight.clone())
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            logits = lm_logits_and_loss(h, head, labels, vocab_size=500)[0] if fused else head(h)
        upstream = torch.linspace(-1, 1, logits.numel()).view(logits.shape)
        (logits.float() * upstream).sum().backward()
        grads.append((h.grad, head.weight.grad))
    for got, expected in zip(*grads, strict=True):
        assert relative_error(got, expected) < (1e-6 if autocast is None else 1e-2)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("logits_weight", [0.0, 0.5])
def test_lm_logits_and_loss_under_bf16_autocast_run_in_bf16_like_autocast_linear(logits_weight, monkeypatch):
    """Inside CPU autocast to bfloat16 the fused head computes in bfloat16, as autocast runs F.linear,
    rather than in float32 past autocast: bfloat16 logits, the loss and float32 gradients of autocast's
    F.linear + ForCausalLMLoss, to bfloat16's precision."""
    monkeypatch.setattr(ops_hfgpt, "HEAD_SLICE_ELEMENTS", 27 * 128)  # four vocabulary slices
    torch.manual_seed(0)
    hidden = torch.randn(3, 9, 32)
    labels = torch.randint(0, 500, (3, 9))
    labels[0, :4] = -100
    ours, theirs = head_and_loss_pair(hidden, labels, logits_weight, autocast=torch.bfloat16)
    (logits, loss, grad_hidden, grad_weight), expected = ours, theirs
    assert logits.dtype == expected[0].dtype == torch.bfloat16
    assert logits.stride(-2) == 512  # from the fused path's row-aligned product, not F.linear's
    assert grad_hidden.dtype == grad_weight.dtype == torch.float32
    torch.testing.assert_close(logits.float(), expected[0].float(), atol=0.05, rtol=0.01)
    torch.testing.assert_close(loss, expected[1], atol=0.02, rtol=0.005)
    for got, want in ((grad_hidden, expected[2]), (grad_weight, expected[3])):
        assert relative_error(got, want) < 0.005
    # bfloat16 for real: float32 products would put the loss this far from autocast's only by chance.
    fp32, _ = head_and_loss_pair(hidden, labels, logits_weight)
    assert relative_error(logits, fp32[0]) > 1e-4


def test_weighted_lm_loss_under_bf16_autocast_matches_the_plain_ops(monkeypatch):
    """GPT-1's auxiliary LM loss (a weight per token) takes the same bfloat16 path under autocast."""
    monkeypatch.setattr(ops_hfgpt, "HEAD_SLICE_ELEMENTS", 27 * 128)
    torch.manual_seed(0)
    hidden, weight = torch.randn(40, 32), torch.randn(500, 32)
    targets, token_weights = torch.randint(0, 500, (40,)), torch.rand(40)
    results = []
    for fused in (True, False):
        if not fused:  # F.linear and F.cross_entropy, as on any other device
            monkeypatch.setattr(ops_hfgpt, "vocab_product_dtype", lambda *args: None)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, loss = weighted_lm_loss(h, w, targets, token_weights)
        loss.backward()
        results.append((logits, loss, h.grad, w.grad))
    (logits, loss, grad_h, grad_w), expected = results
    assert logits.dtype == expected[0].dtype == torch.bfloat16
    assert logits.stride(0) == 512  # the fused path's row-aligned product
    torch.testing.assert_close(logits.float(), expected[0].float(), atol=0.05, rtol=0.01)
    torch.testing.assert_close(loss, expected[1], atol=0.05, rtol=0.002)
    assert relative_error(grad_h, expected[2]) < 0.005 and relative_error(grad_w, expected[3]) < 0.005


def test_lm_logits_and_loss_leave_float16_autocast_to_the_plain_ops():
    torch.manual_seed(0)
    hidden, labels = torch.randn(2, 12, 32), torch.randint(0, 500, (2, 12))
    ours, theirs = head_and_loss_pair(hidden, labels, autocast=torch.float16)
    assert ours[0].dtype == torch.float16 and ours[0].is_contiguous()
    for got, expected in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, expected)


def test_bf16_autocast_training_matches_transformers_gpt2():
    """A training step's loss and gradients inside CPU autocast to bfloat16 agree with transformers'
    GPT2LMHeadModel on the same weights in the same autocast, to bfloat16's precision."""
    torch.manual_seed(0)
    ours = GPTForCausalLM(GPTConfig(**TINY, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0))
    peer = to_transformers(ours)
    ids = torch.randint(0, 96, (2, 24))
    results = []
    for model in (ours, peer):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, labels=ids)
        out.loss.backward()
        grads = {n.replace("transformer.", ""): p.grad for n, p in model.named_parameters()}
        results.append((out.logits, out.loss, grads))
    (logits, loss, grads), (peer_logits, peer_loss, peer_grads) = results
    assert logits.dtype == peer_logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), peer_logits.float(), atol=0.05, rtol=0.01)
    torch.testing.assert_close(loss, peer_loss, atol=0.01, rtol=0.002)
    assert grads.keys() == peer_grads.keys()
    for name, grad in grads.items():
        assert relative_error(grad, peer_grads[name]) < 0.02, name


@pytest.fixture
def bands_on_any_cpu(monkeypatch):
    """Attention in bands wherever it applies otherwise, as on a CPU with AVX-512 (`avx512_cpu`): its
    values are checked on any CPU."""
    monkeypatch.setattr(ops_hfgpt, "avx512_cpu", lambda: True)


@pytest.fixture
def banded_queries(monkeypatch) -> list[torch.Tensor]:
    """The query of every call to `cpu_banded_attention`, recorded (and still computed)."""
    queries = []
    original = ops_hfgpt.cpu_banded_attention
    monkeypatch.setattr(
        ops_hfgpt, "cpu_banded_attention", lambda *a, **k: queries.append(a[1]) or original(*a, **k)
    )
    return queries


def test_bf16_autocast_prefill_matches_transformers_gpt2(banded_queries, bands_on_any_cpu):
    """A left-padded prefill of 160 positions inside CPU autocast to bfloat16: attention in bands (in
    bfloat16), the few-row head from float32 weights; logits agree with transformers' GPT-2 in the same
    autocast to bfloat16's precision."""
    torch.manual_seed(0)
    ours = GPTForCausalLM(GPTConfig(**{**TINY, "n_positions": 256})).eval()
    peer = to_transformers(ours).eval()
    ids = torch.randint(0, 96, (2, 160))
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    for keep in (0, 1):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            got = ours(ids, attention_mask=mask, logits_to_keep=keep).logits
            expected = peer(ids, attention_mask=mask, logits_to_keep=keep).logits
        assert got.dtype == expected.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected.float(), atol=0.05, rtol=0.02)
    assert banded_queries and {q.dtype for q in banded_queries} == {torch.bfloat16}


def test_lm_loss_with_nothing_to_count_is_nan_like_transformers():
    ours, theirs = head_and_loss_pair(torch.randn(1, 20, 32), torch.full((1, 20), -100))
    assert ours[1].isnan() and theirs[1].isnan()


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("num_items_in_batch", [None, 0])
@pytest.mark.parametrize("layer_norm_position", ["pre", "post"])
def test_lm_loss_with_nothing_to_count_has_zero_gradients_like_transformers(
    layer_norm_position, num_items_in_batch, create_graph
):
    """Labels all `ignore_index` (Trainer then passes num_items_in_batch=0): the loss is 0 / 0 = NaN and,
    as in GPT2LMHeadModel / OpenAIGPTLMHeadModel, every gradient is zero; the fused loss's backward wrote
    NaN into every parameter's gradient until session 12."""
    torch.manual_seed(0)
    ours = GPTForCausalLM(no_drop_config(layer_norm_position))
    peer = to_transformers(ours)
    ids = torch.randint(0, 96, (2, 12))  # 24 rows: the fused loss, not the plain one of <= FEW_ROWS rows
    extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    for model in (ours, peer):
        loss = model(ids, labels=torch.full_like(ids, -100), **extra).loss
        assert loss.isnan()
        loss.backward(create_graph=create_graph)
    grads, peer_grads = parameter_grads(ours), parameter_grads(peer)
    assert grads.keys() == peer_grads.keys()
    for name, grad in grads.items():
        assert not peer_grads[name].any(), name
        assert grad is not None and not grad.any(), name


def test_lm_logits_and_loss_name_bad_labels():
    head = torch.nn.Linear(32, 50, bias=False)
    labels = torch.randint(0, 50, (1, 20))
    labels[0, 7] = 57
    with pytest.raises(ValueError, match=r"labels contain 57, neither a token id in \[0, 50\)"):
        lm_logits_and_loss(torch.randn(1, 20, 32), head, labels, vocab_size=50)
    with pytest.raises(ValueError, match="labels hold 30 positions but the logits 20"):
        lm_logits_and_loss(torch.randn(1, 20, 32), head, labels.repeat(1, 2)[:, :30], vocab_size=50)


def test_user_loss_function_is_honoured():
    model = GPTForCausalLM(GPTConfig(**TINY))
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum() * 0 + 42.0
    ids = torch.randint(0, 96, (1, 5))
    assert model(ids, labels=ids).loss.item() == 42.0


def test_keep_mask_keeps_one_minus_p_and_follows_the_seed():
    torch.manual_seed(3)
    keep = keep_mask((1000, 1000), 0.1, torch.device("cpu"))
    # Binomial(1e6, 0.9): standard deviation 300 elements, so 6 sigma is 1800.
    assert abs(int(keep.sum()) - 900_000) < 1800
    torch.manual_seed(3)
    assert torch.equal(keep, keep_mask((1000, 1000), 0.1, torch.device("cpu")))
    # An odd count draws half a word more and uses its first half.
    assert keep_mask((3, 5), 0.5, torch.device("cpu")).shape == (3, 5)
    assert not keep_mask((1000,), 0.999999, torch.device("cpu")).any()
    assert not keep_mask((1000,), 1 - 1e-12, torch.device("cpu")).any()  # round(p * 2^32) = 2^32


def test_dropout_scales_kept_values_and_gradients():
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    y = dropout(x, 0.25, training=True)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, kept / 0.75)
    assert dropout(x, 0.25, training=False) is x


def attention_inputs(batch: int = 2, heads: int = 3, length: int = 7, dim: int = 8):
    torch.manual_seed(0)
    return [torch.randn(batch, heads, length, dim, requires_grad=True) for _ in range(3)]


def masked_softmax_attention(q, k, v, keep, scaling: float, p: float) -> torch.Tensor:
    """Causal softmax attention with the kept weights scaled by 1 / (1 - p), as (B, T, H, D), in the
    inputs' dtype."""
    length = q.shape[-2]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    probs = F.softmax((q @ k.transpose(-1, -2) * scaling).masked_fill(~causal, float("-inf")), dim=-1)
    return ((probs * keep / (1 - p)) @ v).transpose(1, 2)


def assert_is_masked_softmax_attention(got, q, k, v, keep, scaling=0.3, p=0.2):
    """`got` (B, T, H, D) has the values and the q, k, v gradients of causal softmax attention with the
    kept weights scaled by 1 / (1 - p)."""
    expected = masked_softmax_attention(q, k, v, keep, scaling, p)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_cpu_dropout_attention_is_sdpa_with_the_drawn_mask():
    q, k, v = attention_inputs()
    torch.manual_seed(5)
    got, weights = cpu_dropout_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, dropout=0.2)
    assert weights is None
    torch.manual_seed(5)
    keep = keep_mask((2, 3, 7, 7), 0.2, torch.device("cpu"))
    assert_is_masked_softmax_attention(got, q, k, v, keep)


def band_keep_masks(
    seed: int, batch: int = 2, heads: int = 3, length: int = 150, p: float = 0.2
) -> torch.Tensor:
    """The keep masks that `cpu_dropout_attention` draws after `torch.manual_seed(seed)`: one per band of
    64 query rows over the keys that band sees, as one (B, H, T, T) mask."""
    torch.manual_seed(seed)
    keep = torch.zeros(batch, heads, length, length, dtype=torch.bool)
    for start in range(0, length, 64):
        stop = min(start + 64, length)
        keep[:, :, start:stop, :stop] = keep_mask((batch, heads, stop - start, stop), p, torch.device("cpu"))
    return keep


def test_cpu_dropout_attention_in_bands_is_sdpa_with_the_drawn_masks():
    """From 128 positions on, causal attention without a mask runs in bands of 64 query rows, drawing
    one keep mask per band over the keys that band sees."""
    q, k, v = attention_inputs(length=150)
    torch.manual_seed(5)
    got, _ = cpu_dropout_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, dropout=0.2)
    keep = band_keep_masks(seed=5)
    assert_is_masked_softmax_attention(got, q, k, v, keep)


def test_cpu_dropout_attention_in_bands_has_the_second_derivatives_of_the_plain_formula():
    """A backward with create_graph=True (a gradient penalty) differentiates the bands through
    autograd's ops with the same keep masks: second derivatives equal the plain formula's."""
    q, k, v = (t.detach().double().requires_grad_() for t in attention_inputs(length=150))
    torch.manual_seed(5)
    got, _ = cpu_dropout_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, dropout=0.2)
    keep = band_keep_masks(seed=5)
    causal = torch.ones(150, 150, dtype=torch.bool).tril()
    probs = F.softmax((q @ k.transpose(-1, -2) * 0.3).masked_fill(~causal, float("-inf")), dim=-1)
    expected = ((probs * keep / 0.8) @ v).transpose(1, 2)
    penalties = []
    for out in (got, expected):
        first = torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True)
        penalties.append(torch.autograd.grad(sum(g.square().sum() for g in first), (q, k, v)))
    for g, e in zip(*penalties, strict=True):
        torch.testing.assert_close(g, e, atol=1e-9, rtol=1e-9)


def test_cpu_dropout_attention_in_bands_runs_in_bfloat16():
    """Under bfloat16 autocast the projections are bfloat16: the bands' products, softmax and hand-written
    backward run in bfloat16, with float32 attention's values and gradients to bfloat16 precision."""
    q, k, v = attention_inputs(length=150)
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(5)
    got, _ = cpu_dropout_attention(torch.nn.Module(), *low, None, scaling=0.3, dropout=0.2)
    assert got.dtype == torch.bfloat16
    torch.manual_seed(5)
    expected, _ = cpu_dropout_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, dropout=0.2)
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)
    upstream = torch.randn(expected.shape)
    grads = torch.autograd.grad(got.float().mul(upstream).sum(), low)
    expected_grads = torch.autograd.grad(expected.mul(upstream).sum(), (q, k, v))
    for g, e in zip(grads, expected_grads, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), e, atol=6e-2, rtol=6e-2)


@pytest.mark.parametrize("prefix", [0, 100])
def test_cpu_dropout_attention_takes_any_boolean_mask(prefix):
    """A boolean mask over 150 positions: causal with a padded row (bands), or also attending to later
    positions within a 100-token prefix (not causal: the whole square). Without drops, as sdpa."""
    q, k, v = attention_inputs(length=150)
    mask = torch.ones(150, 150, dtype=torch.bool).tril()
    mask[:prefix, :prefix] = True
    mask = mask.expand(2, 1, 150, 150).clone()
    mask[1, :, :, :5] = False  # left padding: the first rows of batch row 1 see nothing
    mask[1, :, :5, :] = False
    got, _ = cpu_dropout_attention(torch.nn.Module(), q, k, v, mask, scaling=0.3, dropout=1e-12)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3).transpose(1, 2)
    real = torch.ones(2, 150, dtype=torch.bool)
    real[1, :5] = False  # sdpa's rows with nothing to attend to are not compared
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
    assert (got[~real] == 0).all()


@pytest.mark.parametrize("layer_norm_position", ["pre", "post"])
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("length", [20, 150])
def test_training_forward_without_drops_equals_sdpa(layer_norm_position, padded, length):
    """With a dropout probability so small that nothing is dropped, the training path (GPTDropout,
    cpu_dropout_attention with or without transformers' padding mask, over the whole square at 20
    positions and in bands at 150, lm_logits_and_loss) gives the eval-mode sdpa model's logits, loss
    and gradients."""
    tiny = 1e-12  # round(p * 2^32) = 0: no element can be dropped, the scale is 1 / (1 - 1e-12)
    config = GPTConfig(
        **{**TINY, "n_positions": 160},
        layer_norm_position=layer_norm_position,
        resid_pdrop=tiny,
        embd_pdrop=tiny,
        attn_pdrop=tiny,
    )
    torch.manual_seed(0)
    model = GPTForCausalLM(config)
    ids = torch.randint(0, 96, (2, length))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :6] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    outputs = {}
    for training in (True, False):
        model.train(training)
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        outputs[training] = (
            out.logits.detach(),
            out.loss.detach(),
            model.transformer.h[0].attn.c_attn.weight.grad,
        )
    (logits_t, loss_t, grad_t), (logits_e, loss_e, grad_e) = outputs[True], outputs[False]
    real = mask.bool()
    torch.testing.assert_close(logits_t[real], logits_e[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss_t, loss_e, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad_t, grad_e, atol=1e-5, rtol=1e-5)


class OpRecorder(TorchDispatchMode):
    """A torch dispatch mode that records each op it sees in `ops` (and runs it): what make_fx,
    FakeTensorMode or FlopCounterMode would see of a computation."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def seeded_step(model: GPTForCausalLM, ids: torch.Tensor, seed: int = 7) -> tuple[torch.Tensor, dict]:
    """The LM loss and every parameter's gradient of one forward and backward after `manual_seed(seed)`
    (so dropout draws the same masks each time)."""
    torch.manual_seed(seed)
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_checkpointing_keeps_the_gradients(model: GPTForCausalLM, ids: torch.Tensor) -> dict:
    """The gradients of `seeded_step` with gradient checkpointing on equal those without; returns the
    latter."""
    _, plain = seeded_step(model, ids)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    _, checkpointed = seeded_step(model, ids)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    return plain


def test_gradient_checkpointing_replays_the_same_dropout_masks():
    """Checkpointing recomputes each block's forward in backward: `keep_mask` draws from the default
    generator, whose state torch.utils.checkpoint restores, so the recomputed masks are the same."""
    torch.manual_seed(0)
    model = GPTForCausalLM(GPTConfig(**TINY, resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)).train()
    ids = torch.randint(0, 96, (2, 24))
    plain = assert_checkpointing_keeps_the_gradients(model, ids)
    # The masks do drop: another seed gives other gradients.
    _, other = seeded_step(model, ids, seed=8)
    key = "transformer.h.0.attn.c_attn.weight"
    assert not torch.allclose(other[key], plain[key])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_sum_exp_equals_torch_logsumexp_including_infinities(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(37, 300) * 20).to(dtype)
    logits[3] = float("-inf")  # nothing possible: -inf
    logits[5, 7] = float("inf")  # one certain token: +inf
    logits[9, :299] = float("-inf")  # one finite entry among -inf
    for rows_at_once in (1, 16, 64):
        got = log_sum_exp(logits, rows_at_once)
        assert got.dtype == torch.float32  # bfloat16 logits, float32 sums (as the loss takes them)
        torch.testing.assert_close(got, torch.logsumexp(logits.float(), dim=-1))


@pytest.mark.parametrize("block_columns", [64, 100, 300, 4096])
def test_onednn_logits_in_blocks_and_their_running_log_sum_exp_equal_one_product(block_columns, monkeypatch):
    """The training head's logits written a block of the vocabulary at a time into a given tensor, and the
    log-sum-exp summed block by block against a running maximum, equal one product and
    `torch.logsumexp`, infinities included (rows built to overflow to +inf and -inf)."""
    if ops_hfgpt._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN (its x86-64 wheels do)")
    monkeypatch.setattr(ops_hfgpt, "LOGIT_BLOCK_COLUMNS", block_columns)
    torch.manual_seed(0)
    hidden, weight = torch.randn(37, 16), torch.randn(300, 16)
    hidden[:, :2] = 0.0
    weight[:, 0] = -20.0  # row 3 below: every logit overflows to -inf
    weight[:, 1] = 0.0
    weight[7, 1] = 20.0  # row 5 below: logit 7 overflows to +inf, the others are 0
    hidden[3], hidden[5] = 0.0, 0.0
    hidden[3, 0], hidden[5, 1] = 1e38, 1e38
    out = torch.full((37, 300), float("nan"))
    logits, lse = blockwise_logits_and_lse(hidden, weight, out)
    expected = hidden @ weight.T
    assert logits is out and lse.shape == (37,) and lse.dtype == torch.float32
    assert torch.isneginf(expected[3]).all() and torch.isposinf(expected[5, 7])
    torch.testing.assert_close(logits, expected)
    torch.testing.assert_close(lse, torch.logsumexp(expected, dim=-1))
    assert torch.isneginf(lse[3]) and torch.isposinf(lse[5])


def test_training_logits_take_the_last_steps_memory_only_when_no_one_holds_them():
    """In a float32 training forward with labels, the logits go into memory the model keeps between steps
    (`HeadBuffers`): taken again once the last step's outputs are gone, never while the caller holds them."""
    torch.manual_seed(0)
    model = GPTForCausalLM(no_drop_config()).train()
    first, second = torch.randint(0, 96, (2, 20)), torch.randint(0, 96, (3, 12))
    with onednn_products(True) as on:
        if not on:
            pytest.skip("this torch build has no oneDNN (its x86-64 wheels do)")

        def kept() -> torch.Tensor:
            return model.__dict__["_head_buffers"].logits._tensor

        held = model(first, labels=first)
        held.loss.backward()
        values = held.logits.detach().clone()
        assert held.logits.data_ptr() == kept().data_ptr()
        out = model(second, labels=second)
        out.loss.backward()
        intact, moved = torch.equal(held.logits, values), out.logits.data_ptr() != held.logits.data_ptr()
        assert intact and moved  # (plain names: pytest's rewritten asserts keep what they evaluate)
        with torch.no_grad():
            torch.testing.assert_close(out.logits, model(second).logits)
            torch.testing.assert_close(values, model(first).logits)
        memory = kept().data_ptr()  # the second step's, which is kept now
        del held, out
        again = model(second[:, :10], labels=second[:, :10])  # fewer rows: the start of the same memory
        assert again.logits.data_ptr() == memory
        with torch.no_grad():
            torch.testing.assert_close(again.logits, model(second[:, :10]).logits)
        del again
        more = model(first, labels=first)  # more rows than kept: fresh memory, kept from then on
        assert more.logits.data_ptr() == kept().data_ptr() != memory
        torch.testing.assert_close(more.logits, values)


def test_masked_scale_reads_the_boolean_mask_as_zero_or_one():
    torch.manual_seed(0)
    x = torch.randn(4, 5, 6)
    keep = torch.rand(4, 5, 6) > 0.3
    got = masked_scale(x, keep, 1.25)
    assert got.dtype == x.dtype
    torch.testing.assert_close(got, torch.where(keep, x * 1.25, 0.0))
    # A strided (transposed) mask is read element by element too.
    torch.testing.assert_close(masked_scale(x.mT, keep.mT, 2.0), torch.where(keep.mT, x.mT * 2.0, 0.0))


@pytest.mark.parametrize("length", [128, 130, 200, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_banded_attention_equals_causal_sdpa(length, dtype, bands_on_any_cpu):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, length, 16).to(dtype) for _ in range(3))
    assert banded_attention_applies(q, k, None)
    got, weights = cpu_banded_attention(torch.nn.Module(), q, k, v, None, scaling=0.2)
    assert weights is None and got.shape == (2, length, 3, 16) and got.dtype == dtype
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2).transpose(1, 2)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8  # bfloat16: one rounding of the output
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("prefix", [0, 100])
def test_cpu_banded_attention_under_a_padding_mask_equals_sdpa(prefix, bands_on_any_cpu):
    """Left padding (rows that see nothing give zeros, as in sdpa) in bands; a mask looking ahead
    across bands (a 100-token bidirectional prefix) is not banded."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 200, 16) for _ in range(3))
    mask = torch.ones(200, 200, dtype=torch.bool).tril()
    mask[:prefix, :prefix] = True
    mask = mask.expand(2, 1, 200, 200).clone()
    mask[1, :, :, :70] = False
    mask[1, :, :70, :] = False
    assert banded_attention_applies(q, k, mask) == (prefix == 0)
    if prefix == 0:
        got, _ = cpu_banded_attention(torch.nn.Module(), q, k, v, mask, scaling=0.2)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2).transpose(1, 2)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_banded_attention_applies_only_to_plain_causal_inference(bands_on_any_cpu):
    q = torch.randn(1, 2, 256, 8)
    assert banded_attention_applies(q, q, None)
    assert banded_attention_applies(q, q, torch.ones(256, 256, dtype=torch.bool).tril())
    assert not banded_attention_applies(q, q, torch.ones(256, 256, dtype=torch.bool))  # looks ahead
    assert not banded_attention_applies(q, q, torch.zeros(256, 256))  # an additive float mask
    assert not banded_attention_applies(q[:, :, :1], q, None)  # a decoding step against cached keys
    assert not banded_attention_applies(q[:, :, :100], q[:, :, :100], None)  # too short to gain
    assert not banded_attention_applies(q.repeat(1, 1, 3, 1), q.repeat(1, 1, 3, 1), None)  # 768: no gain
    assert banded_attention_applies(q.bfloat16(), q.bfloat16(), None)  # a bf16 model, or autocast
    assert not banded_attention_applies(q.half(), q.half(), None)
    assert not banded_attention_applies(q.requires_grad_(), q, None)  # autograd: sdpa's backward


@pytest.mark.parametrize("avx512", [True, False])
def test_prefill_attention_runs_in_bands_only_where_torch_runs_avx512(avx512, monkeypatch, banded_queries):
    """Where torch's kernels stop at AVX2 (`avx512_cpu`), sdpa keeps prefill attention, which was measured
    faster there than the bands; the logits are the same either way."""
    monkeypatch.setattr(ops_hfgpt, "avx512_cpu", lambda: avx512)
    torch.manual_seed(0)
    model = GPTForCausalLM(GPTConfig(**{**TINY, "n_positions": 160})).eval()
    peer = to_transformers(model).eval()
    ids = torch.randint(0, 96, (2, 150))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, peer(ids).logits, atol=1e-5, rtol=1e-5)
    assert len(banded_queries) == (TINY["n_layer"] if avx512 else 0)
    assert banded_attention_applies(torch.randn(1, 2, 256, 8), torch.randn(1, 2, 256, 8), None) == avx512


@pytest.mark.parametrize("activation_function", ["gelu_new", "gelu", "relu", "silu"])
@pytest.mark.parametrize("padded", [False, True])
def test_inference_forward_with_in_place_activation_and_bands_equals_the_training_graph(
    activation_function, padded, bands_on_any_cpu
):
    """Without autograd the MLP overwrites c_fc's output with its activation and attention runs in
    bands (at 150 positions, with or without left padding); the logits are those of the same forward
    with autograd on, which takes neither shortcut."""
    config = GPTConfig(**{**TINY, "n_positions": 160}, activation_function=activation_function)
    torch.manual_seed(0)
    model = GPTForCausalLM(config).eval()
    ids = torch.randint(0, 96, (2, 150))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :30] = 0
    expected = model(ids, attention_mask=mask).logits
    assert expected.requires_grad
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected.detach()[real], atol=1e-5, rtol=1e-5)


def test_a_forward_hook_on_c_fc_keeps_its_output():
    """The in-place activation must not overwrite what a forward hook on c_fc was handed."""
    torch.manual_seed(0)
    model = GPTForCausalLM(GPTConfig(**TINY)).eval()
    mlp = model.transformer.h[0].mlp
    inputs, outputs = [], []
    mlp.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    mlp.c_fc.register_forward_hook(lambda module, args, output: outputs.append(output))
    with torch.no_grad():
        model(torch.randint(0, 96, (1, 12)))
        torch.testing.assert_close(outputs[0], mlp.c_fc(inputs[0]))
    assert outputs[0].min() < -0.2  # pre-activations: below the tanh GELU's minimum (-0.17)


def no_drop_config(layer_norm_position: str = "pre") -> GPTConfig:
    return GPTConfig(
        **TINY, layer_norm_position=layer_norm_position, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )


def parameter_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    renames = {"transformer.": "", "tokens_embed": "wte", "positions_embed": "wpe"}
    grads = {}
    for name, param in model.named_parameters():
        for old, new in renames.items():
            name = name.replace(old, new)
        grads[name] = param.grad
    return grads


@pytest.mark.parametrize("layer_norm_position", ["pre", "post"])
def test_tied_head_and_embedding_gradients_meet_in_place_and_equal_transformers(
    layer_norm_position, cpu_products, monkeypatch
):
    """A float32 training step with labels hands the LM head's weight gradient to the token embedding's
    backward (`TiedHeadGradient`), which adds its rows into it: the gradients, the tied one included, are
    transformers' GPT2LMHeadModel / OpenAIGPTLMHeadModel's on the same weights."""
    handed = []
    hand_over = ops_hfgpt.TiedHeadGradient.hand_over
    monkeypatch.setattr(
        ops_hfgpt.TiedHeadGradient,
        "hand_over",
        lambda self, grad: handed.append(grad.data_ptr()) or hand_over(self, grad),
    )
    torch.manual_seed(0)
    ours = GPTForCausalLM(no_drop_config(layer_norm_position))
    peer = to_transformers(ours)
    ids = torch.randint(0, 96, (3, 24))
    labels = ids.clone()
    labels[0, :5] = -100
    for model in (ours, peer):
        model(ids, labels=labels).loss.backward()
    # One hand-over, and the gradient stored is that very tensor: the sum was made in place.
    assert handed == [ours.transformer.wte.weight.grad.data_ptr()]
    grads, peer_grads = parameter_grads(ours), parameter_grads(peer)
    assert grads.keys() == peer_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, peer_grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_tied_gradients_of_two_forwards_in_one_backward_add_up():
    torch.manual_seed(0)
    model = GPTForCausalLM(no_drop_config())
    first, second = torch.randint(0, 96, (2, 20)), torch.randint(0, 96, (1, 30))
    (model(first, labels=first).loss + 2.0 * model(second, labels=second).loss).backward()
    together = model.transformer.wte.weight.grad
    model.zero_grad()
    # inputs_embeds: the plain embedding, whose gradient autograd sums with the head's
    for ids, factor in ((first, 1.0), (second, 2.0)):
        (factor * model(inputs_embeds=model.transformer.wte(ids), labels=ids).loss).backward()
    torch.testing.assert_close(together, model.transformer.wte.weight.grad, atol=1e-6, rtol=1e-5)


def test_tied_head_gradient_is_taken_only_in_the_backward_that_handed_it_over():
    """A gradient handed over outside the embedding's backward pass (here: before it, with no backward
    running) is not added in; one handed over within the same pass is, in place."""
    weight = torch.zeros(10, 4, requires_grad=True)
    ids = torch.tensor([[1, 3, 1]])
    tied = ops_hfgpt.TiedHeadGradient()
    stale = torch.full((10, 4), 100.0)
    tied.hand_over(stale)
    ops_hfgpt._TiedEmbedding.apply(ids, weight, tied).sum().backward()
    expected = torch.zeros(10, 4)
    expected[1], expected[3] = 2.0, 1.0
    torch.testing.assert_close(weight.grad, expected)

    class HandOver(torch.autograd.Function):  # stands in for the head: hands a gradient over in backward
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            tied.hand_over(torch.ones(10, 4))
            return grad

    weight.grad = None
    HandOver.apply(ops_hfgpt._TiedEmbedding.apply(ids, weight, tied)).sum().backward()
    torch.testing.assert_close(weight.grad, expected + 1.0)


def test_tied_head_gradient_memory_is_taken_again_only_when_nothing_holds_it():
    """The tied head's V x E gradient reuses the last step's memory (`RecycledBuffer`) once `zero_grad`
    dropped it, with the values a fresh tensor gets; a gradient someone still holds, or one kept for
    accumulation, is never written into."""
    torch.manual_seed(0)
    model = GPTForCausalLM(no_drop_config()).train()
    fresh = copy.deepcopy(model)  # computes every step in new memory: the reference values
    first, second = torch.randint(0, 96, (2, 20)), torch.randint(0, 96, (3, 12))

    def gradients(m: GPTForCausalLM, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        m.zero_grad(set_to_none=True)
        m(ids, labels=ids).loss.backward()
        return {name: p.grad.clone() for name, p in m.named_parameters()}

    def kept() -> torch.Tensor:
        return model.__dict__["_head_buffers"].gradient._tensor

    expected = {"first": gradients(fresh, first), "second": gradients(fresh, second)}
    assert gradients(model, first).keys() == expected["first"].keys()
    wte = model.transformer.wte.weight
    memory = kept().data_ptr()
    assert wte.grad.data_ptr() == memory
    for name, grad in gradients(model, second).items():  # set_to_none=True, then the same memory again
        assert torch.equal(grad, expected["second"][name]), name
    assert wte.grad.data_ptr() == kept().data_ptr() == memory

    held, values = wte.grad, wte.grad.clone()  # the caller keeps the gradient: left alone
    gradients(model, first)
    assert torch.equal(held, values) and wte.grad.data_ptr() not in (held.data_ptr(), 0)
    assert kept().data_ptr() == wte.grad.data_ptr()
    del held

    model.zero_grad(set_to_none=False)  # accumulation into the kept .grad: new memory for each addend
    for ids in (first, second):
        model(ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.grad, expected["first"][name] + expected["second"][name], atol=1e-6, rtol=1e-5, msg=name
        )

    clone = copy.deepcopy(model)  # a copy starts with nothing kept
    assert clone.__dict__["_head_buffers"].gradient._tensor is None
    assert pickle.loads(pickle.dumps(model.__dict__["_head_buffers"].gradient))._tensor is None
    model.eval()  # evaluation frees it
    assert "_head_buffers" not in model.__dict__


def tied_head_cases():
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    return {
        "causal-lm": (GPTForCausalLM, {}, {"input_ids": ids, "labels": ids}),
    }


@pytest.mark.parametrize("case", list(tied_head_cases()))
def test_every_tied_lm_loss_hands_over_and_a_hooked_embedding_is_called_as_usual(case, monkeypatch):
    """The causal LM's loss takes the tied-gradient path (the classification heads' auxiliary LM loss runs
    the fused loss without it: `hfgpt.cpu.layers.auxiliary_lm_loss`); a forward hook on the token
    embeddings (Trainer's NEFTune adds noise through one) makes it step aside, so the hook is called.
    Both give the same gradients."""
    cls, overrides, inputs = tied_head_cases()[case]
    handed = []
    hand_over = ops_hfgpt.TiedHeadGradient.hand_over
    monkeypatch.setattr(
        ops_hfgpt.TiedHeadGradient,
        "hand_over",
        lambda self, grad: handed.append(1) or hand_over(self, grad),
    )
    torch.manual_seed(0)
    no_drops = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
    model = cls(GPTConfig(**{**TINY, **overrides}, **no_drops))
    model(**inputs).loss.backward()
    assert handed == [1]
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    calls = []
    model.transformer.wte.register_forward_hook(lambda module, args, output: calls.append(output.shape))
    model(**inputs).loss.backward()
    assert handed == [1] and calls == [(2, 16, 32)]  # (sequences, positions, width)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], atol=1e-6, rtol=1e-5, msg=name)


def test_training_forward_names_token_ids_outside_the_vocabulary():
    model = GPTForCausalLM(no_drop_config()).train()
    ids = torch.tensor([[1, 2, 96]])
    with pytest.raises(ValueError, match=r"token id 96, outside the vocabulary \[0, 96\)"):
        model(ids, labels=ids)


def peer_pair(layer_norm_position: str, attn: str = "sdpa") -> tuple[GPTForCausalLM, torch.nn.Module]:
    """A dropout-free model (random layer norms and biases, so that no term vanishes) and transformers'
    GPT2LMHeadModel / OpenAIGPTLMHeadModel on its weights, both running `attn`."""
    torch.manual_seed(0)
    config = no_drop_config(layer_norm_position)
    config._attn_implementation = attn
    ours = GPTForCausalLM(config)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if "ln" in name or name.endswith("bias"):
                param.normal_(1.0 if "ln" in name and name.endswith("weight") else 0.0, 0.1)
    peer = to_transformers(ours)
    if layer_norm_position == "pre":
        peer.set_attn_implementation(attn)
    return ours, peer


@pytest.mark.parametrize("layer_norm_position", ["pre", "post"])
@pytest.mark.parametrize("inputs", ["input_ids", "inputs_embeds"])
def test_lm_loss_second_derivatives_equal_transformers(layer_norm_position, inputs, cpu_products):
    """A backward with create_graph=True through the fused LM loss (a gradient penalty; also what
    `torch.autograd.functional.hvp` / `jvp` run) recomputes the head with autograd's ops: gradients and
    second derivatives are transformers' (eager attention: its CPU sdpa kernel has no double backward).
    With input_ids the head is tied to the embeddings, whose part must be counted once. It raised
    "sub(): functions with out=... arguments don't support automatic differentiation"."""
    ours, peer = peer_pair(layer_norm_position, attn="eager")
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (ours, peer):
        wte = model.get_input_embeddings()
        if inputs == "input_ids":
            loss = model(ids, labels=ids).loss
            wrt = (wte.weight, model.transformer.h[0].attn.c_attn.weight)
        else:
            embeds = wte(ids).detach().requires_grad_(True)
            loss = model(inputs_embeds=embeds, labels=ids).loss
            wrt = (embeds, wte.weight)
        first = torch.autograd.grad(loss, wrt, create_graph=True)
        second = torch.autograd.grad(sum(g.square().sum() for g in first), wrt)
        results.append((*first, *second))
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("layer_norm_position", ["pre", "post"])
def test_torch_func_transforms_and_forward_ad_take_the_plain_ops(layer_norm_position, cpu_products):
    """torch.func's grad, vmap and jvp, and forward-mode AD, over a forward: hfgpt's autograd Functions
    (no `setup_context`, no `jvp`) and oneDNN's op (no forward derivative) step aside for torch's ops, and
    the values are transformers' (each raised in hfgpt before). Eager attention for jvp: transformers'
    CPU sdpa kernel has no forward derivative."""
    ours, peer = peer_pair(layer_norm_position, attn="eager")
    ours.eval(), peer.eval()
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    tangent = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(2))

    def transformed(model):
        embeds = model.get_input_embeddings()(ids).detach()
        loss_grad = torch.func.grad(lambda e: model(inputs_embeds=e, labels=ids).loss)(embeds)
        logits = torch.func.vmap(lambda e: model(inputs_embeds=e[None]).logits[0])(embeds)
        _, logits_jvp = torch.func.jvp(lambda e: model(inputs_embeds=e).logits, (embeds,), (tangent,))
        with torch.autograd.forward_ad.dual_level(), torch.no_grad():
            dual = torch.autograd.forward_ad.make_dual(embeds, tangent)
            loss = model(inputs_embeds=dual, labels=ids).loss
            loss_jvp = torch.autograd.forward_ad.unpack_dual(loss).tangent
        return loss_grad, logits, logits_jvp, loss_jvp

    for got, expected in zip(transformed(ours), transformed(peer), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert not ops_hfgpt._transformed()  # outside them, the fast paths are back
    assert ops_hfgpt.vocab_product_dtype(tangent, tangent) == torch.float32


def record_backward_hooks(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The output gradients the backward hooks on lm_head and the token embeddings see, recorded."""
    calls = []
    model.lm_head.register_full_backward_hook(lambda m, gi, go: calls.append(("head", go[0].clone())))
    model.lm_head.register_full_backward_pre_hook(lambda m, go: calls.append(("head-pre", go[0].clone())))
    model.get_input_embeddings().register_full_backward_hook(
        lambda m, gi, go: calls.append(("wte", go[0].clone()))
    )
    return calls


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the embeddings' inputs are token ids
@pytest.mark.parametrize("layer_norm_position", ["pre", "post"])
def test_backward_hooks_on_the_lm_head_and_embeddings_run_as_in_transformers(layer_norm_position):
    """A full backward hook (or backward pre-hook) on lm_head or the token embeddings runs, with the
    gradients transformers' gives it, in every path that computes the head or the embeddings without
    calling the module (the fused loss with the tied gradient, the head alone): those step aside."""
    ours, peer = peer_pair(layer_norm_position)
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    seen = []
    for model in (ours, peer):
        seen.append(record_backward_hooks(model))
        model(ids, labels=ids).loss.backward()
        model(ids).logits.square().mean().backward()
    assert [name for name, _ in seen[0]] == [name for name, _ in seen[1]]
    assert [name for name, _ in seen[0]] == ["head-pre", "head", "wte"] * 2
    for (_, got), (_, expected) in zip(*seen, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
