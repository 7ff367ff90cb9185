"""The int8 decoding copy's one-call decoding step (`hfgpt.cpu.decoding`, csrc/int8_linear.c's
`hfgpt_int8_decode_step`, `torch.ops.hfgpt.int8_decode_step`): the numbers, tokens and cache of the
block-by-block path, and that path wherever the one call would skip or misread something."""

import pytest
import torch
from test_int8_block import copies, padded_batch  # tests/ is on sys.path

from hfgpt.cpu import backend, decoding, is_kernelized, kernels, native
from hfgpt.cpu.cache import grow_in_place
from hfgpt.cpu.quantization import Int8Block
from hfgpt.modeling import GPTForCausalLM
from hfgpt.modeling.modeling_hfgpt import CACHE_FIELD, GPTModel

# The final layer norm (GPT-2's) is the kernel's own in the one call and torch's block by block.
CLOSE = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def int8_kernel():
    if native.kernel("int8_linear") is None:
        pytest.skip("no C compiler to build the int8 kernel with")


def record_steps(monkeypatch, operator: str) -> list[int]:
    """The batch size of each call of the one-call step's operator `hfgpt.cpu.kernels.<operator>`."""
    calls = []
    step = getattr(kernels, operator)

    def recorded(ids, *args):
        calls.append(ids.numel())
        return step(ids, *args)

    monkeypatch.setattr(kernels, operator, recorded)
    return calls


@pytest.fixture
def one_calls(monkeypatch) -> list[int]:
    return record_steps(monkeypatch, "int8_decode_step")


@pytest.fixture
def block_calls(monkeypatch) -> list[bool]:
    """Whether each `Int8Block` call fused (block-by-block forwards only)."""
    calls = []
    fuses = Int8Block.fuses

    def recorded(self, hidden_states):
        calls.append(fuses(self, hidden_states))
        return calls[-1]

    monkeypatch.setattr(Int8Block, "fuses", recorded)
    return calls


def block_by_block(monkeypatch) -> None:
    monkeypatch.setattr(decoding, "decodes_in_one_call", lambda *args: False)


def greedy(model: GPTForCausalLM, ids: torch.Tensor, mask: torch.Tensor, new: int = 8, **kwargs):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
            eos_token_id=None, output_scores=True, return_dict_in_generate=True, **kwargs,
        )  # fmt: skip


def test_the_int8_copy_decodes_through_the_backend(one_calls):
    model, int8 = copies("gpt2")
    assert type(int8.transformer) is GPTModel
    # the copy runs the backend whatever the default; nothing is set on its modules but the model's flag
    assert is_kernelized(int8) and GPTForCausalLM.forward is backend.forward
    assert int8.__dict__[backend._FLAG] is True
    assert "forward" not in int8.__dict__ and "forward" not in int8.transformer.__dict__
    # (the float model is left as it was: no flag of its own, the backend's default)
    assert backend._FLAG not in model.__dict__
    assert all(type(block) is Int8Block for block in int8.transformer.h)
    greedy(int8, *padded_batch(300), new=2)
    assert one_calls == [3]


@pytest.mark.parametrize("family", ["gpt2", "gpt1"])
def test_each_decoding_step_is_one_call_with_the_block_by_block_numbers(
    family, one_calls, block_calls, monkeypatch
):
    _, int8 = copies(family)
    ids, mask = padded_batch(300)
    one = greedy(int8, ids, mask)
    # every step after the prompt in one call, of the whole batch; only the prompt went block by block
    assert one_calls == [3] * 7
    assert block_calls == [True, True]
    block_by_block(monkeypatch)
    blocks = greedy(int8, ids, mask)
    assert len(block_calls) == 2 + 2 * 8 and all(block_calls)
    assert torch.equal(one.sequences, blocks.sequences)
    # (block by block, the attention is torch's sdpa; in the one call, the kernel's own)
    for got, expected in zip(one.scores, blocks.scores, strict=True):
        torch.testing.assert_close(got, expected, **CLOSE)


def test_beam_search_reorders_the_cache_between_one_call_steps(one_calls, monkeypatch):
    """Beam search selects rows of the cache between steps (new tensors, not the buffers' views): the next
    step copies them into buffers of its own and goes on in one call."""
    _, int8 = copies("gpt2")
    assert_beams_step_in_one_call(int8, one_calls, monkeypatch)


def assert_beams_step_in_one_call(model: GPTForCausalLM, one_calls: list[int], monkeypatch) -> None:
    """Beam search on `padded_batch`: every step after the prompt in one call, of the 9 beams, with the
    block-by-block sequences."""
    ids, mask = padded_batch(300)

    def beams() -> torch.Tensor:
        with torch.no_grad():
            return model.generate(
                ids, attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0,
                eos_token_id=None,
            )  # fmt: skip

    one = beams()
    assert one_calls == [9] * 5  # 3 rows of 3 beams, every step after the prompt
    block_by_block(monkeypatch)
    assert torch.equal(one, beams())


def test_the_step_writes_the_cache_the_block_by_block_path_writes(monkeypatch):
    _, int8 = copies("gpt2")
    cached, expected_cached = assert_steps_write_the_cache(int8, monkeypatch)
    # the keys and values of c_attn's product, written as they are: the first block's bit for bit (the
    # next ones' follow an attention that is the kernel's in one call and torch's sdpa block by block)
    for got, expected in zip(cached[:2], expected_cached[:2], strict=True):
        assert torch.equal(got, expected)
    for got, expected in zip(cached[2:], expected_cached[2:], strict=True):
        torch.testing.assert_close(got, expected, **CLOSE)


def assert_steps_write_the_cache(model: GPTForCausalLM, monkeypatch) -> tuple[list[torch.Tensor], ...]:
    """Three steps after a prompt of `padded_batch`, in one call each and block by block: the same logits
    to float rounding and caches of the same length; returns both caches' keys and values."""
    ids, mask = padded_batch(300)

    def decode() -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.no_grad():
            out = model(ids[:, :-3], attention_mask=mask[:, :-3], use_cache=True)
            cache, logits = getattr(out, CACHE_FIELD), []
            for end in range(ids.shape[1] - 3, ids.shape[1]):
                out = model(ids[:, end : end + 1], attention_mask=mask[:, : end + 1], cache=cache)
                logits.append(out.logits[:, -1])
        return torch.stack(logits, 1), [t for layer in cache.layers for t in (layer.keys, layer.values)]

    logits, cached = decode()
    with monkeypatch.context() as patch:
        block_by_block(patch)
        expected_logits, expected_cached = decode()
    torch.testing.assert_close(logits, expected_logits, **CLOSE)
    assert [t.shape[2] for t in cached] == [ids.shape[1]] * 4
    return cached, expected_cached


def test_a_step_grows_the_cache_buffers_it_fills(one_calls, monkeypatch):
    _, int8 = copies("gpt2", n_positions=160)
    ids = torch.randint(1, 300, (1, 4))
    one = greedy(int8, ids, torch.ones_like(ids), new=140)  # past the buffers' first spare positions
    assert len(one_calls) == 139
    with monkeypatch.context() as patch:
        block_by_block(patch)
        blocks = greedy(int8, ids, torch.ones_like(ids), new=140)
    assert torch.equal(one.sequences, blocks.sequences)


@pytest.mark.parametrize(
    "blocker",
    [
        "hook on a block",
        "hook on ln_f",
        "hook on c_proj",
        "training",
        "gradients",
        "hidden states asked for",
        "heads of 32",
        "static cache",
        "new token masked",
    ],
)
def test_block_by_block_wherever_the_one_call_would_skip_something(blocker, one_calls, monkeypatch):
    _, int8 = copies("gpt2", **({"n_embd": 96, "n_head": 3} if blocker == "heads of 32" else {}))
    ids, mask = padded_batch(300)
    seen = []
    model = int8.transformer
    if blocker == "hook on a block":
        model.h[1].register_forward_pre_hook(lambda m, args: seen.append(m))
    elif blocker == "hook on ln_f":
        model.ln_f.register_forward_hook(lambda m, args, out: seen.append(m))
    elif blocker == "hook on c_proj":
        model.h[0].mlp.c_proj.register_forward_hook(lambda m, args, out: seen.append(m))
    elif blocker == "training":
        model.h[0].attn.train()
    with torch.no_grad():
        cache = getattr(int8(ids, attention_mask=mask, use_cache=True), CACHE_FIELD)
    step = dict(attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1), cache=cache)
    token = ids[:, -1:]
    if blocker == "gradients":
        model.ln_f.weight.requires_grad_(True)
        int8(token, **step)
    elif blocker == "hidden states asked for":
        with torch.no_grad():
            out = int8(token, output_hidden_states=True, **step)
        assert len(out.hidden_states) == 3
    elif blocker == "static cache":
        greedy_static = dict(cache_implementation="static", max_new_tokens=3, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            int8.generate(ids, attention_mask=mask, **greedy_static)
    elif blocker == "new token masked":
        step["attention_mask"][1, -1] = 0
        with torch.no_grad():
            int8(token, **step)
    else:
        with torch.no_grad():
            int8(token, **step)
    assert one_calls == []
    if "hook" in blocker:
        assert len(seen) == 2  # the prompt's forward and the step's


def test_a_change_between_steps_is_seen_by_the_next_step(one_calls, monkeypatch):
    """The one call reads the modules' tensors where they are at each step: a buffer replaced, a hook
    registered or removed, a module put in training mode after a first step."""
    _, int8 = copies("gpt2")
    block = int8.transformer.h[0]
    assert_changes_are_seen(int8, one_calls, monkeypatch, torch.ones_like(block.mlp.c_fc.bias), block.attn)


def assert_changes_are_seen(
    model: GPTForCausalLM, one_calls: list[int], monkeypatch, new_bias: torch.Tensor, module: torch.nn.Module
) -> None:
    """Two steps after a prompt of `padded_batch`, with a change between them: the first block's c_fc
    bias replaced by `new_bias` (the block-by-block numbers), a hook on its ln_2 (the second step through
    it), `module` put in training mode (the second step not in one call)."""
    ids, mask = padded_batch(300)
    block = model.transformer.h[0]
    bias = block.mlp.c_fc.bias

    def steps(change) -> list[torch.Tensor]:
        block.mlp.c_fc.bias = bias
        with torch.no_grad():
            out = model(ids[:, :-2], attention_mask=mask[:, :-2], use_cache=True)
            cache = getattr(out, CACHE_FIELD)
            first = model(ids[:, -2:-1], attention_mask=mask[:, :-1], cache=cache).logits
            change()
            second = model(ids[:, -1:], attention_mask=mask, cache=cache).logits
        return [first, second]

    def replace_bias():
        block.mlp.c_fc.bias = new_bias

    got = steps(replace_bias)
    assert len(one_calls) == 2
    with monkeypatch.context() as patch:
        block_by_block(patch)
        expected = steps(replace_bias)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **CLOSE)
    assert not torch.allclose(got[1], steps(lambda: None)[1])  # the new bias changed the step
    one_calls.clear()
    seen = []
    handle = None

    def hook():
        nonlocal handle
        handle = block.ln_2.register_forward_hook(lambda m, args, out: seen.append(m))

    steps(hook)
    assert len(one_calls) == 1 and len(seen) == 1  # the first step in one call, the second through ln_2
    handle.remove()
    steps(lambda: module.train())
    assert len(one_calls) == 2  # the first step only
    module.eval()
    steps(lambda: None)
    assert len(one_calls) == 4


@torch.no_grad()  # (the copy's layer norms are parameters: with gradients on, no step would run)
def test_the_step_operator_refuses_what_the_kernel_would_misread():
    _, int8 = copies("gpt2")
    model = int8.transformer
    ids, mask = padded_batch(300)
    cache = getattr(int8(ids, attention_mask=mask, use_cache=True), CACHE_FIELD)
    tensors = decoding.step_tensors(model)
    grow_in_place(cache)
    buffers = [layer.reserve(1) for layer in cache.layers]
    args = dict(
        ids=ids[:, -1].contiguous(), positions=torch.full((3,), 14), wte=tensors[0], wpe=tensors[1],
        blocks=tensors[2:34], keys=[k for k, _ in buffers], values=[v for _, v in buffers], past=14,
        mask=None, scalings=[0.125, 0.125], eps=1e-5, pre_norm=True, final_norm=tensors[34:], final_eps=1e-5,
    )  # fmt: skip
    out = kernels.int8_decode_step(**args)
    assert out.shape == (3, 128) and torch.isfinite(out).all()
    bad = {
        "ids": dict(ids=torch.tensor([0, 1, 300])),
        "positions": dict(positions=torch.tensor([0, 64, 1])),
        "blocks\\[5\\]": dict(blocks=[*tensors[2:7], tensors[7].double(), *tensors[8:34]]),
        "layer 2": dict(blocks=[*tensors[2:14], tensors[14][:-1].clone(), *tensors[15:34]]),
        "16 tensors a block": dict(blocks=tensors[2:33]),
        "capacity": dict(keys=[k[:, :, :14].contiguous() for k, _ in buffers]),
        "values\\[1\\]": dict(values=[buffers[0][1], buffers[1][1].transpose(2, 3)]),
        "mask": dict(mask=torch.ones(3, 14, dtype=torch.bool)),
        "final norm": dict(final_norm=[tensors[34][:-1], tensors[35]]),
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            kernels.int8_decode_step(**{**args, **change})
