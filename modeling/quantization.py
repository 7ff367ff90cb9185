"""Faster CPU decoding from a copy of the model: int8 or bfloat16 weights, or float32 in the layout the
one-row kernels read fastest.

One decoding step streams every weight once, so float32 decoding is bound by how fast the matrix-vector
kernels read the weights; int8 weights read a quarter of the bytes, bfloat16 half. `benchmarks/
bench_model.py` (section `lowp`) measures the speed and the accuracy cost (logit error, top-1 and greedy
agreement) beside float32.
"""

import copy
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from .modeling_hfgpt import GPTPreTrainedModel
from .ops_hfgpt import (
    FEW_ROWS,
    fast_product_applies,
    few_rows_product,
    needs_grad,
    onednn_mm,
    onednn_runs_here,
)


class DecodingLinear(nn.Linear):
    """`nn.Linear` with faster CPU products for inference.

    - float32, 1-`FEW_ROWS` rows (a decoding step): `few_rows_product`, as `project_to_vocab` computes the
      LM head: MKL's one-row kernel for `F.linear` reads the weight ~1.3-1.8x slower (GPT-2's 768 x 2304
      / 768 x 3072 / 3072 x 768 weights, out of cache: 279 / 361 / 493 us for Conv1D's addmm against
      152 / 221 / 357 us this way); one row split between the threads (`one_row_product`).
    - bfloat16 without gradients: oneDNN's linear op (`_bfloat16_onednn_applies`), which read GPT-2's
      weights at one row faster than `F.linear`'s bfloat16 path (the 50257 x 768 head 4.9 against 7.1
      ms; 768 x 3072 308 against 397 us) with the same values (GPT-2 logits equal, greedy tokens equal).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows > 0 and _bfloat16_onednn_applies(x, self.weight, self.bias):
            out = onednn_mm(x.reshape(rows, -1), self.weight, self.bias)
            return out.view(*x.shape[:-1], -1)
        if not (0 < rows <= FEW_ROWS and fast_product_applies(x, self.weight)):
            return F.linear(x, self.weight, self.bias)
        out = few_rows_product(x.reshape(rows, -1), self.weight)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], -1)


def _bfloat16_onednn_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """bfloat16 tensors without gradients, where `onednn_runs_here` (which `use_onednn_products(False)` and
    `torch.backends.mkldnn.flags(enabled=False)` turn off)."""
    return (
        onednn_runs_here(x)
        and x.dtype == weight.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
        and not needs_grad(x, weight, *([] if bias is None else [bias]))
    )


def _conv1d_to_linear(model: nn.Module, cls: type[nn.Linear] = nn.Linear) -> None:
    """Replace each Conv1D (`[in, out]` weights, as OpenAI's releases) by the equivalent `cls` (an
    `nn.Linear`, `[out, in]` weights), in place."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                linear = cls(child.weight.shape[0], child.weight.shape[1])
                linear.weight.data = child.weight.data.t().contiguous()
                linear.bias.data = child.bias.data.clone()
                setattr(module, name, linear)


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
    """The message refusing `action` (saving, pushing, exporting) on a copy made by
    `quantize_for_decoding`, or None for any other model.

    Such a copy cannot be written as a checkpoint: its `nn.Linear` weights are `[out, in]` under the keys
    of Conv1D's `[in, out]` ones (float32, bfloat16: `from_pretrained` refuses the non-square ones and
    loads a square `c_proj` transposed, without a word), or packed int8 parameters that safetensors cannot
    hold."""
    dtype = getattr(model, DECODING_COPY_ATTRIBUTE, None)
    return None if dtype is None else _decoding_copy_message(action, dtype)


def _decoding_copy_message(action: str, dtype: torch.dtype) -> str:
    return (
        f"{action} refused: this model is a decoding copy made by quantize_for_decoding ({dtype}), whose "
        "layers no longer have the checkpoint's layout; save or export the float32 model it was made from"
    )


def _refuse(action: str, dtype: torch.dtype) -> Callable[..., NoReturn]:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(_decoding_copy_message(action, dtype))

    return refuse


def _mark_decoding_copy(model: GPTPreTrainedModel, dtype: torch.dtype) -> GPTPreTrainedModel:
    """Mark `model` as a decoding copy and shadow its writers (instance attributes, which `copy.deepcopy`
    of the copy keeps) so that they refuse, naming what to save instead."""
    setattr(model, DECODING_COPY_ATTRIBUTE, dtype)
    for action in ("save_pretrained", "push_to_hub"):
        setattr(model, action, _refuse(action, dtype))
    return model


def quantize_for_decoding(model: GPTPreTrainedModel, dtype: torch.dtype = torch.qint8) -> GPTPreTrainedModel:
    """A copy of `model` with int8 (`torch.qint8`, the default), `torch.bfloat16` or `torch.float32`
    weights for CPU inference; `model` itself is left untouched.

    Each Conv1D becomes the equivalent `nn.Linear` first:
    - float32: nothing is quantised: `DecodingLinear` layers give the same values (to float rounding)
      and the same greedy tokens, and decoding steps run faster (GPT-2 124M: 20.0 vs 24.3 ms a step at
      one row in benchmarks/RESULTS.md; 64 new tokens at eight rows, 3.33 vs 3.94 s). The copy holds a
      second set of weights: drop the original when memory matters.
    - int8: torch.ao dynamic quantisation, which handles `nn.Linear` only. The LM head, tied to `wte`,
      gets its own int8 copy while the embedding lookup stays float32. Weights get one scale per output
      channel (a per-tensor scale costs ~4x more logit error on GPT-2 shapes); activations are
      quantised per batch at run time.
    - bfloat16: the whole model in bfloat16, every linear layer and the LM head a `DecodingLinear` (its
      products through oneDNN's linear op). For one row, the CPU's bfloat16 kernels read an `[out, in]`
      weight ~1.6x faster than Conv1D's `[in, out]` (768 x 3072: 159-174 vs 251-271 us, weights not in
      cache), which a plain `model.to(torch.bfloat16)` would keep.
    The copy is for inference: its `save_pretrained`, `push_to_hub` and `interop.to_transformers` refuse
    it (ValueError); save the float32 model instead.
    """
    if dtype not in (torch.qint8, torch.bfloat16, torch.float32):
        raise ValueError(
            f"quantize_for_decoding makes torch.qint8, torch.bfloat16 or torch.float32 weights, not {dtype}"
        )
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("quantize_for_decoding makes a CPU model; move the model to the CPU first")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("quantize_for_decoding expects float32 weights; call model.float() first")
    model = copy.deepcopy(model).eval()
    if dtype == torch.float32:
        _conv1d_to_linear(model, DecodingLinear)
        return _mark_decoding_copy(model, dtype)
    if dtype == torch.bfloat16:
        _conv1d_to_linear(model, DecodingLinear)
        _head_to_decoding_linear(model)
        return _mark_decoding_copy(model.to(torch.bfloat16), dtype)
    _conv1d_to_linear(model)
    with warnings.catch_warnings():
        # torch.ao's eager quantisation is deprecated in favour of torchao (not a dependency); it ships
        # and works in the torch versions this project supports.
        warnings.simplefilter("ignore", (DeprecationWarning, UserWarning))
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        quantized = quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    return _mark_decoding_copy(quantized, dtype)


__all__ = ["DecodingLinear", "decoding_copy_error", "quantize_for_decoding"]
