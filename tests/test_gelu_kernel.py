"""hfgpt's tanh GELU kernel (cpu/csrc/gelu.c, `torch.ops.hfgpt.gelu_tanh`) against the float64 GELU
and torch's own, where the model runs it, and where it steps aside."""

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
from test_attention_kernel import needs_kernel
from test_performance import OpRecorder, seeded_step

from hfgpt.cpu import kernels, native
from hfgpt.cpu import ops as ops_hfgpt
from hfgpt.cpu.ops import gelu_tanh
from hfgpt.modeling import GPTConfig, GPTForCausalLM

pytestmark = needs_kernel  # the same C compiler as the attention kernel


@pytest.fixture
def kernel_calls(monkeypatch) -> list[str]:
    """The names of the GELU kernel's entry points as they are called (and still run)."""
    return record_kernel_calls(monkeypatch, "gelu")


def inputs(n: int, seed: int = 0) -> torch.Tensor:
    """Normal values x 3, then -20 to 20 evenly: past both tails of the tanh."""
    normal = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    return torch.cat([normal, torch.linspace(-20, 20, n)])


def float64_gelu_and_slope(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.double().requires_grad_()
    y = F.gelu(x, approximate="tanh")
    (slope,) = torch.autograd.grad(y.sum(), x)
    return y.detach(), slope


def max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got.double() - expected).abs().max().item()


@pytest.mark.parametrize("n", [1, 15, 17, 40_000])  # a partial vector, and split between the threads
def test_gelu_and_its_gradient_are_the_float64_gelus_to_float_rounding(n, kernel_calls):
    x = inputs(n).requires_grad_()
    y = gelu_tanh(x)
    (slope,) = torch.autograd.grad(y.sum(), x)
    assert kernel_calls == ["hfgpt_gelu_forward", "hfgpt_gelu_backward"]
    expected, expected_slope = float64_gelu_and_slope(x)
    theirs = F.gelu(x.detach(), approximate="tanh")
    (their_slope,) = torch.autograd.grad(F.gelu(x, approximate="tanh").sum(), x)
    # Within 1.5x of float32 torch's own largest error, or of one rounding of the largest value (20).
    assert max_error(y, expected) <= max(1.5 * max_error(theirs, expected), 20 * 2**-24)
    assert max_error(slope, expected_slope) <= max(1.5 * max_error(their_slope, expected_slope), 2**-23)


def test_gelu_kernel_takes_a_zero_dimensional_tensor(kernel_calls):
    x = torch.tensor(1.5, requires_grad=True)
    y = gelu_tanh(x)
    y.backward()
    assert kernel_calls == ["hfgpt_gelu_forward", "hfgpt_gelu_backward"] and y.shape == ()
    expected, slope = float64_gelu_and_slope(x.detach())
    torch.testing.assert_close(y.double(), expected)
    torch.testing.assert_close(x.grad.double(), slope)


def test_gelu_kernel_keeps_nans_and_infinities_as_torch_and_the_tails_finite(kernel_calls):
    """NaN and the infinities give torch's values and slopes (NaN slopes); large finite inputs give the
    GELU's own values and slopes (1 and 0, where torch's float32 slope formula overflows to NaN)."""
    inf = float("inf")
    x = torch.tensor([float("nan"), inf, -inf, -1e30, -100.0, -9.5, 100.0, 1e30], requires_grad=True)
    y = gelu_tanh(x)
    (slope,) = torch.autograd.grad(y.sum(), x)
    assert kernel_calls == ["hfgpt_gelu_forward", "hfgpt_gelu_backward"]
    theirs = F.gelu(x, approximate="tanh")
    (their_slope,) = torch.autograd.grad(theirs.sum(), x)
    torch.testing.assert_close(y[:3], theirs[:3], equal_nan=True, atol=0, rtol=0)  # NaN, inf, NaN
    assert slope[:3].isnan().all() and their_slope[:3].isnan().all()
    torch.testing.assert_close(y[3:], torch.tensor([-0.0, -0.0, -0.0, 100.0, 1e30]), atol=1e-30, rtol=0)
    torch.testing.assert_close(slope[3:], torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0]), atol=1e-30, rtol=0)


def test_gelu_kernel_has_torchs_second_derivatives(kernel_calls):
    """A backward with create_graph=True (a gradient penalty) differentiates torch's `gelu_backward`."""
    x = inputs(500).requires_grad_()
    penalties = []
    for gelu in (gelu_tanh, lambda t: F.gelu(t, approximate="tanh")):
        (slope,) = torch.autograd.grad(gelu(x).pow(2).sum(), x, create_graph=True)
        penalties.append(torch.autograd.grad(slope.square().sum(), x)[0])
    torch.testing.assert_close(penalties[0], penalties[1], atol=1e-4, rtol=1e-5)
    # The first backward through torch's ops; the second (no graph) on the kernel.
    assert kernel_calls == ["hfgpt_gelu_forward", "hfgpt_gelu_backward"]


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x.double(),
        lambda x: x.bfloat16(),
        lambda x: x.view(40, 50).t(),  # not contiguous
    ],
    ids=["float64", "bfloat16", "strided"],
)
def test_gelu_kernel_steps_aside_for_other_dtypes_and_strides(make, kernel_calls):
    x = make(torch.randn(2000))
    torch.testing.assert_close(gelu_tanh(x), F.gelu(x, approximate="tanh"), atol=0, rtol=0)
    assert kernel_calls == []


def test_a_dispatch_mode_sees_the_gelu_kernel_and_hfgpt_native_0_leaves_it(monkeypatch):
    """The kernel is a torch operator: a dispatch mode (make_fx, FlopCounterMode) records it as one op."""
    x = torch.randn(3000)
    with OpRecorder() as recorder:
        gelu_tanh(x)
    assert recorder.ops == [torch.ops.hfgpt.gelu_tanh.default]
    monkeypatch.setenv("HFGPT_NATIVE", "0")
    native.kernel.cache_clear()
    assert not kernels.available("gelu")
    torch.testing.assert_close(gelu_tanh(x), F.gelu(x, approximate="tanh"), atol=0, rtol=0)


def test_gelu_kernel_steps_aside_for_tensor_subclasses_that_dispatch_in_python(kernel_calls):
    """A `__torch_dispatch__` subclass (TwoTensor here; DTensor and FakeTensor alike) holds no values at
    its own data pointer, which the kernel would read: torch's GELU runs on each of its tensors."""
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.randn(3000), torch.randn(3000)
    y = gelu_tanh(TwoTensor(a, b))
    assert isinstance(y, TwoTensor) and kernel_calls == []
    torch.testing.assert_close(y.a, F.gelu(a, approximate="tanh"), atol=0, rtol=0)
    torch.testing.assert_close(y.b, F.gelu(b, approximate="tanh"), atol=0, rtol=0)


def test_a_dispatch_mode_entered_after_the_forward_sees_the_kernels_backward(kernel_calls):
    x = torch.randn(3000, requires_grad=True)
    y = gelu_tanh(x)
    upstream = torch.randn(3000)
    with OpRecorder() as recorder:
        (grad,) = torch.autograd.grad(y, x, upstream)
    assert torch.ops.hfgpt.gelu_tanh_backward.default in recorder.ops
    assert kernel_calls == ["hfgpt_gelu_forward", "hfgpt_gelu_backward"]
    want = torch.ops.aten.gelu_backward(upstream, x.detach(), approximate="tanh")
    torch.testing.assert_close(grad, want, atol=2e-6, rtol=1e-5)  # (each within ~1e-6 of the float64 slope)


def test_a_training_step_runs_the_gelu_kernel_with_torchs_gradients(kernel_calls, monkeypatch):
    """Each MLP of a GPT-2-shaped model runs the kernel forward and backward; the gradients equal those
    of the same step on torch's GELU (the same dropout masks) to float rounding."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=96, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    model = GPTForCausalLM(config).train()
    ids = torch.randint(0, 96, (2, 40))
    loss, grads = seeded_step(model, ids, seed=3)
    assert sorted(kernel_calls) == ["hfgpt_gelu_backward"] * 2 + ["hfgpt_gelu_forward"] * 2
    monkeypatch.setattr(ops_hfgpt, "_native_gelu_applies", lambda x: False)
    assert_step_equals_torchs(model, ids, (loss, grads), atol=1e-5, rtol=1e-4)
    assert len(kernel_calls) == 4


@pytest.mark.parametrize("target", NARROW_TARGETS)
def test_a_build_for_narrower_vectors_gives_the_same_gelu(target, tmp_path, monkeypatch):
    """csrc/gelu.c built for narrower vectors than the host's (`NARROW_TARGETS`: AVX2's 8 lanes, the
    baseline's 4 without FMA) is the same source as the
    native build: its forward and gradient equal the native ones to float rounding, NaN and infinities
    included, at lengths that end in a partial vector."""
    x = torch.cat([inputs(1003), torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30])])
    x.requires_grad_()
    results = []
    for library in (None, narrow_build(tmp_path, "gelu", target)):
        with monkeypatch.context() as patch:  # (undone before the fixture clears the real kernel's cache)
            if library is not None:
                using_library(patch, "gelu", library)
            y = kernels.gelu_tanh(x)
            (slope,) = torch.autograd.grad(y.sum(), x)
            results.append((y.detach(), slope))
    (y, slope), (narrow_y, narrow_slope) = results
    torch.testing.assert_close(narrow_y, y, atol=1e-6, rtol=1e-6, equal_nan=True)
    torch.testing.assert_close(narrow_slope, slope, atol=1e-6, rtol=1e-6, equal_nan=True)


def test_inference_mlps_overwrite_c_fcs_output_with_the_kernels_gelu(kernel_calls, monkeypatch):
    """Without autograd each MLP runs the kernel once, over c_fc's output (`ops.gelu_tanh_`), with the
    values of the kernel's out-of-place GELU (products on MKL: on oneDNN the GELU runs inside c_fc's)."""
    torch.manual_seed(0)
    model = GPTForCausalLM(GPTConfig(vocab_size=96, n_positions=64, n_embd=64, n_layer=2, n_head=2)).eval()
    ids = torch.randint(0, 96, (2, 40))
    overwritten = []
    real = kernels.gelu_tanh_
    monkeypatch.setattr(kernels, "gelu_tanh_", lambda x: overwritten.append(x.data_ptr()) or real(x))
    with torch.no_grad(), ops_hfgpt.onednn_products(False):
        got = model(ids).logits
        assert kernel_calls == ["hfgpt_gelu_forward"] * 2 and len(overwritten) == 2
        monkeypatch.setitem(ops_hfgpt.IN_PLACE, ops_hfgpt.gelu_tanh, None)  # `act(c_fc(x))`: a fresh output
        torch.testing.assert_close(model(ids).logits, got, atol=0, rtol=0)
    assert kernel_calls == ["hfgpt_gelu_forward"] * 4 and len(overwritten) == 2


def test_the_in_place_gelu_returns_its_input_overwritten_and_refuses_what_it_cannot_write():
    x = inputs(1003)
    expected = kernels.gelu_tanh(x)
    assert ops_hfgpt.gelu_tanh_(x) is x
    torch.testing.assert_close(x, expected, atol=0, rtol=0)
    strided = inputs(64).view(2, 64)[:, ::2]
    want = F.gelu(strided, approximate="tanh")
    assert ops_hfgpt.gelu_tanh_(strided) is strided  # (torch's in-place GELU: the kernel steps aside)
    torch.testing.assert_close(strided, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="hfgpt::gelu_tanh_: x must be contiguous"):
        torch.ops.hfgpt.gelu_tanh_(inputs(64).view(2, 64)[:, ::2])
    with pytest.raises(ValueError, match="hfgpt::gelu_tanh_: x must be a torch.float32 CPU tensor"):
        torch.ops.hfgpt.gelu_tanh_(inputs(8).double())
