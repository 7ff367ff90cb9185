"""generate() with a static cache and the decoding step compiled (transformers' `compile_config`), as
transformers documents it: one graph with no break, compiled once and never again for later steps or a
second call of the same shapes, and the tokens of eager decoding. GPT-2 and GPT-1 (transformers' own GPT-1
has no cache to compile), one prompt and a left-padded batch; and the int8 decoding copy, its C operators
inside the graph."""

import collections
import contextlib
from typing import Any

import pytest
import torch
import transformers
from test_modeling import TINY

from hfgpt.cpu import kernelize, kernels, native, unkernelize
from hfgpt.cpu.quantization import quantize_for_decoding
from hfgpt.modeling import GPTConfig, GPTForCausalLM

pytestmark = pytest.mark.slow


def compiled_step_config() -> transformers.CompileConfig:
    config = transformers.CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True  # transformers' switch for compiling off accelerators
    return config


def prompts(batch: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, TINY["vocab_size"], (batch, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1:, :3] = 0  # left padding
        ids[1:, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


COMMON = dict(max_new_tokens=7, do_sample=False, pad_token_id=0, cache_implementation="static")


def assert_compiled_once(model, inputs: dict[str, torch.Tensor], watch=contextlib.nullcontext) -> Any:
    """Decode `inputs` eagerly, then twice with the step compiled: one graph without a break, compiled on the
    first call and never again, the eager tokens both times. Returns what `watch()` yields around the second
    call (compiling itself runs the graph on real inputs too)."""
    eager = model.generate(**inputs, **COMMON)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = model.generate(**inputs, compile_config=compiled_step_config(), **COMMON)
    # The prompt runs eagerly; the 6 decoding steps after it run the compiled step, traced once.
    assert counters["stats"]["unique_graphs"] == 1
    assert dict(counters["graph_break"]) == {}
    with watch() as watched:
        again = model.generate(**inputs, compile_config=compiled_step_config(), **COMMON)
    assert counters["stats"]["unique_graphs"] == 1  # no recompilation for a second call
    assert dict(counters["recompiles"]) == {}
    assert torch.equal(compiled, eager) and torch.equal(again, eager)
    assert "_compiled_call" in vars(model)  # the compiled step really ran
    return watched


@contextlib.contextmanager
def native_calls(monkeypatch: pytest.MonkeyPatch):
    """Counts of the C entry points (`hfgpt_int8_linear`, ...) that hfgpt's operators call meanwhile: what
    really ran, whether the caller was eager code or a compiled graph (a profiler's events may leave out the
    operators a compiled graph calls, as on torch 2.11)."""
    calls: collections.Counter[str] = collections.Counter()
    library = kernels._library

    class Counting:
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            entry = getattr(self._lib, name)

            def counted(*args):
                calls[name] += 1
                return entry(*args)

            return counted

    with monkeypatch.context() as patch:
        patch.setattr(kernels, "_library", lambda name: Counting(library(name)))
        yield calls


# (each case compiles twice, for two batch sizes: the two models alternate between the plain model file
# and the model with the CPU backend, whose layers step aside under compile)
@pytest.mark.parametrize("norm, backend", [("pre", "plain"), ("post", "kernelized")])
def test_compiled_static_cache_decoding_is_one_graph_compiled_once(norm, backend):
    torch.manual_seed(0)
    model = GPTForCausalLM(GPTConfig(**TINY, layer_norm_position=norm)).eval()
    (unkernelize if backend == "plain" else kernelize)(model)
    for batch in (1, 3):
        assert_compiled_once(model, prompts(batch))


# The int8 decoding copy compiles the same way: its fused block operators (`hfgpt::int8_norm_linear`,
# `hfgpt::int8_block_tail`) and the LM head's `hfgpt::int8_linear` are calls inside the one graph, so the
# compiled steps give the eager copy's tokens.
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_int8_decoding_copy_compiles_to_one_graph_around_its_operators(norm, monkeypatch):
    if native.kernel("int8_linear") is None:
        pytest.skip("no C compiler to build the int8 kernel with")
    torch.manual_seed(0)
    int8 = quantize_for_decoding(GPTForCausalLM(GPTConfig(**TINY, layer_norm_position=norm)).eval())
    calls = assert_compiled_once(int8, prompts(3), watch=lambda: native_calls(monkeypatch))
    # the prompt (eager) and the 6 compiled steps: each layer's two fused calls, one LM head a step
    steps, layers = 7, TINY["n_layer"]
    assert calls["hfgpt_int8_norm_linear"] == calls["hfgpt_int8_block_tail"] == steps * layers
    assert calls["hfgpt_int8_linear"] == steps
