"""Generation through transformers' `DynamicCache`: greedy, assisted (the cache cropped), left-padded past
the context's columns, and a prompt cache reused across calls, all with transformers' tokens; the cache by
the installed transformers' name."""

import copy
import inspect
import warnings

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, GPT2LMHeadModel
from transformers.cache_utils import DynamicCache

from hfgpt.modeling import (
    GPTConfig,
    GPTDoubleHeadsModel,
    GPTForCausalLM,
    GPTForSequenceClassification,
    GPTModel,
)
from hfgpt.modeling.interop import to_transformers

TINY = dict(
    vocab_size=96, n_positions=128, n_embd=32, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None
)
# The cache's keyword and output field in the installed transformers, read from its own GPT-2: transformers
# 5.24 renamed `past_key_values` to `cache`, and its generate() passes and reads the new name.
CACHE = "cache" if "cache" in inspect.signature(GPT2LMHeadModel.forward).parameters else "past_key_values"


def states(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, 4, length, 8, generator=generator) for _ in range(2))


def assert_same_layers(got: DynamicCache, expected: DynamicCache) -> None:
    assert got.get_seq_length() == expected.get_seq_length()
    for ours, theirs in zip(got.layers, expected.layers, strict=True):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


@pytest.mark.parametrize("layer_norm_position", ["pre", "post"])
def test_long_generation_and_assisted_decoding_match_transformers(layer_norm_position, monkeypatch):
    """Greedy decoding of 100 tokens, and assisted decoding (which crops the cache after rejected draft
    tokens) give transformers' tokens."""
    torch.manual_seed(0)
    config = GPTConfig(**TINY, layer_norm_position=layer_norm_position)
    ours = GPTForCausalLM(config).eval()
    peer = to_transformers(ours).eval()
    draft = GPTForCausalLM(
        GPTConfig(**{**TINY, "n_layer": 1}, layer_norm_position=layer_norm_position)
    ).eval()
    ids = torch.randint(0, 96, (2, 9))
    common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=100, do_sample=False, pad_token_id=0)
    crops, crop = [], DynamicCache.crop
    monkeypatch.setattr(DynamicCache, "crop", lambda self, n: crops.append(n) or crop(self, n))
    with torch.no_grad():
        expected = peer.generate(ids, **common)
        out = ours.generate(ids, **common, return_dict_in_generate=True)
        assert crops == []
        one = dict(common, attention_mask=common["attention_mask"][:1], max_new_tokens=30)
        assisted = ours.generate(ids[:1], **one, assistant_model=draft)
    assert torch.equal(out.sequences, expected)
    assert crops  # the draft's tokens were rejected at least once
    assert torch.equal(assisted, expected[:1, : 9 + 30])


@pytest.mark.parametrize("layer_norm_position", ["pre", "post"])
def test_a_left_padded_batch_generates_past_n_positions_columns_while_its_positions_fit(layer_norm_position):
    """Left padding takes columns, not positions: a batch whose every row is padded runs past n_positions
    columns as long as no row's positions reach it, as transformers' GPT2LMHeadModel does (GPT-1's
    reference: hfgpt without a cache); the next token would need position n_positions and is refused
    naming it."""
    torch.manual_seed(0)
    config = GPTConfig(**{**TINY, "n_positions": 32}, layer_norm_position=layer_norm_position)
    ours = GPTForCausalLM(config).eval()
    ids = torch.randint(1, 96, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # the longest prompt: 7 tokens in 10 columns
    mask[1, :6] = 0
    ids = ids * mask
    # 7 + 26 = 33 tokens: the last one is predicted at position 31, from 36 columns.
    common = dict(attention_mask=mask, max_length=36, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        if layer_norm_position == "pre":
            expected = to_transformers(ours).eval().generate(ids, **common)
        else:
            expected = ours.generate(ids, **common, use_cache=False)
        for kwargs in (dict(), dict(cache_implementation="static")):
            assert torch.equal(ours.generate(ids, **common, **kwargs), expected), kwargs
        assert expected.shape[1] == 36
        with pytest.raises(
            ValueError, match=r"position_ids contains 32, outside the context \[0, 32\) \(config"
        ):
            ours.generate(ids, **{**common, "max_length": 37})


@pytest.mark.parametrize("layer_norm_position", ["pre", "post"])
def test_a_prompt_cache_reused_across_generate_calls_gives_the_tokens_of_a_fresh_start(layer_norm_position):
    """Prefix caching: a prompt's cache deep-copied for each of several suffixes, then the cache itself
    continued, cropped back to the prompt (its buffers written over) and continued with another suffix;
    each gives the tokens of generating from scratch (transformers' for GPT-2, hfgpt's without a cache
    for GPT-1, whose transformers class has none)."""
    torch.manual_seed(0)
    ours = GPTForCausalLM(GPTConfig(**TINY, layer_norm_position=layer_norm_position)).eval()
    reference = to_transformers(ours).eval() if layer_norm_position == "pre" else ours
    no_cache = {} if layer_norm_position == "pre" else dict(use_cache=False)
    prompt = torch.randint(1, 96, (1, 10))
    common = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cache = ours(prompt, attention_mask=torch.ones_like(prompt), use_cache=True)[CACHE]
        for seed in range(3):
            suffix = torch.randint(1, 96, (1, 3 + seed), generator=torch.Generator().manual_seed(seed))
            ids = torch.cat([prompt, suffix], 1)
            mask = torch.ones_like(ids)
            expected = reference.generate(ids, attention_mask=mask, **common, **no_cache)
            copied = copy.deepcopy(cache) if seed < 2 else cache
            assert torch.equal(ours.generate(ids, attention_mask=mask, **{CACHE: copied}, **common), expected)
            assert copied.get_seq_length() == ids.shape[1] + 11 and (
                seed == 2 or cache.get_seq_length() == 10
            )
        cache.crop(-(cache.get_seq_length() - 10))
        ids = torch.cat([prompt, torch.randint(1, 96, (1, 4))], 1)
        mask = torch.ones_like(ids)
        expected = reference.generate(ids, attention_mask=mask, **common, **no_cache)
        assert torch.equal(ours.generate(ids, attention_mask=mask, **{CACHE: cache}, **common), expected)


@pytest.mark.parametrize(
    "head", [GPTModel, GPTForCausalLM, GPTForSequenceClassification, GPTDoubleHeadsModel]
)
def test_the_cache_goes_by_the_installed_transformers_name(head):
    """Every head that returns a cache (as its transformers GPT-2 class does) takes it by the installed
    transformers' keyword and returns it in the output field of that name (where generate() reads it), with
    the outputs of a full forward; generate() continues a prompt's cache passed by that name, with a mask,
    to the tokens of a fresh start."""
    torch.manual_seed(0)
    config = GPTConfig(**TINY, pad_token_id=0)
    model = head(config).eval()
    ids = torch.randint(1, 96, (2, 7))
    mask = torch.ones_like(ids)
    if head is GPTDoubleHeadsModel:
        ids, mask = ids[None], mask[None]  # one example of two choices
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
        prefix = model(ids[..., :6], attention_mask=mask[..., :6], use_cache=True)
        cache = prefix[CACHE]
        assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 6
        step = model(ids[..., 6:], attention_mask=mask, use_cache=True, **{CACHE: cache})
    assert step[CACHE] is cache and getattr(step, CACHE) is cache and cache.get_seq_length() == 7
    # The first field: the hidden states or logits (per position, but per sequence for classification).
    last = (lambda t: t) if head is GPTForSequenceClassification else (lambda t: t[..., -1, :])
    torch.testing.assert_close(last(step[0]), last(full[0]), atol=1e-5, rtol=1e-5)
    if head is GPTForCausalLM:
        common = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            expected = model.generate(ids, **common)
            cache = model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True)[CACHE]
            assert torch.equal(model.generate(ids, **common, **{CACHE: cache}), expected)
        assert cache.get_seq_length() == 7 + 3


def test_the_cache_by_its_name_before_transformers_5_24_still_works():
    """`past_key_values=` (what transformers 5.23's generate() passes, and code written for it) is the same
    cache as `cache=`; both at once are refused. Where transformers has renamed it (5.24 on), the old name
    gives the FutureWarning that transformers' models give (its common test `test_bc_cache_name_forward`
    looks for "`past_key_values` is deprecated"), and `cache=` none."""
    torch.manual_seed(0)
    model = GPTForCausalLM(GPTConfig(**TINY)).eval()
    ids = torch.randint(0, 96, (2, 7))
    logits = []
    with torch.no_grad():
        for name in ("cache", "past_key_values"):
            cache = model(ids[:, :6], use_cache=True)[CACHE]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = model(ids[:, 6:], use_cache=True, **{name: cache})
            deprecated = [w for w in caught if "`past_key_values` is deprecated" in str(w.message)]
            expected = 1 if name == "past_key_values" and CACHE == "cache" else 0
            assert len(deprecated) == expected and all(w.category is FutureWarning for w in deprecated), name
            assert out[CACHE] is cache and cache.get_seq_length() == 7, name
            logits.append(out.logits)
        with pytest.raises(ValueError, match="Pass the cache once, as `cache`"):
            model(ids[:, 6:], cache=cache, past_key_values=cache)
    assert torch.equal(*logits)


def test_continuous_batching_gives_the_tokens_of_generate():
    """generate_batch (continuous batching) hands the model a paged cache as `cache`, which the attention
    fills through `cache.update(..., kwargs=...)` (since transformers 5.24; before, the attention function
    did): each prompt gets the tokens that generate() gives it alone."""
    from hfgpt.cpu import kernelize  # (the backend's step declines a paged cache: the model's own code runs)

    torch.manual_seed(0)
    ours = kernelize(GPTForCausalLM(GPTConfig(**TINY)).eval())
    prompts = [torch.randint(0, 96, (n,)).tolist() for n in (5, 9, 3)]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    # The pages these requests need (on the CPU transformers would size the cache by the host's memory).
    pages = ContinuousBatchingConfig(
        page_size=16, num_blocks=8, max_batch_tokens=17, auto_switch_to_flash=False
    )
    with torch.no_grad():
        results = ours.generate_batch(
            prompts, generation_config=config, continuous_batching_config=pages, warmup=False
        ).values()
        alone = [ours.generate(torch.tensor([p]), generation_config=config)[0, len(p) :] for p in prompts]
    got = {tuple(result.prompt_ids): result.generated_tokens for result in results}
    assert got == {tuple(p): tokens.tolist() for p, tokens in zip(prompts, alone, strict=True)}
