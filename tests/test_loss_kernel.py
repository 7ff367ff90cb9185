"""hfgpt's LM-loss kernel (modeling/csrc/loss.c): the training head's log-sum-exp a vocabulary block at a
time (`blockwise_logits_and_lse`) and softmax - onehot a slice at a time (`_LinearCrossEntropy.backward`),
against torch's expressions of the same arithmetic and `torch.logsumexp`, and where it steps aside."""

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import (  # tests/ is on sys.path
    NARROW_TARGETS,
    assert_step_equals_torchs,
    fresh_kernel_cache,  # noqa: F401 (autouse: each test loads the kernels afresh)
    narrow_build,
    record_kernel_calls,
    using_library,
)
from kernel_testing import without_kernel as without
from test_attention_kernel import needs_kernel
from test_performance import OpRecorder, seeded_step

from hfgpt.cpu import kernels, native
from hfgpt.cpu import ops as ops_hfgpt
from hfgpt.cpu.ops import _LinearCrossEntropy, blockwise_logits_and_lse, onednn_products
from hfgpt.modeling import GPTConfig, GPTForCausalLM

pytestmark = needs_kernel  # the same C compiler as the attention kernel


@pytest.fixture(autouse=True)
def _onednn():
    with onednn_products(True) as on:
        if not on:
            pytest.skip("this torch build has no oneDNN (its x86-64 wheels do)")
        yield


@pytest.fixture
def kernel_calls(monkeypatch) -> list[str]:
    """The names of the kernel's entry points as they are called (and still run)."""
    return record_kernel_calls(monkeypatch, "loss")


def without_kernel(monkeypatch) -> None:
    without(monkeypatch, "loss")


def lse_by_blocks(x: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.ops.hfgpt.lse_block` over `x` a block of `columns` at a time, as `blockwise_logits_and_lse`
    calls it: (the copy it writes, the log-sum-exp)."""
    rows, width = x.shape
    out, peak = torch.full_like(x, 7.0), torch.full((rows,), float("-inf"))
    total = torch.zeros(rows, dtype=torch.float64)
    for start in range(0, width, columns):
        part = x[:, start : start + columns].contiguous()
        kernels.lse_block(part, out[:, start : start + part.shape[1]], peak, total)
    return out, (total.log() + peak.masked_fill(~peak.isfinite(), 0.0)).float()


def special_rows(width: int) -> torch.Tensor:
    """Rows that torch.logsumexp gives -inf, +inf, NaN and finite values for, across several blocks: all
    -inf; one +inf; one NaN in a late block; every logit near -1000 (the first block's factor exp(0 + 1000)
    overflows, in double too); -inf in the first blocks only; -inf after the first blocks; ordinary values, and large
    ones (1e4) where float32 exp overflows without the shift."""
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(0)) * 3
    x[0] = float("-inf")
    x[1, 7] = float("inf")
    x[2, width - 5] = float("nan")
    x[3] = x[3] - 1000.0
    x[4, : width // 2] = float("-inf")
    x[5, width // 3 :] = float("-inf")
    x[7] = x[7] + 1e4
    return x


@pytest.mark.parametrize("columns", [16, 100, 2048])
def test_lse_kernel_equals_torchs_logsumexp_infinities_and_nans_included(columns):
    x = special_rows(1003)
    out, lse = lse_by_blocks(x, columns)
    torch.testing.assert_close(out, x, equal_nan=True, atol=0, rtol=0)  # the blocks copied where asked
    expected = torch.logsumexp(x.double(), dim=-1).float()
    torch.testing.assert_close(lse, expected, equal_nan=True, atol=1e-6, rtol=1e-6)
    assert torch.isneginf(lse[0]) and torch.isposinf(lse[1]) and torch.isnan(lse[2])


def test_torch_blocks_keep_a_row_whose_first_finite_block_lies_below_minus_88(monkeypatch):
    """The torch expression of the running sum: a row whose logits all lie near -200 multiplied its empty
    total 0 by exp(200) = inf (NaN); it now stays 0, as in the kernel."""
    without_kernel(monkeypatch)
    monkeypatch.setattr(ops_hfgpt, "LOGIT_BLOCK_COLUMNS", 64)
    hidden = torch.full((3, 1), -1.0)
    weight = (200.0 + torch.arange(300.0) / 300.0)[:, None]
    logits, lse = blockwise_logits_and_lse(hidden, weight, torch.empty(3, 300))
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1))
    assert lse.isfinite().all()


@pytest.mark.parametrize("vocab", [300, 5000])  # one block, and three (2048 columns each)
def test_training_head_runs_the_lse_kernel_with_torchs_values(vocab, kernel_calls, monkeypatch):
    torch.manual_seed(0)
    hidden, weight = torch.randn(40, 32), torch.randn(vocab, 32)
    logits, lse = blockwise_logits_and_lse(hidden, weight, torch.empty(40, vocab))
    assert kernel_calls == ["hfgpt_lse_block"] * -(-vocab // ops_hfgpt.LOGIT_BLOCK_COLUMNS)
    without_kernel(monkeypatch)
    torch_logits, torch_lse = blockwise_logits_and_lse(hidden, weight, torch.empty(40, vocab))
    assert torch.equal(logits, torch_logits)
    torch.testing.assert_close(lse, torch_lse, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        lse, torch.logsumexp(torch_logits.double(), dim=-1).float(), atol=1e-6, rtol=1e-6
    )


def head_loss_and_grads(hidden, weight, targets, row_weights, logits_weight=0.0, dtype=torch.float32):
    """The loss and the gradients of hidden and weight, with the head's products in `dtype`."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    divisor = row_weights.sum()
    logits, loss = _LinearCrossEntropy.apply(h, w, targets, row_weights, divisor, dtype, None)
    upstream = torch.linspace(-1, 1, logits.numel()).view(logits.shape)
    (loss + logits_weight * (logits.float() * upstream).sum()).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("logits_weight", [0.0, 0.5])
@pytest.mark.parametrize("slice_elements", [4 << 20, 40 * 128])  # one vocabulary slice, or several
def test_head_backward_runs_the_softmax_kernel_with_torchs_gradients(
    logits_weight, slice_elements, kernel_calls, monkeypatch
):
    """Targets in every slice, the first and last column among them, rows of weight 0 (skipped), and a
    gradient reaching the logits from elsewhere: the kernel's gradients are torch's to float rounding."""
    monkeypatch.setattr(ops_hfgpt, "HEAD_SLICE_ELEMENTS", slice_elements)
    torch.manual_seed(0)
    vocab = 1000
    hidden, weight = torch.randn(40, 32), torch.randn(vocab, 32) * 0.3
    targets = torch.randint(0, vocab, (40,))
    targets[:3] = torch.tensor([0, vocab - 1, 128])
    row_weights = torch.ones(40)
    row_weights[5:9] = 0.0
    ours = head_loss_and_grads(hidden, weight, targets, row_weights, logits_weight)
    slices = -(-vocab // max(64, slice_elements // 40 // 64 * 64))
    assert kernel_calls.count("hfgpt_softmax_grad") == slices
    without_kernel(monkeypatch)
    theirs = head_loss_and_grads(hidden, weight, targets, row_weights, logits_weight)
    for got, expected in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    expected_loss = (F.cross_entropy(hidden @ weight.T, targets, reduction="none") * row_weights).sum() / 36
    torch.testing.assert_close(ours[0], expected_loss)


def test_loss_kernel_steps_aside_in_bfloat16_and_for_hfgpt_native_0_and_a_dispatch_mode_sees_it(
    kernel_calls, monkeypatch
):
    torch.manual_seed(0)
    hidden, weight = torch.randn(40, 32), torch.randn(300, 32)
    targets, row_weights = torch.randint(0, 300, (40,)), torch.ones(40)
    expected = head_loss_and_grads(hidden, weight, targets, row_weights)
    kernel_calls.clear()
    head_loss_and_grads(hidden, weight, targets, row_weights, dtype=torch.bfloat16)  # (as under autocast)
    assert kernel_calls == []
    with OpRecorder() as recorder:  # the kernels are torch operators: the mode sees each as one op
        got = head_loss_and_grads(hidden, weight, targets, row_weights)
    assert torch.ops.hfgpt.lse_block.default in recorder.ops
    assert torch.ops.hfgpt.softmax_grad.default in recorder.ops
    for value, want in zip(got, expected, strict=True):
        torch.testing.assert_close(value, want, atol=1e-6, rtol=1e-5)
    monkeypatch.setenv("HFGPT_NATIVE", "0")
    native.kernel.cache_clear()
    assert not ops_hfgpt.kernel_runs("loss", hidden)


def test_a_training_step_runs_the_loss_kernel_with_torchs_gradients(kernel_calls, monkeypatch):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    model = GPTForCausalLM(config).train()
    ids = torch.randint(0, 300, (2, 40))
    loss, grads = seeded_step(model, ids, seed=3)
    assert kernel_calls == ["hfgpt_lse_block", "hfgpt_softmax_grad"]
    without_kernel(monkeypatch)
    assert_step_equals_torchs(model, ids, (loss, grads), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("target", NARROW_TARGETS)
def test_a_build_for_narrower_vectors_gives_the_same_loss(target, tmp_path, monkeypatch):
    """csrc/loss.c built for narrower vectors than the host's (`NARROW_TARGETS`: AVX2's 8 lanes, the
    baseline's 4 without FMA) is the same source as the
    native build: the same copies and log-sum-exps, the special rows included, and the same softmax
    gradients to float rounding, over widths that end in a partial vector."""
    x = torch.cat([torch.randn(5, 203) * 4, special_rows(203)])
    rows = x.shape[0]
    lse = torch.logsumexp(x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), dim=1)
    scale, targets = torch.rand(rows), torch.randint(0, 203, (rows,))
    results = []
    for library in (None, narrow_build(tmp_path, "loss", target)):
        with monkeypatch.context() as patch:  # (undone before the fixture clears the real kernel's cache)
            if library is not None:
                using_library(patch, "loss", library)
            copy, got_lse = lse_by_blocks(x, 67)
            grad = torch.empty(rows, 100)
            kernels.softmax_grad(x[:, 50:150].contiguous(), lse, scale, targets, 50, grad)
            results.append((copy, got_lse, grad))
    (copy, got_lse, grad), (narrow_copy, narrow_lse, narrow_grad) = results
    assert torch.equal(narrow_copy.nan_to_num(), copy.nan_to_num())
    torch.testing.assert_close(narrow_lse, got_lse, atol=1e-6, rtol=1e-6, equal_nan=True)
    torch.testing.assert_close(narrow_grad, grad, atol=1e-6, rtol=1e-5, equal_nan=True)
