"""A vocabulary padded the transformers way, `resize_token_embeddings(n, pad_to_multiple_of=64)`, on hfgpt's GPT-1
and GPT-2 (docs/gpu.md): the head stays tied, the real tokens' logits do not move, a checkpoint keeps the
padding, `suppress_tokens` keeps generate() and `decode_on_device` off the padded ids (transformers does not by
itself), and training runs over the padded softmax."""

import math

import pytest
import torch
import torch.nn.functional as F

from hfgpt.modeling import GPTConfig, GPTForCausalLM
from hfgpt.modeling.generation import decode_on_device

VOCAB = 257  # (a tokenizer's length that is no multiple of 64)


def tiny_model(norm: str) -> GPTForCausalLM:
    config = GPTConfig(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        layer_norm_position=norm,
        initializer_range=0.3,  # (greedy continuations that vary)
        resid_pdrop=0.0,  # (a training forward computes what an inference forward does)
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return GPTForCausalLM(config).eval()


def ids_and_mask(batch: int = 3) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (batch, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1:, :2] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


@pytest.mark.parametrize("added", [0, 3])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_padding_keeps_the_tie_and_the_real_tokens_logits(norm, added, tmp_path):
    model = tiny_model(norm)
    inputs = ids_and_mask()
    before = model(**inputs).logits.clone()
    rows = model.transformer.wte.weight.detach().clone()
    model.resize_token_embeddings(VOCAB + added, pad_to_multiple_of=64)
    padded = math.ceil((VOCAB + added) / 64) * 64
    assert model.config.vocab_size == padded == model.transformer.wte.num_embeddings
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.transformer.wte.weight[:VOCAB], rows)
    after = model(**inputs).logits
    assert after.shape[-1] == padded
    assert torch.equal(after[..., :VOCAB], before)
    # A checkpoint keeps the padded vocabulary, still tied.
    model.save_pretrained(tmp_path)
    again = GPTForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.vocab_size == padded and again.lm_head.weight is again.transformer.wte.weight
    assert torch.equal(again(**inputs).logits, after)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_suppress_tokens_keeps_generation_off_the_padded_ids(norm):
    """The padded rows made the most likely tokens on purpose: unsuppressed, greedy decoding picks them; with
    `suppress_tokens` set to the padded ids, generate() and decode_on_device give the unpadded model's tokens."""
    model = tiny_model(norm)
    inputs = ids_and_mask()
    greedy = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    expected = model.generate(**inputs, **greedy)
    chosen = expected[:, 8:].flatten().unique()
    model.resize_token_embeddings(pad_to_multiple_of=64)
    with torch.no_grad():  # each padded row a scaled copy of a token greedy decoding chooses
        weight = model.transformer.wte.weight
        weight[VOCAB:] = 20 * weight[chosen[torch.arange(len(weight) - VOCAB) % len(chosen)]]
    unsuppressed = model.generate(**inputs, **greedy)
    assert (unsuppressed[:, 8:] >= VOCAB).any()
    model.generation_config.suppress_tokens = list(range(VOCAB, model.config.vocab_size))
    assert torch.equal(model.generate(**inputs, **greedy), expected)
    assert torch.equal(model.generate(**inputs, **greedy, custom_generate=decode_on_device), expected)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_a_padded_model_trains_over_the_padded_softmax(norm):
    """The training loss (hfgpt's fused head and loss) is the cross-entropy over the padded vocabulary, and the
    tied weight's gradient covers every row."""
    model = tiny_model(norm)
    model.resize_token_embeddings(pad_to_multiple_of=64)
    ids = ids_and_mask()["input_ids"]
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert model.transformer.wte.weight.grad.shape == (model.config.vocab_size, 32)
    assert model.transformer.wte.weight.grad[VOCAB:].abs().sum() > 0  # (the padded ids join the softmax)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


def test_a_model_used_before_padding_trains_once_no_earlier_graph_holds_its_weight():
    """transformers' resize gives the embedding Parameter its new rows in place (`.data`): a graph that an
    earlier forward built and that is still held (its output kept, gradients on) keeps the weight's old shape,
    and the next backward fails, in transformers' GPT-2 alike (docs/gpu.md: pad before the first forward).
    Outputs kept from a forward without gradients, or a graph let go, leave training after a resize intact."""
    model = tiny_model("pre")
    ids = ids_and_mask()["input_ids"]
    with torch.no_grad():
        kept = model(input_ids=ids).logits  # (kept: no graph behind it)
    dropped = model(input_ids=ids).logits.sum()
    del dropped  # (a graph let go)
    model.resize_token_embeddings(pad_to_multiple_of=64)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.transformer.wte.weight.grad.shape[0] == model.config.vocab_size > kept.shape[-1]
