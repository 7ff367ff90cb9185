"""The CPU backend's cache appends (`hfgpt.cpu.cache`): a plain `DynamicCache` handed to a kernelized causal
LM is grown at its first one-call decoding step, which then writes each step into buffers with spare positions
instead of concatenating; it holds what a `DynamicLayer` holds through every edit transformers makes to a
cache, and gives the plain model's logits and tokens. Where no step runs in one call (heads other than 64),
the cache stays the plain model's."""

import copy

import pytest
import torch
from test_kv_cache import CACHE, states  # tests/ is on sys.path
from transformers.cache_utils import DynamicCache, DynamicLayer

from hfgpt.cpu import cache as growing
from hfgpt.cpu import kernelize, unkernelize
from hfgpt.modeling import GPTConfig, GPTForCausalLM
from hfgpt.modeling.interop import to_transformers

TINY = dict(
    vocab_size=96, n_positions=256, n_embd=32, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None
)
# Heads of 64, so that decoding steps run in one call (`hfgpt.cpu.decoding`) on the buffers.
WIDE_HEADS = dict(TINY, n_embd=128, n_head=2)


def layer_type(overrides: dict) -> type:
    """The cache layers' type after a decoding step: grown where the step ran in one call (heads of 64)."""
    return growing.GrowingLayer if overrides is WIDE_HEADS else DynamicLayer


def models(overrides: dict) -> tuple[GPTForCausalLM, GPTForCausalLM]:
    """(a kernelized model, the same weights unkernelized)."""
    torch.manual_seed(0)
    ours = kernelize(GPTForCausalLM(GPTConfig(**overrides)).eval())
    return ours, unkernelize(copy.deepcopy(ours))


def assert_same_layers(got: DynamicCache, expected: DynamicCache) -> None:
    assert got.get_seq_length() == expected.get_seq_length()
    for ours, theirs in zip(got.layers, expected.layers, strict=True):
        assert ours.is_initialized == theirs.is_initialized
        if theirs.is_initialized:
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


@pytest.mark.parametrize("overrides", [TINY, WIDE_HEADS], ids=["heads-of-8", "heads-of-64"])
def test_steps_write_into_the_callers_cache_without_copying_it(overrides):
    """A user's own `DynamicCache`, passed step by step, stays the same object, is filled in place from the
    first one-call step on (each step's keys start where the previous step's did), and the logits are the
    plain model's at every step. The prompt (and every step where none runs in one call) leaves it plain."""
    ours, plain = models(overrides)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    cache, reference = DynamicCache(), DynamicCache()
    with torch.no_grad():
        got = ours(ids[:, :8], cache=cache).logits
        expected = plain(ids[:, :8], cache=reference).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert all(type(layer) is DynamicLayer for layer in cache.layers)
        start = None
        for position in range(8, 40):
            out = ours(ids[:, position : position + 1], cache=cache)
            assert getattr(out, CACHE) is cache
            assert all(type(layer) is layer_type(overrides) for layer in cache.layers)
            expected = plain(ids[:, position : position + 1], cache=reference).logits
            torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-5)
            if overrides is WIDE_HEADS:
                start = start or cache.layers[0].keys.data_ptr()
                assert cache.layers[0].keys.data_ptr() == start  # 9 + 64 spare positions: never reallocated
        assert cache.get_seq_length() == reference.get_seq_length() == 40
        for layer, expected_layer in zip(cache.layers, reference.layers, strict=True):
            torch.testing.assert_close(layer.keys, expected_layer.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(layer.values, expected_layer.values, rtol=1e-5, atol=1e-5)
        whole = plain(ids).logits[:, -1]
    torch.testing.assert_close(out.logits[:, -1], whole, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overrides", [TINY, WIDE_HEADS], ids=["heads-of-8", "heads-of-64"])
def test_generate_gives_transformers_tokens_past_the_buffers_first_size(overrides):
    """Greedy decoding of 150 tokens (the buffers reallocated as they fill), left-padded, and beam search
    (which reorders the cache every step) give the tokens of transformers' GPT2LMHeadModel."""
    ours, _ = models(overrides)
    peer = to_transformers(ours).eval()
    ids = torch.randint(1, 96, (3, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = mask[2, :7] = 0
    common = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = ours.generate(ids, max_new_tokens=150, return_dict_in_generate=True, **common)
        assert torch.equal(out.sequences, peer.generate(ids, max_new_tokens=150, **common))
        cache = getattr(out, CACHE)
        assert all(type(layer) is layer_type(overrides) for layer in cache.layers)
        beams = dict(common, max_new_tokens=20, num_beams=3)
        assert torch.equal(ours.generate(ids, **beams), peer.generate(ids, **beams))


def test_every_edit_transformers_makes_leaves_what_a_dynamic_layer_holds():
    """The same appends and edits on a grown cache and on a plain one (crop, batch selection and
    repetition, beam reordering, reset, appends that outgrow the buffers) leave the same keys and values;
    a crop keeps the buffer, so the next append writes over the cropped positions."""
    grown, plain = DynamicCache(), DynamicCache()
    for layer_idx in range(2):
        key, value = states(4, 5, seed=layer_idx)
        grown.update(key, value, layer_idx)
        plain.update(key, value, layer_idx)
    growing.grow_in_place(grown)
    assert [type(layer) for layer in grown.layers] == [growing.GrowingLayer] * 2

    def both(edit, *args) -> None:
        getattr(grown, edit)(*args)
        getattr(plain, edit)(*args)
        assert_same_layers(grown, plain)

    seed, batch = 10, 4
    for step in range(12):
        for layer_idx in range(2):
            seed += 1
            both("update", *states(batch, 1 + step % 3, seed), layer_idx)
        if step == 3:
            buffer = grown.layers[0].keys.data_ptr()
            both("crop", -3)
            both("update", *states(4, 1, 99), 0)
            both("update", *states(4, 1, 98), 1)
            assert grown.layers[0].keys.data_ptr() == buffer
        if step == 5:
            both("reorder_cache", torch.tensor([3, 1, 1, 0]))
        if step == 7:
            both("batch_select_indices", torch.tensor([0, 2]))
            batch = 2
        if step == 8:
            both("batch_repeat_interleave", 2)
            batch = 4
        if step == 10:
            both("reset")
    key, value = states(4, 100, 123)  # past the spare positions
    both("update", key, value, 0)


def test_appends_under_autograd_concatenate_and_carry_gradients():
    """Keys and values that need gradients (a training forward that asked for a cache) are concatenated as
    `DynamicLayer` does, so the gradient reaches them; without gradients they go into a buffer (the cached
    ones copied into it once), and the next append writes into the same buffer."""
    layer = growing.GrowingLayer()
    key, value = states(1, 4, 0)
    layer.update(key, value)
    new_key, new_value = (t.requires_grad_() for t in states(1, 2, 1))
    keys, values = layer.update(new_key, new_value)
    (keys.sum() + 2 * values.sum()).backward()
    assert torch.equal(new_key.grad, torch.ones_like(new_key))
    assert torch.equal(new_value.grad, torch.full_like(new_value, 2.0))
    with torch.no_grad():
        keys, _ = layer.update(*states(1, 1, 2))
        buffer = keys.data_ptr()
        keys, _ = layer.update(*states(1, 1, 3))
    assert keys.data_ptr() == buffer and keys.shape[-2] == 8


def test_a_cache_filled_under_inference_mode_grows_outside_it():
    """A prompt run under `torch.inference_mode()` and steps under `torch.no_grad()` (a tensor made in
    inference mode cannot be written outside it): the steps move the cache into a buffer they may write,
    with the plain model's logits."""
    ours, plain = models(WIDE_HEADS)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    cache, reference = DynamicCache(), DynamicCache()
    with torch.inference_mode():
        ours(ids[:, :6], cache=cache)
        plain(ids[:, :6], cache=reference)
    with torch.no_grad():
        for position in range(6, 12):
            got = ours(ids[:, position : position + 1], cache=cache).logits
            expected = plain(ids[:, position : position + 1], cache=reference).logits
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert type(cache.layers[0]) is growing.GrowingLayer and not cache.layers[0].keys.is_inference()


def test_other_caches_and_other_devices_are_left_alone():
    """A `DynamicCache` subclass (which may rely on its layers' type) keeps its `DynamicLayer`s, and a
    plain one given to an unkernelized model is not touched."""

    class MyCache(DynamicCache):
        pass

    ours, plain = models(WIDE_HEADS)  # (heads of 64: a plain cache would grow in the kernelized model's step)
    ids = torch.randint(0, 96, (1, 6))
    mine, untouched = MyCache(), DynamicCache()
    with torch.no_grad():
        ours(ids, cache=mine)
        ours(ids[:, :1], cache=mine)
        plain(ids, cache=untouched)
        plain(ids[:, :1], cache=untouched)
    assert all(type(layer) is DynamicLayer for layer in mine.layers + untouched.layers)
