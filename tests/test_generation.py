"""`generate(custom_generate=decode_on_device)` (hfgpt.modeling.generation): the tokens of greedy `generate()`
for GPT-2 and GPT-1, one prompt and left-padded batches with their attention masks, stopping on end-of-sequence
ids, on a dynamic and a static cache, eager and with the whole step compiled (on the CPU; CUDA graphs on a GPU);
the same loop on transformers' own GPT-2 with the same weights; sampling on the device; and an error for
everything it does not do."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import GPT2LMHeadModel

from hfgpt.modeling import GPTConfig, GPTForCausalLM
from hfgpt.modeling.generation import DecodeState, decode_on_device
from hfgpt.modeling.interop import to_transformers

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 257
# Head width 8 (the plain forward) and 64 (hfgpt's CPU backend decodes each step in one call into C there).
SIZES = {"heads of 8": dict(n_embd=32, n_head=4), "heads of 64": dict(n_embd=128, n_head=2)}


def tiny_model(norm: str, size: str = "heads of 8", seed: int = 0) -> GPTForCausalLM:
    """A random GPT-2 (pre-norm) or GPT-1 (post-norm) whose greedy continuations vary (a wide initialisation:
    the usual 0.02 makes a tiny model repeat one token)."""
    config = GPTConfig(
        vocab_size=VOCAB,
        n_positions=64,
        n_layer=2,
        layer_norm_position=norm,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
        **SIZES[size],
    )
    torch.manual_seed(seed)
    return GPTForCausalLM(config).eval()


def prompts(batch: int, length: int = 9, seed: int = 1) -> dict[str, torch.Tensor]:
    """Left-padded prompts: row i > 0 has i + 1 padding positions (id 0, a real token: only the mask hides it)."""
    ids = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        mask[row, : min(row + 1, length - 1)] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


GREEDY = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_greedy_tokens_equal_generate(norm, batch, cache, size):
    model = tiny_model(norm, size)
    inputs = prompts(batch)
    kwargs = {**GREEDY, "cache_implementation": cache}
    expected = model.generate(**inputs, **kwargs)
    got = model.generate(**inputs, **kwargs, custom_generate=decode_on_device)
    assert got.shape == expected.shape == (batch, 9 + 12)
    assert torch.equal(got, expected)
    assert len(set(got[:, 9:].flatten().tolist())) > 3  # (the model does not repeat one token)


@pytest.mark.slow
def test_the_plain_model_without_the_cpu_backend_gives_the_same_tokens(tmp_path):
    """With hfgpt's CPU backend off (HFGPT_CPU_BACKEND=0: the plain model file, as on a GPU), the loop, eager and
    with the static cache, still gives generate()'s tokens, GPT-2 and GPT-1, heads of 64."""
    script = tmp_path / "plain.py"
    script.write_text(
        "import torch, test_generation as t\n"
        "from hfgpt.modeling.generation import decode_on_device\n"
        "for norm in ('pre', 'post'):\n"
        "    model, inputs = t.tiny_model(norm, 'heads of 64'), t.prompts(4)\n"
        "    for cache in ('dynamic', 'static'):\n"
        "        kw = dict(t.GREEDY, cache_implementation=cache)\n"
        "        got = model.generate(**inputs, **kw, custom_generate=decode_on_device)\n"
        "        assert torch.equal(got, model.generate(**inputs, **kw)), (norm, cache)\n"
        "print('equal')\n"
    )
    env = {**os.environ, "HFGPT_CPU_BACKEND": "0", "PYTHONPATH": str(Path(__file__).parent)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "equal"


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_left_padding_and_the_mask_give_each_prompt_its_own_tokens(norm):
    """A padded row decodes as its prompt alone would: the loop passes the mask and the positions on."""
    model = tiny_model(norm)
    inputs = prompts(3)
    batched = model.generate(**inputs, **GREEDY, custom_generate=decode_on_device)
    for row in range(3):
        keep = inputs["attention_mask"][row].bool()
        alone = model.generate(
            input_ids=inputs["input_ids"][row, keep][None], **GREEDY, custom_generate=decode_on_device
        )
        assert torch.equal(batched[row, 9:], alone[0, keep.sum() :])


@pytest.mark.parametrize("interval", [1, 3, 16])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_end_of_sequence_stops_and_pads_as_generate_does(norm, interval):
    """eos ids taken from the continuations themselves: one that ends a single row (the others run on, the row
    is padded), and a pair that ends every row before max_new_tokens (the output is as short as generate()'s,
    whatever the interval at which the loop reads whether all rows have finished)."""
    model = tiny_model(norm)
    inputs = prompts(4)
    free = model.generate(**inputs, **GREEDY)[:, 9:]
    single = int(free[1, 2])
    every = sorted({int(free[row, 4]) for row in range(4)})
    outputs = {}
    for eos in (single, every):
        expected = model.generate(**inputs, **GREEDY, eos_token_id=eos)
        got = model.generate(
            **inputs,
            **GREEDY,
            eos_token_id=eos,
            custom_generate=decode_on_device,
            stop_check_interval=interval,
        )
        assert torch.equal(got, expected), eos
        outputs[str(eos)] = expected
    # (the cases the test means: a row padded while others run on; every row ended before max_new_tokens)
    assert outputs[str(single)].shape[1] == 9 + 12 and (outputs[str(single)][1, 9 + 3 :] == 0).all()
    assert outputs[str(every)].shape[1] <= 9 + 5


def test_the_same_loop_on_transformers_gpt2_with_the_same_weights():
    model = tiny_model("pre", "heads of 64")
    peer = to_transformers(model).eval()
    assert isinstance(peer, GPT2LMHeadModel)
    inputs = prompts(3)
    ours = model.generate(**inputs, **GREEDY, custom_generate=decode_on_device)
    theirs = peer.generate(**inputs, **GREEDY, custom_generate=decode_on_device)
    assert torch.equal(ours, theirs)
    assert torch.equal(theirs, peer.generate(**inputs, **GREEDY))


def test_return_dict_in_generate_gives_the_sequences():
    model = tiny_model("pre")
    inputs = prompts(2)
    out = model.generate(**inputs, **GREEDY, return_dict_in_generate=True, custom_generate=decode_on_device)
    assert isinstance(out, transformers.generation.GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, model.generate(**inputs, **GREEDY))


def test_sampling_with_top_k_1_is_greedy_and_a_seeded_generator_repeats():
    model = tiny_model("pre")
    inputs = prompts(3)
    greedy = model.generate(**inputs, **GREEDY)
    sample = dict(GREEDY, do_sample=True)
    one = model.generate(**inputs, **sample, top_k=1, custom_generate=decode_on_device)
    assert torch.equal(one, greedy)
    draws = [
        model.generate(
            **inputs,
            **sample,
            top_k=0,
            temperature=2.0,
            custom_generate=decode_on_device,
            generator=torch.Generator().manual_seed(seed),
        )
        for seed in (5, 5, 6)
    ]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert not torch.equal(draws[0], greedy)


def test_top_k_sampling_draws_only_among_the_k_most_likely():
    model = tiny_model("post")
    inputs = prompts(2)
    out = model.generate(
        **inputs, **dict(GREEDY, do_sample=True), top_k=3, custom_generate=decode_on_device,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    # the logits at every position, from one forward over the whole output
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, 12, dtype=torch.long)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=out, attention_mask=mask, position_ids=positions).logits
    top = logits[:, 8:-1].topk(3, dim=-1).indices  # (the predictions of each new token)
    assert (top == out[:, 9:, None]).any(-1).all()


def test_the_draw_follows_the_softmax():
    """The exponential race (argmax of p / E, E ~ Exp(1)) draws token i with probability p_i."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -9.0]]).expand(20000, 5).contiguous()
    state = DecodeState(20000, 1, 1, None, None, torch.device("cpu"))
    state.start(None, torch.zeros(20000, 1, dtype=torch.long))
    state.select(logits, transformers.LogitsProcessorList(), True, torch.Generator().manual_seed(0))
    frequencies = torch.bincount(state.tokens[:, 0], minlength=5).float() / 20000
    torch.testing.assert_close(frequencies, torch.softmax(logits[0], -1), atol=0.015, rtol=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_beams=2), "beam search"),
        (dict(repetition_penalty=1.3), "RepetitionPenalty"),
        (dict(min_new_tokens=3, eos_token_id=5), "MinNewTokens"),
        (dict(return_dict_in_generate=True, output_scores=True), "sequences only"),
        (dict(max_time=30.0), "MaxTimeCriteria"),
        (dict(stop_check_interval=0), "stop_check_interval"),
    ],
)
def test_what_it_does_not_do_is_refused(kwargs, message):
    model = tiny_model("pre")
    with pytest.raises(ValueError, match=message):
        model.generate(**prompts(2), **{**GREEDY, **kwargs}, custom_generate=decode_on_device)


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_the_compiled_step_is_one_graph_with_the_eager_tokens(norm):
    """compile_step=True (the default on CUDA): the whole step, model forward, token selection and counters, in
    one graph without a break, compiled once and reused by later calls with other prompts, of other lengths too
    (rounded up to the same multiple), whose buffers it resets; the tokens those of eager generate(), eos
    stopping included."""
    model = tiny_model(norm)
    first, second, longer = prompts(3), prompts(3, seed=2), prompts(3, length=13, seed=3)
    free = model.generate(**first, **GREEDY)[:, 9:]
    eos = sorted({int(free[row, 3]) for row in range(3)})
    kwargs = dict(GREEDY, eos_token_id=eos)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    # (a longer prompt and fewer new tokens: lengths in the same multiple of 64, the same graph)
    for inputs, new in ((first, 12), (second, 12), (longer, 9), (first, 12)):
        options = dict(kwargs, max_new_tokens=new)
        got = model.generate(**inputs, **options, custom_generate=decode_on_device, compile_step=True)
        assert torch.equal(got, model.generate(**inputs, **options))
    assert counters["stats"]["unique_graphs"] == 1
    assert dict(counters["graph_break"]) == {} and dict(counters["recompiles"]) == {}


@pytest.mark.slow
def test_the_compiled_step_samples_from_torchs_seed_and_follows_inference_mode():
    """Sampling in the compiled step draws from torch's default generator (the same seed, the same tokens; another
    seed, others), and a call under torch.inference_mode() then one outside it both decode (the buffers made
    under inference mode are kept apart from the others)."""
    model = tiny_model("pre")
    inputs = prompts(3)
    sample = dict(GREEDY, do_sample=True, top_k=5, custom_generate=decode_on_device, compile_step=True)
    draws = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        draws.append(model.generate(**inputs, **sample))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    expected = model.generate(**inputs, **GREEDY)
    with torch.inference_mode():
        inside = model.generate(**inputs, **GREEDY, custom_generate=decode_on_device, compile_step=True)
    outside = model.generate(**inputs, **GREEDY, custom_generate=decode_on_device, compile_step=True)
    assert torch.equal(inside, expected) and torch.equal(outside, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_cuda_graphs_give_the_eager_tokens(norm):
    """On CUDA, in float32: the step compiled in "reduce-overhead" mode (a CUDA graph a step) by default."""
    model = tiny_model(norm).cuda()
    inputs = {k: v.cuda() for k, v in prompts(4).items()}
    expected = model.generate(**inputs, **GREEDY)
    for _ in range(2):
        assert torch.equal(model.generate(**inputs, **GREEDY, custom_generate=decode_on_device), expected)


@pytest.mark.slow
def test_the_gpu_pages_loop_and_padding_blocks_run(tmp_path):
    """docs/gpu.md's blocks on the on-device loop and on vocabulary padding run as they are (on the CPU here),
    each as a script in one fresh interpreter, and the loop's block prints that its tokens are generate()'s."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    blocks = [
        code
        for language, code in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
        if language == "python" and ("decode_on_device" in code or "pad_to_multiple_of" in code)
    ]
    assert len(blocks) == 2 and "decode_on_device" in blocks[1]
    scripts = [tmp_path / f"block_{i}.py" for i in range(2)]
    for script, code in zip(scripts, blocks, strict=True):
        script.write_text(code)
    run_each = (
        "import runpy, sys\nfor script in sys.argv[1:]:\n    runpy.run_path(script, run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", run_each, *map(str, scripts)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("torch.Size([2, 37]) True")  # the loop's block, the last
