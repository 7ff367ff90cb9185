"""hfgpt's C kernels as torch operators (`hfgpt.cpu.kernels`): each passes `torch.library.opcheck` (its
schema, its fake implementation against the real one, its autograd registration, and a trace through
AOTAutograd), runs under FakeTensorMode without touching C, and names the argument it refuses."""

import pytest
import torch
from kernel_testing import (  # tests/ is on sys.path
    fresh_kernel_cache,  # noqa: F401 (autouse: each test loads the kernels afresh)
    needs_kernel,
)
from torch.fx.experimental.proxy_tensor import make_fx

from hfgpt.cpu import kernels
from hfgpt.cpu.quantization import Int8Linear

needs_int8 = pytest.mark.skipif(not kernels.available("int8_linear"), reason="no C compiler here")
needs_fused_int8 = pytest.mark.skipif(not kernels.int8_fused_available(), reason="no C compiler here")


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def int8_layer(out: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layer = Int8Linear.from_float(randn(out, width, seed=seed) * 0.1, randn(out, seed=seed + 1))
    return layer.packed, layer.scale, layer.bias


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
    with mode:
        y = kernels.int8_linear(torch.empty(2, 5, 72), packed, scale, bias)
        row = kernels.row_product(torch.empty(3, 72), torch.empty(40, 72), None)
    assert y.shape == (2, 5, 40) and y.dtype == torch.float32
    assert row.shape == (3, 40) and row.dtype == torch.float32


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
def test_row_product_passes_opcheck():
    x, weight = randn(3, 48), randn(40, 48, seed=1)
    torch.library.opcheck(kernels.row_product, (x, weight, None))
    torch.library.opcheck(kernels.row_product, (x[:1], weight, randn(40, seed=2)))


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
