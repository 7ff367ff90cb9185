"""hfgpt's int8 linear kernel (modeling/csrc/int8_linear.c, built by modeling/native.py) against the torch
reference of the same arithmetic, and the builder's caching and failure paths."""

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import fresh_kernel_cache  # noqa: F401 (autouse: each test loads the kernels afresh)

from hfgpt.cpu import native
from hfgpt.cpu.quantization import INT8_BLOCK, Int8Linear, quantize_activations

# The kernel is built with the machine's C compiler (CI has one). Without it hfgpt falls back to the torch
# reference, which the other tests here exercise.
needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler to build the int8 kernel with"
)

SHAPES = [(1, 1), (37, 45), (33, 64), (64, 200), (96, 130)]  # (out, in): tails of tiles and blocks
ROWS = [1, 2, 3, 4, 5, 9]


def _cpu_has_vnni() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "").split()
    return {"avx512f", "avx512bw", "avx512_vnni"} <= set(flags)


def portable_library(directory: Path, name: str = "int8_linear"):
    """csrc/{name}.c built without -march=native: its portable path (no AVX-512, no VNNI)."""
    flags = tuple(f for f in native.FLAGS if f != "-march=native")
    return native.load(native.build(name, flags, directory), name)


def _layer(out: int, inp: int, bias: bool = True, seed: int = 0) -> Int8Linear:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inp, generator=generator) * 0.02
    return Int8Linear.from_float(weight, torch.randn(out, generator=generator) if bias else None)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # float32 sums in another order; the integer products are exact on both sides
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("out,inp", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@needs_cc
def test_kernel_matches_the_torch_reference(out, inp, bias):
    assert native.kernel("int8_linear") is not None  # this machine has a C compiler: the kernel runs
    layer = _layer(out, inp, bias)
    for rows in ROWS:
        x = torch.randn(rows, inp) * 3
        _close(layer(x), layer.reference(x))


def _c_quantize(library, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, width = x.shape
    padded = -(-width // INT8_BLOCK) * INT8_BLOCK
    q, s = torch.empty(rows, padded, dtype=torch.int8), torch.empty(rows, padded // INT8_BLOCK)
    sums = torch.empty(rows, padded // INT8_BLOCK, dtype=torch.int32)
    library.hfgpt_int8_quantize_rows(
        x.data_ptr(), rows, width, width, padded, q.data_ptr(), s.data_ptr(), sums.data_ptr()
    )
    return q, s, sums


@needs_cc
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_activation_quantisation_is_bit_exact(portable, tmp_path):
    """The C kernel's int8 activations and scales equal `quantize_activations` exactly, ties to even
    included (x / s = k + 0.5), in whole blocks (vectorised) and in a partial last block."""
    library = portable_library(tmp_path) if portable else native.kernel("int8_linear")
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(8, 200, generator=generator) * torch.logspace(-3, 3, 8)[:, None]
    x[0, :64] = torch.arange(64) - 31.5  # a ramp
    x[1, :64] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * 8)  # s = 1: ties to even
    x[1, 192:] = torch.tensor([254.0, 1.0, 3.0, -5.0, 7.0, 0.0, -1.0, 9.0])  # s = 2, partial block: ties
    x[2, 64:128] = 0.0  # an all-zero block
    x[3, 10], x[4, 70], x[5, 195] = float("nan"), float("inf"), float("-inf")  # whole and partial blocks
    q, s, sums = _c_quantize(library, x)
    want_q, want_s = quantize_activations(x)
    assert torch.equal(q.float(), want_q)
    torch.testing.assert_close(s, want_s, rtol=0, atol=0, equal_nan=True)
    assert s[3, 0].isnan() and s[4, 1].isnan() and s[5, 3].isnan() and s[3, 1:].isfinite().all()
    assert torch.equal(sums, want_q.view(8, -1, INT8_BLOCK).sum(-1).int())


@needs_cc
def test_kernel_is_exact_for_wide_positive_activations():
    """Activations with a large mean (after a GELU) over 3072 inputs: the kernel's only rounding is the
    float sum over blocks, so it stays as close to the exact int8 arithmetic (float64) as the reference."""
    layer = _layer(256, 3072)
    x = torch.rand(4, 3072, generator=torch.Generator().manual_seed(4)) * 3 + 0.5
    q, s = quantize_activations(x)
    exact = (q.double().view(4, -1, INT8_BLOCK) * s.double()[..., None]).view(4, -1)
    exact = exact @ layer.int8_weight().double().t() * layer.scale.double() + layer.bias.double()
    scale = exact.abs().max().item()
    assert (layer(x).double() - exact).abs().max().item() < 2e-6 * scale
    assert (layer.reference(x).double() - exact).abs().max().item() < 2e-6 * scale


@needs_cc
def test_non_finite_activations_give_nan_rows():
    layer = _layer(40, 130)
    x = torch.randn(4, 130)
    x[1, 3], x[2, 129] = float("nan"), float("inf")  # a whole block, the partial last one
    got, want = layer(x), layer.reference(x)
    assert got[1].isnan().all() and got[2].isnan().all()
    assert got[[0, 3]].isfinite().all()
    _close(got[[0, 3]], want[[0, 3]])
    assert want[1].isnan().all() and want[2].isnan().all()


def test_no_gradient_and_no_crash_on_other_devices(monkeypatch):
    layer = _layer(24, 48)
    x = torch.randn(3, 48, requires_grad=True)
    assert not layer(x).requires_grad  # inference only, on the kernel's path ...
    monkeypatch.setenv("HFGPT_NATIVE", "0")
    native.kernel.cache_clear()
    assert not layer(x).requires_grad  # ... and on the reference's
    on_meta = _layer(24, 48).to("meta")
    with pytest.raises((RuntimeError, NotImplementedError)):  # torch's device error, not a crash
        on_meta(torch.randn(3, 48))


@needs_cc
def test_kernel_result_does_not_depend_on_the_thread_count():
    layer = _layer(100, 300)
    x = torch.randn(7, 300)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        two = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_cc
def test_portable_build_matches_too(tmp_path):
    """The C file's portable path (no AVX-512 VNNI), built here without -march=native."""
    library = portable_library(tmp_path)
    assert library.hfgpt_int8_vectorized() == 0
    layer = _layer(70, 130)
    x = torch.randn(5, 130)
    y = torch.empty(5, 70)
    status = library.hfgpt_int8_linear(
        x.data_ptr(), 5, 130, 130, layer.packed.data_ptr(), 70, layer.packed_in,
        layer.scale.data_ptr(), layer.bias.data_ptr(), y.data_ptr(), 70, 2,
    )  # fmt: skip
    assert status == 0
    _close(y, layer.reference(x))


@needs_cc
def test_native_build_is_vectorized_where_the_cpu_has_vnni():
    library = native.kernel("int8_linear")
    assert library.hfgpt_int8_vectorized() == int(_cpu_has_vnni())


def test_inputs_of_any_layout_and_leading_shape():
    layer = _layer(48, 96)
    x = torch.randn(2, 3, 192)[..., ::2]  # strided last dimension
    assert layer(x).shape == (2, 3, 48)
    _close(layer(x), layer.reference(x.contiguous()))
    _close(layer(x.double()), layer.reference(x))
    assert layer(torch.empty(0, 96)).shape == (0, 48)


def test_quantisation_is_close_to_the_float_product_and_blocks_contain_an_outlier():
    torch.manual_seed(0)
    weight = torch.randn(256, 768) * 0.02
    layer = Int8Linear.from_float(weight)
    x = torch.randn(4, 768)
    exact = F.linear(x, weight)
    assert ((layer(x) - exact).norm() / exact.norm()).item() < 0.02
    # One input channel 200x larger than the rest, as in GPT-2's residual stream: with one scale per row
    # the other channels would keep ~1 bit; with one scale per 64 inputs only its block loses precision.
    x[:, 5] = 200.0
    q, s = quantize_activations(x)
    blockwise = (q.view(4, -1, INT8_BLOCK) * s[..., None]).view(4, -1)
    row_scale = x.abs().amax(1, keepdim=True) / 127
    per_row = torch.round(x / row_scale) * row_scale
    rest = torch.ones(768, dtype=torch.bool)
    rest[:INT8_BLOCK] = False
    assert (blockwise - x)[:, rest].abs().max() < 0.05 * (per_row - x)[:, rest].abs().max()


def test_dtype_conversions_keep_the_float32_scales_the_kernel_reads():
    layer = _layer(40, 70)
    x = torch.randn(3, 70)
    want = layer(x)
    for convert in (torch.nn.Module.half, torch.nn.Module.double, lambda m: m.to(torch.bfloat16)):
        convert(layer)
        assert layer.scale.dtype == layer.bias.dtype == torch.float32
        assert layer.packed.dtype == torch.uint8
        assert torch.equal(layer(x), want)


def test_int8_weight_round_trips_and_bad_input_is_named():
    weight = torch.randn(40, 70)
    layer = Int8Linear.from_float(weight)
    scale = weight.abs().amax(1, keepdim=True) / 127
    assert torch.equal(layer.int8_weight(), torch.round(weight / scale).to(torch.int8))
    with pytest.raises(ValueError, match=r"expects 70 input features, got shape \(3, 71\)"):
        layer(torch.randn(3, 71))
    with pytest.raises(ValueError, match="packed int8 weight must be uint8 of shape"):
        Int8Linear(70, 40, layer.packed.view(torch.int8), layer.scale, None)
    with pytest.raises(ValueError, match=r"scale and bias must have shape \(40,\), not \(\(39,\), None\)"):
        Int8Linear(70, 40, layer.packed, layer.scale[:39], None)


@needs_cc
def test_build_is_cached_and_leaves_no_temporary_files(tmp_path):
    first = native.build("int8_linear", directory=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native.build("int8_linear", directory=tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


@needs_cc
def test_a_changed_header_builds_a_new_library(tmp_path, monkeypatch):
    """csrc's headers (vector_math.h, which attention.c and gelu.c include) are part of a build's name."""
    sources = tmp_path / "csrc"
    shutil.copytree(native.SOURCE_DIR, sources)
    monkeypatch.setattr(native, "SOURCE_DIR", sources)
    first = native.build("gelu", directory=tmp_path / "cache")
    with open(sources / "vector_math.h", "a") as header:
        header.write("/* changed */\n")
    second = native.build("gelu", directory=tmp_path / "cache")
    assert second != first and first.exists() and second.exists()


def test_without_a_compiler_the_reference_runs_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("HFGPT_CACHE_DIR", str(tmp_path / "cache"))
    layer = _layer(20, 30)
    x = torch.randn(3, 30)
    with pytest.warns(RuntimeWarning, match="no C compiler: .*no-such-cc.* is not on PATH"):
        got = layer(x)
    assert torch.equal(got, layer.reference(x))
    assert not (tmp_path / "cache").exists()


def test_a_failing_compile_is_reported_with_its_command(monkeypatch, tmp_path):
    script = tmp_path / "badcc"
    script.write_text("#!/bin/sh\necho 'cc: error: something broke' >&2\nexit 3\n")
    os.chmod(script, 0o755)
    monkeypatch.setenv("CC", str(script))
    with pytest.raises(native.NativeBuildError, match=r"(?s)badcc -O3 .*failed \(exit 3\).*something broke"):
        native.build("int8_linear", directory=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary output was removed


def test_hfgpt_native_0_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("HFGPT_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # switched off on purpose: no warning
        assert native.kernel("int8_linear") is None
        layer = _layer(8, 16)
        x = torch.randn(2, 16)
        assert torch.equal(layer(x), layer.reference(x))


@needs_cc
def test_dispatch_modes_see_the_torch_reference_instead_of_the_kernel():
    """Under `make_fx` (and any torch dispatch mode) the layer runs its torch reference, which the graph
    records: replayed on another input, the graph gives that input's output."""
    from torch.fx.experimental.proxy_tensor import make_fx

    layer = _layer(37, 45)
    graph = make_fx(layer, tracing_mode="real")(torch.randn(3, 45))
    x = torch.randn(3, 45)
    _close(graph(x), layer.reference(x))


def test_a_tensor_subclass_that_dispatches_in_python_runs_the_torch_reference():
    """A `__torch_dispatch__` subclass (TwoTensor; DTensor alike) holds no values at its own data pointer,
    which the kernel would read: the layer runs its torch reference on it instead."""
    from torch.testing._internal.two_tensor import TwoTensor

    layer = _layer(37, 45)
    x = TwoTensor(torch.randn(3, 45), torch.randn(3, 45))
    torch.testing.assert_close(layer(x), layer.reference(x), atol=0, rtol=0)
