"""hfgpt's int8 linear kernel (cpu/csrc/int8_linear.c, built by cpu/native.py) against the torch reference
of the same arithmetic, each of its instruction-set paths against its portable one, and the builder's
caching and failure paths."""

import os
import re
import shlex
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import intra_op_threads  # tests/ is on sys.path
from kernel_testing import (
    cpu_flags,
    fresh_kernel_cache,  # noqa: F401 (autouse: each test loads the kernels afresh)
)

from hfgpt.cpu import kernels, native
from hfgpt.cpu.quantization import INT8_BLOCK, Int8Linear, quantize_activations


def _has_compiler() -> bool:
    return shutil.which((shlex.split(os.environ.get("CC", "")) or ["cc"])[0]) is not None


# The kernel is built with the machine's C compiler (CI has one). Without it hfgpt falls back to the torch
# reference, which the other tests here exercise.
needs_cc = pytest.mark.skipif(not _has_compiler(), reason="no C compiler to build the int8 kernel with")

SHAPES = [(1, 1), (37, 45), (33, 64), (64, 200), (96, 130)]  # (out, in): tails of tiles and blocks
ROWS = [1, 2, 3, 4, 5, 9]

# The int8 products of csrc/int8_linear.c (`hfgpt_int8_vectorized()`): the number each path reports, the
# flags that build it with -march=native on a CPU that has more (x86 compilers), and the CPU flags it needs.
ISA_PATHS = {
    "avx512_vnni": (3, (), {"avx512f", "avx512bw", "avx512_vnni"}),
    "avx_vnni": (2, ("-mno-avx512f",), {"avx2", "fma", "avx_vnni"}),
    "avx2": (1, ("-mno-avx512f", "-mno-avxvnni"), {"avx2", "fma"}),
}


def native_isa() -> int:
    """The path -march=native builds on this CPU: the widest whose instructions it has."""
    flags = cpu_flags()
    return max((isa for isa, _, needs in ISA_PATHS.values() if needs <= flags), default=0)


def portable_library(directory: Path, name: str = "int8_linear"):
    """csrc/{name}.c built without -march=native: its portable path (no AVX2, no VNNI)."""
    flags = tuple(f for f in native.FLAGS if f != "-march=native")
    return native.load(native.build(name, flags, directory), name)


@pytest.fixture(scope="module")
def isa_libraries(tmp_path_factory) -> dict:
    """The portable build and each instruction-set path this CPU runs, built once for the module."""
    if not _has_compiler():
        pytest.skip("no C compiler to build the int8 kernel with")
    directory = tmp_path_factory.mktemp("int8-paths")
    libraries = {"portable": portable_library(directory)}
    for path, (_, extra, needs) in ISA_PATHS.items():
        if needs <= cpu_flags():
            libraries[path] = native.load(
                native.build("int8_linear", native.FLAGS + extra, directory), "int8_linear"
            )
    return libraries


def isa_library(libraries: dict, path: str):
    """The library of `path`, or a skip naming the instructions this CPU lacks for it."""
    if path not in libraries:
        needs = ", ".join(sorted(ISA_PATHS[path][2] - cpu_flags()))
        pytest.skip(f"the {path} path needs a CPU with {needs}")
    return libraries[path]


def _c_product(library, layer: Int8Linear, x: torch.Tensor, threads: int = 2) -> torch.Tensor:
    """`layer`'s product of the rows of `x` in `library`'s `hfgpt_int8_linear`."""
    rows = x.shape[0]
    y = torch.full((rows, layer.out_features), float("nan"))
    status = library.hfgpt_int8_linear(
        x.data_ptr(), rows, layer.in_features, layer.in_features, layer.packed.data_ptr(), layer.out_features,
        layer.packed_in, layer.scale.data_ptr(), None if layer.bias is None else layer.bias.data_ptr(),
        y.data_ptr(), layer.out_features, threads,
    )  # fmt: skip
    assert status == 0
    return y


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
@pytest.mark.parametrize("path", ["native", "portable", *ISA_PATHS])
def test_activation_quantisation_is_bit_exact(path, isa_libraries):
    """The C kernel's int8 activations and scales equal `quantize_activations` exactly, ties to even
    included (x / s = k + 0.5), in whole blocks (vectorised) and in a partial last block, on every path."""
    library = native.kernel("int8_linear") if path == "native" else isa_library(isa_libraries, path)
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
    with intra_op_threads(1):
        one = layer(x)
    with intra_op_threads(2):
        two = layer(x)
    assert torch.equal(one, two)


@needs_cc
def test_portable_build_matches_too(isa_libraries):
    """The C file's portable path, built here without -march=native."""
    library = isa_libraries["portable"]
    assert library.hfgpt_int8_vectorized() == 0
    layer = _layer(70, 130)
    x = torch.randn(5, 130)
    _close(_c_product(library, layer, x), layer.reference(x))


@needs_cc
@pytest.mark.parametrize("path", ISA_PATHS)
def test_each_isa_path_gives_the_portable_paths_products(path, isa_libraries):
    """Each instruction-set path against the portable one (whose float sums the compiler contracts as it
    chooses: to rounding), and bit for bit against the AVX2 path, which every CPU running another path
    also runs: the same int32 sums, then the same float operations in the same order. Rows that fill and
    that do not fill a path's group of rows, tails of tiles and blocks, activations at +-127 in every block
    (the AVX2 path's int16 pairs at their largest), with and without a bias."""
    library = isa_library(isa_libraries, path)
    assert library.hfgpt_int8_vectorized() == ISA_PATHS[path][0]
    for (out, inp), bias in zip([*SHAPES, (300, 768), (40, 3072)], [True, False] * 4, strict=False):
        layer = _layer(out, inp, bias, seed=out)
        for rows in ROWS:
            x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)) * 3
            x[:, ::7] = 1e3 * torch.sign(x[:, ::7])
            got = _c_product(library, layer, x)
            _close(got, _c_product(isa_libraries["portable"], layer, x))
            _close(got, layer.reference(x))
            assert torch.equal(got, _c_product(isa_libraries["avx2"], layer, x)), (out, inp, rows)


@needs_cc
def test_the_avx2_int16_pairs_never_saturate(isa_libraries):
    """VPMADDUBSW sums two products in int16 with saturation; the AVX2 path keeps each pair within
    2 * 127 * 127: with every weight and activation at +-127, of equal and of mixed signs, each output is
    the exact integer sum times the scales, to float rounding."""
    library = isa_library(isa_libraries, "avx2")
    out, inp = 64, 256
    mixed = torch.where(torch.rand(out, inp, generator=torch.Generator().manual_seed(5)) < 0.5, -1.0, 1.0)
    for weight in (torch.ones(out, inp), -torch.ones(out, inp), mixed):
        layer = Int8Linear.from_float(weight)
        assert layer.int8_weight().abs().min() == 127
        for x in (torch.ones(3, inp), -torch.ones(3, inp), mixed[:3]):  # q = +-127, scale 1 / 127
            exact = (127 * x.double()) @ layer.int8_weight().double().t() / 127 * layer.scale.double()
            got = _c_product(library, layer, x).double()
            torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)  # (a saturated pair: ~50% off)


@needs_cc
@pytest.mark.parametrize("path", ISA_PATHS)
def test_each_isa_path_gives_the_portable_paths_blocks(path, isa_libraries, monkeypatch):
    """The fused block's entry points (`int8_norm_linear`, `int8_block_tail`, pre-norm and post-norm) on
    each instruction-set path against the portable build: the same products, layer norms and GELU to float
    rounding, which the int8 copy of a next product can turn into one quantisation step of an input now
    and then."""
    library = isa_library(isa_libraries, path)
    generator = torch.Generator().manual_seed(6)
    width, inner, rows = 128, 512, 3
    shapes = ((3 * width, width), (width, width), (inner, width), (width, inner))
    layers = [_layer(out, inp, seed=out + inp) for out, inp in shapes]
    hidden = torch.randn(1, rows, width, generator=generator) * 2
    attention = torch.randn(rows, width, generator=generator)
    norms = [
        1 + 0.1 * torch.randn(width, generator=generator),
        0.1 * torch.randn(width, generator=generator),
    ] * 2
    tail_layers = [t for layer in layers[1:] for t in (layer.packed, layer.scale)]

    def block(chosen) -> list[torch.Tensor]:
        monkeypatch.setattr(kernels, "_library", lambda name: chosen)
        qkv = kernels.int8_norm_linear(
            hidden, *norms[:2], 1e-5, layers[0].packed, layers[0].scale, layers[0].bias
        )
        return [qkv] + [
            kernels.int8_block_tail(
                attention, hidden, pre_norm, norms, 1e-5, tail_layers, [layer.bias for layer in layers[1:]]
            )
            for pre_norm in (True, False)
        ]

    for got, want in zip(block(library), block(isa_libraries["portable"]), strict=True):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)


@needs_cc
def test_native_build_runs_the_widest_int8_products_of_the_cpu():
    library = native.kernel("int8_linear")
    assert library.hfgpt_int8_vectorized() == native_isa()
    assert library.hfgpt_int8_fused_available() == 1  # the fused block, on every CPU
    assert kernels.int8_fused_available()


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
    """csrc's headers (vector_math.h, which row_product.c includes) are part of a build's name."""
    sources = tmp_path / "csrc"
    shutil.copytree(native.SOURCE_DIR, sources)
    monkeypatch.setattr(native, "SOURCE_DIR", sources)
    first = native.build("row_product", directory=tmp_path / "cache")
    with open(sources / "vector_math.h", "a") as header:
        header.write("/* changed */\n")
    second = native.build("row_product", directory=tmp_path / "cache")
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


@needs_cc
@pytest.mark.parametrize(
    "fault, message",
    [
        ("hidden", "hidden must be a torch.float32 CPU tensor"),
        ("attention", "attention must be contiguous"),
        ("norms", "norms[2] must be a torch.float32 CPU tensor"),
        ("packed", "packed must be a torch.uint8 CPU tensor"),
        ("scale", "scale must have contiguous rows"),
        ("bias", "bias must be a torch.float32 CPU tensor"),
    ],
)
def test_the_fused_block_operators_name_the_argument_at_fault(fault, message):
    """`int8_norm_linear` and `int8_block_tail` check every tensor they read (in one quick pass where all
    is well); a tensor of another dtype or layout is refused by name, before any C code reads it."""
    width, inner = 64, 128
    layers = [
        _layer(out, inp, seed=out)
        for out, inp in ((3 * width, width), (width, width), (inner, width), (width, inner))
    ]
    hidden, attention = torch.randn(1, 2, width), torch.randn(2, width)
    norms = [torch.ones(width), torch.zeros(width)] * 2
    packed = [layer.packed for layer in layers]
    scales = [layer.scale for layer in layers]
    biases = [layer.bias for layer in layers]
    if fault == "hidden":
        hidden = hidden.double()
    elif fault == "attention":
        attention = torch.randn(4, width)[::2]  # rows contiguous, the whole not
    elif fault == "norms":
        norms[2] = norms[2].double()
    elif fault == "packed":
        packed = [p.to(torch.int8) for p in packed]
    elif fault == "scale":
        scales = [torch.randn(2 * s.numel())[::2] for s in scales]
    else:
        biases = [b.double() for b in biases]
    tail = [t for i in (1, 2, 3) for t in (packed[i], scales[i])]
    with pytest.raises(ValueError, match=re.escape(message)):
        kernels.int8_block_tail(attention, hidden, True, norms, 1e-5, tail, biases[1:])
    if fault not in ("attention", "norms"):  # (int8_norm_linear reads neither)
        with pytest.raises(ValueError, match=re.escape(message.replace("hidden", "x"))):
            kernels.int8_norm_linear(hidden, *norms[:2], 1e-5, packed[0], scales[0], biases[0])
