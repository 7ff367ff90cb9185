"""How the CPU backend plugs into hfgpt's models (docs/cpu-backend.md, "How it plugs in"): once, at the class,
as Liger's `apply_liger_kernel_to_*` functions do, `install()` wraps `GPTForCausalLM.forward` in `forward`
below, which runs a decoding step in one call into C where `hfgpt.cpu.decoding` says that computes what the
model's own code would, and otherwise the model file's forward with the same arguments. Nothing is set on a
model but one flag (`kernelize`, `unkernelize`), so it pickles, copies and saves as the plain one. Prefill and
training run the model file's code: no faster path for them beat transformers' own by a margin worth its code
on every host (benchmarks/RESULTS.md).
"""

import functools
import inspect
import os
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from hfgpt.modeling.modeling_hfgpt import GPTForCausalLM, cache_field

from .checks import has_forward_hooks
from .decoding import decoding_step, watch_code
from .products import few_rows_applies, few_rows_product

ENV_SWITCH = "HFGPT_CPU_BACKEND"
_FLAG = "_hfgpt_cpu_backend"  # in a model's __dict__: True after `kernelize`, False after `unkernelize`
_MODEL_FILE_FORWARD = GPTForCausalLM.forward


def enabled_by_default() -> bool:
    """Whether hfgpt's causal LMs run the backend unless told otherwise: yes unless the environment sets
    `HFGPT_CPU_BACKEND=0` (read when hfgpt is imported)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


_DEFAULT = enabled_by_default()


def runs_backend(model: nn.Module) -> bool:
    """Whether `model` (a `GPTForCausalLM`) runs the backend: its flag, else the default."""
    flag = model.__dict__.get(_FLAG)
    return _DEFAULT if flag is None else flag


@functools.wraps(_MODEL_FILE_FORWARD)
def forward(
    self: GPTForCausalLM, input_ids: torch.LongTensor | None = None, cache: Any = None,
    attention_mask: torch.Tensor | None = None, token_type_ids: torch.LongTensor | None = None,
    position_ids: torch.LongTensor | None = None, inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None, use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0, **kwargs: Any,
) -> CausalLMOutputWithPast | tuple:  # fmt: skip
    """`GPTForCausalLM.forward`, a decoding step of which runs in one call into C where it computes what
    the model's own code would (`decoding_step`), its LM head's few rows as `few_rows_product`."""
    if (
        labels is None
        and token_type_ids is None
        and inputs_embeds is None
        and isinstance(logits_to_keep, int)
        and runs_backend(self)
        and type(self) is GPTForCausalLM
    ):
        outputs = decoding_step(self._modules["transformer"], input_ids, cache, attention_mask, position_ids,
                                use_cache, kwargs)  # fmt: skip
        if outputs is not None:
            hidden = outputs.last_hidden_state[:, -logits_to_keep:, :]  # (B, 1, E)
            return CausalLMOutputWithPast(
                logits=_head(self._modules["lm_head"], hidden), **cache_field(outputs)
            )
    return _MODEL_FILE_FORWARD(
        self, input_ids, cache, attention_mask, token_type_ids, position_ids, inputs_embeds, labels,
        use_cache, logits_to_keep, **kwargs,
    )  # fmt: skip


# generate() reads the forward's parameters at every step: the model file's, computed once
forward.__signature__ = inspect.signature(_MODEL_FILE_FORWARD)
watch_code(nn.Linear, "forward")  # (the LM head's, which `_head` computes)


def _head(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`head(hidden)` for a decoding step's (B, 1, E) hidden states: `few_rows_product` for a plain bias-free
    `nn.Linear` head (MKL reads a tall weight slowly at a few rows), the module itself otherwise."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    weight = head._parameters.get("weight") if type(head) is nn.Linear else None
    if (
        weight is None
        or head.bias is not None
        or has_forward_hooks(head)
        or not few_rows_applies(rows, weight)
    ):
        return head(hidden)
    return few_rows_product(rows, weight).view(*hidden.shape[:-1], -1)


def install() -> None:
    """Wrap `GPTForCausalLM.forward` (once): hfgpt's causal LMs then run the backend where their flag, or
    the default, says so (`kernelize`, `unkernelize`, `HFGPT_CPU_BACKEND`)."""
    if GPTForCausalLM.forward is _MODEL_FILE_FORWARD:
        GPTForCausalLM.forward = forward


def kernelize(model: nn.Module) -> nn.Module:
    """Run the backend in every `GPTForCausalLM` of `model` (a model, or any module holding models), whatever
    the default. Returns `model`."""
    install()
    for module in model.modules():
        if isinstance(module, GPTForCausalLM):
            module.__dict__[_FLAG] = True
    return model


def unkernelize(model: nn.Module) -> nn.Module:
    """Run the model file's code alone in every `GPTForCausalLM` of `model`. Returns `model`."""
    for module in model.modules():
        if isinstance(module, GPTForCausalLM):
            module.__dict__[_FLAG] = False
    return model


def is_kernelized(model: nn.Module) -> bool:
    """Whether any `GPTForCausalLM` of `model` runs the backend."""
    return GPTForCausalLM.forward is forward and any(
        isinstance(module, GPTForCausalLM) and runs_backend(module) for module in model.modules()
    )
