"""hfgpt's C kernels (csrc/, loaded by `hfgpt.cpu.native`) as torch operators (`torch.ops.hfgpt.*`), each
with a fake implementation, so FakeTensor, meta, `make_fx`, `torch.compile` and dispatch modes see one op.
None has a gradient: inference only. The callers (`products`, `decoding`, `quantization`) decide where a
kernel stands in for torch's ops (`available`); each implementation raises an error naming any argument the
C code would misread, and runs its kernel on `torch.get_num_threads()` OpenMP threads of its own.
"""

import ctypes
import functools
import operator
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from . import native


@torch.compiler.assume_constant_result
def available(name: str) -> bool:
    """Whether csrc/{name}.c is built and loaded (`native.kernel`); every kernel builds on any CPU."""
    return native.kernel(name) is not None


def _library(name: str) -> ctypes.CDLL:
    library = native.kernel(name)
    if library is None:
        raise RuntimeError(
            f"hfgpt's C kernel csrc/{name}.c is not available (HFGPT_NATIVE=0, or no compiler)"
        )
    return library


def _expect(op: str, dtype: torch.dtype, rows_contiguous: bool = True, **tensors: Tensor | None) -> None:
    """Raise a ValueError naming the first tensor argument of `op` that the C code would misread: not on the
    CPU, not `dtype`, or without contiguous rows (last stride 1)."""
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cpu" or t.dtype != dtype:
            raise ValueError(f"hfgpt::{op}: {name} must be a {dtype} CPU tensor, got {t.dtype} on {t.device}")
        if rows_contiguous and t.dim() > 0 and t.stride(-1) != 1 and t.numel() > 1:
            raise ValueError(f"hfgpt::{op}: {name} must have contiguous rows (strides {t.stride()})")


def _contiguous(op: str, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(
                f"hfgpt::{op}: {name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})"
            )


def _ok(status: int, op: str, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"hfgpt::{op}: the C kernel refused its arguments (status {status}, {what})")


def _pointer(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _pointers(tensors: list[Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*map(Tensor.data_ptr, tensors))


# Operators are defined with `Library.define` and `Library.impl` (CPU) rather than `custom_op`: the dispatcher
# sees them alike, but a call skips `custom_op`'s autograd wrapper in Python, which cost a GPT-2 decoding step
# at batch size 1 about 45 us an operator.
_DECODING = torch.library.Library("hfgpt", "FRAGMENT")


def _decoding_op(function: Callable | None = None, *, mutates_args: tuple[str, ...] = ()) -> Callable:
    """Define `function` (typed as for `custom_op`) as the CPU implementation of `hfgpt::<its name>`, and
    return `torch.ops.hfgpt.<name>.default`; `mutates_args` as `custom_op`'s."""
    if function is None:
        return functools.partial(_decoding_op, mutates_args=mutates_args)
    name = function.__name__
    _DECODING.define(name + torch.library.infer_schema(function, mutates_args=mutates_args))
    _DECODING.impl(name, function, "CPU")
    operator = getattr(torch.ops.hfgpt, name).default
    operator.__doc__ = function.__doc__
    return operator


def _expect_rows(
    op: str, dtype: torch.dtype, x: Tensor, weight: Tensor, bias: Tensor | None, one: bool
) -> int:
    """Check a row product's arguments (`one`: of one row of x only); returns its outputs."""
    _expect(op, dtype, x=x, weight=weight, bias=bias)
    _contiguous(op, x=x, weight=weight, bias=bias)
    if x.dim() != 2 or (one and x.shape[0] != 1) or weight.dim() != 2:
        wanted = "one row x (1, in)" if one else "rows x (rows, in)"
        raise ValueError(f"hfgpt::{op}: needs {wanted} and a 2-D weight, got {tuple(x.shape)}")
    out, width = weight.shape
    if x.shape[1] != width or (bias is not None and bias.numel() != out):
        given = "" if bias is None else f" and {bias.numel()} biases"
        raise ValueError(f"hfgpt::{op}: x {tuple(x.shape)}{given} against a {out} x {width} weight")
    return out


@_decoding_op
def row_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`F.linear(x, weight, bias)` for float32 rows `x` (rows, in) and an `[out, in]` weight, each thread
    reading its run of the weight's rows once for all of x's rows (csrc/row_product.c)."""
    out, (rows, width) = _expect_rows("row_product", torch.float32, x, weight, bias, one=False), x.shape
    y, threads = x.new_empty(rows, out), torch.get_num_threads()
    status = _library("row_product").hfgpt_row_product(
        x.data_ptr(), weight.data_ptr(), rows, out, width, _pointer(bias), y.data_ptr(), threads
    )
    _ok(status, "row_product", f"a {out} x {width} weight")
    return y


@_decoding_op
def row_product_bf16(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`F.linear(x, weight, bias)` for one bfloat16 row `x` (1, in) and a bfloat16 `[out, in]` weight, summed
    in float32 and rounded once (csrc/row_product.c)."""
    out, width = _expect_rows("row_product_bf16", torch.bfloat16, x, weight, bias, one=True), x.shape[1]
    y = x.new_empty(1, out)
    status = _library("row_product").hfgpt_row_product_bf16(
        x.data_ptr(), weight.data_ptr(), out, width, _pointer(bias), y.data_ptr(), torch.get_num_threads()
    )
    _ok(status, "row_product_bf16", f"a {out} x {width} weight")
    return y


@torch.library.register_fake("hfgpt::row_product")
@torch.library.register_fake("hfgpt::row_product_bf16")
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


# The packed int8 weight's layout (csrc/int8_linear.c): [ceil(out / TILE)][inp / 4][TILE][4] bytes, inp the
# inputs rounded up to a multiple of BLOCK.
INT8_BLOCK, INT8_TILE = 64, 32
_DTYPE, _IS_CPU, _SHAPE = map(operator.attrgetter, ("dtype", "is_cpu", "shape"))


def _all_contiguous(dtype: torch.dtype, tensors: Iterable[Tensor | None]) -> bool:
    """Whether every tensor given (None skipped) is a contiguous `dtype` CPU tensor: `_expect` and
    `_contiguous` in one quick pass (C loops); where it fails, those name the tensor at fault."""
    tensors = [t for t in tensors if t is not None]
    return (
        set(map(_DTYPE, tensors)) <= {dtype}
        and all(map(_IS_CPU, tensors))
        and all(map(Tensor.is_contiguous, tensors))
    )


def _packed_shape(width_in: int, width_out: int) -> tuple[int, int, int, int]:
    """The packed int8 weight's shape for `width_in` inputs and `width_out` outputs."""
    return (-(-width_out // INT8_TILE), -(-width_in // INT8_BLOCK) * INT8_BLOCK // 4, INT8_TILE, 4)


def _expect_int8_layer(
    op: str, packed: Tensor, scale: Tensor, bias: Tensor | None, width: int, types_checked: bool = False
) -> int:
    """Check a packed int8 layer for `width` inputs (its dtypes and layout too, unless `types_checked`);
    returns its output count (the scales')."""
    if not types_checked:
        _expect(op, torch.uint8, packed=packed)
        _expect(op, torch.float32, scale=scale, bias=bias)
        _contiguous(op, packed=packed, scale=scale, bias=bias)
    out_features = scale.numel()
    expected = _packed_shape(width, out_features)
    if tuple(packed.shape) != expected:
        raise ValueError(
            f"hfgpt::{op}: a packed weight for {width} inputs and {out_features} outputs has shape {expected}, "
            f"got {tuple(packed.shape)}"
        )
    if bias is not None and bias.numel() != out_features:
        raise ValueError(f"hfgpt::{op}: bias holds {bias.numel()} values for {out_features} outputs")
    return out_features


def _int8_layer_arguments(packed: Tensor, scale: Tensor, bias: Tensor | None, out: bool) -> tuple:
    """A packed layer's arguments to the block kernels: weight, (outputs,) padded inputs, scales, bias."""
    packed_in = packed.shape[1] * packed.shape[3]
    sizes = (scale.numel(), packed_in) if out else (packed_in,)
    return (packed.data_ptr(), *sizes, scale.data_ptr(), _pointer(bias))


@_decoding_op
def int8_linear(x: Tensor, packed: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """`Int8Linear`'s product (`hfgpt.cpu.quantization`): float32 rows `x` (..., in) quantized per block of
    `INT8_BLOCK` inputs to int8, multiplied by the packed int8 weight, times the per-channel `scale`, plus
    `bias` (csrc/int8_linear.c)."""
    _expect("int8_linear", torch.float32, x=x)
    _contiguous("int8_linear", x=x)
    width = x.shape[-1]
    out_features = _expect_int8_layer("int8_linear", packed, scale, bias, width)
    packed_in = packed.shape[1] * packed.shape[3]
    out = x.new_empty(*x.shape[:-1], out_features)
    status = _library("int8_linear").hfgpt_int8_linear(
        x.data_ptr(), x.numel() // max(width, 1), width, width, packed.data_ptr(), out_features, packed_in,
        scale.data_ptr(), _pointer(bias), out.data_ptr(), out_features, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"hfgpt::int8_linear: no memory for the int8 copy of a {tuple(x.shape)} input")
    return out


@torch.library.register_fake("hfgpt::int8_linear")
def _(x: Tensor, packed: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], scale.shape[0])


@_decoding_op
def int8_norm_linear(
    x: Tensor, norm_weight: Tensor | None, norm_bias: Tensor | None, eps: float, packed: Tensor,
    scale: Tensor, bias: Tensor | None,
) -> Tensor:  # fmt: skip
    """A layer norm of the rows of `x` (B, T, in) (skipped without `norm_weight`), then `int8_linear`:
    `Int8Block`'s ln_1 and c_attn in one call (csrc/int8_linear.c)."""
    checked = _all_contiguous(torch.float32, (x, norm_weight, norm_bias, scale, bias)) and _all_contiguous(
        torch.uint8, (packed,)
    )
    if not checked:
        _expect("int8_norm_linear", torch.float32, x=x, norm_weight=norm_weight, norm_bias=norm_bias)
        _contiguous("int8_norm_linear", x=x, norm_weight=norm_weight, norm_bias=norm_bias)
    if x.dim() != 3:
        raise ValueError(f"hfgpt::int8_norm_linear: needs (B, T, in) hidden states, got {tuple(x.shape)}")
    batch, seq_len, width = x.shape
    out_features = _expect_int8_layer("int8_norm_linear", packed, scale, bias, width, types_checked=checked)
    for name, norm in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if norm is not None and norm.numel() != width:
            raise ValueError(
                f"hfgpt::int8_norm_linear: {name} holds {norm.numel()} values for {width} inputs"
            )
    y = x.new_empty(batch, seq_len, out_features)
    status = _library("int8_linear").hfgpt_int8_norm_linear(
        x.data_ptr(), batch * seq_len, width, _pointer(norm_weight), _pointer(norm_bias), eps,
        *_int8_layer_arguments(packed, scale, bias, out=True), y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"hfgpt::int8_norm_linear: no memory for the scratch of a {tuple(x.shape)} input")
    return y


@torch.library.register_fake("hfgpt::int8_norm_linear")
def _(x: Tensor, *rest: object) -> Tensor:
    scale = rest[4]  # (after the norm's weight and bias, eps and the packed weight)
    return x.new_empty(*x.shape[:-1], scale.shape[0])


@_decoding_op
def int8_block_tail(
    attention: Tensor, hidden: Tensor, pre_norm: bool, norms: list[Tensor], eps: float, layers: list[Tensor],
    biases: list[Tensor | None],
) -> Tensor:  # fmt: skip
    """The rest of an `Int8Block` after its attention (B*T, E) on `hidden` (B, T, E), in one call
    (csrc/decode_step.h's `block_tail`). `norms`: ln_1's and ln_2's weight and bias; `layers`: the packed
    weight and scales of c_proj, c_fc and the MLP's c_proj; `biases`: their biases."""
    if len(norms) != 4 or len(layers) != 6 or len(biases) != 3:
        raise ValueError("hfgpt::int8_block_tail: needs 4 norm tensors, 3 packed layers and 3 biases")
    checked = _all_contiguous(
        torch.float32, (attention, hidden, *norms, *layers[1::2], *biases)
    ) and _all_contiguous(torch.uint8, layers[0::2])
    if not checked:
        _expect("int8_block_tail", torch.float32, attention=attention, hidden=hidden)
        _contiguous("int8_block_tail", attention=attention, hidden=hidden)
    if hidden.dim() != 3 or attention.numel() != hidden.numel():
        raise ValueError(
            f"hfgpt::int8_block_tail: attention {tuple(attention.shape)} for hidden states {tuple(hidden.shape)}"
        )
    batch, seq_len, width = hidden.shape
    for index, norm in enumerate(norms):
        if not checked:
            _expect("int8_block_tail", torch.float32, **{f"norms[{index}]": norm})
            _contiguous("int8_block_tail", **{f"norms[{index}]": norm})
        if norm.numel() != width:
            raise ValueError(
                f"hfgpt::int8_block_tail: norms[{index}] holds {norm.numel()} values for {width}"
            )
    # c_proj (width -> width), c_fc (width -> fc), mlp c_proj (fc -> width)
    fc = layers[3].numel()
    for index, width_in in enumerate((width, width, fc)):
        out_features = _expect_int8_layer(
            "int8_block_tail", layers[2 * index], layers[2 * index + 1], biases[index], width_in, checked
        )
        if out_features != (fc if index == 1 else width):
            raise ValueError(f"hfgpt::int8_block_tail: layer {index} has {out_features} outputs")
    c_proj, c_fc, mlp_proj = (
        _int8_layer_arguments(layers[2 * i], layers[2 * i + 1], biases[i], out=i == 1) for i in range(3)
    )
    out = torch.empty_like(hidden)
    status = _library("int8_linear").hfgpt_int8_block_tail(
        attention.data_ptr(), hidden.data_ptr(), out.data_ptr(), batch * seq_len, width, int(pre_norm),
        *(norm.data_ptr() for norm in norms), eps, *c_proj, *c_fc, *mlp_proj, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(
            f"hfgpt::int8_block_tail: no memory for the scratch of a {tuple(hidden.shape)} input"
        )
    return out


@torch.library.register_fake("hfgpt::int8_block_tail")
def _(attention: Tensor, hidden: Tensor, *_: object) -> Tensor:
    return torch.empty_like(hidden)


@torch.compiler.assume_constant_result
def int8_fused_available() -> bool:
    """Whether `int8_norm_linear` and `int8_block_tail` run here: csrc/int8_linear.c is built (on any CPU)."""
    return available("int8_linear") and bool(native.kernel("int8_linear").hfgpt_int8_fused_available())


# Tensors a block in `blocks` of `int8_decode_step` and `float_decode_step` (their csrc's LAYER_POINTERS)
INT8_BLOCK_TENSORS, FLOAT_BLOCK_TENSORS = 16, 12
HEAD_SIZE = 64  # the heads the C attention computes (csrc/decode_attention.h)


# Where the packed weights lie among a block's `INT8_BLOCK_TENSORS` (after the 4 norm tensors, every third).
_PACKED_AT = frozenset((4, 7, 10, 13))


@functools.cache
def _block_positions(layers: int) -> tuple[Callable, Callable]:
    """Getters of the packed weights and of the float vectors among `layers` blocks' tensors."""
    count = layers * INT8_BLOCK_TENSORS
    packed = [i for i in range(count) if i % INT8_BLOCK_TENSORS in _PACKED_AT]
    return operator.itemgetter(*packed), operator.itemgetter(*(i for i in range(count) if i not in packed))


def _name_in_step(t: Tensor, wte: Tensor, wpe: Tensor, *groups: list[Tensor]) -> str:
    """How a decoding step's error names tensor `t`: wte, wpe, or its list and index there."""
    if t is wte or t is wpe:
        return "wte" if t is wte else "wpe"
    for name, group in zip(("blocks", "keys", "values", "final_norm"), groups, strict=True):
        for index, other in enumerate(group):
            if other is t:
                return f"{name}[{index}]"
    return "a tensor"


def _check_ids(op: str, name: str, ids: Tensor, size: int, rows: int) -> None:
    _expect(op, torch.int64, **{name: ids})
    if tuple(ids.shape) != (rows,) or not ids.is_contiguous():
        raise ValueError(f"hfgpt::{op}: {name} must be {rows} contiguous ids, got shape {tuple(ids.shape)}")
    low, high = torch.aminmax(ids)
    if int(low) < 0 or int(high) >= size:
        raise ValueError(f"hfgpt::{op}: {name} holds ids outside [0, {size}): {int(low)} .. {int(high)}")


def _check_step(
    op: str, per_block: int, ids: Tensor, positions: Tensor, wte: Tensor, wpe: Tensor, blocks: list[Tensor],
    keys: list[Tensor], values: list[Tensor], past: int, mask: Tensor | None, scalings: list[float],
    final_norm: list[Tensor], types: dict[torch.dtype, list[Tensor]],
) -> int:  # fmt: skip
    """Raise a ValueError naming what a decoding step's C code would misread, but for each block's own
    shapes. `types`: the tensors of each dtype, each one contiguous. Returns the width."""
    layers, rows = len(keys), ids.numel()
    if layers == 0 or len(values) != layers or len(scalings) != layers:
        raise ValueError(
            f"hfgpt::{op}: {layers} key buffers, {len(values)} value buffers, {len(scalings)} scales"
        )
    if len(blocks) != per_block * layers or len(final_norm) not in (0, 2):
        raise ValueError(
            f"hfgpt::{op}: needs {per_block} tensors a block ({len(blocks)} for {layers} blocks) "
            f"and 0 or 2 final norm tensors ({len(final_norm)})"
        )
    # (one quick pass, as a step runs once per token; where it fails, the loop names the tensor at fault)
    if not all(_all_contiguous(dtype, group) for dtype, group in types.items()):
        for dtype, group in types.items():
            for t in group:
                name = _name_in_step(t, wte, wpe, blocks, keys, values, final_norm)
                _expect(op, dtype, **{name: t})
                _contiguous(op, **{name: t})
    if wte.dim() != 2 or wpe.dim() != 2 or wte.shape[1] != wpe.shape[1]:
        raise ValueError(f"hfgpt::{op}: wte {tuple(wte.shape)} and wpe {tuple(wpe.shape)} must be (rows, n)")
    width = wte.shape[1]
    heads = width // HEAD_SIZE
    _check_ids(op, "ids", ids, wte.shape[0], rows)
    _check_ids(op, "positions", positions, wpe.shape[0], rows)
    if heads * HEAD_SIZE != width:
        raise ValueError(f"hfgpt::{op}: {width} features are not heads of {HEAD_SIZE}")
    expected = (rows, heads, HEAD_SIZE)
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        if (
            k.dim() != 4
            or k.shape != v.shape
            or (k.shape[0], k.shape[1], k.shape[3]) != expected
            or not 0 <= past < k.shape[2]
        ):
            raise ValueError(
                f"hfgpt::{op}: block {layer}'s key and value buffers {tuple(k.shape)}, {tuple(v.shape)} must be "
                f"(B, H, capacity, {HEAD_SIZE}) = ({rows}, {width // HEAD_SIZE}, > {past}, {HEAD_SIZE})"
            )
    if any(norm.numel() != width for norm in final_norm):
        raise ValueError(f"hfgpt::{op}: the final norm's tensors must hold {width} values")
    if mask is not None:
        if mask.dtype not in (torch.bool, torch.uint8) or not mask.is_cpu:
            raise ValueError(
                f"hfgpt::{op}: mask must be a bool or uint8 CPU tensor, got {mask.dtype} on {mask.device}"
            )
        if mask.dim() != 2 or tuple(mask.shape) != (rows, past + 1) or mask.stride(1) != 1:
            raise ValueError(
                f"hfgpt::{op}: mask must be ({rows}, {past + 1}) with contiguous rows, got {tuple(mask.shape)}"
            )
    return width


def _run_step(
    library: str, op: str, ids: Tensor, positions: Tensor, wte: Tensor, wpe: Tensor, inner: int,
    blocks: list[Tensor], keys: list[Tensor], values: list[Tensor], past: int, mask: Tensor | None,
    scalings: list[float], eps: float, pre_norm: bool, final_norm: list[Tensor], final_eps: float,
) -> Tensor:  # fmt: skip
    """Call csrc/{library}.c's `hfgpt_{op}` (decode_step.h's arguments) on checked arguments."""
    rows, width = ids.numel(), wte.shape[1]
    layers = len(keys)
    out = wte.new_empty(rows, width)
    status = getattr(_library(library), f"hfgpt_{op}")(
        ids.data_ptr(), positions.data_ptr(), wte.data_ptr(), wpe.data_ptr(), rows, width, width // HEAD_SIZE,
        inner, layers, int(pre_norm), eps, (ctypes.c_float * layers)(*scalings), _pointers(blocks),
        _pointers(keys), _pointers(values), (ctypes.c_int64 * layers)(*(k.shape[2] for k in keys)), past,
        _pointer(mask), 0 if mask is None else mask.stride(0), *(_pointer(t) for t in final_norm or (None, None)),
        final_eps, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(
            f"hfgpt::{op}: no memory for the scratch of a step of {rows} rows, {past + 1} positions"
        )
    return out


@_decoding_op(mutates_args=("keys", "values"))
def int8_decode_step(
    ids: Tensor, positions: Tensor, wte: Tensor, wpe: Tensor, blocks: list[Tensor], keys: list[Tensor],
    values: list[Tensor], past: int, mask: Tensor | None, scalings: list[float], eps: float, pre_norm: bool,
    final_norm: list[Tensor], final_eps: float,
) -> Tensor:  # fmt: skip
    """One decoding step of an int8 decoding copy in one call (csrc/decode_step.h's `decode_step`, which
    documents the arguments); returns the (B, n) last hidden states. `blocks`: `INT8_BLOCK_TENSORS` a block:
    ln_1's weight and bias, ln_2's, then c_attn, the attention's c_proj, c_fc and the MLP's c_proj, each as
    packed weight, scales and bias. `keys[l]`, `values[l]`: contiguous (B, H, capacity, 64) buffers."""
    op, layers = "int8_decode_step", len(keys)
    packed_at, vectors_at = _block_positions(max(layers, 1))
    grouped = len(blocks) == INT8_BLOCK_TENSORS * layers and layers > 0
    packed, vectors = (list(packed_at(blocks)), vectors_at(blocks)) if grouped else ([], blocks)
    floats = [wte, wpe, *keys, *values, *final_norm, *vectors]
    types = {torch.uint8: packed, torch.float32: floats}
    width = _check_step(
        op, INT8_BLOCK_TENSORS, ids, positions, wte, wpe, blocks, keys, values, past, mask, scalings,
        final_norm, types,
    )  # fmt: skip
    inner = blocks[11].numel()  # (c_fc's scales)
    # (c_attn, the attention's c_proj, c_fc, the MLP's c_proj: inputs, outputs and packed shape)
    shapes = [(width_in, width_out, _packed_shape(width_in, width_out)) for width_in, width_out in (
        (width, 3 * width), (width, width), (width, inner), (inner, width)
    )]  # fmt: skip
    # (every block's packed shapes and vector sizes compared in C loops first; the loop names the one at fault)
    sizes = [width] * 4 + [size for _, width_out, _ in shapes for size in (width_out, width_out)]
    if (
        list(map(_SHAPE, packed)) != [shape for _, _, shape in shapes] * layers
        or list(map(Tensor.numel, vectors)) != sizes * layers
    ):
        for layer in range(layers):
            block = blocks[INT8_BLOCK_TENSORS * layer : INT8_BLOCK_TENSORS * (layer + 1)]
            _check_norms(op, layer, block[:4], width)
            for index, (width_in, width_out, shape) in enumerate(shapes):
                weight, scale, bias = block[4 + 3 * index : 7 + 3 * index]
                if weight.shape != shape or scale.numel() != width_out or bias.numel() != width_out:
                    raise ValueError(
                        f"hfgpt::{op}: block {layer}'s layer {index} ({width_in} inputs, {width_out} outputs) "
                        f"needs a packed weight of shape {shape} and {width_out} scales and biases, got "
                        f"{tuple(weight.shape)}, {scale.numel()} and {bias.numel()}"
                    )
    return _run_step(
        "int8_linear", op, ids, positions, wte, wpe, inner, blocks, keys, values, past, mask, scalings, eps,
        pre_norm, final_norm, final_eps,
    )  # fmt: skip


def _check_norms(op: str, layer: int, norms: list[Tensor], width: int) -> None:
    for index, norm in enumerate(norms):
        if norm.numel() != width:
            raise ValueError(
                f"hfgpt::{op}: block {layer}'s norm tensor {index} holds {norm.numel()} values for {width}"
            )


@_decoding_op(mutates_args=("keys", "values"))
def float_decode_step(
    ids: Tensor, positions: Tensor, wte: Tensor, wpe: Tensor, blocks: list[Tensor], keys: list[Tensor],
    values: list[Tensor], past: int, mask: Tensor | None, scalings: list[float], eps: float, pre_norm: bool,
    final_norm: list[Tensor], final_eps: float,
) -> Tensor:  # fmt: skip
    """`int8_decode_step` for a float32 model (`hfgpt.cpu.decoding`, csrc/row_product.c): `blocks` holds
    `FLOAT_BLOCK_TENSORS` tensors a block: ln_1's weight and bias, ln_2's, then c_attn, the attention's
    c_proj, c_fc and the MLP's c_proj, each as its Conv1D weight `[in, out]` and bias."""
    op, layers = "float_decode_step", len(keys)
    types = {torch.float32: [wte, wpe, *keys, *values, *final_norm, *blocks]}
    width = _check_step(
        op, FLOAT_BLOCK_TENSORS, ids, positions, wte, wpe, blocks, keys, values, past, mask, scalings,
        final_norm, types,
    )  # fmt: skip
    inner = blocks[9].numel()  # (c_fc's bias)
    shapes = [(width, 3 * width), (width, width), (width, inner), (inner, width)]
    expected = [(width,)] * 4 + [
        shape for width_in, width_out in shapes for shape in ((width_in, width_out), (width_out,))
    ]
    if list(map(_SHAPE, blocks)) != expected * layers:
        for layer in range(layers):
            block = blocks[FLOAT_BLOCK_TENSORS * layer : FLOAT_BLOCK_TENSORS * (layer + 1)]
            _check_norms(op, layer, block[:4], width)
            for index, (width_in, width_out) in enumerate(shapes):
                weight, bias = block[4 + 2 * index : 6 + 2 * index]
                if weight.shape != (width_in, width_out) or bias.shape != (width_out,):
                    raise ValueError(
                        f"hfgpt::{op}: block {layer}'s layer {index} needs a ({width_in}, {width_out}) weight and "
                        f"{width_out} biases, got {tuple(weight.shape)} and {tuple(bias.shape)}"
                    )
    return _run_step(
        "row_product", op, ids, positions, wte, wpe, inner, blocks, keys, values, past, mask, scalings, eps,
        pre_norm, final_norm, final_eps,
    )  # fmt: skip


@torch.library.register_fake("hfgpt::float_decode_step")
@torch.library.register_fake("hfgpt::int8_decode_step")
def _(ids: Tensor, positions: Tensor, wte: Tensor, *_: object) -> Tensor:
    return wte.new_empty(ids.numel(), wte.shape[1])
