"""`append_to_cache` (ops_hfgpt.py): appends to transformers' `DynamicCache` layers into buffers with spare
positions instead of `torch.cat`, with the same keys and values as `DynamicCache.update` through everything
transformers does to a cache (cropping, beam reordering, batch selection, reset)."""

import copy

import pytest
import torch
from transformers.cache_utils import DynamicCache

from hfgpt.cpu.ops import append_to_cache
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


def test_appends_equal_dynamic_cache_updates_through_crop_reorder_select_and_reset():
    config = GPTConfig(**TINY)
    ours, theirs = DynamicCache(config=config), DynamicCache(config=config)
    seed, batch = 0, 3

    def append(length: int) -> None:
        nonlocal seed
        for layer in range(2):
            seed += 1
            key, value = states(batch, length, seed)
            got = append_to_cache(ours, key, value, layer)
            expected = theirs.update(key, value, layer)
            assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
        assert_same_layers(ours, theirs)

    append(7)  # the prompt: a buffer with spare positions
    buffer = ours.layers[0]._hfgpt_buffers[0]
    assert buffer.shape[2] > 7
    for _ in range(buffer.shape[2] - 7):  # decoding steps fill the spare positions in place...
        append(1)
    assert ours.layers[0]._hfgpt_buffers[0] is buffer
    assert ours.layers[0].keys.data_ptr() == buffer.data_ptr()
    append(1)  # ...and one more grows it, keeping what was there
    assert ours.layers[0]._hfgpt_buffers[0].shape[2] > buffer.shape[2]
    for cache in (ours, theirs):
        cache.crop(-5)  # assisted decoding drops rejected tokens: a shorter view of the buffer
    assert_same_layers(ours, theirs)
    append(3)  # written over the dropped positions
    for cache in (ours, theirs):
        cache.reorder_cache(torch.tensor([2, 0, 0]))  # beam search: new tensors, copied at the next append
    append(1)
    for cache in (ours, theirs):
        cache.batch_select_indices(torch.tensor([1, 2]))
    batch = 2
    append(2)
    for cache in (ours, theirs):
        cache.reset()
    append(4)


def test_falls_back_to_the_cache_update_where_the_tensors_must_stay_intact():
    """With a gradient to keep, each step's tensors must stay as autograd saw them: plain `update`."""
    cache = DynamicCache(config=GPTConfig(**TINY))
    key, value = states(2, 5, 0)
    append_to_cache(cache, key.requires_grad_(), value, 0)
    assert "_hfgpt_buffers" not in cache.layers[0].__dict__
    with torch.no_grad():
        append_to_cache(cache, *states(2, 1, 1), 1)
    assert "_hfgpt_buffers" in cache.layers[1].__dict__


def test_a_cache_filled_in_inference_mode_is_appended_to_outside_it():
    cache = DynamicCache(config=GPTConfig(**TINY))
    with torch.inference_mode():
        append_to_cache(cache, *states(1, 6, 0), 0)
    keys, _ = append_to_cache(cache, *states(1, 1, 1), 0)  # writing into an inference tensor would raise
    assert keys.shape[2] == 7 and not keys.is_inference()
    assert torch.equal(keys[:, :, :6], states(1, 6, 0)[0])


@pytest.mark.parametrize("layer_norm_position", ["pre", "post"])
def test_generation_with_grown_buffers_and_assisted_decoding_matches_transformers(
    layer_norm_position, monkeypatch
):
    """Greedy decoding long enough to grow the buffers twice, and assisted decoding (which crops the cache
    after rejected draft tokens) give transformers' tokens; the cache holds views of the buffers."""
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
    layer = out.past_key_values.layers[0]
    assert layer.keys.data_ptr() == layer._hfgpt_buffers[0].data_ptr()


def test_a_compiled_graph_appends_through_the_cache_update(monkeypatch):
    calls = []
    monkeypatch.setattr(DynamicCache, "update", lambda self, *args: calls.append(args[2]) or args[:2])
    cache = DynamicCache(config=GPTConfig(**TINY))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    append_to_cache(cache, *states(1, 2, 0), 0)
    monkeypatch.undo()
    assert calls == [0]


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
