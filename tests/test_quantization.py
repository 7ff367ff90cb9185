"""Decoding copies (int8, bfloat16, float32): faithful, independent copies of the
float32 model."""

import copy

import huggingface_hub.constants
import pytest
import torch
from test_int8_step import record_steps  # tests/ is on sys.path

from hfgpt.cpu.quantization import DecodingLinear, Int8Linear, quantize_for_decoding
from hfgpt.modeling import GPTConfig, GPTForCausalLM
from hfgpt.modeling.interop import ExportError, to_transformers


@pytest.fixture
def model() -> GPTForCausalLM:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    return GPTForCausalLM(config).eval()


def test_int8_copy_is_close_and_leaves_the_model_untouched(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantized = quantize_for_decoding(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(isinstance(m, torch.nn.Linear) and type(m) is torch.nn.Linear for m in quantized.modules())
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference, got = model(ids).logits, quantized(ids).logits
    error = (got - reference).abs().max() / reference.abs().max()
    assert 0 < error < 0.05  # int8 changes the numbers, a little
    out = quantized.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 17)


def test_int8_copy_has_int8_layers_everywhere_and_computes_a_loss(model):
    quantized = quantize_for_decoding(model)
    int8 = [m for m in quantized.modules() if isinstance(m, Int8Linear)]
    assert len(int8) == 4 * 2 + 1  # c_attn, c_proj, c_fc, mlp c_proj per block, and the LM head
    assert quantized.transformer.wte.weight.dtype == torch.float32  # the lookup stays float32
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        loss, reference = quantized(ids, labels=ids).loss, model(ids, labels=ids).loss
    assert 0 < abs(loss - reference) < 0.01 * reference


def test_refuses_what_it_cannot_quantize(model):
    with pytest.raises(ValueError, match="float32 weights"):
        quantize_for_decoding(model.to(torch.bfloat16))


def test_bfloat16_copy_uses_linear_layers_and_stays_close(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lowp = quantize_for_decoding(model, torch.bfloat16)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.dtype == torch.bfloat16 for p in lowp.parameters())
    linears = [m for m in lowp.modules() if type(m) is DecodingLinear]
    assert len(linears) == 4 * 2 + 1  # c_attn, c_proj, c_fc, mlp c_proj per block, and the LM head
    assert lowp.lm_head.weight is lowp.transformer.wte.weight  # still tied
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference, got = model(ids).logits, lowp(ids).logits.float()
    error = (got - reference).abs().max() / reference.abs().max()
    assert 0 < error < 0.02  # bfloat16 keeps 8 bits of mantissa
    out = lowp.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 17)


def test_refuses_other_dtypes(model):
    with pytest.raises(ValueError, match="torch.bfloat16 or torch.float32 weights, not torch.float16"):
        quantize_for_decoding(model, torch.float16)


@pytest.mark.parametrize("shape", [(1, 48), (2, 48), (16, 48), (17, 48), (3, 1, 48), (2, 5, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_decoding_linear_equals_f_linear(shape, bias):
    torch.manual_seed(0)
    layer = DecodingLinear(48, 80, bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        got = layer(x)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_float32_copy_is_the_model_in_huge_pages_decoding_in_one_call(monkeypatch):
    """The float32 copy keeps the model's own layers (its weights gathered into one mapping: test_huge_pages):
    the same logits and tokens, bit for bit, each decoding step in one call (`hfgpt.cpu.decoding`)."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, n_positions=32, n_embd=128, n_layer=2, n_head=2, eos_token_id=0)
    model = GPTForCausalLM(config).eval()  # (heads of 64, which the one-call step computes)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = quantize_for_decoding(model, torch.float32)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [type(m) for m in fast.modules()] == [type(m) for m in model.modules()]
    assert all(p.dtype == torch.float32 for p in fast.parameters())
    steps = record_steps(monkeypatch, "float_decode_step")
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: a key mask in every step
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids).logits, model(ids).logits, atol=0, rtol=0)
        kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert torch.equal(fast.generate(ids, **kwargs), model.generate(ids, **kwargs))
        one = dict(attention_mask=mask[:1], max_new_tokens=8, do_sample=False)
        assert torch.equal(fast.generate(ids[:1], **one), model.generate(ids[:1], **one))
    assert steps == [2] * 7 * 2 + [1] * 7 * 2  # the copy's steps and the model's


@pytest.mark.parametrize("torch_threads", [1, 2], indirect=True)
def test_one_row_decoding_gives_the_same_tokens_on_one_thread_and_split_between_two(model, torch_threads):
    """At batch size 1 every product has one row, split between the threads where there are several
    (in the model and its float32 copy alike)."""
    fast = quantize_for_decoding(model, torch.float32)
    ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    with torch.inference_mode():
        full = model.generate(ids, **kwargs, output_logits=True, return_dict_in_generate=True)
        copied = fast.generate(ids, **kwargs, output_logits=True, return_dict_in_generate=True)
        torch.set_num_threads(1)
        expected = model.generate(ids, **kwargs, output_logits=True, return_dict_in_generate=True)
    for out in (full, copied):
        assert torch.equal(out.sequences, expected.sequences)
        torch.testing.assert_close(
            torch.stack(out.logits), torch.stack(expected.logits), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 3, 48)])
def test_bfloat16_decoding_linear_runs_f_linear_beside_the_one_row_kernel(shape, monkeypatch):
    """bfloat16 products of more than one row, with gradients, or where the one-row kernel steps aside are
    `F.linear`'s, bit for bit. (One row runs on hfgpt's C kernel: tests/test_row_product_kernel.py;
    switched off here.)"""
    from hfgpt.cpu import quantization

    monkeypatch.setattr(quantization, "one_row_bfloat16", lambda *args: None)
    torch.manual_seed(0)
    layer = DecodingLinear(48, 80).to(torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    with torch.no_grad():
        got = layer(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    with_grad = layer(x)
    assert with_grad.requires_grad and torch.equal(with_grad.detach(), expected)  # autograd: F.linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.qint8], ids=str)
def test_decoding_copy_refuses_to_be_saved_pushed_or_exported(model, dtype, tmp_path, monkeypatch):
    """A decoding copy's layers are `[out, in]` nn.Linear (or packed int8) under Conv1D's keys: written out,
    float32 / bfloat16 reload wrongly (a square c_proj transposed) and int8 cannot be written at all."""
    decoding = quantize_for_decoding(model, dtype)
    refused = rf"a decoding copy made by quantize_for_decoding \({dtype}\).*save or export the float32 model"
    with pytest.raises(ValueError, match="save_pretrained refused: this model is " + refused):
        decoding.save_pretrained(tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    # Refused before any network call: an unguarded push would fail on this endpoint with another error.
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ValueError, match="push_to_hub refused: this model is " + refused):
        decoding.push_to_hub("someone/decoding-copy", token="hf_unused")
    with pytest.raises(ExportError, match="to_transformers refused: this model is " + refused):
        to_transformers(decoding)
    with pytest.raises(ValueError, match="save_pretrained refused"):  # a copy of the copy stays refused
        copy.deepcopy(decoding).save_pretrained(tmp_path / "copy")
    # The float32 model it was made from still saves, and reloads with its own logits.
    model.save_pretrained(tmp_path / "float32")
    reloaded = GPTForCausalLM.from_pretrained(tmp_path / "float32").eval()
    ids = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)
