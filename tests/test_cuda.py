"""hfgpt on a CUDA GPU, where there is one: the plain model (the CPU backend does not apply there) against
transformers' GPT-2 and GPT-1 on the same weights and the same device, in inference, generation, a
training step and bfloat16 autocast. CUDA is optional hardware: without it these tests skip."""

import pytest
import torch
from test_modeling import NORMS, make_pair, random_ids  # tests/ is on sys.path

from hfgpt.cpu import is_kernelized, kernelize
from hfgpt.modeling import GPTForCausalLM, GPTForSequenceClassification

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")

CUDA = torch.device("cuda")


def on_cuda(head: type, norm: str, attn: str = "sdpa"):
    peer, ours = make_pair(head, norm, attn=attn)
    return peer.to(CUDA), ours.to(CUDA)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("norm", NORMS)
def test_logits_and_classifier_scores_equal_transformers_on_cuda(norm, attn):
    torch.backends.cuda.matmul.allow_tf32 = False
    ids = random_ids().to(CUDA)
    for head in (GPTForCausalLM, GPTForSequenceClassification):
        peer, ours = on_cuda(head, norm, attn)
        peer.config.pad_token_id = ours.config.pad_token_id = 0  # (the ids are 1-95: each row's last token)
        with torch.no_grad():
            torch.testing.assert_close(ours(ids).logits, peer(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", NORMS)
def test_the_cpu_backend_leaves_a_cuda_model_plain(norm):
    """`kernelize` on a CUDA model computes the plain model: the same logits as before it."""
    _, ours = on_cuda(GPTForCausalLM, norm)
    ids = random_ids().to(CUDA)
    with torch.no_grad():
        before = ours(ids).logits
        kernelize(ours)
        after = ours(ids).logits
    assert is_kernelized(ours)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("norm", NORMS)
def test_greedy_tokens_equal_transformers_on_cuda(norm):
    peer, ours = on_cuda(GPTForCausalLM, norm)
    ids = random_ids(3, 10).to(CUDA)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    common = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    if norm == "post":  # transformers' GPT-1 has no cache: compare without one
        common["use_cache"] = False
    assert torch.equal(ours.generate(ids, **common), peer.generate(ids, **common))
    cached = ours.generate(ids, **{**common, "use_cache": True})
    assert torch.equal(cached, ours.generate(ids, **{**common, "use_cache": False}))


@pytest.mark.parametrize("norm", NORMS)
def test_a_training_step_has_transformers_loss_and_gradients_on_cuda(norm):
    peer, ours = on_cuda(GPTForCausalLM, norm)
    ids = random_ids(2, 16).to(CUDA)
    losses, grads = [], []
    for model in (peer, ours):  # (in eval mode: no dropout, so both compute the same step)
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.get_input_embeddings().weight.grad)
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_bfloat16_autocast_on_cuda_stays_close_to_float32():
    _, ours = on_cuda(GPTForCausalLM, "pre")
    ids = random_ids().to(CUDA)
    with torch.no_grad():
        full = ours(ids).logits
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low = ours(ids).logits
    torch.testing.assert_close(low.float(), full, atol=0.05, rtol=0.05)
