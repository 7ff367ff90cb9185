"""Lossless conversion between hfgpt models and transformers' own `GPT2*` / `OpenAIGPT*` classes.

Loading their checkpoints needs nothing from here: `GPTForCausalLM.from_pretrained(path)` reads a
`gpt2` or `openai-gpt` checkpoint directly. This module builds the other direction (and in-memory
conversion both ways): same tensors, same logits.
"""

from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from hfgpt.cpu.quantization import decoding_copy_error

from .configuration_hfgpt import ACTIVATIONS, OPENAI_GPT_AFN, GPTConfig
from .modeling_hfgpt import (
    OPENAI_GPT_RENAMES,
    GPTDoubleHeadsModel,
    GPTForCausalLM,
    GPTForQuestionAnswering,
    GPTForSequenceClassification,
    GPTForTokenClassification,
    GPTModel,
    GPTPreTrainedModel,
)

# hfgpt head -> (transformers GPT-2 class, transformers GPT-1 class); None where transformers has none
# (modeling_openai defines no token-classification or question-answering head).
_HEADS: dict[type, tuple[str, str | None]] = {
    GPTModel: ("GPT2Model", "OpenAIGPTModel"),
    GPTForCausalLM: ("GPT2LMHeadModel", "OpenAIGPTLMHeadModel"),
    GPTForSequenceClassification: ("GPT2ForSequenceClassification", "OpenAIGPTForSequenceClassification"),
    GPTDoubleHeadsModel: ("GPT2DoubleHeadsModel", "OpenAIGPTDoubleHeadsModel"),
    GPTForTokenClassification: ("GPT2ForTokenClassification", None),
    GPTForQuestionAnswering: ("GPT2ForQuestionAnswering", None),
}

# hfgpt activation_function -> OpenAIGPTConfig.afn computing the same function. modeling_openai.ACT_FNS:
# "gelu" is NewGELUActivation (the tanh GELU, hfgpt's "gelu_new" / "gelu_pytorch_tanh"), "relu" nn.ReLU,
# "silu" and "swish" both SiLUActivation (hfgpt's both F.silu). hfgpt's "gelu" is the exact (erf) GELU,
# which ACT_FNS lacks.
_OPENAI_GPT_AFN_OF = {
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "swish",
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
    "classifier_dropout",  # read by GPT2ForTokenClassification (its default, 0.1, is hfgpt's too)
)  # fmt: skip
_OPENAI_GPT_CONFIG_FIELDS = (
    "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "resid_pdrop", "embd_pdrop", "attn_pdrop",
    "layer_norm_epsilon", "initializer_range", "summary_type", "summary_use_proj", "summary_activation",
    "summary_proj_to_labels", "summary_first_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
    "classifier_dropout",  # unused by OpenAIGPT's heads; kept so that a round trip keeps it
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
        # The context length under its old name too, as the Hub's gpt2 and openai-gpt config.json have it:
        # transformers reads n_positions, but llama.cpp's GPT-2 converter (convert_hf_to_gguf.py, GPT2Model)
        # reads hparams["n_ctx"] and stops with a KeyError without it.
        "n_ctx": config.n_positions,
    }
    if config.layer_norm_position == "pre":
        return transformers.GPT2Config(**{f: getattr(config, f) for f in _GPT2_CONFIG_FIELDS}, **common)
    # transformers' OpenAIGPT: the activations of ACT_FNS (`afn`), scaled attention, no n_inner.
    afn = _OPENAI_GPT_AFN_OF.get(config.activation_function)
    if afn is None:
        raise ExportError(
            f"config.activation_function={config.activation_function!r} has no OpenAIGPT equivalent "
            f"(OpenAIGPTConfig.afn: the tanh GELU, relu, silu, swish); hfgpt's 'gelu' is the exact erf GELU"
        )
    if config.n_inner not in (None, 4 * config.n_embd):
        raise ExportError(f"OpenAIGPT's MLP is 4 * n_embd wide; config.n_inner is {config.n_inner}")
    if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
        raise ExportError("OpenAIGPT always scales attention by 1/sqrt(head_dim) and nothing else")
    return transformers.OpenAIGPTConfig(
        **{f: getattr(config, f) for f in _OPENAI_GPT_CONFIG_FIELDS}, afn=afn, **common
    )


def _rename(key: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        key = key.replace(old, new)
    return key


def to_transformers(model: GPTPreTrainedModel) -> PreTrainedModel:
    """The same model as one of transformers' own classes, sharing no storage with `model`."""
    refused = decoding_copy_error(model, "to_transformers")
    if refused:
        raise ExportError(refused)
    name = type(model).__name__
    heads = _HEADS.get(type(model))
    if heads is None:
        raise ExportError(f"transformers has no GPT2/OpenAIGPT class equivalent to {name}")
    post_norm = model.config.layer_norm_position == "post"
    cls_name = heads[1] if post_norm else heads[0]
    if cls_name is None:
        raise ExportError(
            f"transformers has no OpenAIGPT class equivalent to {name} with layer_norm_position='post' "
            f"(GPT-1); only a pre-norm (GPT-2) {name} exports, as {heads[0]}"
        )
    _check_summary_type(name, model.config.summary_type)
    config = to_transformers_config(model.config)
    target_cls = getattr(transformers, cls_name)
    # In the model's dtype and device: load_state_dict copies into the target's tensors, so a float32
    # target would silently turn a bfloat16 model into another model.
    target = target_cls(config).to(device=model.device, dtype=model.dtype)
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
    _check_peer_config(name, model.config)
    if ours is GPTDoubleHeadsModel:
        _check_summary_type(name, model.config.summary_type)
    config = GPTConfig.from_dict(model.config.to_dict())  # from_dict translates gpt2 / openai-gpt
    with torch.device("meta"):
        target = ours(config)
    state = {_rename(k, OPENAI_GPT_RENAMES): v.detach().clone() for k, v in model.state_dict().items()}
    result = target.load_state_dict(state, strict=False, assign=True)
    _check_complete(name, ours.__name__, result, target)
    target.tie_weights()
    return target.train(model.training)


def _check_summary_type(name: str, summary_type: str) -> None:
    """Double-heads models pool one state per choice the same way only with "cls_index": transformers'
    GPT2SequenceSummary indexes "last" / "first" / "mean" on axis 1 of its (batch, choices, length, E)
    input (`hidden_states[:, -1]`, `.mean(dim=1)`), the choices, where hfgpt pools each choice's tokens."""
    if name.endswith("DoubleHeadsModel") and summary_type != "cls_index":
        raise ExportError(
            f"{name} with config.summary_type={summary_type!r} computes different mc_logits in transformers "
            "(its summary pools over the choices axis); only summary_type='cls_index' converts"
        )


def _check_peer_config(name: str, config: transformers.PretrainedConfig) -> None:
    """Refuse, naming the field, what hfgpt's GPTConfig cannot express (before its strict validation
    answers with a dataclass error)."""
    if config.model_type == "gpt2":
        if config.activation_function not in ACTIVATIONS:
            raise ExportError(
                f"{name} has config.activation_function={config.activation_function!r}, which hfgpt does "
                f"not implement (GPTConfig.activation_function: {', '.join(ACTIVATIONS)})"
            )
        if getattr(config, "add_cross_attention", False):
            raise ExportError(f"{name} has config.add_cross_attention=True; hfgpt has no cross-attention")
    elif config.model_type == "openai-gpt" and config.afn not in OPENAI_GPT_AFN:  # what from_dict reads
        raise ExportError(
            f"{name} has config.afn={config.afn!r}, which hfgpt does not implement "
            f"(OpenAIGPTConfig.afn: {', '.join(sorted(OPENAI_GPT_AFN))})"
        )


def _check_complete(source: str, target: str, result: Any, model: PreTrainedModel) -> None:
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    missing = [k for k in result.missing_keys if k not in tied]
    unexpected = [k for k in result.unexpected_keys if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise ExportError(f"{source} -> {target}: missing {missing}, unexpected {unexpected}")


__all__ = ["ExportError", "from_transformers", "to_transformers", "to_transformers_config"]
