"""The contenders of `bench_model.py`: hfgpt's model, transformers' model holding the same weights, and the
other routes to a fast model timed beside them (`--peers`): the plain hfgpt model (`hfgpt.cpu.unkernelize`)
under `torch.compile`, torchao's int8 and CTranslate2's int8 generator; with the greedy decoding and the
accuracy measures they share. Imported by `harness.py` and the sections; imports none of the scripts.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import (
    CompileConfig,
    GPT2Config,
    GPT2LMHeadModel,
    OpenAIGPTConfig,
    PreTrainedModel,
)
from transformers.pytorch_utils import Conv1D

from hfgpt.cpu import unkernelize
from hfgpt.modeling import GPTConfig, GPTForCausalLM
from hfgpt.modeling.interop import to_transformers, to_transformers_config

FAMILIES = ("gpt2", "gpt1")
# Other routes to a fast model, timed as extra contenders (`--peers`): the plain hfgpt model under
# torch.compile (prefill, decode, train; in lowp, the int8 copy's step compiled), torchao's int8 and CTranslate2's
# int8 generator (lowp). The last two need `pip install 'hfgpt[bench]'`.
PEERS = ("compile", "torchao", "ctranslate2")
PEER_PACKAGES = {"torchao": "torchao", "ctranslate2": "ctranslate2"}
# The contenders' names in the figures (a row's `impl`).
COMPILED = "torch.compile"
TORCHAO = "torchao int8"
INT8 = "hfgpt int8"
INT8_COMPILED = "hfgpt int8 compiled"
# A compiled decoding step whose logits are further than this (relative) from the same step run eagerly
# computes something else: its row says so instead of a speed (`step_error`). (An int8 copy's step can be a
# few percent off: another summation order in a float op moves an activation across a rounding boundary
# of its int8 copy now and then. A step that skips its products is off by orders of magnitude.)
WRONG_STEP = 0.25
CTRANSLATE2 = "ctranslate2 int8"
# An int8 copy's row: CTranslate2's median time over the copy's, round by round (`alone_rounds`)
VS_CTRANSLATE2 = "ctranslate2_time_over_own_by_round"
# ---------------------------------------------------------------------------------------------------
# Models


def our_config(family: str, overrides: dict[str, Any]) -> GPTConfig:
    return GPTConfig.from_preset("gpt2" if family == "gpt2" else "openai-gpt", **overrides)


def peer_config(config: GPTConfig) -> GPT2Config | OpenAIGPTConfig:
    """transformers' config of the same model (`interop.to_transformers_config`), GPT-2 on sdpa.
    OpenAIGPT's `afn="gelu"` is the tanh GELU."""
    peer = to_transformers_config(config)
    if isinstance(peer, GPT2Config):
        peer._attn_implementation = "sdpa"
    return peer


def build_ours(family: str, overrides: dict[str, Any], device: str, seed: int = 0) -> GPTForCausalLM:
    torch.manual_seed(seed)
    return GPTForCausalLM(our_config(family, overrides)).to(device)


def build_peer(ours: GPTForCausalLM) -> PreTrainedModel:
    """transformers' model of the same shape holding a copy of `ours`' weights (`interop.to_transformers`,
    which refuses an incomplete transfer), GPT-2 on sdpa."""
    peer = to_transformers(ours)
    if isinstance(peer, GPT2LMHeadModel):
        peer.set_attn_implementation("sdpa")
    return peer.to(ours.device)


def plain_hfgpt(model: GPTForCausalLM) -> GPTForCausalLM:
    """A copy of `model` that computes the plain model file: hfgpt's CPU backend taken out
    (`hfgpt.cpu.unkernelize`), attention on transformers' sdpa."""
    return unkernelize(copy.deepcopy(model))


def compiled_plain_hfgpt(model: GPTForCausalLM) -> nn.Module:
    """`plain_hfgpt(model)` under `torch.compile` (inductor, default mode): what compiling the model file
    gives without hfgpt's backend. It compiles on its first call (the warm-up, untimed)."""
    return torch.compile(plain_hfgpt(model))


def conv1d_as_linear(model: nn.Module) -> nn.Module:
    """Turn every transformers `Conv1D` of `model` into the equivalent `nn.Linear` (the weight
    transposed), in place: torchao's `quantize_` replaces `nn.Linear` layers only."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                linear = nn.Linear(child.weight.shape[0], child.weight.shape[1], device=child.weight.device)
                linear.weight = nn.Parameter(child.weight.detach().t().contiguous())
                linear.bias = nn.Parameter(child.bias.detach().clone())
                setattr(module, name, linear)
    return model


def torchao_int8(model: GPTForCausalLM) -> tuple[GPTForCausalLM, dict[str, Any]]:
    """torchao's int8 copy of the plain model: `quantize_` with `Int8DynamicActivationInt8WeightConfig`
    (int8 weights per channel, activations quantised per token at run time) on every linear layer, the
    tied LM head included (the embedding lookup stays float32); `generate()` then compiles its decoding
    step with a static cache, as torchao's own examples run it. Returns the copy and the `generate()`
    arguments that turn compilation on."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantized = conv1d_as_linear(plain_hfgpt(model)).eval()
    quantize_(quantized, Int8DynamicActivationInt8WeightConfig())
    return quantized, compiled_decoding(quantized)


def compiled_decoding(model: nn.Module) -> dict[str, Any]:
    """Set `model` to compile its decoding step in `generate()` on any device (transformers' compile_config)
    and return the `generate()` arguments that turn compilation on: a static cache."""
    compile_config = CompileConfig(fullgraph=True, mode="default")
    compile_config._compile_all_devices = True  # transformers compiles on accelerators only by default
    model.generation_config.compile_config = compile_config
    return {"cache_implementation": "static"}


@dataclass
class Decoder:
    """A contender of the lowp section: its logits for a batch of ids, and greedy decoding from
    left-padded prompts (the new tokens only)."""

    logits: Callable[[torch.Tensor], torch.Tensor]
    greedy: Callable[[dict[str, torch.Tensor], int], torch.Tensor]
    # For a compiled decoding step: how far its logits are from the same step run eagerly (`step_error`).
    compiled_step_error: Callable[[dict[str, torch.Tensor]], float] | None = None


def module_decoder(model: nn.Module, **generate_kwargs: Any) -> Decoder:
    compiled = generate_kwargs.get("cache_implementation") == "static"
    return Decoder(
        logits=lambda ids: model(ids).logits.float(),
        greedy=lambda prompts, new: greedy(model, prompts, new, **generate_kwargs),
        compiled_step_error=(lambda prompts: step_error(model, prompts, generate_kwargs))
        if compiled
        else None,
    )


def step_error(model: nn.Module, prompts: dict[str, torch.Tensor], generate_kwargs: dict[str, Any]) -> float:
    """The relative error of the logits of `model`'s first compiled decoding step against the same step run
    eagerly (`disable_compile`): the prompt runs eagerly in both, so the step's input is the same. A
    compiled graph can compute something else than the eager model; the speed of a step that does is not
    a figure (torch's `_int_mm` on the CPU returns without computing when inductor hands it a single row
    with stride 0, pytorch/pytorch#195066: what torchao's compiled int8 decoding does)."""
    common = dict(
        max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
        return_dict_in_generate=True, **generate_kwargs,
    )  # fmt: skip
    compiled = model.generate(**prompts, **common)
    eager = model.generate(**prompts, **common, disable_compile=True)
    step, reference = compiled.logits[1].float(), eager.logits[1].float()
    return ((step - reference).norm() / reference.norm()).item()


def ctranslate2_int8(peer: PreTrainedModel) -> Decoder | None:
    """CTranslate2's int8 generator on `peer`'s weights (transformers' `GPT2LMHeadModel`, which
    `ctranslate2.converters.TransformersConverter` converts; it has no converter for GPT-1, so None
    there). Weights int8 per output channel, `compute_type="int8"`, on torch's thread count.

    The converter reads a tokenizer only for its vocabulary; random weights have none, so the vocabulary
    is the token ids written as strings, and prompts go in and tokens come out as ids."""
    if not isinstance(peer, GPT2LMHeadModel):
        return None
    import tempfile

    import ctranslate2
    import numpy as np

    class IdVocabulary:
        """What the converter's GPT-2 loader reads from a tokenizer."""

        def __init__(self, size: int, eos: int) -> None:
            self.size, self.bos_token = size, str(eos)
            self.eos_token = self.unk_token = self.bos_token

        def get_vocab(self) -> dict[str, int]:
            return {str(i): i for i in range(self.size)}

    class Converter(ctranslate2.converters.TransformersConverter):
        def load_tokenizer(self, *args: Any, **kwargs: Any) -> IdVocabulary:
            config = peer.config
            eos = config.eos_token_id if config.eos_token_id is not None else config.vocab_size - 1
            return IdVocabulary(config.vocab_size, min(eos, config.vocab_size - 1))

    with tempfile.TemporaryDirectory(prefix="hfgpt-bench-ct2-") as tmp:
        peer.save_pretrained(f"{tmp}/transformers")
        Converter(f"{tmp}/transformers").convert(f"{tmp}/ctranslate2", quantization="int8")
        generator = ctranslate2.Generator(
            f"{tmp}/ctranslate2", device="cpu", compute_type="int8", intra_threads=torch.get_num_threads()
        )

    def logits(ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(generator.forward_batch(ids.tolist()))).float()

    def generate(prompts: dict[str, torch.Tensor], new: int) -> torch.Tensor:
        rows = [
            [str(token) for token, keep in zip(ids.tolist(), mask.tolist(), strict=True) if keep]
            for ids, mask in zip(prompts["input_ids"], prompts["attention_mask"], strict=True)
        ]
        # end_token=[]: no token ends a row, so every run is exactly `new` steps (as eos_token_id=None).
        results = generator.generate_batch(
            rows, max_length=new, end_token=[], include_prompt_in_result=False, sampling_topk=1
        )
        return torch.tensor([result.sequences_ids[0] for result in results])

    return Decoder(logits=logits, greedy=generate)


def missing_peer_packages(peers: tuple[str, ...]) -> list[str]:
    """The packages `peers` need that cannot be imported here."""
    return [
        PEER_PACKAGES[peer]
        for peer in peers
        if peer in PEER_PACKAGES and importlib.util.find_spec(PEER_PACKAGES[peer]) is None
    ]


# ---------------------------------------------------------------------------------------------------
# Prompts, greedy decoding, and a copy's accuracy against the float32 model


def left_padded_prompts(
    batch: int, length: int, vocab: int, pad_id: int, device: str
) -> dict[str, torch.Tensor]:
    """Prompts of different lengths (the longest `length`), left-padded, with their attention mask."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(batch):
        pad = (row * length) // (2 * max(batch, 1))  # rows lose up to half of their length
        ids[row, :pad] = pad_id
        mask[row, :pad] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def first_token_prompt(length: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    """The time-to-first-token prompt: one row of `length` tokens, no padding, with its attention mask."""
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(2)).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def greedy(
    model: nn.Module, prompts: dict[str, torch.Tensor], new_tokens: int, **kwargs: Any
) -> torch.Tensor:
    # eos_token_id=None keeps every run at exactly `new_tokens` steps even when a row picks EOS. (Not
    # min_new_tokens: its logits processor scans the whole vocabulary at every step, for both models
    # alike, time that a plain generate() call does not spend.)
    return model.generate(
        **prompts,
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        **kwargs,
    )[:, prompts["input_ids"].shape[1] :]


def decoding_accuracy(
    logits: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor, ref_tokens: torch.Tensor
) -> dict[str, float | int]:
    """A decoding copy's logits and greedy tokens against the float32 model's."""
    agree = (tokens == ref_tokens).float()
    return {
        "max_abs_logit_err": (logits - reference).abs().max().item(),
        "rel_logit_err": ((logits - reference).norm() / reference.norm()).item(),
        "top1_agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        "greedy_token_agreement": agree.mean().item(),
        "greedy_first_divergence": int((agree == 0).nonzero()[0, 1])
        if (agree == 0).any()
        else tokens.shape[1],
    }
