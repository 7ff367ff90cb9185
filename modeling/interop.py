"""Lossless conversion between hfgpt models and transformers' own `GPT2*` / `OpenAIGPT*` classes.

Loading their checkpoints needs nothing from here: `GPTForCausalLM.from_pretrained(path)` reads a
`gpt2` or `openai-gpt` checkpoint directly. This module builds the other direction (and in-memory
conversion both ways): same tensors, same logits.
"""

from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from .configuration_hfgpt import GPTConfig
from .modeling_hfgpt import (
    OPENAI_GPT_RENAMES,
    GPTDoubleHeadsModel,
    GPTForCausalLM,
    GPTForSequenceClassification,
    GPTModel,
    GPTPreTrainedModel,
)

# hfgpt head -> (transformers GPT-2 class, transformers GPT-1 class); None where transformers has none.
_HEADS: dict[type, tuple[str, str | None]] = {
    GPTModel: ("GPT2Model", "OpenAIGPTModel"),
    GPTForCausalLM: ("GPT2LMHeadModel", "OpenAIGPTLMHeadModel"),
    GPTForSequenceClassification: ("GPT2ForSequenceClassification", "OpenAIGPTForSequenceClassification"),
    GPTDoubleHeadsModel: ("GPT2DoubleHeadsModel", "OpenAIGPTDoubleHeadsModel"),
}

# Config fields that exist only in hfgpt; exporting a model that relies on a non-default value would
# change its maths in transformers, so it is refused.
_HFGPT_ONLY_DEFAULTS = {"score_bias": False, "classify_token_id": None, "lm_loss_weight": 0.0}

_GPT2_CONFIG_FIELDS = (
    "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
    "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "initializer_range", "summary_type",
    "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
    "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
    "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip
_OPENAI_GPT_CONFIG_FIELDS = (
    "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "resid_pdrop", "embd_pdrop", "attn_pdrop",
    "layer_norm_epsilon", "initializer_range", "summary_type", "summary_use_proj", "summary_activation",
    "summary_proj_to_labels", "summary_first_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip


class ExportError(ValueError):
    """The model uses something transformers' GPT2 / OpenAIGPT classes cannot express."""


def to_transformers_config(config: GPTConfig) -> transformers.PretrainedConfig:
    """The equivalent `GPT2Config` (pre-norm) or `OpenAIGPTConfig` (post-norm)."""
    for field, default in _HFGPT_ONLY_DEFAULTS.items():
        if getattr(config, field) != default:
            raise ExportError(f"config.{field}={getattr(config, field)!r} has no equivalent in transformers")
    common = {
        "num_labels": config.num_labels,
        "id2label": config.id2label,
        "label2id": config.label2id,
        "problem_type": config.problem_type,
        "tie_word_embeddings": config.tie_word_embeddings,  # an untied head must stay untied
    }
    if config.layer_norm_position == "pre":
        return transformers.GPT2Config(**{f: getattr(config, f) for f in _GPT2_CONFIG_FIELDS}, **common)
    # transformers' OpenAIGPT: fixed tanh GELU ("gelu" there), scaled attention, no n_inner.
    if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ExportError(f"OpenAIGPT supports only the tanh GELU, not {config.activation_function!r}")
    if config.n_inner not in (None, 4 * config.n_embd):
        raise ExportError(f"OpenAIGPT's MLP is 4 * n_embd wide; config.n_inner is {config.n_inner}")
    if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
        raise ExportError("OpenAIGPT always scales attention by 1/sqrt(head_dim) and nothing else")
    return transformers.OpenAIGPTConfig(
        **{f: getattr(config, f) for f in _OPENAI_GPT_CONFIG_FIELDS}, afn="gelu", **common
    )


def _rename(key: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        key = key.replace(old, new)
    return key


def to_transformers(model: GPTPreTrainedModel) -> PreTrainedModel:
    """The same model as one of transformers' own classes, sharing no storage with `model`."""
    heads = _HEADS.get(type(model))
    if heads is None:
        raise ExportError(f"transformers has no GPT2/OpenAIGPT class equivalent to {type(model).__name__}")
    config = to_transformers_config(model.config)
    post_norm = model.config.layer_norm_position == "post"
    cls_name = heads[1] if post_norm else heads[0]
    target_cls = getattr(transformers, cls_name)
    target = target_cls(config)
    renames = {new: old for old, new in OPENAI_GPT_RENAMES.items()} if post_norm else {}
    state = {_rename(k, renames): v.detach().clone() for k, v in model.state_dict().items()}
    result = target.load_state_dict(state, strict=False)
    _check_complete(type(model).__name__, cls_name, result, target)
    return target.train(model.training)


def from_transformers(model: PreTrainedModel) -> GPTPreTrainedModel:
    """An hfgpt model equivalent to a transformers `GPT2*` / `OpenAIGPT*` model."""
    name = type(model).__name__
    ours = next((cls for cls, theirs in _HEADS.items() if name in theirs), None)
    if ours is None:
        raise ExportError(f"no hfgpt equivalent of {name}")
    config = GPTConfig.from_dict(model.config.to_dict())  # from_dict translates gpt2 / openai-gpt
    with torch.device("meta"):
        target = ours(config)
    state = {_rename(k, OPENAI_GPT_RENAMES): v.detach().clone() for k, v in model.state_dict().items()}
    result = target.load_state_dict(state, strict=False, assign=True)
    _check_complete(name, ours.__name__, result, target)
    target.tie_weights()
    return target.train(model.training)


def _check_complete(source: str, target: str, result: Any, model: PreTrainedModel) -> None:
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    missing = [k for k in result.missing_keys if k not in tied]
    unexpected = [k for k in result.unexpected_keys if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise ExportError(f"{source} -> {target}: missing {missing}, unexpected {unexpected}")


__all__ = ["ExportError", "from_transformers", "to_transformers", "to_transformers_config"]
