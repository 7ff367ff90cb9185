"""hfgpt's C kernels as torch operators (`hfgpt.cpu.kernels`): each passes `torch.library.opcheck` (its
schema, its fake implementation against the real one, its autograd registration, and a trace through
AOTAutograd), runs under FakeTensorMode without touching C, and names the argument it refuses."""

import pytest
import torch
from kernel_testing import fresh_kernel_cache  # noqa: F401 (autouse: each test loads the kernels afresh)
from test_attention_kernel import needs_kernel  # tests/ is on sys.path
from torch.fx.experimental.proxy_tensor import make_fx

from hfgpt.cpu import kernels
from hfgpt.cpu.quantization import Int8Linear

needs_int8 = pytest.mark.skipif(not kernels.available("int8_linear"), reason="no C compiler here")
needs_dropout = pytest.mark.skipif(not kernels.available("dropout"), reason="no C compiler here")
needs_fused_int8 = pytest.mark.skipif(not kernels.int8_fused_available(), reason="no C compiler here")


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def int8_layer(out: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layer = Int8Linear.from_float(randn(out, width, seed=seed) * 0.1, randn(out, seed=seed + 1))
    return layer.packed, layer.scale, layer.bias


def heads(batch: int, heads: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    return [randn(batch, heads, length, 64, seed=seed + i) for i in range(3)]


def bands(batch_heads: int, length: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keep masks and probability buffers for the training attention's bands of 64 query rows."""
    keeps, probs = [], []
    for start in range(0, length, kernels.ATTENTION_BAND):
        stop = min(start + kernels.ATTENTION_BAND, length)
        shape = (batch_heads, stop - start, stop)
        keeps.append(torch.rand(shape, generator=torch.Generator().manual_seed(seed + start)) > 0.1)
        probs.append(torch.empty(shape))
    return keeps, probs


@needs_dropout
def test_keep_mask_passes_opcheck():
    torch.library.opcheck(kernels.keep_mask, ([3, 5], torch.tensor(12345), 2**31))
    torch.library.opcheck(kernels.keep_mask, ([0], torch.tensor(-1), 0))


@needs_int8
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_passes_opcheck(rows, bias):
    packed, scale, b = int8_layer(40, 72)
    torch.library.opcheck(kernels.int8_linear, (randn(rows, 72), packed, scale, b if bias else None))
    torch.library.opcheck(kernels.int8_linear, (randn(2, rows, 72), packed, scale, b if bias else None))


@needs_int8
def test_fake_tensors_get_shapes_without_running_c(monkeypatch):
    """Under FakeTensorMode (as torch.compile and memory estimators trace) the operators give outputs of the
    right shape and dtype, and the C code is never called."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(kernels, "_library", lambda name: pytest.fail(f"C kernel {name} called"))
    packed, scale, bias = int8_layer(40, 72)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    seed = mode.from_tensor(torch.tensor(3))
    with mode:
        y = kernels.int8_linear(torch.empty(2, 5, 72), packed, scale, bias)
        keep = kernels.keep_mask([4, 7], seed, 2**31)
    assert y.shape == (2, 5, 40) and y.dtype == torch.float32
    assert keep.shape == (4, 7) and keep.dtype == torch.bool


@needs_int8
def test_make_fx_records_the_operator():
    packed, scale, bias = int8_layer(40, 72)
    graph = make_fx(lambda x: kernels.int8_linear(x, packed, scale, bias))(randn(3, 72))
    assert torch.ops.hfgpt.int8_linear.default in {node.target for node in graph.graph.nodes}
    x = randn(3, 72, seed=5)
    assert torch.equal(graph(x), kernels.int8_linear(x, packed, scale, bias))


@needs_int8
@pytest.mark.parametrize(
    "args, message",
    [
        (
            lambda p, s, b: (randn(3, 72, dtype=torch.float64), p, s, b),
            r"x must be a torch\.float32 CPU tensor",
        ),
        (lambda p, s, b: (randn(72, 3).T, p, s, b), r"x must have contiguous rows"),
        (lambda p, s, b: (randn(3, 72), p[:1], s, b), r"packed weight for 72 inputs and 40 outputs"),
        (lambda p, s, b: (randn(3, 72), p, s.double(), b), r"scale must be a torch\.float32"),
        (lambda p, s, b: (randn(3, 72), p, s, b[:7]), r"bias holds 7 values for 40 outputs"),
        (lambda p, s, b: (randn(3, 64), p, s, b), r"packed weight for 64 inputs"),
    ],
    ids=["float64", "strided", "short-weight", "float64-scale", "short-bias", "other-width"],
)
def test_int8_linear_names_the_argument_it_refuses(args, message):
    with pytest.raises(ValueError, match=message):
        kernels.int8_linear(*args(*int8_layer(40, 72)))


@needs_kernel
def test_gelu_passes_opcheck_with_its_gradient_and_vmap():
    x = randn(5, 7, seed=1)
    torch.library.opcheck(kernels.gelu_tanh, (x,))
    torch.library.opcheck(kernels.gelu_tanh, (x.clone().requires_grad_(),))
    torch.library.opcheck(kernels.gelu_tanh_backward, (randn(5, 7, seed=2), x))
    batched = torch.vmap(kernels.gelu_tanh, in_dims=1)(x)
    torch.testing.assert_close(batched, torch.nn.functional.gelu(x, approximate="tanh").T)


@needs_kernel
def test_attention_operators_pass_opcheck():
    q, k, v = heads(2, 2, 20)
    torch.library.opcheck(kernels.causal_attention, (q, k, v, 0.125))
    step = randn(2, 2, 1, 64, seed=7)
    torch.library.opcheck(kernels.decode_attention, (step, k, v, None, 0.125))
    mask = torch.rand(2, 1, 1, 20, generator=torch.Generator().manual_seed(3)) > 0.3
    torch.library.opcheck(kernels.decode_attention, (step, k, v, mask, 0.125))
    q, k, v = heads(1, 2, 70)
    keeps, probs = bands(2, 70)
    torch.library.opcheck(kernels.attention_train_forward, (q, k, v, keeps, probs, 0.125, 0.1))
    kernels.attention_train_forward(q, k, v, keeps, probs, 0.125, 0.1)
    grad = randn(1, 70, 2, 64, seed=9)
    torch.library.opcheck(kernels.attention_train_backward, (q, k, v, grad, keeps, probs, 0.125, 0.1))


@needs_kernel
def test_row_products_and_loss_operators_pass_opcheck():
    x = randn(1, 48)
    torch.library.opcheck(kernels.row_product, (x, randn(40, 48, seed=1), 2))
    torch.library.opcheck(kernels.row_conv1d, (x, randn(48, 40, seed=2), randn(40, seed=3), 2))
    torch.library.opcheck(kernels.row_conv1d, (x, randn(48, 40, seed=2), None, 3))
    logits = randn(3, 32, seed=4)
    part, out = logits[:, :16].contiguous(), torch.empty(3, 32)
    peak, total = torch.full((3,), float("-inf")), torch.zeros(3, dtype=torch.float64)
    torch.library.opcheck(kernels.lse_block, (part, out[:, :16], peak, total))
    lse, scale, targets = torch.logsumexp(logits, -1), torch.ones(3), torch.tensor([0, 17, 31])
    torch.library.opcheck(kernels.softmax_grad, (logits[:, 16:], lse, scale, targets, 16, torch.empty(3, 16)))


@needs_kernel
def test_the_attention_operator_names_what_it_refuses():
    q, k, v = heads(1, 2, 20)
    with pytest.raises(ValueError, match=r"needs \(B, H, T, 64\) queries"):
        kernels.causal_attention(q[..., :32], k[..., :32], v[..., :32], 0.125)
    with pytest.raises(ValueError, match=r"value must be a torch\.float32 CPU tensor"):
        kernels.causal_attention(q, k, v.double(), 0.125)
    keeps, probs = bands(2, 20)
    with pytest.raises(ValueError, match=r"20 positions take 1 bands, got 2 keep masks"):
        kernels.attention_train_forward(q, k, v, keeps * 2, probs * 2, 0.125, 0.1)


@needs_kernel
def test_bfloat16_row_product_passes_opcheck():
    x, weight = randn(1, 48, dtype=torch.bfloat16), randn(40, 48, seed=1, dtype=torch.bfloat16)
    torch.library.opcheck(kernels.row_product_bf16, (x, weight, None))
    torch.library.opcheck(kernels.row_product_bf16, (x, weight, randn(40, seed=2, dtype=torch.bfloat16)))


@needs_fused_int8
def test_fused_int8_block_operators_pass_opcheck():
    hidden = randn(2, 3, 72)
    norm = [randn(72, seed=s) for s in range(4)]
    qkv = int8_layer(216, 72)
    torch.library.opcheck(kernels.int8_norm_linear, (hidden, norm[0], norm[1], 1e-5, *qkv))
    torch.library.opcheck(kernels.int8_norm_linear, (hidden, None, None, 1e-5, *qkv))
    layers = [int8_layer(72, 72, 1), int8_layer(288, 72, 2), int8_layer(72, 288, 3)]
    packed = [t for packed, scale, _ in layers for t in (packed, scale)]
    biases = [bias for _, _, bias in layers]
    attention = randn(6, 72, seed=8)
    for pre_norm in (True, False):
        torch.library.opcheck(
            kernels.int8_block_tail, (attention, hidden, pre_norm, norm, 1e-5, packed, biases)
        )
