"""Copies of the model for CPU decoding (docs/cpu-backend.md, "Decoding copies"): int8 or bfloat16 weights,
or the float32 model's own layers with its weights in huge pages. A decoding step streams every weight once,
so it is bound by how fast the weights are read: int8 reads a quarter of float32's bytes, bfloat16 half.
`benchmarks/bench_model.py` (section `lowp`) measures the speed and the accuracy cost beside float32.
"""

import copy
import functools
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from hfgpt.modeling.modeling_hfgpt import GPTBlock, GPTPreTrainedModel
from hfgpt.modeling.modeling_hfgpt import gelu_tanh as plain_gelu_tanh

from . import kernels
from .backend import kernelize
from .checks import (
    float32_vector,
    has_forward_hooks,
    has_storage,
    layer_norm_fits_kernel,
    needs_grad,
    plain_tensors,
)
from .decoding import STEP_KINDS, StepKind, watch_code
from .huge_pages import gather_into_huge_pages
from .products import few_rows_applies, few_rows_product, one_row_bfloat16


class DecodingLinear(nn.Linear):
    """`nn.Linear` with faster CPU products for a decoding step's few rows (`few_rows_product`,
    `one_row_bfloat16`); `F.linear` everywhere else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) if x.numel() else x
        if x.dtype == torch.bfloat16 and len(rows) == 1 and x.numel():
            out = one_row_bfloat16(rows, self.weight, self.bias)
            if out is not None:
                return out.view(*x.shape[:-1], -1)
        if x.dtype != torch.float32 or not x.numel() or not few_rows_applies(rows, self.weight, self.bias):
            return F.linear(x, self.weight, self.bias)
        return few_rows_product(rows, self.weight, self.bias).view(*x.shape[:-1], -1)


# inputs of a row that share one activation scale, and output channels packed together (csrc/int8_linear.c)
INT8_BLOCK, INT8_TILE = kernels.INT8_BLOCK, kernels.INT8_TILE


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _symmetric_int8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 rule of weights and activations alike, along the last dimension: s = max |values| / 127,
    q = round-half-even(values / s) in [-127, 127] (float32 holding integers); q = 0 where s = 0, and
    s = NaN (q = 0) where a NaN or an infinity is among the values. Returns q and s (last dimension 1)."""
    peak = values.abs().amax(-1, keepdim=True)
    scale = torch.where(peak.isfinite(), peak / 127.0, torch.nan)
    q = torch.where(scale > 0, torch.round(values / torch.where(scale > 0, scale, 1.0)), 0.0)
    return q.clamp_(-127, 127), scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` ([rows, in], float32) as the C kernel quantises it: `_symmetric_int8` per `INT8_BLOCK` inputs of
    a row. Returns q (float32 holding integers, zero-padded to the block) and s ([rows, blocks])."""
    rows, width = x.shape
    padded = F.pad(x.to(torch.float32), (0, _round_up(width, INT8_BLOCK) - width))  # (out of place: vmap)
    q, scale = _symmetric_int8(padded.view(rows, padded.shape[1] // INT8_BLOCK, INT8_BLOCK))
    return q.view(padded.shape), scale.squeeze(-1)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights (one scale per output channel: max |row| / 127, values in
    [-127, 127]) and int8 activations with one scale per 64 consecutive inputs of a row, for CPU
    inference: float32 outputs whatever the input's dtype, and no gradient (as torch.ao's quantised layers).

    The product (`torch.ops.hfgpt.int8_linear`) reads the packed weight once, one stream per 32 outputs: at
    one row faster than fbgemm's (benchmarks/RESULTS.md); `reference` is the same arithmetic in torch. Scales
    per 64 inputs keep an outlier from flattening its row, as a scale per row (or batch, as fbgemm's) does."""

    def __init__(
        self, in_features: int, out_features: int, packed: torch.Tensor, scale: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.packed_in = _round_up(in_features, INT8_BLOCK)
        expected = (_round_up(out_features, INT8_TILE) // INT8_TILE, self.packed_in // 4, INT8_TILE, 4)
        self.packed_shape = expected
        if packed.dtype != torch.uint8 or tuple(packed.shape) != expected:
            raise ValueError(
                f"packed int8 weight must be uint8 of shape {expected}, not {packed.dtype} "
                f"{tuple(packed.shape)}"
            )
        if tuple(scale.shape) != (out_features,) or (
            bias is not None and tuple(bias.shape) != (out_features,)
        ):
            given = (tuple(scale.shape), None if bias is None else tuple(bias.shape))
            raise ValueError(f"Int8Linear scale and bias must have shape ({out_features},), not {given}")
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scale", scale.to(torch.float32).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """Quantise a float `[out, in]` weight: scale = max |row| / 127, round half to even."""
        out_features, in_features = weight.shape
        q, scale = _symmetric_int8(weight.detach().to(torch.float32))
        biased = torch.full(
            (_round_up(out_features, INT8_TILE), _round_up(in_features, INT8_BLOCK)), 128, dtype=torch.int16
        )
        biased[:out_features, :in_features] = q.to(torch.int16) + 128  # unsigned bytes for VPDPBUSD
        packed = biased.to(torch.uint8).view(-1, INT8_TILE, biased.shape[1] // 4, 4).permute(0, 2, 1, 3)
        return cls(in_features, out_features, packed.contiguous(), scale.squeeze(1), bias)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        # `.half()`, `.double()`, `.to(dtype)` convert floating buffers: the kernel reads float32 scales
        # and biases, so they stay float32 (the packed weight is uint8, which those leave alone).
        kept = {name: self._buffers[name] for name in ("scale", "bias")}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after is not None and after.dtype != torch.float32:
                self._buffers[name] = before.to(after.device)  # float32 as it was, on the new device
        return self

    def int8_weight(self) -> torch.Tensor:
        """The `[out, in]` int8 weight (before its per-channel scale)."""
        rows = self.packed.permute(0, 2, 1, 3).reshape(-1, self.packed_in)
        return (rows[: self.out_features, : self.in_features].to(torch.int16) - 128).to(torch.int8)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's arithmetic in torch (float32 sums in another order): the fallback and the tests'
        reference."""
        flat = x.reshape(-1, self.in_features).to(torch.float32)
        q, s = quantize_activations(flat)
        dequantized = (q.view(*s.shape, INT8_BLOCK) * s[..., None]).view(q.shape)
        out = F.linear(dequantized[:, : self.in_features], self.int8_weight().to(torch.float32)) * self.scale
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Lean on purpose: one decoding step of GPT-2 makes 49 of these calls.
        width = self.in_features
        if x.shape[-1] != width:
            raise ValueError(f"Int8Linear expects {width} input features, got shape {tuple(x.shape)}")
        buffers = self._buffers  # (the module's __getattr__ is slow for lookups made on every call)
        # (off the CPU, torch's errors; a tensor subclass or buffers replaced by a user: torch's ops on them)
        if (
            not x.is_cpu
            or not plain_tensors(x)
            or not self.buffers_fit_kernel()
            or not kernels.available("int8_linear")
        ):
            with torch.no_grad():
                return self.reference(x)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        if not has_storage(x):  # a functorch transform's wrapper (vmap, grad): torch's ops see through it
            with torch.no_grad():
                return self.reference(x)
        if x.requires_grad:  # inference only, as the reference runs under no_grad
            x = x.detach()
        return kernels.int8_linear(x, buffers["packed"], buffers["scale"], buffers["bias"])

    def buffers_fit_kernel(self) -> bool:
        """Whether the buffers are what the kernel reads: the packed uint8 weight of this layer's shape and
        float32 scales and bias of `out_features`, all contiguous CPU tensors with storage. A buffer
        replaced by another (`layer.packed = ...`) otherwise sends the torch path, which checks shapes."""
        buffers = self._buffers
        packed, scale, bias = buffers["packed"], buffers["scale"], buffers["bias"]
        out = (self.out_features,)
        return (
            packed.dtype == torch.uint8
            and tuple(packed.shape) == self.packed_shape
            and packed.is_contiguous()
            and float32_vector(scale, out)
            and (bias is None or float32_vector(bias, out))
            and has_storage(packed)
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class Int8Block(GPTBlock):
    """A block of an int8 decoding copy: `GPTBlock`'s modules and order of operations, run where it can be
    (`fuses`) in two C calls around the attention, `int8_norm_linear` (ln_1, c_attn) and `int8_block_tail`
    (the rest), instead of about 20 torch ops and module calls, whose overhead was a sizeable share of an int8
    decoding step. The products are `Int8Linear`'s; the layer norms and the GELU are the kernel's own, equal
    to torch's to float rounding (tests/test_int8_block.py measures what that does to the logits)."""

    @classmethod
    def of(cls, block: GPTBlock) -> "Int8Block":
        """An `Int8Block` holding `block`'s modules (the same objects)."""
        with torch.device("meta"):
            new = cls(block.attn.config, block.attn.layer_idx)
        for name, child in block.named_children():
            setattr(new, name, child)
        new.training = block.training  # (the children keep their own modes)
        return new

    def _parts(self) -> tuple[nn.Module, ...]:
        """attn, mlp, ln_1, ln_2, c_attn, attn's c_proj, c_fc, mlp's c_proj, from the modules' own
        dictionaries (`nn.Module.__getattr__` is slow, and this runs on every block of every step)."""
        modules = self._modules
        attn, mlp = modules["attn"], modules["mlp"]
        return (
            attn, mlp, modules["ln_1"], modules["ln_2"],
            attn._modules["c_attn"], attn._modules["c_proj"], mlp._modules["c_fc"], mlp._modules["c_proj"],
        )  # fmt: skip

    def fuses(self, hidden_states: torch.Tensor) -> bool:
        """Whether the fused kernels compute what `GPTBlock.forward` would on `hidden_states`: float32 CPU
        hidden states (B, T, E) that need no gradient, and a block that `fusable` says they compute."""
        return (
            hidden_states.dtype == torch.float32
            and hidden_states.is_cpu
            and hidden_states.dim() == 3
            and has_storage(hidden_states)
            and plain_tensors(hidden_states)
            and not needs_grad(hidden_states)
            and self.fusable(hidden_states.shape[-1])
        )

    def fusable(self, width: int) -> bool:
        """Whether the fused kernels compute what this block's modules would for hidden states of `width`:
        inference, outside autocast and tracing, int8 layers throughout, affine layer norms of one epsilon,
        the tanh GELU, and no hook on a module the fused path would not call."""
        attn, mlp, ln_1, ln_2, c_attn, c_proj, c_fc, mlp_proj = parts = self._parts()
        if (
            self.training
            or attn.training
            or mlp.training
            or type(c_attn) is not Int8Linear
            or type(c_proj) is not Int8Linear
            or type(c_fc) is not Int8Linear
            or type(mlp_proj) is not Int8Linear
            or c_attn.in_features != width
            or mlp.act is not plain_gelu_tanh
            or not (layer_norm_fits_kernel(ln_1, width) and layer_norm_fits_kernel(ln_2, width))
            or ln_1.eps != ln_2.eps
            or not all(layer.buffers_fit_kernel() for layer in (c_attn, c_proj, c_fc, mlp_proj))
            or needs_grad(ln_1.weight, ln_1.bias, ln_2.weight, ln_2.bias)
            or torch.is_autocast_enabled("cpu")
            or torch.jit.is_tracing()
            or any(has_forward_hooks(module) for module in parts)  # code the fused path would not run
        ):
            return False
        return kernels.int8_fused_available()

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:  # fmt: skip
        if not self.fuses(hidden_states):
            return super().forward(hidden_states, attention_mask, cache, **kwargs)
        attn, _, ln_1, ln_2, c_attn, c_proj, c_fc, mlp_proj = self._parts()
        batch, seq_len, width = hidden_states.shape
        h = hidden_states.contiguous()
        norm = (ln_1.weight, ln_1.bias) if self.pre_norm else (None, None)
        qkv = kernels.int8_norm_linear(h, *norm, ln_1.eps, *_kernel_layer(c_attn))
        output = _attend(attn, qkv, attention_mask, cache, **kwargs)
        output = output.reshape(batch * seq_len, width).contiguous()  # (B*T, E)
        layers = (c_proj, c_fc, mlp_proj)
        return kernels.int8_block_tail(
            output, h, self.pre_norm, [ln_1.weight, ln_1.bias, ln_2.weight, ln_2.bias], ln_1.eps,
            [t for layer in layers for t in _kernel_layer(layer)[:2]],
            [_kernel_layer(layer)[2] for layer in layers],
        )  # fmt: skip


def _attend(
    attn: nn.Module, qkv: torch.Tensor, attention_mask: Any, cache: Any, **kwargs: Any
) -> torch.Tensor:
    """What `GPTAttention.forward` computes between its c_attn and c_proj, from c_attn's (B, T, 3E) output:
    the new keys and values into the cache, then the model's attention. Returns the (B, T, H, D) output."""
    batch, seq_len, _ = qkv.shape
    qkv = qkv.view(batch, seq_len, 3, attn.num_heads, attn.head_dim)
    query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, D)
    if cache is not None:
        key, value = cache.update(key, value, attn.layer_idx, kwargs=kwargs)
    output, _ = attn.attention_interface()(
        attn, query, key, value, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs
    )
    return output


def _kernel_layer(layer: Int8Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """An `Int8Linear`'s packed weight, scales and bias, as the int8 kernels take them."""
    buffers = layer._buffers
    return buffers["packed"], buffers["scale"], buffers["bias"]


STEP_KINDS[Int8Block] = StepKind(
    layer_tensors=("packed", "scale", "bias"),
    computes=lambda block, width: (
        block.fusable(width) and all(layer.bias is not None for layer in block._parts()[4:])
    ),
    inner=lambda block: block.mlp.c_fc.out_features,
    step="int8_decode_step",
)
watch_code(Int8Block, "forward")
watch_code(Int8Linear, "forward")


def _replace_layers(model: nn.Module, convert: Callable[[nn.Module], nn.Module | None]) -> None:
    """Replace, in place, each submodule for which `convert` returns a module."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            replacement = convert(child)
            if replacement is not None:
                setattr(module, name, replacement)


def _to_int8(model: nn.Module) -> None:
    """Replace each Conv1D and `nn.Linear` (the LM head included: it gets its own int8 copy of the tied
    embeddings, which stay float32 for the lookup) by an `Int8Linear`, in place."""

    def convert(child: nn.Module) -> Int8Linear | None:
        if isinstance(child, Conv1D):
            return Int8Linear.from_float(child.weight.t(), child.bias)
        if isinstance(child, nn.Linear):
            return Int8Linear.from_float(child.weight, child.bias)
        return None

    _replace_layers(model, convert)
    _replace_layers(model, lambda child: Int8Block.of(child) if type(child) is GPTBlock else None)


def _conv1d_to_linear(model: nn.Module, cls: type[nn.Linear] = nn.Linear) -> None:
    """Replace each Conv1D (`[in, out]` weights, as OpenAI's releases) by the equivalent `cls` (an
    `nn.Linear`, `[out, in]` weights), in place."""

    def convert(child: nn.Module) -> nn.Linear | None:
        if not isinstance(child, Conv1D):
            return None
        linear = cls(child.weight.shape[0], child.weight.shape[1])
        linear.weight.data = child.weight.data.t().contiguous()
        linear.bias.data = child.bias.data.clone()
        return linear

    _replace_layers(model, convert)


def _head_to_decoding_linear(model: nn.Module) -> None:
    """Make a plain `nn.Linear` LM head a `DecodingLinear` holding the same parameters (the tie to the
    token embeddings stays)."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear:
        return
    new = DecodingLinear(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
    new.weight, new.bias = head.weight, head.bias
    model.lm_head = new


# Set on each copy `quantize_for_decoding` returns: the dtype it was made for.
DECODING_COPY_ATTRIBUTE = "hfgpt_decoding_dtype"


def decoding_copy_error(model: Any, action: str) -> str | None:
    """The message refusing `action` (saving, pushing, exporting) on a copy made by `quantize_for_decoding`,
    or None for any other model. Such a copy's `nn.Linear` weights are `[out, in]` under the keys of Conv1D's
    `[in, out]` ones (`from_pretrained` refuses the non-square ones and loads a square `c_proj` transposed,
    without a word), or packed int8 buffers that safetensors cannot hold."""
    dtype = getattr(model, DECODING_COPY_ATTRIBUTE, None)
    return None if dtype is None else _decoding_copy_message(action, dtype)


def _decoding_copy_message(action: str, dtype: torch.dtype) -> str:
    return (
        f"{action} refused: this model is a decoding copy made by quantize_for_decoding ({dtype}), whose "
        "layers no longer have the checkpoint's layout; save or export the float32 model it was made from"
    )


def _refuse(action: str, dtype: torch.dtype, *args: Any, **kwargs: Any) -> NoReturn:
    raise ValueError(_decoding_copy_message(action, dtype))


def _mark_decoding_copy(model: GPTPreTrainedModel, dtype: torch.dtype) -> GPTPreTrainedModel:
    """Mark `model` as a decoding copy and shadow its writers (instance attributes, which `copy.deepcopy`
    of the copy keeps) so that they refuse, naming what to save instead."""
    setattr(model, DECODING_COPY_ATTRIBUTE, dtype)
    for action in ("save_pretrained", "push_to_hub"):
        setattr(model, action, functools.partial(_refuse, action, dtype))  # (a partial pickles)
    return model


def quantize_for_decoding(model: GPTPreTrainedModel, dtype: torch.dtype = torch.qint8) -> GPTPreTrainedModel:
    """A copy of `model` for CPU inference (docs/cpu-backend.md); `model` itself is left untouched.

    - float32: the model's own layers and values, bit for bit, and as fast (benchmarks/RESULTS.md); a
      second set of weights: drop the original when memory matters.
    - int8: every Conv1D and `nn.Linear` (the LM head too: its own int8 copy of the tied `wte`, whose
      lookup stays float32) becomes an `Int8Linear`, each block an `Int8Block`.
    - bfloat16: the whole model in bfloat16, every Conv1D, linear layer and the LM head a `DecodingLinear`:
      for one row, the CPU's bfloat16 kernels read an `[out, in]` weight faster than Conv1D's `[in, out]`,
      which a plain `model.to(torch.bfloat16)` would keep.
    Its weights share one mapping in transparent huge pages (`huge_pages`). Its `save_pretrained`,
    `push_to_hub` and `interop.to_transformers` refuse it (ValueError): save the float32 model instead."""
    if dtype not in (torch.qint8, torch.bfloat16, torch.float32):
        raise ValueError(
            f"quantize_for_decoding makes torch.qint8, torch.bfloat16 or torch.float32 weights, not {dtype}"
        )
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("quantize_for_decoding makes a CPU model; move the model to the CPU first")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("quantize_for_decoding expects float32 weights; call model.float() first")
    model = copy.deepcopy(model).eval()
    if dtype == torch.qint8:
        _to_int8(model)
    elif dtype == torch.bfloat16:
        _conv1d_to_linear(model, DecodingLinear)
        _head_to_decoding_linear(model)
        model = model.to(torch.bfloat16)
    gather_into_huge_pages(model)
    return _mark_decoding_copy(kernelize(model), dtype)


__all__ = [
    "DecodingLinear",
    "Int8Linear",
    "decoding_copy_error",
    "quantize_activations",
    "quantize_for_decoding",
]
