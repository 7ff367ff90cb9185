"""The int8 decoding copy's fused blocks (`Int8Block`, csrc/int8_linear.c's `hfgpt_int8_norm_linear` and
`hfgpt_int8_block_tail`): the same numbers as the unfused block to float rounding, the same tokens, and
the unfused block wherever the fused one would skip something."""

import pytest
import torch
import torch.nn.functional as F

from hfgpt.cpu import decoding, kernels, native
from hfgpt.cpu.quantization import Int8Block, Int8Linear, _kernel_layer, quantize_for_decoding
from hfgpt.modeling import GPTConfig, GPTForCausalLM


@pytest.fixture(autouse=True)
def fused_kernel():
    """The kernel library (built in the test session's cache folder, conftest.py)."""
    library = native.kernel("int8_linear")
    if library is None:
        pytest.skip("no C compiler to build the int8 kernel with")
    return library


# The fused block's layer norms and GELU round differently from torch's; the next int8 product can turn
# that into one quantisation step of an input now and then (~1/127 of its block's largest value).
CLOSE = dict(atol=2e-3, rtol=1e-3)


def config(family: str, **overrides) -> GPTConfig:
    fields = dict(vocab_size=300, n_positions=64, n_embd=128, n_layer=2, n_head=2)
    if family == "gpt1":
        fields.update(layer_norm_position="post", bos_token_id=None, eos_token_id=None)
    else:
        fields.update(bos_token_id=0, eos_token_id=0)
    return GPTConfig(**{**fields, **overrides})


def copies(family: str, **overrides) -> tuple[GPTForCausalLM, GPTForCausalLM]:
    torch.manual_seed(0)
    model = GPTForCausalLM(config(family, **overrides)).eval()
    return model, quantize_for_decoding(model)


@pytest.fixture
def fused_calls(monkeypatch) -> list[bool]:
    """Whether each block call took the fused path."""
    calls = []
    choose = Int8Block.fuses

    def recorded(self, hidden_states):
        fused = choose(self, hidden_states)
        calls.append(fused)
        return fused

    monkeypatch.setattr(Int8Block, "fuses", recorded)
    return calls


def unfused(monkeypatch) -> None:
    """Every block through its modules (decoding steps too: not in one call, `hfgpt.cpu.decoding`)."""
    monkeypatch.setattr(Int8Block, "fuses", lambda self, hidden_states: False)
    monkeypatch.setattr(decoding, "decodes_in_one_call", lambda *args: False)


def padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, vocab, (3, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :9] = 0
    return ids, mask


@pytest.mark.parametrize("family", ["gpt2", "gpt1"])
@pytest.mark.parametrize("width, heads", [(128, 2), (96, 3)])  # heads of 64 (C attention) and of 32 (sdpa)
def test_fused_blocks_give_the_unfused_logits_and_tokens(family, width, heads, fused_calls, monkeypatch):
    model, int8 = copies(family, n_embd=width, n_head=heads)
    assert sum(isinstance(m, Int8Block) for m in int8.modules()) == 2
    ids, mask = padded_batch(300)
    with torch.no_grad():
        fused = int8(ids, attention_mask=mask).logits
        tokens = int8.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        reference = model(ids, attention_mask=mask).logits
    assert fused_calls and all(fused_calls)  # every block of the prompts (the steps: one call each)
    unfused(monkeypatch)
    with torch.no_grad():
        expected = int8(ids, attention_mask=mask).logits
        expected_tokens = int8.generate(
            ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    kept = mask.bool()
    torch.testing.assert_close(fused[kept], expected[kept], **CLOSE)
    assert torch.equal(tokens, expected_tokens)
    # and as close to the float32 model as the unfused int8 copy is
    error, unfused_error = ((x[kept] - reference[kept]).abs().max() for x in (fused, expected))
    assert error < 1.5 * unfused_error + 1e-3


def test_incremental_decoding_equals_the_fused_prefill():
    _, int8 = copies("gpt2")
    ids, mask = padded_batch(300)
    with torch.no_grad():
        whole = int8(ids, attention_mask=mask).logits
        out = int8(ids[:, :-3], attention_mask=mask[:, :-3], use_cache=True)
        cache, steps = out.past_key_values, []
        for i in range(ids.shape[1] - 3, ids.shape[1]):
            step = int8(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], past_key_values=cache)
            cache = step.past_key_values
            steps.append(step.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), whole[:, -3:], **CLOSE)


@pytest.mark.parametrize(
    "blocker",
    [
        "hook on attn",
        "hook on c_fc",
        "pre-hook on ln_2",
        "training",
        "gradients",
        "autocast",
    ],
)
def test_unfused_wherever_the_fused_block_would_skip_something(blocker, fused_calls, monkeypatch):
    _, int8 = copies("gpt2")
    block = int8.transformer.h[0]
    seen = []
    if blocker == "hook on attn":
        block.attn.register_forward_hook(lambda m, args, out: seen.append(m))
    elif blocker == "hook on c_fc":
        block.mlp.c_fc.register_forward_hook(lambda m, args, out: seen.append(m))
    elif blocker == "pre-hook on ln_2":
        block.ln_2.register_forward_pre_hook(lambda m, args: seen.append(m))
    elif blocker == "training":
        block.train()
    ids = torch.randint(1, 300, (1, 6))
    if blocker == "gradients":
        block.ln_1.weight.requires_grad_(True)
        int8(ids)
    elif blocker == "autocast":
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            int8(ids)
    else:
        with torch.no_grad():
            int8(ids)
    assert fused_calls[0] is False
    if blocker.startswith(("hook", "pre-hook")):
        assert seen  # the hook ran: the block went through its modules
        assert fused_calls[1] is True  # the other block has no hook


@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("width", [128, 72])  # 72: inputs padded to the kernel's blocks of 64
def test_norm_linear_is_the_layer_norm_then_the_int8_product(rows, width, fused_kernel):
    torch.manual_seed(0)
    layer = Int8Linear.from_float(torch.randn(96, width) * 0.1, torch.randn(96))
    x = torch.randn(rows, width) * 3 + 1
    weight, bias = torch.randn(width), torch.randn(width)
    out = kernels.int8_norm_linear(x[None], weight, bias, 1e-5, *_kernel_layer(layer))[0]
    with torch.no_grad():
        expected = layer(F.layer_norm(x, (width,), weight, bias, 1e-5))
    torch.testing.assert_close(out, expected, **CLOSE)
    out = kernels.int8_norm_linear(x[None], None, None, 1e-5, *_kernel_layer(layer))[0]
    with torch.no_grad():
        assert torch.equal(out, layer(x))  # no layer norm: exactly Int8Linear's product
