"""Configuration for hfgpt: one config class covering OpenAI's GPT-1 and GPT-2 decoders.

Everything that differs between the two originals is a typed field, never a name check:

| field                 | GPT-1 (Radford et al., 2018)     | GPT-2 (Radford et al., 2019)        |
|-----------------------|----------------------------------|-------------------------------------|
| `layer_norm_position` | "post": LN after each residual   | "pre": LN before each sub-layer,    |
|                       | add, no final LN                 | plus a final `ln_f`                 |
| `n_positions`         | 512                              | 1024                                |
| `vocab_size`          | 40478 (BPE, `</w>` word ends)    | 50257 (byte-level BPE)              |
| `scale_residual_init` | False (N(0, 0.02) everywhere)    | True (residual projections / √2L)   |

This file is self-contained (transformers only) so that it can be copied next to a checkpoint and loaded
with `trust_remote_code=True` where hfgpt is not installed.
"""

from typing import Any, Literal

from huggingface_hub.dataclasses import strict
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

# Named presets. Each row cites where its numbers come from.
PRESETS: dict[str, dict[str, Any]] = {
    # GPT-1: "Improving Language Understanding by Generative Pre-Training", §4.1 (12 layers, 768 wide,
    # 12 heads, 3072 inner, 512 tokens, 40,000 BPE merges) and openai/finetune-transformer-lm train.py
    # (n_vocab 40478 = len(encoder_bpe_40000.json), post-norm blocks, tanh GELU, eps 1e-5).
    "openai-gpt": dict(
        vocab_size=40478,
        n_positions=512,
        n_embd=768,
        n_layer=12,
        n_head=12,
        layer_norm_position="post",
        scale_residual_init=False,
        bos_token_id=None,
        eos_token_id=None,
    ),
    # GPT-2: openai/gpt-2 models/{124M,355M,774M,1558M}/hparams.json (n_vocab 50257, n_ctx 1024) and
    # src/model.py (pre-norm blocks with a final ln_f, eps 1e-5, tanh GELU).
    "gpt2": dict(n_embd=768, n_layer=12, n_head=12),  # 124M
    "gpt2-medium": dict(n_embd=1024, n_layer=24, n_head=16),  # 355M
    "gpt2-large": dict(n_embd=1280, n_layer=36, n_head=20),  # 774M
    "gpt2-xl": dict(n_embd=1600, n_layer=48, n_head=25),  # 1558M
}

# Activations accepted by `activation_function`. GPT-1 and GPT-2 both use the tanh approximation of GELU
# (`gelu_new`); the others exist for checkpoints trained with them.
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu", "silu", "swish")

# transformers' OpenAIGPT names its tanh GELU "gelu" (modeling_openai.ACT_FNS maps it to gelu_new).
OPENAI_GPT_AFN = {"gelu": "gelu_new", "relu": "relu", "silu": "silu", "swish": "silu"}


@strict(accept_kwargs=True)
class GPTConfig(PretrainedConfig):
    r"""Configuration of an hfgpt model (GPT-1 or GPT-2). Defaults are GPT-2 small (124M).

    Args:
        vocab_size: number of tokens (GPT-2 50257, GPT-1 40478, plus any added tokens).
        n_positions: context length (GPT-2 1024, GPT-1 512).
        n_embd: width of the residual stream.
        n_layer: number of transformer blocks.
        n_head: attention heads; must divide `n_embd`.
        n_inner: MLP width, `None` for 4 * n_embd.
        activation_function: MLP activation; `gelu_new` is the tanh GELU of both originals.
        resid_pdrop, embd_pdrop, attn_pdrop: dropout probabilities.
        layer_norm_epsilon: epsilon of every layer norm (1e-5 in both originals).
        layer_norm_position: "pre" (GPT-2, with a final `ln_f`) or "post" (GPT-1, no final norm).
        scale_residual_init: initialise residual projections with std / sqrt(2 * n_layer) (GPT-2 §2.3).
        initializer_range: std of the normal initialisation.
        scale_attn_weights: divide attention scores by sqrt(head_dim).
        scale_attn_by_inverse_layer_idx: additionally divide them by (layer_idx + 1).
        reorder_and_upcast_attn: compute scores and softmax in float32 under lower precision.
        summary_*: the sequence-summary head of `GPTDoubleHeadsModel` (as transformers' GPT2Config).
        summary_dropout_shared: draw one `summary_first_dropout` mask per example and apply it to every
            choice (GPT-1's train.py drops the pooled states of ROCStories' two endings with noise shape
            [B, 1, E]); False draws one per choice, as transformers' GPT2DoubleHeadsModel does.
        classifier_dropout: dropout before the token-classification head.
        score_bias: give the sequence-classification projection a bias (GPT-1's `clf` has one).
        score_dropout: dropout on the pooled state before that projection (train.py's `clf_pdrop`, 0.1;
            0 here by default, as transformers' GPT2ForSequenceClassification has none).
        classify_token_id: id of GPT-1's `_classify_` token; sequence heads pool at it when present.
        lm_loss_weight: lambda of GPT-1's auxiliary objective L3 = L2 + lambda * L1 (§3.2); 0 disables it.
    """

    model_type = "hfgpt"
    # The cache (`cache` since transformers 5.24, `past_key_values` before) and scalar loss terms: not
    # predictions for Trainer to gather at evaluation ("loss" too, which Trainer keeps among the predictions
    # when a batch lacks one of the label names, e.g. mc_labels alone).
    keys_to_ignore_at_inference = [
        "cache",
        "past_key_values",
        "loss",
        "classification_loss",
        "lm_loss",
        "mc_loss",
    ]
    attribute_map = {
        "hidden_size": "n_embd",
        "max_position_embeddings": "n_positions",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
        "intermediate_size": "n_inner",
    }

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: Literal["gelu_new", "gelu_pytorch_tanh", "gelu", "relu", "silu", "swish"] = (
        "gelu_new"
    )
    resid_pdrop: float | int = 0.1
    embd_pdrop: float | int = 0.1
    attn_pdrop: float | int = 0.1
    layer_norm_epsilon: float = 1e-5
    layer_norm_position: Literal["pre", "post"] = "pre"
    scale_residual_init: bool = True
    initializer_range: float = 0.02
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    reorder_and_upcast_attn: bool = False
    summary_type: Literal["last", "first", "mean", "cls_index"] = "cls_index"
    summary_use_proj: bool = True
    summary_activation: str | None = None
    summary_proj_to_labels: bool = True
    summary_first_dropout: float | int = 0.1
    summary_dropout_shared: bool = False
    classifier_dropout: float | int = 0.1
    score_bias: bool = False
    score_dropout: float | int = 0.0
    classify_token_id: int | None = None
    lm_loss_weight: float | int = 0.0
    use_cache: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | list[int] | None = 50256
    pad_token_id: int | None = None
    tie_word_embeddings: bool = True

    def validate_hfgpt_sizes(self) -> None:
        """Refuse impossible shapes at construction, naming the field at fault."""
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value}")
        if self.n_inner is not None and self.n_inner <= 0:
            raise ValueError(f"GPTConfig.n_inner must be a positive integer or None, got {self.n_inner}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by GPTConfig.n_head ({self.n_head})"
            )
        for name in (
            "resid_pdrop",
            "embd_pdrop",
            "attn_pdrop",
            "summary_first_dropout",
            "classifier_dropout",
            "score_dropout",
        ):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"GPTConfig.{name} must be in [0, 1), got {value}")
        if self.layer_norm_epsilon <= 0:
            raise ValueError(f"GPTConfig.layer_norm_epsilon must be positive, got {self.layer_norm_epsilon}")
        if self.summary_activation is not None and self.summary_activation not in ACT2FN:
            raise ValueError(
                f"GPTConfig.summary_activation {self.summary_activation!r} is not an activation transformers "
                f"knows (transformers.activations.ACT2FN: {', '.join(sorted(ACT2FN))}); None for none"
            )
        if self.lm_loss_weight < 0:
            raise ValueError(f"GPTConfig.lm_loss_weight must be >= 0, got {self.lm_loss_weight}")
        if self.classify_token_id is not None and not 0 <= self.classify_token_id < self.vocab_size:
            raise ValueError(
                f"GPTConfig.classify_token_id ({self.classify_token_id}) is outside the vocabulary "
                f"(vocab_size {self.vocab_size})"
            )

    @property
    def inner_size(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "GPTConfig":
        """Build the config of a released model: one of `PRESETS` (e.g. "gpt2-medium", "openai-gpt")."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def get_config_dict(
        cls, pretrained_model_name_or_path: Any, **kwargs: Any
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        # A `gpt2` / `openai-gpt` config.json reads as the hfgpt config it is equivalent to, before
        # `from_pretrained` compares model types: it would warn that loading one "is not supported and can
        # yield errors", which hfgpt supports on purpose. Other model types still get that warning.
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        return translate_transformers_config(config_dict), kwargs

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> "GPTConfig":
        # Accept configs written by transformers' own GPT2* (`gpt2`) and OpenAIGPT* (`openai-gpt`) classes,
        # so their checkpoints load directly into hfgpt models.
        return super().from_dict(translate_transformers_config(config_dict), **kwargs)


def translate_transformers_config(config_dict: dict[str, Any]) -> dict[str, Any]:
    """Turn a transformers `gpt2` / `openai-gpt` config dict into the equivalent hfgpt config dict."""
    model_type = config_dict.get("model_type")
    if model_type not in ("gpt2", "openai-gpt"):
        return config_dict
    # n_ctx: the context length's old name, kept in their config.json beside n_positions (which hfgpt reads).
    dropped = ("model_type", "architectures", "auto_map", "n_ctx")
    out = {k: v for k, v in config_dict.items() if k not in dropped}
    out.pop("add_cross_attention", None)
    if model_type == "openai-gpt":
        afn = out.pop("afn", "gelu")
        if afn not in OPENAI_GPT_AFN:
            raise ValueError(f"openai-gpt config: unsupported afn {afn!r}")
        out.update(
            activation_function=OPENAI_GPT_AFN[afn],
            layer_norm_position="post",
            scale_residual_init=False,
            bos_token_id=out.get("bos_token_id"),
            eos_token_id=out.get("eos_token_id"),
        )
    else:
        out.setdefault("layer_norm_position", "pre")
    return out


__all__ = ["ACTIVATIONS", "GPTConfig", "PRESETS", "translate_transformers_config"]
