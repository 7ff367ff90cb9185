"""Lower-precision decoding (int8, bfloat16): a faithful, independent copy of the float32 model."""

import pytest
import torch

from hfgpt.modeling import GPTConfig, GPTForCausalLM
from hfgpt.modeling.quantization import quantize_for_decoding


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


def test_refuses_what_it_cannot_quantize(model):
    with pytest.raises(ValueError, match="float32 weights"):
        quantize_for_decoding(model.to(torch.bfloat16))


def test_bfloat16_copy_uses_linear_layers_and_stays_close(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lowp = quantize_for_decoding(model, torch.bfloat16)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.dtype == torch.bfloat16 for p in lowp.parameters())
    linears = [m for m in lowp.modules() if type(m) is torch.nn.Linear]
    assert len(linears) == 4 * 2 + 1  # c_attn, c_proj, c_fc, mlp c_proj per block, and the LM head
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference, got = model(ids).logits, lowp(ids).logits.float()
    error = (got - reference).abs().max() / reference.abs().max()
    assert 0 < error < 0.02  # bfloat16 keeps 8 bits of mantissa
    out = lowp.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 17)


def test_refuses_other_dtypes(model):
    with pytest.raises(ValueError, match="torch.qint8 or torch.bfloat16 weights, not torch.float16"):
        quantize_for_decoding(model, torch.float16)
