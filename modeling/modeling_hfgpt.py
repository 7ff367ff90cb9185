"""hfgpt models: OpenAI's GPT-1 and GPT-2 decoders as transformers `PreTrainedModel`s.

Order: building blocks (activation, attention, MLP, block, sequence summary), the `PreTrainedModel` base, the
base model, then the heads. Module names equal the keys of OpenAI's GPT-2 release and of transformers'
`GPT2LMHeadModel` (`transformer.h.{i}.attn.c_attn`, ...), and linear weights keep their Conv1D layout
`[in, out]`, so converting a checkpoint is a table, not a rename.

This file says what GPT-1 and GPT-2 compute, with public torch and transformers APIs only: it is copied
next to every checkpoint (with `configuration_hfgpt.py`) for `trust_remote_code=True` users, and runs the
same on any device. hfgpt's CPU backend (`hfgpt.cpu`) plugs in from outside; this file never imports it.
"""

import contextlib
import inspect
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt2.modeling_gpt2 import GPT2DoubleHeadsModelOutput
from transformers.pytorch_utils import Conv1D
from transformers.utils import ModelOutput, logging
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_hfgpt import GPTConfig

logger = logging.get_logger(__name__)

# transformers 5.24 renamed the key-value cache from `past_key_values` to `cache`: the models' argument, the
# field of their outputs (BaseModelOutputWithPast, ...), and what generate() passes and reads. The models here
# take `cache` (and, through `_cache_argument`, `past_key_values`) and return the installed version's field.
CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(BaseModelOutputWithPast)} else "past_key_values"


def cache_field(outputs: ModelOutput) -> dict[str, Cache | None]:
    """The cache `outputs` carry, as the keyword argument of another output: `{CACHE_FIELD: cache}`."""
    return {CACHE_FIELD: getattr(outputs, CACHE_FIELD)}


def _cache_argument(cache: Cache | None, kwargs: dict[str, Any]) -> Cache | None:
    """`cache`, or the cache passed by its name before transformers 5.24, `past_key_values` (taken out of
    `kwargs`), which transformers 5.23's generate() passes; deprecated (a FutureWarning, as transformers' own
    models give) where transformers has moved on."""
    old = kwargs.pop("past_key_values", None)
    if old is None:
        return cache
    if cache is not None:
        raise ValueError("Pass the cache once, as `cache` (`past_key_values` is its name before 5.24).")
    if CACHE_FIELD == "cache" and not torch.compiler.is_compiling():
        warnings.warn("`past_key_values` is deprecated: pass `cache`", FutureWarning, stacklevel=3)
    return old


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU, as both originals compute it (GPT-2 model.py `gelu`)."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention that also returns the weights (for `output_attentions=True`)."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling  # (B, H, T, S)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2)  # (B, T, H, D)
    return output, weights


class GPTAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.is_causal = True
        # One scale for every backend: 1/sqrt(d) (both originals), optionally / (layer_idx + 1).
        self.scaling = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scaling /= float(layer_idx + 1)
        self.c_attn = Conv1D(3 * config.n_embd, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, config.n_embd)
        self.c_proj.is_residual_projection = True  # scaled at initialisation (`scale_residual_init`)
        self.attn_dropout = config.attn_pdrop
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, T, E)
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, seq_len, _ = hidden_states.shape
        qkv = self.c_attn(hidden_states).view(batch, seq_len, 3, self.num_heads, self.head_dim)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, D)
        if cache is not None:
            # `kwargs`: continuous batching's paged cache writes the attention's arguments into them.
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)

        attention_interface = self.attention_interface()
        input_dtype = query.dtype
        if input_dtype not in (torch.float32, torch.float64) and self.config.reorder_and_upcast_attn:
            # GPT-2's `reorder_and_upcast_attn`: scores and softmax in float32 under lower precision,
            # honoured by every backend by running it in float32.
            query, key, value = query.float(), key.float(), value.float()
        output, weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attn_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        output = output.to(input_dtype).reshape(batch, seq_len, self.num_heads * self.head_dim)  # (B, T, E)
        output = self.resid_dropout(self.c_proj(output))
        return output, weights

    def attention_interface(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
        """The attention function `config._attn_implementation` names in transformers' registry (eager,
        sdpa, flex_attention, flash_attention_2, ...). A backend may set its own on an instance."""
        return ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )


class GPTMLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = Conv1D(config.inner_size, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, config.inner_size)
        self.c_proj.is_residual_projection = True  # scaled at initialisation (`scale_residual_init`)
        self.act = ACTIVATIONS[config.activation_function]
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(hidden_states))))


class GPTBlock(GradientCheckpointingLayer):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.pre_norm = config.layer_norm_position == "pre"
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPTAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPTMLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if self.pre_norm:
            # GPT-2 model.py `block`: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))
            attn_out, _ = self.attn(self.ln_1(hidden_states), attention_mask, cache, **kwargs)
            hidden_states = hidden_states + attn_out
            return hidden_states + self.mlp(self.ln_2(hidden_states))
        # GPT-1 train.py `block`: n = ln_1(x + attn(x)); h = ln_2(n + mlp(n))
        attn_out, _ = self.attn(hidden_states, attention_mask, cache, **kwargs)
        normed = self.ln_1(hidden_states + attn_out)
        return self.ln_2(normed + self.mlp(normed))


class GPTSequenceSummary(nn.Module):
    """Pool one hidden state per sequence and project it (GPT-1's `clf` head, transformers' GPT2 summary).

    Parameter names (`summary.weight`, `summary.bias`) match transformers' `GPT2SequenceSummary` so
    `multiple_choice_head.*` keys load from `GPT2DoubleHeadsModel` / `OpenAIGPTDoubleHeadsModel`.
    """

    def __init__(self, config: GPTConfig, num_outputs: int):
        super().__init__()
        self.summary_type = config.summary_type
        self.summary: nn.Module = nn.Identity()
        if config.summary_use_proj:
            out = num_outputs if config.summary_proj_to_labels and num_outputs > 0 else config.n_embd
            self.summary = nn.Linear(config.n_embd, out)
        # As transformers' GPT2SequenceSummary: any of its activations by name, none for None.
        self.activation: Callable = (
            ACT2FN[config.summary_activation] if config.summary_activation else nn.Identity()
        )
        self.first_dropout = nn.Dropout(config.summary_first_dropout)
        self.dropout_shared = config.summary_dropout_shared

    def forward(self, hidden_states: torch.Tensor, cls_index: torch.Tensor | None = None) -> torch.Tensor:
        # hidden_states: (..., T, E); cls_index: (...) positions, default the last one.
        if self.summary_type == "last":
            output = hidden_states[..., -1, :]
        elif self.summary_type == "first":
            output = hidden_states[..., 0, :]
        elif self.summary_type == "mean":
            output = hidden_states.mean(dim=-2)
        else:  # "cls_index"
            if cls_index is None:
                output = hidden_states[..., -1, :]
            else:
                index = cls_index[..., None, None].expand(*cls_index.shape, 1, hidden_states.size(-1))
                output = hidden_states.gather(-2, index).squeeze(-2)
        if self.dropout_shared and self.training and output.dim() >= 3:  # (B, C, E): one mask for C choices
            keep = self.first_dropout(output.new_ones(*output.shape[:-2], 1, output.shape[-1]))
            return self.activation(self.summary(output * keep))
        return self.activation(self.summary(self.first_dropout(output)))


# Every head, for `config.auto_map` in saved checkpoints (trust_remote_code users load any of them).
AUTO_MAP = {
    "AutoConfig": "configuration_hfgpt.GPTConfig",
    "AutoModel": "modeling_hfgpt.GPTModel",
    "AutoModelForCausalLM": "modeling_hfgpt.GPTForCausalLM",
    "AutoModelForSequenceClassification": "modeling_hfgpt.GPTForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_hfgpt.GPTForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_hfgpt.GPTForQuestionAnswering",
}

# transformers' OpenAIGPT* checkpoints name the embeddings differently; everything else matches.
OPENAI_GPT_RENAMES = {"tokens_embed.": "wte.", "positions_embed.": "wpe."}
# The same renames as `from_pretrained(key_mapping=...)` patterns (regular expressions).
OPENAI_GPT_KEY_MAPPING = {re.escape(old): new for old, new in OPENAI_GPT_RENAMES.items()}


def record_every_head(config: GPTConfig) -> None:
    """Put `auto_map` for every head in `config` before it is saved: transformers records only the saved
    class, and trust_remote_code users may load any head."""
    config.auto_map = {**(getattr(config, "auto_map", None) or {}), **AUTO_MAP}


# The code files of a checkpoint for trust_remote_code users: the two `AUTO_MAP` modules, which import
# nothing else of hfgpt.
REMOTE_CODE_FILES = ("configuration_hfgpt.py", "modeling_hfgpt.py")


def copy_remote_code(save_directory: str | os.PathLike) -> None:
    """Copy `REMOTE_CODE_FILES` next to a checkpoint (transformers copies them only for classes with an
    Auto class of their own, which GPTDoubleHeadsModel lacks)."""
    here = Path(__file__).parent
    for name in REMOTE_CODE_FILES:
        shutil.copyfile(here / name, Path(save_directory) / name)


@contextlib.contextmanager
def _named_as_own_class(model: nn.Module) -> Iterator[None]:
    """Within the block, a class that torch built around the model's class at run time bears the name and
    module of the class it wraps.

    FSDP2's `fully_shard` (and `replicate`) swap the model's class for `FSDP<name>(FSDPModule, <name>)`,
    made by `type()` in torch's `_fsdp_init`. transformers' `save_pretrained` names and copies the code of
    the instance's class for trust_remote_code (`custom_object_save`: `auto_map` gets
    `_fsdp_init.FSDPGPTForCausalLM`, and torch's `_fsdp_*.py` files are copied beside the checkpoint, which
    then fail to load: torch's operators registered twice). Named as the class it wraps, the same call
    records hfgpt's class and copies hfgpt's two code files (`push_to_hub` uploads within that call)."""
    cls = type(model)
    if not cls.__module__.startswith("torch."):
        yield
        return
    wrapped = next(c for c in cls.__mro__[1:] if issubclass(c, GPTPreTrainedModel))
    names = cls.__module__, cls.__name__
    cls.__module__, cls.__name__ = wrapped.__module__, wrapped.__name__
    try:
        yield
    finally:
        cls.__module__, cls.__name__ = names


def _unpoolable_batch(n_rows: int, clf_id: int | None = None) -> ValueError:
    """The error for a batch of several sequences that a classification head cannot pool without a pad token."""
    return ValueError(
        f"Cannot pool a batch of {n_rows} sequences without a pad token: set "
        "`model.config.pad_token_id` (e.g. to the tokenizer's pad or eos id) so the last "
        "non-padding token of each row can be found"
        + (f", or end every sequence with the classify token {clf_id}" if clf_id is not None else "")
        + "."
    )


def weighted_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """sum_i weights[i] * CE(logits[i], targets[i]) over rows, computed in float32."""
    losses = F.cross_entropy(logits.float(), targets, reduction="none")
    return (losses * weights).sum()


# Logits formed at a time by `LinearCrossEntropy`, whatever the vocabulary: on the CPU 2**26 (256 MB in
# float32), elsewhere 2**30 (2 GB in bfloat16). A GPU wants few, large slices: each slice's three products
# shrink with it, and the one that sums over the vocabulary (the hidden states' gradient) runs far below a
# GPU's rate on a few thousand rows. benchmarks/RESULTS.md has the measurements behind both numbers.
LOSS_CHUNK_ELEMENTS = 1 << 26
ACCELERATOR_LOSS_CHUNK_ELEMENTS = 1 << 30


class LinearCrossEntropy(torch.autograd.Function):
    """The causal-LM loss of a bias-free head, `sum(CE(hidden @ weight.T, targets)) / divisor` over the rows
    whose target is not `ignore_index`, without the N x V logits ever existing at once.

    The forward pass takes `chunk_rows` rows at a time: their logits, log-softmax and loss, then right away
    the gradient of that loss, softmax - onehot, through the head's two products into the gradients of the
    hidden states (N x E) and of the weight (V x E), which it keeps; the backward pass scales them by the
    loss's gradient. The same products as `F.linear`, `F.cross_entropy` and their backward, in the same
    precision: autocast's dtype (or the inputs') for the products, float32 for the softmax, the loss and the
    weight's gradient sum. Plain autograd instead keeps the float32 logits, their log-softmax and two
    gradients of that size: at GPT-2's vocabulary, 200 KB a token each.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # (N, E)
        weight: torch.Tensor,  # (V, E)
        targets: torch.Tensor,  # (N,) token ids or ignore_index
        divisor: torch.Tensor,  # () the summed loss is divided by it
        ignore_index: int,
        chunk_rows: int,
    ) -> torch.Tensor:
        device = hidden.device.type
        autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else hidden.dtype
        low_weight = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        exact = torch.float64 if dtype == torch.float64 else torch.float32  # of the softmax and the sums
        grad_weight = torch.zeros_like(weight, dtype=exact) if weight.requires_grad else None
        loss = hidden.new_zeros((), dtype=exact)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = hidden[start : start + chunk_rows].to(dtype)
            chunk_targets = targets[start : start + chunk_rows]
            counted = chunk_targets != ignore_index
            target = torch.where(counted, chunk_targets, 0)[:, None]
            log_probs = torch.log_softmax(rows @ low_weight.T, dim=-1, dtype=exact)  # (C, V)
            loss = loss - (log_probs.gather(1, target).squeeze(1) * counted).sum()
            # d loss / d logits = (softmax - onehot) / divisor on counted rows, 0 elsewhere
            scale = counted[:, None] / divisor
            if torch.compiler.is_compiling():
                # the one-hot as a comparison: one fused pass over the slice (a scatter would split it in two)
                onehot = torch.arange(log_probs.shape[1], device=log_probs.device) == target
                grad = (log_probs.exp() - onehot.to(exact)) * scale
            else:
                # in place, so that one slice of logits is all the memory this takes
                grad = log_probs.exp_().scatter_add_(1, target, counted[:, None].to(exact).neg())
                grad = grad.mul_(scale)
            grad = grad.to(dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + chunk_rows] = grad @ low_weight
            if grad_weight is not None:
                grad_weight += grad.T @ rows
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss / divisor

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss
        if grad_weight is not None:
            grad_weight = grad_weight * grad_loss
        return grad_hidden, grad_weight, None, None, None, None


def linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' `ForCausalLMLoss(hidden_states @ weight.T, labels, ...)`, the same arguments and value
    (labels shifted inside, `ignore_index` skipped, the mean over counted tokens, or the sum divided by
    `num_items_in_batch` under Trainer's gradient accumulation), through `LinearCrossEntropy`."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden_states.device)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"labels hold {targets.shape[0]} positions but the hidden states {hidden.shape[0]} "
            f"(labels shape {tuple(shift_labels.shape)}, inputs {tuple(hidden_states.shape[:-1])})"
        )
    if num_items_in_batch is None:
        divisor = (targets != ignore_index).sum()
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device)
    elements = LOSS_CHUNK_ELEMENTS if hidden.device.type == "cpu" else ACCELERATOR_LOSS_CHUNK_ELEMENTS
    chunk_rows = max(1, elements // weight.shape[0])
    return LinearCrossEntropy.apply(hidden, weight, targets, divisor, ignore_index, chunk_rows)


class GPTPreTrainedModel(PreTrainedModel):
    config_class = GPTConfig
    config: GPTConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["GPTBlock"]
    _skip_keys_device_placement = ["cache", "past_key_values"]  # the cache by either name (`CACHE_FIELD`)
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "hidden_states": GPTBlock,
        "attentions": OutputRecorder(GPTAttention, index=1),
    }
    # Causal-mask buffers of older GPT-2 / OpenAIGPT checkpoints; masks are built on the fly here.
    _keys_to_ignore_on_load_unexpected = [r"\.attn\.bias$", r"\.attn\.masked_bias$"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, Conv1D):
            std = self.config.initializer_range
            # GPT-2 §2.3: "scale the weights of residual layers at initialization by 1/sqrt(N)" where N is
            # the number of residual layers (two per block). GPT-1 used N(0, 0.02) everywhere. Decided on the
            # projection itself: transformers never calls `_init_weights` on a custom-code module without
            # parameters of its own (GPTAttention, GPTMLP), as GPT2LMHeadModel's scaling does.
            if self.config.scale_residual_init and getattr(module, "is_residual_projection", False):
                std /= (2 * self.config.n_layer) ** 0.5
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.bias)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any):
        # Checkpoints of transformers' OpenAIGPT* classes load directly (their config is translated by
        # GPTConfig.from_dict); the renames match nothing in hfgpt's or GPT2*'s own keys.
        kwargs.setdefault("key_mapping", OPENAI_GPT_KEY_MAPPING)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def save_pretrained(
        self, save_directory: Any, is_main_process: bool = True, *args: Any, **kwargs: Any
    ) -> None:
        # Loadable with trust_remote_code where hfgpt is not installed, through any head's Auto class.
        record_every_head(self.config)
        with _named_as_own_class(self):
            super().save_pretrained(save_directory, is_main_process, *args, **kwargs)
        if is_main_process:
            copy_remote_code(save_directory)

    def _pool_positions(
        self, input_ids: torch.Tensor | None, n_rows: int, seq_len: int, require_pad: bool = True
    ) -> torch.Tensor:
        """Index of the token each sequence is summarised at: GPT-1's `_classify_` token where the
        recipe placed one (train.py pools at the `clf_token`), else the last non-padding token. Without a
        pad token a batch is refused (`require_pad`, as GPT2ForSequenceClassification) or pooled at the
        last position (as GPT2DoubleHeadsModel)."""
        device = input_ids.device if input_ids is not None else self.device
        positions = torch.arange(seq_len, device=device)
        last = torch.full((n_rows,), seq_len - 1, device=device, dtype=torch.long)
        pad_id = self.config.pad_token_id
        if input_ids is None:  # inputs_embeds: no token to find, the last position (as GPT2*)
            if pad_id is None and n_rows != 1 and require_pad:
                raise _unpoolable_batch(n_rows)
            return last
        input_ids = input_ids.reshape(n_rows, seq_len)
        clf_id = self.config.classify_token_id
        if clf_id is not None:
            is_clf = input_ids == clf_id
            if bool(is_clf.any(dim=-1).all()):
                return (positions * is_clf).argmax(-1)
        if pad_id is None:
            if n_rows != 1 and require_pad:
                raise _unpoolable_batch(n_rows, clf_id)
            return last
        # Rightmost non-pad token: works for left and right padding alike (as GPT2ForSequenceClassification).
        return (positions * (input_ids != pad_id)).argmax(-1)

    def _auxiliary_lm_loss(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        head: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """GPT-1's auxiliary LM objective L1 on the task inputs (Radford et al. 2018, §3.2, train.py `model`):
        next-token cross-entropy with the (tied) LM head, averaged over each sequence's real tokens (mask
        M[:, 1:]), then over sequences. Returns the LM logits at every position and L1. One deliberate
        difference: train.py's single matrix `we` also holds the position rows, so its softmax normalises
        over them too; here it runs over the vocabulary only, as every LM head in transformers does
        (targets are never positions). `head` is the LM head, or the token embeddings it is tied to."""
        head_weight = getattr(head, "weight", None)
        if isinstance(head_weight, torch.Tensor) and head_weight.is_meta and not hidden_states.is_meta:
            # accelerate's offloading (device_map) keeps it there outside the module's own call; a product
            # of real hidden states with it would not fail but return garbage.
            raise ValueError(
                "The auxiliary LM loss (config.lm_loss_weight > 0) multiplies by the LM head's weight (the "
                "tied token embeddings), which is offloaded (on the meta device): load the model without "
                "offloading transformer.wte (and lm_head), or set config.lm_loss_weight = 0."
            )
        targets, weights = self._auxiliary_lm_targets(input_ids, attention_mask)
        logits = (
            F.linear(hidden_states, head.weight) if isinstance(head, nn.Embedding) else head(hidden_states)
        )
        return logits, weighted_cross_entropy(logits.reshape(len(weights), -1), targets, weights)

    def _auxiliary_lm_targets(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The next-token targets at every position and each one's weight in L1: 1 / (its sequence's count
        of real next tokens) / (the number of sequences); the last position, which has no next token,
        weighs 0 (so one head product gives every position's logits)."""
        seq_len = input_ids.shape[-1]
        targets = input_ids.reshape(-1, seq_len)[:, 1:]
        if attention_mask is not None:
            mask = attention_mask.reshape(-1, seq_len)[:, 1:].float()
        elif self.config.pad_token_id is not None:
            mask = (targets != self.config.pad_token_id).float()
        else:
            mask = torch.ones_like(targets, dtype=torch.float32)
        weights = F.pad(mask / mask.sum(-1, keepdim=True).clamp(min=1) / len(targets), (0, 1)).reshape(-1)
        return F.pad(targets, (0, 1)).reshape(-1), weights


def _values_readable(*tensors: torch.Tensor) -> bool:
    """Whether the values of `tensors` can be read back to check them: plain tensors (not fake, functional,
    batched or other subclasses), eagerly (outside compile, export and tracing), not on the meta device."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    for tensor in tensors:
        if type(tensor) is not torch.Tensor or tensor.is_meta:
            return False
        try:
            tensor.data_ptr()  # functorch's vmap and grad wrappers have no memory of their own
        except RuntimeError:
            return False
    return True


def _cache_batch(cache: Cache | None) -> int | None:
    """The batch size a `DynamicCache`'s keys were stored for (its append would broadcast a batch of one
    to any other, silently); None for other caches, which check their own shapes."""
    layers = getattr(cache, "layers", None)
    if not isinstance(cache, DynamicCache) or not layers or not getattr(layers[0], "is_initialized", False):
        return None
    keys = getattr(layers[0], "keys", None)
    return keys.shape[0] if isinstance(keys, torch.Tensor) and keys.ndim == 4 else None


def _check_index_range(ids: torch.Tensor, size: int, message: str) -> None:
    """A clear error for ids outside an embedding table of `size` rows (F.embedding's comes from deep
    inside torch); `message` is formatted with the offending id as `bad`."""
    if ids.numel() == 0:
        return
    low, high = torch.aminmax(ids)
    if int(low) < 0 or int(high) >= size:
        raise ValueError(message.format(bad=int(low) if int(low) < 0 else int(high)))


class GPTModel(GPTPreTrainedModel):
    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([GPTBlock(config, layer_idx=i) for i in range(config.n_layer)])
        # GPT-2 adds a final layer norm after the last pre-norm block; GPT-1 has none.
        self.ln_f = (
            nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
            if config.layer_norm_position == "pre"
            else None
        )
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, new_embeddings: nn.Embedding) -> None:
        self.wte = new_embeddings

    def _check_inputs(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        batch: int,
        seq_len: int,
        past_seen: int,
        position_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        cache_batch: int | None = None,
    ) -> None:
        """Clear errors for inputs that would otherwise fail deep inside torch (or silently wrap).
        `cache_batch`: the batch size a DynamicCache holding `past_seen` positions was filled for."""
        total = past_seen + seq_len
        # Past the context, explicit position_ids may still lie inside it: left padding takes columns, not
        # positions (generate() numbers a padded row's tokens from its first real one). They are then
        # checked below whatever the device; without them the positions would run up to `total - 1`.
        beyond_context = total > self.config.n_positions
        if beyond_context and position_ids is None:
            raise ValueError(
                f"Sequence length {total} (input {seq_len} + cached {past_seen}) exceeds the model's "
                f"context of {self.config.n_positions} positions (config.n_positions)."
            )
        # Reading the ids back costs a device-to-host sync: on accelerators it is done for the prompt
        # only, not for each decoding step (whose tokens the model itself produced).
        if input_ids is not None and (past_seen == 0 or input_ids.device.type == "cpu"):
            self.check_input_ids(input_ids)
        context, vocab = self.config.n_positions, self.wte.num_embeddings
        for ids, size, message in (
            (
                position_ids,
                context,
                f"position_ids contains {{bad}}, outside the context [0, {context}) (config.n_positions)",
            ),
            (
                token_type_ids,
                vocab,
                f"token_type_ids contains {{bad}}, outside [0, {vocab}): token types are embedded with the "
                "token embeddings",
            ),
        ):
            if ids is not None and (
                past_seen == 0 or ids.device.type == "cpu" or (ids is position_ids and beyond_context)
            ):
                _check_index_range(ids, size, message)
        if (
            attention_mask is not None
            and attention_mask.ndim == 2
            and tuple(attention_mask.shape) != (batch, total)
        ):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, expected ({batch}, {total}) "
                f"= (batch, cached + input length)"
            )
        if cache_batch not in (None, batch):
            raise ValueError(
                f"The cache holds {cache_batch} sequences, but the input has {batch}: pass the cache "
                "of these sequences (or reorder/repeat it first)"
            )

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        """A clear error for token ids outside the embeddings (F.embedding's would come from deep in torch)."""
        vocab = self.wte.num_embeddings
        _check_index_range(
            input_ids,
            vocab,
            f"input_ids contains token id {{bad}}, outside the vocabulary [0, {vocab}) of the model's "
            "embeddings (did the tokenizer add tokens without `model.resize_token_embeddings`?)",
        )

    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        cache = _cache_argument(cache, kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        # Leading dimensions beyond the batch (e.g. (B, choices, T) for multiple choice) are flattened.
        input_shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        seq_len = input_shape[-1]
        if seq_len == 0:
            raise ValueError(
                f"The input has no tokens (shape {tuple(input_shape)}): pass at least one token per sequence."
            )
        if input_ids is not None:
            input_ids = input_ids.reshape(-1, seq_len)
        else:
            inputs_embeds = inputs_embeds.reshape(-1, seq_len, inputs_embeds.shape[-1])
        batch = input_ids.shape[0] if input_ids is not None else inputs_embeds.shape[0]
        if attention_mask is not None and attention_mask.ndim == len(input_shape) and len(input_shape) > 2:
            attention_mask = attention_mask.reshape(batch, -1)

        training = self.training and torch.is_grad_enabled()
        if use_cache is None:
            # `config.use_cache` is inference's default: a training forward fills no cache unless asked to
            # (it would hold a copy of every layer's keys and values that nothing reads).
            use_cache = self.config.use_cache and not training
        elif use_cache and training and self.gradient_checkpointing:
            logger.warning_once(
                "`use_cache=True` is incompatible with gradient checkpointing: no cache is kept."
            )
            use_cache = False
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        # (continuous batching's paged cache is no `Cache` and comes with position_ids)
        past_seen = cache.get_seq_length() if isinstance(cache, Cache) else 0
        checked = [t for t in (input_ids, position_ids, token_type_ids) if t is not None]
        if _values_readable(*checked):
            cache_batch = _cache_batch(cache) if past_seen else None
            self._check_inputs(
                input_ids,
                attention_mask,
                batch,
                seq_len,
                past_seen,
                position_ids,
                token_type_ids,
                cache_batch,
            )

        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        positions_given = position_ids is not None  # (packed sequences come as position ids that restart)
        if position_ids is None:
            position_ids = (torch.arange(seq_len, device=inputs_embeds.device) + past_seen).unsqueeze(0)
        hidden_states = inputs_embeds + self.wpe(position_ids)
        if token_type_ids is not None:
            # GPT-2 and transformers embed token types with the token embedding matrix.
            hidden_states = hidden_states + self.wte(token_type_ids.reshape(-1, seq_len))
        hidden_states = self.drop(hidden_states)  # (B, T, E)

        if (
            attention_mask is None
            and cache is None
            and not positions_given
            and self.config._attn_implementation == "sdpa"
        ):
            # Every token sees all before it and nothing else: sdpa's own `is_causal=True` (what its sdpa
            # entry runs for a mask of None), which runs its flash kernels. transformers' `create_causal_mask`
            # returns None here too, except under torch.compile before torch 2.14, where it builds a
            # (T, T) mask that sends sdpa to a slower kernel in every compiled training step.
            causal_mask = None
        else:
            # Positional: the cache argument is `past_key_values` before transformers 5.24.
            causal_mask = create_causal_mask(self.config, inputs_embeds, attention_mask, cache, position_ids)
        # A checkpointed block runs again in the backward pass and would fill the cache twice: it gets none, as
        # in GPT2Model (transformers' GradientCheckpointingLayer drops a cache passed by its keyword, which
        # 5.24 renamed). Without gradients nothing runs again.
        recomputed = self.gradient_checkpointing and training
        block_cache = None if recomputed else cache
        for block in self.h:
            hidden_states = block(
                hidden_states, causal_mask, block_cache, position_ids=position_ids, **kwargs
            )
        if self.ln_f is not None:
            hidden_states = self.ln_f(hidden_states)
        hidden_states = hidden_states.view(*input_shape, hidden_states.shape[-1])
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states, **{CACHE_FIELD: cache if use_cache else None}
        )


class GPTForCausalLM(GPTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.transformer = GPTModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def generate(self, inputs: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        ids = inputs if inputs is not None else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if isinstance(ids, torch.Tensor) and ids.ndim > 0 and ids.shape[0] == 0:
            # (transformers' loop fails inside a max() over the empty batch)
            raise ValueError(f"generate() got a batch of 0 sequences (input shape {tuple(ids.shape)}).")
        return super().generate(inputs, *args, **kwargs)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """`labels` are the input ids (shifted inside, -100 ignored); `logits_to_keep=k` computes
        logits for the last k positions only (generate() asks for 1)."""
        outputs: BaseModelOutputWithPast = self.transformer(
            input_ids,
            cache=cache,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,  # the heads read fields; their own return_dict is handled by can_return_tuple
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if labels is not None and self._fused_loss_applies(hidden_states, logits_to_keep):
            # Training: the head and its loss together, without the full float32 logits (returned as None).
            loss = linear_cross_entropy(hidden_states, self.lm_head.weight, labels, **kwargs)
            return CausalLMOutputWithPast(
                loss=loss,
                **cache_field(outputs),
                hidden_states=outputs.hidden_states,
                attentions=outputs.attentions,
            )
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])
        loss = None
        if labels is not None:
            # transformers' causal-LM loss (ForCausalLMLoss): shifted, float32, -100 ignored.
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **cache_field(outputs),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def _fused_loss_applies(self, hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> bool:
        """Whether the loss runs through `linear_cross_entropy`: in training (train mode, gradients on), with
        transformers' own loss function and every position's logits asked for, and a plain bias-free head
        (not one whose forward a user or accelerate's offloading replaced, nor one whose weight is
        offloaded)."""
        head = self.lm_head
        return (
            self.training
            and torch.is_grad_enabled()
            and self.loss_function is ForCausalLMLoss
            and isinstance(logits_to_keep, int)
            and logits_to_keep == 0
            and type(head) is nn.Linear
            and head.bias is None
            and "forward" not in head.__dict__
            and not head.weight.is_meta
        )


@dataclass
class GPTSequenceClassifierOutput(SequenceClassifierOutputWithPast):
    """`loss` is L3 = L2 + lambda * L1 (GPT-1 §3.3); its two terms are reported separately. The fields of
    transformers' output come first (the cache under its installed name, `CACHE_FIELD`), so return_dict=False
    tuples hold them where GPT-2 code indexes them."""

    classification_loss: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None


class GPTForSequenceClassification(GPTPreTrainedModel):
    """Classification / regression from the hidden state at the last non-padding token, or at GPT-1's
    `_classify_` token (`config.classify_token_id`) where the recipe's input transform placed one.

    `input_ids` of shape (B, K, T) pool K sequences per example and add their representations: GPT-1's
    similarity transform (§3.3, "both possible sentence orderings ... added element-wise").
    With `config.lm_loss_weight` > 0 the loss is L2 + lambda * L1, L1 the auxiliary LM loss on the inputs.
    """

    # Its loss is a mean over the batch: Trainer must scale it for gradient accumulation itself, not pass
    # num_items_in_batch (which **kwargs would otherwise advertise as handled).
    accepts_loss_kwargs = False

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = GPTModel(config)
        self.dropout = nn.Dropout(config.score_dropout)
        self.score = nn.Linear(config.n_embd, config.num_labels, bias=config.score_bias)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> GPTSequenceClassifierOutput:
        auxiliary_lm = labels is not None and self.config.lm_loss_weight > 0 and input_ids is not None
        outputs: BaseModelOutputWithPast = self.transformer(
            input_ids,
            cache=cache,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        hidden = outputs.last_hidden_state  # (B, [K,] T, E)
        batch, seq_len = hidden.shape[0], hidden.shape[-2]
        flat = hidden.reshape(-1, seq_len, hidden.shape[-1])
        index = self._pool_positions(input_ids, flat.shape[0], seq_len)
        pooled = flat[torch.arange(flat.shape[0], device=flat.device), index]  # (B*K, E)
        pooled = pooled.reshape(batch, -1, pooled.shape[-1]).sum(1)  # K orderings added: (B, E)
        logits = self.score(self.dropout(pooled))  # (B, num_labels)

        loss = classification_loss = lm_loss = None
        if labels is not None:
            classification_loss = self._classification_loss(logits, labels)
            loss = classification_loss
            if auxiliary_lm:
                _, lm_loss = self._auxiliary_lm_loss(
                    hidden, input_ids, attention_mask, self.get_input_embeddings()
                )
                loss = classification_loss + self.config.lm_loss_weight * lm_loss
        return GPTSequenceClassifierOutput(
            loss=loss,
            logits=logits,
            classification_loss=classification_loss,
            lm_loss=lm_loss,
            **cache_field(outputs),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def _classification_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labels = labels.to(logits.device)
        if self.config.problem_type is None:
            if self.num_labels == 1:
                self.config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                self.config.problem_type = "single_label_classification"
            else:
                self.config.problem_type = "multi_label_classification"
        if self.config.problem_type == "regression":
            if self.num_labels == 1:
                return F.mse_loss(logits.squeeze(-1), labels.squeeze(-1).to(logits.dtype))
            return F.mse_loss(logits, labels.to(logits.dtype))
        if self.config.problem_type == "single_label_classification":
            flat = labels.reshape(-1)
            if _values_readable(flat):
                bad = flat[(flat != -100) & ((flat < 0) | (flat >= self.num_labels))]
                if bad.numel():
                    raise ValueError(
                        f"label {int(bad[0])} is outside [0, {self.num_labels}) (config.num_labels)"
                    )
            return F.cross_entropy(logits.reshape(-1, self.num_labels), flat)
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


@dataclass
class GPTDoubleHeadsModelOutput(GPT2DoubleHeadsModelOutput):
    """`loss` is the training objective: mc_loss + lambda * lm_loss when `mc_labels` are given
    (GPT-1's L3), else lm_loss. `lm_loss` and `mc_loss` are also reported on their own. The fields of
    transformers' output come first, as GPTSequenceClassifierOutput's."""

    lm_loss: torch.Tensor | None = None


class GPTDoubleHeadsModel(GPTPreTrainedModel, GenerationMixin):
    """LM head plus a multiple-choice head: GPT-1's fine-tuning model (ROCStories, RACE: one sequence
    `[_start_] context [_delimiter_] answer_k [_classify_]` per choice, §3.3)."""

    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    accepts_loss_kwargs = False  # a batch-mean loss, as GPTForSequenceClassification

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.transformer = GPTModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.multiple_choice_head = GPTSequenceSummary(config, num_outputs=1)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        mc_token_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        mc_labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> GPTDoubleHeadsModelOutput:
        """input_ids: (B, C, T) for C choices. mc_token_ids: (B, C) positions to classify at; by default
        the `_classify_` token, else the last non-padding token. labels: LM labels (shifted inside)."""
        auxiliary_lm = (
            labels is None
            and mc_labels is not None
            and self.config.lm_loss_weight > 0
            and input_ids is not None
        )
        outputs: BaseModelOutputWithPast = self.transformer(
            input_ids,
            cache=cache,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        hidden = outputs.last_hidden_state  # (B, C, T, E)
        if mc_token_ids is None:
            seq_len = hidden.shape[-2]
            n_rows = hidden[..., 0, 0].numel()
            mc_token_ids = self._pool_positions(input_ids, n_rows, seq_len, require_pad=False)
            mc_token_ids = mc_token_ids.reshape(hidden.shape[:-2])
        mc_logits = self.multiple_choice_head(hidden, mc_token_ids).squeeze(-1)  # (B, C)

        mc_loss = lm_loss = loss = None
        if mc_labels is not None:
            mc_loss = F.cross_entropy(mc_logits.reshape(-1, mc_logits.size(-1)), mc_labels.reshape(-1))
        if auxiliary_lm:
            lm_logits, lm_loss = self._auxiliary_lm_loss(hidden, input_ids, attention_mask, self.lm_head)
        else:
            lm_logits = self.lm_head(hidden)
            if labels is not None:  # transformers' causal-LM loss: shifted, float32, -100 ignored
                lm_loss = ForCausalLMLoss(lm_logits, labels, vocab_size=self.config.vocab_size)
        if mc_loss is not None:
            loss = mc_loss if lm_loss is None else mc_loss + self.config.lm_loss_weight * lm_loss
        else:
            loss = lm_loss
        return GPTDoubleHeadsModelOutput(
            loss=loss,
            mc_loss=mc_loss,
            lm_loss=lm_loss,
            logits=lm_logits,
            mc_logits=mc_logits,
            **cache_field(outputs),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class GPTForTokenClassification(GPTPreTrainedModel):
    accepts_loss_kwargs = False  # a batch-mean loss, as GPTForSequenceClassification

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = GPTModel(config)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.n_embd, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> TokenClassifierOutput:
        outputs: BaseModelOutputWithPast = self.transformer(
            input_ids,
            cache=cache,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(self.dropout(outputs.last_hidden_state))  # (B, T, num_labels)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, self.num_labels), labels.reshape(-1).to(logits.device))
        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class GPTForQuestionAnswering(GPTPreTrainedModel):
    accepts_loss_kwargs = False  # a batch-mean loss, as GPTForSequenceClassification

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.transformer = GPTModel(config)
        self.qa_outputs = nn.Linear(config.n_embd, 2)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        **kwargs: Any,
    ) -> QuestionAnsweringModelOutput:
        outputs: BaseModelOutputWithPast = self.transformer(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).unbind(-1)  # 2 x (B, T)
        loss = None
        if start_positions is not None and end_positions is not None:
            # Positions outside the input are ignored, as in transformers' QA heads.
            ignored = start_logits.size(1)
            start = start_positions.reshape(-1).clamp(0, ignored).to(start_logits.device)
            end = end_positions.reshape(-1).clamp(0, ignored).to(end_logits.device)
            loss = (
                F.cross_entropy(start_logits, start, ignore_index=ignored)
                + F.cross_entropy(end_logits, end, ignore_index=ignored)
            ) / 2
        return QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits.contiguous(),
            end_logits=end_logits.contiguous(),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


GPTConfig.register_for_auto_class()
GPTModel.register_for_auto_class("AutoModel")
GPTForCausalLM.register_for_auto_class("AutoModelForCausalLM")
GPTForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
GPTForTokenClassification.register_for_auto_class("AutoModelForTokenClassification")
GPTForQuestionAnswering.register_for_auto_class("AutoModelForQuestionAnswering")
# GPTDoubleHeadsModel has no matching Auto class (AutoModelForMultipleChoice expects `labels` for the
# choices and no LM head); saving it still records the other heads through AUTO_MAP.

# Registered, these classes are remote code to transformers, whose generate() then reads their forward's
# signature at every step (looking for a `cache_position` argument). Held on the function, it is looked up
# instead of rebuilt: about 50 us a token, a few percent of a CUDA-graph decoding step of GPT-2.
GPTForCausalLM.forward.__signature__ = inspect.signature(GPTForCausalLM.forward)
GPTDoubleHeadsModel.forward.__signature__ = inspect.signature(GPTDoubleHeadsModel.forward)

__all__ = [
    "GPTDoubleHeadsModel",
    "GPTForCausalLM",
    "GPTForQuestionAnswering",
    "GPTForSequenceClassification",
    "GPTForTokenClassification",
    "GPTModel",
    "GPTPreTrainedModel",
]
