"""Faster CPU decoding with lower-precision weights: int8 or bfloat16.

One decoding step streams every weight once, so float32 decoding is bound by memory bandwidth; int8
weights read a quarter of the bytes, bfloat16 half. `benchmarks/bench_model.py` (section `lowp`)
measures the speed and the accuracy cost (logit error, top-1 and greedy agreement) beside float32.
"""

import copy
import warnings

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .modeling_hfgpt import GPTPreTrainedModel


def _conv1d_to_linear(model: nn.Module) -> None:
    """Replace each Conv1D (`[in, out]` weights, as OpenAI's releases) by the equivalent `nn.Linear`
    (`[out, in]`), in place."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                linear = nn.Linear(child.weight.shape[0], child.weight.shape[1])
                linear.weight.data = child.weight.data.t().contiguous()
                linear.bias.data = child.bias.data.clone()
                setattr(module, name, linear)


def quantize_for_decoding(model: GPTPreTrainedModel, dtype: torch.dtype = torch.qint8) -> GPTPreTrainedModel:
    """A copy of `model` with int8 (`torch.qint8`, the default) or `torch.bfloat16` weights for CPU
    inference; `model` itself is left untouched.

    Each Conv1D becomes the equivalent `nn.Linear` first:
    - int8: torch.ao dynamic quantisation, which handles `nn.Linear` only. The LM head, tied to `wte`,
      gets its own int8 copy while the embedding lookup stays float32. Weights get one scale per output
      channel (a per-tensor scale costs ~4x more logit error on GPT-2 shapes); activations are
      quantised per batch at run time.
    - bfloat16: the whole model in bfloat16. For one row, the CPU's bfloat16 kernels read an `[out, in]`
      weight ~1.6x faster than Conv1D's `[in, out]` (768 x 3072: 159-174 vs 251-271 us, weights not in
      cache), which a plain `model.to(torch.bfloat16)` would keep.
    The copy is for inference: save the float32 model, not this one.
    """
    if dtype not in (torch.qint8, torch.bfloat16):
        raise ValueError(f"quantize_for_decoding makes torch.qint8 or torch.bfloat16 weights, not {dtype}")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("quantize_for_decoding makes a CPU model; move the model to the CPU first")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("quantize_for_decoding expects float32 weights; call model.float() first")
    model = copy.deepcopy(model).eval()
    _conv1d_to_linear(model)
    if dtype == torch.bfloat16:
        return model.to(torch.bfloat16)
    with warnings.catch_warnings():
        # torch.ao's eager quantisation is deprecated in favour of torchao (not a dependency); it ships
        # and works in the torch versions this project supports.
        warnings.simplefilter("ignore", (DeprecationWarning, UserWarning))
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        return quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)


__all__ = ["quantize_for_decoding"]
