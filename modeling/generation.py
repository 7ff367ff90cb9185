"""A decoding loop that runs on the device, for `generate(custom_generate=decode_on_device)`.

transformers' `generate()` spends most of a GPT-2 124M decoding step on a GPU in Python around the model: each
step prepares its inputs, concatenates the ids, the mask and the positions, runs the logits processors and
stopping criteria, and reads `unfinished_sequences.max()` back to the host, which waits for the device. Its
CUDA graph covers the model's forward only. `decode_on_device` is the same greedy (or sampled) decoding as a
loop whose whole step is tensor operations on fixed-size buffers that the step updates in place:

- the model's forward on one new token a row, on a static cache (on CUDA) whose write position the cache
  keeps on the device;
- the token selection (argmax, or a sample drawn on the device), written into a (batch, new tokens) buffer;
- the stopping test: a finished row gets the padding token, as in `generate()`, and the count of steps with
  a row still running grows on the device; the host reads whether every row has finished only every
  `stop_check_interval` steps, and trims the steps taken after that at the end;
- the positions, advanced by one.

On CUDA that step is compiled whole (`torch.compile(fullgraph=True, mode="reduce-overhead")`): each token is
one CUDA graph replay, with nothing but the call between two. Elsewhere the same step runs eagerly on the
cache `generate()` prepared (a `DynamicCache` unless you ask for another), with the same model inputs as
`generate()`'s, so whatever speeds up `generate()`'s forward (hfgpt's CPU backend) speeds up this one too.

The tokens are greedy `generate()`'s: the same argmax of the same float32 logits, padding after the end of
sequence and the same stopping length. It takes what a plain decoding loop needs (prompts with an attention
mask, `max_new_tokens` / `max_length`, `eos_token_id`, `pad_token_id`, `suppress_tokens`, sampling with
temperature, top-k, top-p or min-p); beam search, streamers, other logits processors and stopping criteria, and outputs beyond
the sequences are refused with an error rather than ignored.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.cache_utils import Cache, DynamicCache, StaticCache
from transformers.generation import (
    EosTokenCriteria,
    GenerateDecoderOnlyOutput,
    MaxLengthCriteria,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# Logits processors the step runs on the device: each reads the scores only (never the ids so far, whose
# length grows), with operations of fixed shapes. `suppress_tokens` keeps the ids of a vocabulary padded past
# the tokenizer's (`resize_token_embeddings(..., pad_to_multiple_of=64)`) from being chosen.
DEVICE_PROCESSORS = (
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
)
# The compiled step's cache length and token buffer are rounded up to a multiple of this, so that prompts and
# continuations of other lengths reuse its graph (the positions past the end are masked, as in any static
# cache).
COMPILED_LENGTH_MULTIPLE = 64
# Model inputs the loop makes itself, or that generate() passes and the loop takes over.
_LOOP_INPUTS = {"attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep"}


class DecodeState(nn.Module):
    """The loop's state, in buffers that every step updates in place (so that a CUDA graph of the step reads and
    writes the same memory at every replay): the new tokens (B, N), the next position of each row (B, 1), which
    rows still run (B,), the index of the next token to write and the count of steps taken while a row ran
    (scalars), the attention mask of the whole cache (B, L), and the end-of-sequence ids and the padding id."""

    def __init__(
        self,
        batch: int,
        new_tokens: int,
        mask_length: int,
        eos_token_ids: torch.Tensor | None,
        pad_token_id: int | None,
        device: torch.device,
    ) -> None:
        super().__init__()
        long = dict(dtype=torch.long, device=device)
        self.register_buffer("tokens", torch.zeros(batch, new_tokens, **long), persistent=False)
        self.register_buffer("position_ids", torch.zeros(batch, 1, **long), persistent=False)
        self.register_buffer(
            "unfinished", torch.ones(batch, dtype=torch.bool, device=device), persistent=False
        )
        self.register_buffer("index", torch.zeros((), **long), persistent=False)
        self.register_buffer("steps", torch.zeros((), **long), persistent=False)
        self.register_buffer("mask", torch.ones(batch, mask_length, **long), persistent=False)
        self.stops = eos_token_ids is not None
        eos = eos_token_ids if eos_token_ids is not None else torch.zeros(0, **long)
        self.register_buffer("eos", eos.to(**long).reshape(-1), persistent=False)
        self.register_buffer(
            "pad", torch.tensor(0 if pad_token_id is None else pad_token_id, **long), persistent=False
        )

    def start(self, prompt_mask: torch.Tensor | None, prompt_positions: torch.Tensor) -> None:
        """Reset for new prompts: no token yet, every row running, the mask of the prompts then ones, each row's
        next position one past its prompt's last."""
        self.tokens.zero_()
        self.unfinished.fill_(True)
        self.index.zero_()
        self.steps.zero_()
        self.mask.fill_(1)
        if prompt_mask is not None:
            self.mask[:, : prompt_mask.shape[1]].copy_(prompt_mask)
        self.position_ids.copy_(prompt_positions[:, -1:].expand_as(self.position_ids) + 1)

    def last_tokens(self) -> torch.Tensor:
        """The tokens written last, (B, 1): the next step's inputs."""
        return self.tokens.index_select(1, (self.index - 1).reshape(1))

    def select(
        self,
        logits: torch.Tensor,
        processors: LogitsProcessorList,
        do_sample: bool,
        generator: torch.Generator | None = None,
    ) -> None:
        """Choose the next token of each row from its float32 logits (B, V), as `generate()` does (the processors,
        then the argmax or a draw), pad finished rows, write the tokens, and advance the counters."""
        scores = logits
        for processor in processors:
            scores = processor(None, scores)  # (DEVICE_PROCESSORS read the scores only)
        if do_sample:
            # A draw from softmax(scores): the argmax of p / E with E ~ Exp(1) (the exponential race, as
            # gpt-fast draws), one tensor operation with no host sync, where torch.multinomial breaks graphs.
            probs = torch.softmax(scores, dim=-1)
            race = torch.empty_like(probs).exponential_(1, generator=generator)
            next_tokens = torch.argmax(probs / race, dim=-1)
        else:
            next_tokens = torch.argmax(scores, dim=-1)  # (B,)
        running = self.unfinished.any()  # (a step generate() would take: some row still runs)
        if self.stops:
            next_tokens = torch.where(self.unfinished, next_tokens, self.pad)
            self.unfinished.logical_and_(~torch.isin(next_tokens, self.eos))
        self.tokens.index_copy_(1, self.index.reshape(1), next_tokens.unsqueeze(1))
        self.index.add_(1)
        self.steps.add_(running.to(torch.long))


def _forward_step(
    model: nn.Module,
    state: DecodeState,
    cache: Cache,
    attention_mask: torch.Tensor | None,
    processors: LogitsProcessorList,
    do_sample: bool,
    cache_name: str,
    generator: torch.Generator | None = None,
) -> None:
    """One decoding step: the model on the last tokens at their positions, the next tokens chosen, the
    positions advanced. Everything it reads and writes lives in `state` and `cache`."""
    outputs = model(
        input_ids=state.last_tokens(),
        attention_mask=attention_mask,
        position_ids=state.position_ids,
        use_cache=True,
        logits_to_keep=1,
        return_dict=True,
        **{cache_name: cache},
    )
    state.select(outputs.logits[:, -1].float(), processors, do_sample, generator)
    state.position_ids.add_(1)


# The compiled step (one function for every model and shape: torch.compile keeps a graph per model and
# shapes), made on first use.
_COMPILED_STEP: Any = None


def _compiled_step() -> Any:
    global _COMPILED_STEP
    if _COMPILED_STEP is None:
        # (dynamic=False: a graph per batch size and length, as transformers' CompileConfig compiles its step)
        _COMPILED_STEP = torch.compile(_forward_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    return _COMPILED_STEP


# Per model, the static caches and states of the compiled loop, kept between calls: a CUDA graph replays on
# the same memory, so a new call reuses them (reset) rather than allocating others. Beside the model, not in
# it, so that it pickles and copies as it is.
_BUFFERS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, tuple[StaticCache, DecodeState]]] = (
    weakref.WeakKeyDictionary()
)


def _cache_argument_name(model: nn.Module) -> str:
    """The name of the model's cache argument: `cache` from transformers 5.24, `past_key_values` before."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _refuse_unsupported(
    model: nn.Module,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
) -> None:
    """A clear error for everything the loop does not do, rather than a silent difference from `generate()`."""
    config = generation_config
    if config.num_beams != 1 or config.num_return_sequences not in (None, 1):
        raise ValueError(
            "decode_on_device decodes one sequence a prompt, greedy or sampled: beam search and "
            "num_return_sequences > 1 run with plain generate()"
        )
    if config.return_dict_in_generate and (
        config.output_scores
        or config.output_logits
        or config.output_attentions
        or config.output_hidden_states
    ):
        raise ValueError(
            "decode_on_device returns the sequences only: no scores, logits, attentions or states"
        )
    if getattr(config, "is_assistant", False) or config.prefill_chunk_size is not None:
        raise ValueError("decode_on_device does not run assisted decoding or chunked prefill")
    unknown = [type(p).__name__ for p in logits_processor if not isinstance(p, DEVICE_PROCESSORS)]
    if unknown:
        raise ValueError(
            f"decode_on_device runs the logits processors {', '.join(c.__name__ for c in DEVICE_PROCESSORS)} "
            f"only; this call has {unknown}: use plain generate()"
        )
    others = [
        type(c).__name__
        for c in stopping_criteria
        if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))
    ]
    if others:
        raise ValueError(f"decode_on_device stops on max length and end-of-sequence ids only, not {others}")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("decode_on_device takes input_ids, not inputs_embeds")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if getattr(cache, "_is_user_defined", False):
        raise ValueError("decode_on_device starts from the prompts: it does not continue a cache you pass")
    extra = sorted(k for k, v in model_kwargs.items() if k not in _LOOP_INPUTS and v is not None)
    if extra:
        raise ValueError(f"decode_on_device passes no other model inputs than the prompts: got {extra}")
    if model.config.is_encoder_decoder:
        raise ValueError("decode_on_device runs decoder-only models")


def decode_on_device(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    compile_step: bool | None = None,
    stop_check_interval: int = 16,
    generator: torch.Generator | None = None,
    **model_kwargs: Any,
) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """The decoding loop for `model.generate(..., custom_generate=decode_on_device)`: `generate()` prepares the
    inputs, the generation config and the cache, then calls this with them (the keyword arguments below pass
    through `generate()`). Returns what `generate()` returns: the prompts followed by the new tokens (a
    `GenerateDecoderOnlyOutput` with `return_dict_in_generate=True`).

    compile_step: compile the whole step with `torch.compile(mode="reduce-overhead", fullgraph=True)` on a static
        cache, kept for the next calls of the same batch size and lengths rounded up to a multiple of
        `COMPILED_LENGTH_MULTIPLE` (CUDA graphs on a GPU). Default: on CUDA yes, elsewhere no (there the step runs
        eagerly on the cache `generate()` prepared).
    stop_check_interval: read whether every row has finished once every this many steps (the loop's only host
        syncs; the steps taken past the end are trimmed, so the tokens do not depend on it).
    generator: the random generator of the draws when sampling, on the eager step (the compiled step draws from
        torch's default generator: `torch.manual_seed` makes it repeatable).
    """
    if stop_check_interval < 1:
        raise ValueError(f"stop_check_interval must be at least 1, got {stop_check_interval}")
    _refuse_unsupported(model, logits_processor, stopping_criteria, generation_config, model_kwargs)
    device = input_ids.device
    compiled = device.type == "cuda" if compile_step is None else compile_step
    if compiled and generator is not None:
        raise ValueError("the compiled step draws from torch's default generator: pass no generator")
    batch, prompt_length = input_ids.shape
    max_length = generation_config.max_length
    new_tokens = max_length - prompt_length
    if new_tokens < 1:
        raise ValueError(f"max_length {max_length} leaves no new token after prompts of {prompt_length}")
    # The end-of-sequence ids generate() stops on, and the padding of finished rows (the first of them where
    # the config has none, as generate() pads).
    eos_ids = [
        int(i)
        for c in stopping_criteria
        if isinstance(c, EosTokenCriteria)
        for i in c.eos_token_id.reshape(-1)
    ]
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device) if eos_ids else None
    pad = generation_config.pad_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    if pad is None and eos_ids:
        pad = eos_ids[0]
    cache_name = _cache_argument_name(model)
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    prompt_mask = model_kwargs.get("attention_mask")  # (None: generate() drops a mask of ones)
    positions = model_kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(prompt_length, device=device).unsqueeze(0)
    positions = positions.expand(batch, -1)

    # The cache (of max_length - 1 positions: the last token is never fed back) and the state.
    if compiled:
        length, slots = (
            -(-n // COMPILED_LENGTH_MULTIPLE) * COMPILED_LENGTH_MULTIPLE for n in (max_length - 1, new_tokens)
        )
        # (inference mode too: buffers made under it cannot be updated outside it)
        key = (
            batch,
            length,
            slots,
            device,
            model.dtype,
            tuple(eos_ids),
            pad,
            torch.is_inference_mode_enabled(),
        )
        kept = _BUFFERS.setdefault(model, {})
        if key not in kept:
            static = StaticCache(config=model.config, max_cache_len=length)
            kept.clear()  # (one shape at a time per model: the graphs of others go stale with their memory)
            kept[key] = static, DecodeState(batch, slots, length, eos, pad, device)
        cache, state = kept[key]
        cache.reset()
        step = _compiled_step()
    else:
        if not isinstance(cache, Cache):  # (use_cache=False, or a model whose generate() makes none)
            cache = DynamicCache(config=model.config)
        state = DecodeState(batch, new_tokens, max_length - 1, eos, pad, device)
        step = _forward_step
    state.start(prompt_mask, positions)

    # The prompt, eagerly (its length varies): the first new token.
    outputs = model(
        input_ids=input_ids,
        attention_mask=prompt_mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        return_dict=True,
        **{cache_name: cache},
    )
    processors = logits_processor
    state.select(outputs.logits[:, -1].float(), processors, generation_config.do_sample, generator)
    del outputs

    # The decoding steps, with the only host syncs every `stop_check_interval` steps.
    for i in range(1, new_tokens):
        if state.stops and i % stop_check_interval == 0 and not bool(state.unfinished.any()):
            break
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
            step(model, state, cache, state.mask, processors, generation_config.do_sample, cache_name)
        else:
            mask = None if prompt_mask is None else state.mask[:, : prompt_length + i]
            step(model, state, cache, mask, processors, generation_config.do_sample, cache_name, generator)
    steps = int(state.steps)  # (the steps generate() takes: until every row has finished)
    sequences = torch.cat([input_ids, state.tokens[:, :steps].to(input_ids.device)], dim=1)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences
