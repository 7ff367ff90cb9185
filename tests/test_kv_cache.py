"""Generation through transformers' `DynamicCache`: greedy, assisted (the cache cropped), left-padded past
the context's columns, and a prompt cache reused across calls, all with transformers' tokens."""

import copy

import pytest
import torch
from transformers.cache_utils import DynamicCache

from hfgpt.modeling import GPTConfig, GPTForCausalLM
from hfgpt.modeling.interop import to_transformers

TINY = dict(
    vocab_size=96, n_positions=128, n_embd=32, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None
)


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
        cache = ours(prompt, attention_mask=torch.ones_like(prompt), use_cache=True).past_key_values
        for seed in range(3):
            suffix = torch.randint(1, 96, (1, 3 + seed), generator=torch.Generator().manual_seed(seed))
            ids = torch.cat([prompt, suffix], 1)
            mask = torch.ones_like(ids)
            expected = reference.generate(ids, attention_mask=mask, **common, **no_cache)
            copied = copy.deepcopy(cache) if seed < 2 else cache
            assert torch.equal(
                ours.generate(ids, attention_mask=mask, past_key_values=copied, **common), expected
            )
            assert copied.get_seq_length() == ids.shape[1] + 11 and (
                seed == 2 or cache.get_seq_length() == 10
            )
        cache.crop(-(cache.get_seq_length() - 10))
        ids = torch.cat([prompt, torch.randint(1, 96, (1, 4))], 1)
        mask = torch.ones_like(ids)
        expected = reference.generate(ids, attention_mask=mask, **common, **no_cache)
        assert torch.equal(ours.generate(ids, attention_mask=mask, past_key_values=cache, **common), expected)
