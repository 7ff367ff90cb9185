"""hfgpt tokenizers: GPT-2's byte-level BPE and GPT-1's original ftfy + spaCy + BPE pipeline.

`GPT2Tokenizer()` and `GPT1Tokenizer()` build the released tokenizers from the vocabularies shipped in
`data/`. This package never imports `hfgpt.modeling` (which imports it to call `register`).
"""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer
from transformers import GPT2Tokenizer as _TransformersGPT2Tokenizer

from .tokenization_gpt1 import FINETUNE_TOKENS, GPT1Tokenizer, MissingDependencyError, text_standardize
from .tokenization_gpt2 import GPT2Tokenizer


def register(config_class: type) -> None:
    """Let `AutoTokenizer` resolve hfgpt checkpoints whose config is `config_class` (hfgpt's GPTConfig).

    GPT-2 folders name transformers' own "GPT2Tokenizer" in tokenizer_config.json, so they need nothing
    from hfgpt; it is also the default for a GPTConfig folder without a tokenizer_class. GPT-1 folders
    name "GPT1Tokenizer", which this makes known by name, so that with hfgpt installed they load the
    installed class rather than the copy saved beside them for trust_remote_code.
    """
    # The name lookup (tokenizer_class_from_name) only sees classes passed to register(); transformers'
    # GPT2Tokenizer stays the class for the name "GPT2Tokenizer", so other models' folders are unaffected.
    AutoTokenizer.register(
        config_class,
        tokenizer_class=_TransformersGPT2Tokenizer,
        slow_tokenizer_class=GPT1Tokenizer,
        exist_ok=True,
    )


def resize_embeddings_to_tokenizer(model: Any, tokenizer: Any) -> Any:
    """Give `model` one token embedding per entry of `tokenizer` (e.g. after adding GPT-1's fine-tuning
    tokens), through transformers' `resize_token_embeddings`; also records `_classify_`'s id in the config
    when the config has a `classify_token_id` field. Returns the model.

    New rows are drawn from N(0, initializer_range = 0.02), as finetune-transformer-lm's train.py draws
    the fine-tuning tokens' rows (`np.random.randn(n_special, n_embd) * 0.02`), not transformers' default
    mean of the old rows."""
    if model.get_input_embeddings().weight.shape[0] != len(tokenizer):
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    classify_id = tokenizer.get_vocab().get("_classify_")
    if classify_id is not None and hasattr(model.config, "classify_token_id"):
        model.config.classify_token_id = classify_id
    return model


__all__ = [
    "FINETUNE_TOKENS",
    "GPT1Tokenizer",
    "GPT2Tokenizer",
    "MissingDependencyError",
    "register",
    "resize_embeddings_to_tokenizer",
    "text_standardize",
]
