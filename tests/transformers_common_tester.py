"""hfgpt's classes under transformers' own common model tests (`ModelTesterMixin`).

Not a test module of this suite: `test_transformers_common.py` copies it beside transformers' own
tests/test_modeling_common.py (of the installed version, from its source distribution) and runs it there,
as a model test of transformers' repository would run (tests/models/gpt2/test_modeling_gpt2.py). The
tester gives small configs of both decoders, GPT-2's pre-norm and GPT-1's post-norm blocks, and inputs with
an attention mask.
"""

import unittest

import torch
from transformers.models.auto import modeling_auto
from transformers.testing_utils import torch_device

from hfgpt import modeling as hfgpt
from hfgpt.modeling import GPTConfig, GPTDoubleHeadsModel

# The common tests find a head's task (which labels to pass, which classes are base models) by its class
# name in transformers' tables of its own models; hfgpt's classes go into them as an in-library model's are.
HEADS = {
    "GPTModel": modeling_auto.MODEL_MAPPING_NAMES,
    "GPTForCausalLM": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    "GPTForSequenceClassification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    "GPTForTokenClassification": modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    "GPTForQuestionAnswering": modeling_auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
}
for name, table in HEADS.items():
    table[GPTConfig.model_type] = name

from .generation.test_utils import GenerationTesterMixin  # noqa: E402  (after the tables)
from .test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask  # noqa: E402


class GPTModelTester:
    def __init__(self, parent: unittest.TestCase, layer_norm_position: str) -> None:
        self.parent, self.layer_norm_position = parent, layer_norm_position
        self.batch_size, self.seq_length, self.num_choices, self.num_labels = 7, 7, 4, 3
        self.vocab_size, self.hidden_size, self.num_hidden_layers, self.num_attention_heads = 99, 32, 2, 4
        self.is_training = True

    def get_config(self) -> GPTConfig:
        special = self.vocab_size - 1
        return GPTConfig(
            vocab_size=self.vocab_size,
            n_positions=512,
            n_embd=self.hidden_size,
            n_layer=self.num_hidden_layers,
            n_head=self.num_attention_heads,
            layer_norm_position=self.layer_norm_position,
            num_labels=self.num_labels,
            pad_token_id=special,
            bos_token_id=special,
            eos_token_id=special,
        )

    def prepare_config_and_inputs_for_common(self) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
        # (ids below the special token, so that no real token is taken for padding)
        ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 1)
        mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": ids, "attention_mask": mask}


class GPTCommonTests(ModelTesterMixin, GenerationTesterMixin):
    all_model_classes = tuple(getattr(hfgpt, name) for name in HEADS) + (GPTDoubleHeadsModel,)
    layer_norm_position: str  # (each test class's block order)

    def setUp(self) -> None:
        self.model_tester = GPTModelTester(self, self.layer_norm_position)

    def _prepare_for_class(
        self, inputs_dict: dict, model_class: type, return_labels: bool = False
    ) -> dict[str, torch.Tensor]:
        """transformers' inputs, and for the double-heads model (LM and multiple choice, as GPT-2's test
        has it) each input repeated per choice, with LM labels, choice labels and the tokens it classifies."""
        inputs = super()._prepare_for_class(inputs_dict, model_class, return_labels)
        if model_class is not GPTDoubleHeadsModel:
            return inputs
        tester = self.model_tester
        batch, choices, length = tester.batch_size, tester.num_choices, tester.seq_length
        inputs = {
            key: value.unsqueeze(1).expand(-1, choices, -1).contiguous()
            if isinstance(value, torch.Tensor) and value.dim() == 2
            else value
            for key, value in inputs.items()
        }
        if return_labels:
            inputs["labels"] = torch.zeros(batch, choices, length, dtype=torch.long, device=torch_device)
            inputs["mc_labels"] = torch.zeros(batch, dtype=torch.long, device=torch_device)
            inputs["mc_token_ids"] = torch.zeros(batch, choices, dtype=torch.long, device=torch_device)
        return inputs


class GPT2CommonTest(GPTCommonTests, unittest.TestCase):
    layer_norm_position = "pre"


class GPT1CommonTest(GPTCommonTests, unittest.TestCase):
    layer_norm_position = "post"
