"""Faster CPU decoding with int8 weights.

One decoding step streams every weight once, so float32 decoding is bound by memory bandwidth; int8
weights read a quarter of the bytes. `benchmarks/bench_model.py` (section `lowp`) measures the speed and
the accuracy cost (logit error, top-1 and greedy agreement) beside float32.
"""

import copy
import warnings

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .modeling_hfgpt import GPTPreTrainedModel


def quantize_for_decoding(model: GPTPreTrainedModel) -> GPTPreTrainedModel:
    """A copy of `model` with int8 weights for CPU inference (torch.ao dynamic quantisation); `model`
    itself is left untouched.

    `quantize_dynamic` handles `nn.Linear` only, so each Conv1D (`[in, out]` weights, as OpenAI's
    releases) becomes the equivalent `nn.Linear` first. The LM head, tied to `wte`, gets its own int8
    copy while the embedding lookup stays float32. Weights get one scale per output channel (a
    per-tensor scale costs ~4x more logit error on GPT-2 shapes); activations are quantised per batch
    at run time.
    """
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("quantize_for_decoding makes a CPU model; move the model to the CPU first")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("quantize_for_decoding expects float32 weights; call model.float() first")
    with warnings.catch_warnings():
        # torch.ao's eager quantisation is deprecated in favour of torchao (not a dependency); it ships
        # and works in the torch versions this project supports.
        warnings.simplefilter("ignore", (DeprecationWarning, UserWarning))
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        model = copy.deepcopy(model).eval()
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, Conv1D):
                    linear = nn.Linear(child.weight.shape[0], child.weight.shape[1])
                    linear.weight.data = child.weight.data.t().contiguous()
                    linear.bias.data = child.bias.data.clone()
                    setattr(module, name, linear)
        return quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)


__all__ = ["quantize_for_decoding"]
