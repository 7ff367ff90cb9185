"""hfgpt on a CUDA GPU, where there is one: the plain model (the CPU backend does not apply there) against
transformers' GPT-2 and GPT-1 on the same weights and the same device, in inference, generation, a
training step and bfloat16 autocast. CUDA is optional hardware: without it the module skips."""

import pytest
import torch
import transformers
from test_modeling import NORMS, make_pair, random_ids  # tests/ is on sys.path

from hfgpt.cpu import is_kernelized, kernelize, unkernelize
from hfgpt.modeling import GPTForCausalLM, GPTForSequenceClassification
from hfgpt.modeling.modeling_hfgpt import CACHE_FIELD

if not torch.cuda.is_available():  # the whole module is one skip in the report, not one per test
    pytest.skip("no CUDA device here: tests/test_cuda.py needs one", allow_module_level=True)

CUDA = torch.device("cuda")


def on_cuda(head: type, norm: str, attn: str = "sdpa", **extra):
    peer, ours = make_pair(head, norm, attn=attn, **extra)
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
    """A model built on the CPU (kernelized) and moved to CUDA computes the plain model, prompt and decoding
    step alike, with nothing of the backend's on its modules; `unkernelize` gives the same logits."""
    _, ours = on_cuda(GPTForCausalLM, norm)
    ids = random_ids().to(CUDA)
    kernelize(ours)
    with torch.no_grad():
        out = ours(ids[:, :-1], use_cache=True)
        before = ours(ids[:, -1:], cache=getattr(out, CACHE_FIELD)).logits
        assert is_kernelized(ours)
        assert all("forward" not in module.__dict__ for module in ours.modules())
        unkernelize(ours)
        out = ours(ids[:, :-1], use_cache=True)
        after = ours(ids[:, -1:], cache=getattr(out, CACHE_FIELD)).logits
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


# --- training at the ceiling: the fused loss, no cache, every attention implementation, compiled ----------


def trained_gradients(model, ids, owner=None, **autocast):
    """(outputs, gradients) of one training step of `model` (or of a compiled `model` and its `owner`)."""
    owner = owner if owner is not None else model
    owner.zero_grad()
    with torch.autocast("cuda", **autocast) if autocast else torch.enable_grad():
        out = model(ids, labels=ids)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in owner.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("norm", NORMS)
def test_a_training_step_in_train_mode_equals_transformers_on_cuda(norm):
    """In train mode (dropout 0) hfgpt's loss runs the fused head and loss and keeps no cache: the loss and
    the tied embeddings' gradient of transformers' model, which forms every logit."""
    torch.backends.cuda.matmul.allow_tf32 = False
    peer, ours = on_cuda(GPTForCausalLM, norm, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = random_ids(2, 16).to(CUDA)
    theirs, their_grads = trained_gradients(peer.train(), ids)
    mine, my_grads = trained_gradients(ours.train(), ids)
    assert mine.logits is None and getattr(mine, CACHE_FIELD) is None
    torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=1e-5)
    embeddings = "transformer.tokens_embed.weight" if norm == "post" else "transformer.wte.weight"
    torch.testing.assert_close(
        my_grads["transformer.wte.weight"], their_grads[embeddings], atol=1e-5, rtol=1e-4
    )


def flash_attention_implementations() -> list[str]:
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    return [
        name
        for name, available in (
            ("flash_attention_2", is_flash_attn_2_available()),
            ("flash_attention_3", is_flash_attn_3_available()),
        )
        if available
    ]


@pytest.mark.parametrize("attn", ["eager", "sdpa", "flex_attention", *flash_attention_implementations()])
@pytest.mark.parametrize("norm", NORMS)
def test_every_attention_implementation_trains_on_cuda(norm, attn):
    """Each attention transformers offers, in a bfloat16-autocast training step with a padded batch: the
    loss and gradients of eager attention. (flash_attention_2/3 are listed where installed.) Two heads of
    16: flex_attention's kernels take no head narrower than 16."""
    settings = dict(attn="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, n_head=2)
    _, reference = on_cuda(GPTForCausalLM, norm, **settings)
    _, ours = on_cuda(GPTForCausalLM, norm, **settings)
    ours.set_attn_implementation(attn)
    assert ours.config._attn_implementation == attn
    ids = random_ids(2, 16).to(CUDA)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # right padding
    losses, grads = [], []
    for model in (reference.train(), ours.train()):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.transformer.h[0].attn.c_attn.weight.grad)
    torch.testing.assert_close(losses[1], losses[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grads[1], grads[0], atol=2e-2, rtol=5e-2)


@pytest.mark.parametrize("norm", NORMS)
def test_a_bfloat16_training_step_compiles_as_one_graph_on_cuda(norm):
    _, ours = on_cuda(GPTForCausalLM, norm, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = random_ids(4, 32).to(CUDA)
    eager, expected = trained_gradients(ours.train(), ids, dtype=torch.bfloat16)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(ours, fullgraph=True)
    out, grads = trained_gradients(compiled, ids, owner=ours, dtype=torch.bfloat16)
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(out.loss, eager.loss, atol=1e-2, rtol=1e-2)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, atol=2e-2, rtol=5e-2, msg=name)


# --- decoding: CUDA graphs, continuous batching ----------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("norm", NORMS)
def test_cuda_graph_decoding_gives_the_tokens_of_eager_decoding(norm, batch):
    """transformers' documented route to CUDA graphs: a static cache and `compile_config` in
    "reduce-overhead" mode. Float32: the tokens of eager dynamic-cache decoding, one prompt or a
    left-padded batch."""
    _, ours = on_cuda(GPTForCausalLM, norm)
    ids = random_ids(batch, 10).to(CUDA)
    mask = torch.ones_like(ids)
    mask[1:, :4] = 0  # left padding
    common = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    eager = ours.generate(ids, **common)
    torch._dynamo.reset()
    config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
    graphed = ours.generate(ids, cache_implementation="static", compile_config=config, **common)
    assert "_compiled_call" in vars(ours)  # the compiled step ran
    assert torch.equal(graphed, eager)
    assert torch.equal(
        ours.generate(ids, cache_implementation="static", compile_config=config, **common), eager
    )


@pytest.mark.parametrize("norm", NORMS)
def test_continuous_batching_on_cuda_gives_the_tokens_of_generate(norm):
    _, ours = on_cuda(GPTForCausalLM, norm)
    kernelize(ours)  # (its step declines a paged cache, as a CUDA model: the model's own code runs)
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (5, 9, 3, 12)]
    config = transformers.GenerationConfig(
        max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        results = ours.generate_batch(prompts, generation_config=config).values()
        alone = [
            ours.generate(torch.tensor([p], device=CUDA), generation_config=config)[0, len(p) :].tolist()
            for p in prompts
        ]
    got = {tuple(result.prompt_ids): result.generated_tokens for result in results}
    assert got == {tuple(p): tokens for p, tokens in zip(prompts, alone, strict=True)}
