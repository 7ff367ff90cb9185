"""hfgpt models. Importing this package registers the config, every head and the tokenizers with
transformers' Auto classes, so `AutoModelForCausalLM.from_pretrained(path)` works on hfgpt checkpoints."""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from hfgpt.tokenization import register as _register_tokenizers

from .configuration_hfgpt import PRESETS, GPTConfig, translate_transformers_config
from .modeling_hfgpt import (
    GPTDoubleHeadsModel,
    GPTForCausalLM,
    GPTForQuestionAnswering,
    GPTForSequenceClassification,
    GPTForTokenClassification,
    GPTModel,
    GPTPreTrainedModel,
)

AutoConfig.register(GPTConfig.model_type, GPTConfig, exist_ok=True)
for _auto, _model in (
    (AutoModel, GPTModel),
    (AutoModelForCausalLM, GPTForCausalLM),
    (AutoModelForSequenceClassification, GPTForSequenceClassification),
    (AutoModelForTokenClassification, GPTForTokenClassification),
    (AutoModelForQuestionAnswering, GPTForQuestionAnswering),
):
    _auto.register(GPTConfig, _model, exist_ok=True)

# AutoTokenizer: GPT-2 folders use transformers' own GPT2Tokenizer, GPT-1 folders hfgpt's GPT1Tokenizer.
_register_tokenizers(GPTConfig)

# The CPU backend (hfgpt.cpu) runs the causal LMs' decoding steps in C, unless HFGPT_CPU_BACKEND=0.
from hfgpt.cpu.backend import enabled_by_default, install  # noqa: E402  (after the models it imports)

if enabled_by_default():
    install()

__all__ = [
    "PRESETS",
    "GPTConfig",
    "GPTDoubleHeadsModel",
    "GPTForCausalLM",
    "GPTForQuestionAnswering",
    "GPTForSequenceClassification",
    "GPTForTokenClassification",
    "GPTModel",
    "GPTPreTrainedModel",
    "translate_transformers_config",
]
