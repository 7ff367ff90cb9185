"""The CPU backend's one-call decoding step for float32 models (`hfgpt.cpu.decoding`, csrc/row_product.c's
`hfgpt_float_decode_step`, `torch.ops.hfgpt.float_decode_step`): the numbers, tokens and cache of the
block-by-block path, and that path wherever the one call would skip or misread something."""

import copy

import pytest
import torch
from conftest import intra_op_threads  # tests/ is on sys.path
from kernel_testing import (
    NARROW_TARGETS,
    fresh_kernel_cache,  # noqa: F401 (autouse: each test loads the kernels afresh)
    narrow_build,
    record_kernel_calls,
    using_library,
)
from test_int8_block import config, padded_batch
from test_int8_step import (
    assert_beams_step_in_one_call,
    assert_changes_are_seen,
    assert_steps_write_the_cache,
    block_by_block,
    greedy,
    record_steps,
)

from hfgpt.cpu import is_kernelized, kernelize, kernels, native, unkernelize
from hfgpt.cpu.cache import grow_in_place
from hfgpt.cpu.decoding import step_tensors
from hfgpt.modeling import GPTForCausalLM
from hfgpt.modeling.modeling_hfgpt import CACHE_FIELD

# The step's layer norms, GELU and products are the kernel's own; block by block, torch's.
CLOSE = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def float_kernel():
    if native.kernel("row_product") is None:
        pytest.skip("no C compiler to build the kernel with")


def kernelized(family: str, **overrides) -> GPTForCausalLM:
    """A float32 model with the CPU backend, whether or not it is on by default (`HFGPT_CPU_BACKEND`)."""
    torch.manual_seed(0)
    return kernelize(GPTForCausalLM(config(family, **overrides)).eval())


@pytest.fixture
def one_calls(monkeypatch) -> list[int]:
    return record_steps(monkeypatch, "float_decode_step")


def test_the_backend_switches_the_one_call_step_on_and_off(one_calls):
    """`unkernelize` takes a model off the one-call step, `kernelize` puts it back, with nothing set on its
    modules: the same tokens either way."""
    model = kernelized("gpt2")
    ids, mask = padded_batch(300)
    assert is_kernelized(model)
    one = greedy(model, ids, mask, new=3)
    assert one_calls == [3, 3]
    unkernelize(model)
    assert not is_kernelized(model)
    assert all("forward" not in module.__dict__ for module in model.modules())
    assert torch.equal(greedy(model, ids, mask, new=3).sequences, one.sequences)
    assert one_calls == [3, 3]
    kernelize(model)
    assert is_kernelized(model)
    assert torch.equal(greedy(model, ids, mask, new=3).sequences, one.sequences)
    assert one_calls == [3, 3] * 2


@pytest.mark.parametrize("family", ["gpt2", "gpt1"])
def test_each_decoding_step_is_one_call_with_the_block_by_block_numbers(family, one_calls, monkeypatch):
    model = kernelized(family)
    ids, mask = padded_batch(300)
    one = greedy(model, ids, mask)
    assert one_calls == [3] * 7  # every step after the prompt, of the whole batch
    plain = greedy(unkernelize(copy.deepcopy(model)), ids, mask)  # the model file, torch's ops throughout
    block_by_block(monkeypatch)
    blocks = greedy(model, ids, mask)
    assert len(one_calls) == 7
    for other in (blocks, plain):
        assert torch.equal(one.sequences, other.sequences)
        for got, expected in zip(one.scores, other.scores, strict=True):
            torch.testing.assert_close(got, expected, **CLOSE)


def test_beam_search_reorders_the_cache_between_one_call_steps(one_calls, monkeypatch):
    assert_beams_step_in_one_call(kernelized("gpt2"), one_calls, monkeypatch)


def test_the_step_writes_the_cache_the_block_by_block_path_writes(monkeypatch):
    for got, expected in zip(*assert_steps_write_the_cache(kernelized("gpt2"), monkeypatch), strict=True):
        torch.testing.assert_close(got, expected, **CLOSE)


def test_a_step_grows_the_cache_buffers_it_fills(one_calls, monkeypatch):
    model = kernelized("gpt1", n_positions=160)
    ids = torch.randint(1, 300, (1, 4))
    one = greedy(model, ids, torch.ones_like(ids), new=140)  # past the buffers' first spare positions
    assert len(one_calls) == 139
    block_by_block(monkeypatch)
    assert torch.equal(one.sequences, greedy(model, ids, torch.ones_like(ids), new=140).sequences)


@pytest.mark.parametrize(
    "blocker",
    [
        "hook on a block",
        "hook on c_fc",
        "forward of its own on c_proj",
        "training",
        "dropout module training",
        "gradients",
        "hidden states asked for",
        "heads of 32",
        "exact GELU",
        "static cache",
        "new token masked",
    ],
)
def test_block_by_block_wherever_the_one_call_would_skip_something(blocker, one_calls):
    overrides = {"n_embd": 96, "n_head": 3} if blocker == "heads of 32" else {}
    if blocker == "exact GELU":
        overrides["activation_function"] = "gelu"
    model = kernelized("gpt2", **overrides)
    ids, mask = padded_batch(300)
    seen = []
    body = model.transformer
    if blocker == "hook on a block":
        body.h[1].register_forward_pre_hook(lambda m, args: seen.append(m))
    elif blocker == "hook on c_fc":
        body.h[0].mlp.c_fc.register_forward_hook(lambda m, args, out: seen.append(m))
    elif blocker == "forward of its own on c_proj":
        layer = body.h[1].attn.c_proj
        plain_forward = type(layer).forward.__get__(layer)
        layer.forward = lambda x: seen.append(layer) or plain_forward(x)
    elif blocker == "training":
        body.h[0].attn.train()
    elif blocker == "dropout module training":
        body.h[1].mlp.dropout.train()
    with torch.no_grad():
        cache = getattr(model(ids, attention_mask=mask, use_cache=True), CACHE_FIELD)
    step = dict(attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1), cache=cache)
    token = ids[:, -1:]
    if blocker == "gradients":
        model(token, **step)  # (the parameters require gradients, and grad mode is on)
    elif blocker == "hidden states asked for":
        with torch.no_grad():
            assert len(model(token, output_hidden_states=True, **step).hidden_states) == 3
    elif blocker == "static cache":
        greedy(model, ids, mask, new=3, cache_implementation="static")
    elif blocker == "new token masked":
        step["attention_mask"][1, -1] = 0
        with torch.no_grad():
            model(token, **step)
    else:
        with torch.no_grad():
            model(token, **step)
    assert one_calls == []
    if "hook" in blocker or "forward" in blocker:
        assert len(seen) == 2  # the prompt's forward and the step's


def test_a_change_between_steps_is_seen_by_the_next_step(one_calls, monkeypatch):
    """The one call reads the modules' tensors where they are at each step: a parameter replaced, a hook
    registered, a dropout module put in training mode after a first step."""
    model = kernelized("gpt2")
    block = model.transformer.h[0]
    bias = torch.nn.Parameter(torch.ones_like(block.mlp.c_fc.bias))
    assert_changes_are_seen(model, one_calls, monkeypatch, bias, block.attn.resid_dropout)


@torch.no_grad()
def test_the_step_operator_refuses_what_the_kernel_would_misread():
    model = kernelized("gpt2")
    ids, mask = padded_batch(300)
    cache = getattr(model(ids, attention_mask=mask, use_cache=True), CACHE_FIELD)
    tensors = step_tensors(model.transformer)
    assert len(tensors) == 2 + 2 * kernels.FLOAT_BLOCK_TENSORS + 2
    grow_in_place(cache)
    buffers = [layer.reserve(1) for layer in cache.layers]
    args = dict(
        ids=ids[:, -1].contiguous(), positions=torch.full((3,), 14), wte=tensors[0], wpe=tensors[1],
        blocks=tensors[2:26], keys=[k for k, _ in buffers], values=[v for _, v in buffers], past=14,
        mask=None, scalings=[0.125, 0.125], eps=1e-5, pre_norm=True, final_norm=tensors[26:], final_eps=1e-5,
    )  # fmt: skip
    out = kernels.float_decode_step(**args)
    assert out.shape == (3, 128) and torch.isfinite(out).all()
    bad = {
        "ids": dict(ids=torch.tensor([0, 1, 300])),
        "positions": dict(positions=torch.tensor([0, 64, 1])),
        "blocks\\[5\\]": dict(blocks=[*tensors[2:7], tensors[7].double(), *tensors[8:26]]),
        "blocks\\[4\\]": dict(blocks=[*tensors[2:6], tensors[6].t(), *tensors[7:26]]),
        "block 0's layer 1": dict(blocks=[*tensors[2:8], tensors[8][:-1].clone(), *tensors[9:26]]),
        "norm tensor 2": dict(blocks=[*tensors[2:16], tensors[16][:-1].clone(), *tensors[17:26]]),
        "12 tensors a block": dict(blocks=tensors[2:25]),
        "capacity": dict(keys=[k[:, :, :14].contiguous() for k, _ in buffers]),
        "mask": dict(mask=torch.ones(3, 14, dtype=torch.bool)),
        "final norm": dict(final_norm=[tensors[26][:-1], tensors[27]]),
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            kernels.float_decode_step(**{**args, **change})


@pytest.mark.parametrize("target", NARROW_TARGETS)
@pytest.mark.parametrize("threads", [1, 3])
def test_a_build_for_narrower_vectors_gives_the_same_steps(target, threads, tmp_path, monkeypatch):
    """csrc/row_product.c's step built for narrower vectors than the host's (`NARROW_TARGETS`: AVX2's 8
    lanes, the baseline's 4 without FMA), on one thread and on more threads than output vectors divide
    evenly among, with an MLP width that ends in a partial vector: the native build's numbers to float
    rounding, and its tokens."""
    model = kernelized("gpt2", n_inner=200)
    ids, mask = padded_batch(300)
    library = narrow_build(tmp_path, "row_product", target)
    runs = []
    for build in (None, library):
        with monkeypatch.context() as patch:
            if build is not None:
                using_library(patch, "row_product", build)
            calls = record_kernel_calls(patch, "row_product")
            with intra_op_threads(threads):
                runs.append(greedy(model, ids, mask))
            assert calls.count("hfgpt_float_decode_step") == 7
    native_run, narrow = runs
    assert torch.equal(native_run.sequences, narrow.sequences)
    for got, expected in zip(narrow.scores, native_run.scores, strict=True):
        torch.testing.assert_close(got, expected, **CLOSE)


def test_a_large_batch_on_one_thread_steps_through_runs_of_columns(one_calls, monkeypatch):
    """16 rows on one thread: the MLP's 520 columns are more than the kernel sums at once for that many rows
    (csrc/row_product.c's runs of columns, which stay in cache while every row reads them)."""
    model = kernelized("gpt2", n_inner=520)
    ids = torch.randint(1, 300, (16, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[::3, :2] = 0
    with intra_op_threads(1):
        one = greedy(model, ids, mask, new=3)
        assert one_calls == [16, 16]
        block_by_block(monkeypatch)
        blocks = greedy(model, ids, mask, new=3)
    assert torch.equal(one.sequences, blocks.sequences)
    for got, expected in zip(one.scores, blocks.scores, strict=True):
        torch.testing.assert_close(got, expected, **CLOSE)


def test_a_copy_of_a_model_checks_its_own_modules(one_calls):
    """A model copied after its first one-call step (`copy.deepcopy`) checks the copy's modules: a forward
    of the user's own set on the copy's layer runs, and no step of the copy skips it."""
    model = kernelized("gpt2")
    ids, mask = padded_batch(300)
    greedy(model, ids, mask, new=2)
    assert one_calls == [3]
    twin = copy.deepcopy(model)
    greedy(twin, ids, mask, new=2)
    assert one_calls == [3, 3]
    seen = []
    layer = twin.transformer.h[0].mlp.c_fc
    plain_forward = type(layer).forward.__get__(layer)
    layer.forward = lambda x: seen.append(x.shape) or plain_forward(x)
    greedy(twin, ids, mask, new=2)
    assert one_calls == [3, 3] and len(seen) == 2  # the prompt's and the step's, through the layer
    greedy(model, ids, mask, new=2)
    assert one_calls == [3, 3, 3]  # (the original is unchanged)
