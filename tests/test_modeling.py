"""Parity of hfgpt's models with transformers' own GPT2* / OpenAIGPT* classes on identical weights, plus
the behaviour transformers users rely on: generate(), caches, Auto classes, remote code, bad inputs."""

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from hfgpt.cpu import unkernelize
from hfgpt.modeling import (
    PRESETS,
    GPTConfig,
    GPTDoubleHeadsModel,
    GPTForCausalLM,
    GPTForQuestionAnswering,
    GPTForSequenceClassification,
    GPTForTokenClassification,
    GPTModel,
)
from hfgpt.modeling.interop import from_transformers, to_transformers
from hfgpt.modeling.modeling_hfgpt import CACHE_FIELD, GPTSequenceSummary

MODELING_DIR = Path(__file__).parent.parent / "modeling"

VOCAB = 96
TINY = dict(
    vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None
)
# hfgpt head -> (transformers GPT-2 class, transformers GPT-1 class)
PEERS = {
    GPTModel: ("GPT2Model", "OpenAIGPTModel"),
    GPTForCausalLM: ("GPT2LMHeadModel", "OpenAIGPTLMHeadModel"),
    GPTForSequenceClassification: ("GPT2ForSequenceClassification", "OpenAIGPTForSequenceClassification"),
    GPTDoubleHeadsModel: ("GPT2DoubleHeadsModel", "OpenAIGPTDoubleHeadsModel"),
    GPTForTokenClassification: ("GPT2ForTokenClassification", None),
    GPTForQuestionAnswering: ("GPT2ForQuestionAnswering", None),
}
NORMS = ["pre", "post"]


def peer_config(norm: str, **extra) -> transformers.PretrainedConfig:
    if norm == "pre":
        return transformers.GPT2Config(**{**TINY, **extra})
    # transformers' OpenAIGPT calls the tanh GELU "gelu".
    return transformers.OpenAIGPTConfig(**{**TINY, "afn": "gelu", **extra})


def make_pair(head: type, norm: str, attn: str = "sdpa", **extra):
    """A transformers model with random weights (layer norms included) and the hfgpt model holding the
    same tensors, loaded by plain load_state_dict with only GPT-1's two embedding names translated."""
    torch.manual_seed(0)
    name = PEERS[head][0 if norm == "pre" else 1]
    peer = getattr(transformers, name)(peer_config(norm, **extra)).eval()
    with torch.no_grad():
        for n, p in peer.named_parameters():
            if "ln" in n:  # non-trivial gains and biases, so a mis-wired norm shows in the logits
                p.normal_(1.0 if n.endswith("weight") else 0.0, 0.1)
    state = {
        k.replace("tokens_embed", "wte").replace("positions_embed", "wpe"): v
        for k, v in peer.state_dict().items()
    }
    state = {k: v for k, v in state.items() if not k.endswith(".attn.bias")}  # OpenAIGPT's mask buffer
    ours = head(GPTConfig(**{**TINY, **extra}, layer_norm_position=norm, attn_implementation=attn)).eval()
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return peer, ours


def random_ids(batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=g)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("norm", NORMS)
def test_lm_logits_match_transformers(norm, attn):
    peer, ours = make_pair(GPTForCausalLM, norm, attn)
    ids = random_ids()
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # right padding in one row
    with torch.no_grad():
        expected = peer(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert got.abs().max() > 0.1  # not a trivially zero comparison


@pytest.mark.parametrize(
    ("head", "norm"),
    # transformers has no OpenAIGPT token-classification or question-answering class to compare with.
    [
        (GPTModel, "pre"),
        (GPTModel, "post"),
        (GPTForTokenClassification, "pre"),
        (GPTForQuestionAnswering, "pre"),
    ],
)
def test_other_heads_match_transformers(head, norm):
    peer, ours = make_pair(head, norm)
    ids = random_ids()
    with torch.no_grad():
        expected, got = peer(ids), ours(ids)
    for key in ("last_hidden_state", "logits", "start_logits", "end_logits"):
        if key in expected:
            torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", NORMS)
def test_sequence_classification_matches_transformers(norm):
    peer, ours = make_pair(GPTForSequenceClassification, norm, num_labels=3, pad_token_id=0)
    ids = random_ids(3, 10)
    ids[1, 6:] = 0  # right-padded row: pooled at its last real token
    labels = torch.tensor([0, 2, 1])
    with torch.no_grad():
        expected = peer(ids, labels=labels)
        got = ours(ids, labels=labels)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", NORMS)
def test_double_heads_match_transformers(norm):
    peer, ours = make_pair(GPTDoubleHeadsModel, norm)
    ids = random_ids(2 * 3, 9).view(2, 3, 9)  # (batch, choices, length)
    mc_token_ids = torch.tensor([[8, 5, 7], [3, 8, 8]])
    mc_labels = torch.tensor([1, 2])
    with torch.no_grad():
        expected = peer(ids, mc_token_ids=mc_token_ids, labels=ids, mc_labels=mc_labels)
        got = ours(ids, mc_token_ids=mc_token_ids, labels=ids, mc_labels=mc_labels)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.mc_logits, expected.mc_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.mc_loss, expected.mc_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.lm_loss, expected.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", NORMS)
def test_greedy_and_beam_search_match_transformers(norm):
    peer, ours = make_pair(GPTForCausalLM, norm)
    ids = random_ids(2, 8)
    mask = torch.ones_like(ids)
    for kwargs in (dict(do_sample=False), dict(do_sample=False, num_beams=3), dict(repetition_penalty=1.3)):
        common = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=0, **kwargs)
        expected = peer.generate(ids, **common)
        got = ours.generate(ids, **common)
        assert torch.equal(got, expected), kwargs
        assert got.shape[1] == ids.shape[1] + 10


@pytest.mark.parametrize("norm", NORMS)
def test_sampling_matches_transformers(norm):
    peer, ours = make_pair(GPTForCausalLM, norm)
    ids = random_ids(2, 8)
    common = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=12,
        pad_token_id=0,
        do_sample=True,
        temperature=0.8,
    )
    for kwargs in (dict(top_k=5), dict(top_p=0.9)):
        torch.manual_seed(123)
        expected = peer.generate(ids, **common, **kwargs)
        torch.manual_seed(123)
        got = ours.generate(ids, **common, **kwargs)
        assert torch.equal(got, expected), kwargs


@pytest.mark.parametrize("norm", NORMS)
def test_left_padded_batch_generates_like_single_prompts(norm):
    _, ours = make_pair(GPTForCausalLM, norm)
    prompts = [random_ids(1, n, seed=n)[0] for n in (5, 9, 7)]
    width = max(len(p) for p in prompts)
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, p in enumerate(prompts):
        batch[row, width - len(p) :] = p
        mask[row, width - len(p) :] = 1
    out = ours.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    for row, p in enumerate(prompts):
        single = ours.generate(
            p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=8, do_sample=False
        )
        assert torch.equal(out[row, width:], single[0, len(p) :]), row


@pytest.mark.parametrize("head", [GPTForCausalLM, GPTDoubleHeadsModel])
@pytest.mark.parametrize("backend", ["kernelized", "plain"])
def test_generate_builds_no_signature_of_forward_at_each_step(head, backend, monkeypatch):
    """Registered for the Auto classes, hfgpt's heads are remote code to transformers, whose generate() reads
    forward's signature at every step: the one held on the function (the CPU backend's forward carries it
    over), never one built again from the function's code, and the same parameters."""
    model = head(GPTConfig(**TINY)).eval()
    if backend == "plain":
        unkernelize(model)
    built = []
    build = inspect._signature_from_function  # what inspect.signature runs for a function it has to read

    def recording(cls, function, *args, **kwargs):
        built.append(function)
        return build(cls, function, *args, **kwargs)

    monkeypatch.setattr(inspect, "_signature_from_function", recording)
    ids = random_ids(1, 5)
    counts = []
    for new in (2, 10):
        built.clear()
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0
        )
        counts.append(len(built))
    assert counts[0] == counts[1]  # the same few signatures read for 2 steps as for 10
    unwrapped = inspect.unwrap(head.forward)
    assert unwrapped not in [inspect.unwrap(f) for f in built]
    parameters = list(inspect.signature(model.forward).parameters)
    code = unwrapped.__code__
    starred = bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    assert parameters == list(code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount + starred])


@pytest.mark.parametrize("norm", NORMS)
def test_incremental_decoding_equals_full_forward(norm):
    _, ours = make_pair(GPTForCausalLM, norm)
    ids = random_ids(2, 14)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = ours(ids, attention_mask=mask, position_ids=position_ids).logits
        out = ours(ids[:, :6], attention_mask=mask[:, :6], position_ids=position_ids[:, :6], use_cache=True)
        steps, cache = [out.logits], out[CACHE_FIELD]
        for t in range(6, 14):
            out = ours(
                ids[:, t : t + 1],
                attention_mask=mask[:, : t + 1],
                position_ids=position_ids[:, t : t + 1],
                cache=cache,
                use_cache=True,
            )
            steps.append(out.logits)
            cache = out[CACHE_FIELD]
    incremental = torch.cat(steps, dim=1)
    real = mask.bool()
    torch.testing.assert_close(incremental[real], full[real], atol=1e-5, rtol=1e-5)


def test_logits_to_keep_and_eager_attentions():
    peer, ours = make_pair(GPTForCausalLM, "pre", attn="eager")
    peer.config._attn_implementation = "eager"
    ids = random_ids(2, 10)
    with torch.no_grad():
        full = ours(ids).logits
        last = ours(ids, logits_to_keep=1).logits
        got = ours(ids, output_attentions=True).attentions
        expected = peer(ids, output_attentions=True).attentions
    assert last.shape == (2, 1, VOCAB)
    torch.testing.assert_close(last[:, 0], full[:, -1])
    assert len(got) == 2 and got[0].shape == (2, 4, 10, 10)
    torch.testing.assert_close(got[-1].sum(-1), torch.ones(2, 4, 10))
    assert torch.all(torch.triu(got[-1], diagonal=1) == 0)  # causal
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "options",
    [
        dict(scale_attn_by_inverse_layer_idx=True),
        dict(scale_attn_weights=False),
        dict(reorder_and_upcast_attn=True),
    ],
)
def test_attention_scaling_options_honoured_by_every_backend(options):
    peer, eager = make_pair(GPTForCausalLM, "pre", attn="eager", **options)
    peer.config._attn_implementation = "eager"
    _, sdpa = make_pair(GPTForCausalLM, "pre", attn="sdpa", **options)
    _, plain = make_pair(GPTForCausalLM, "pre", attn="sdpa")
    ids = random_ids()
    with torch.no_grad():
        expected = peer(ids).logits
        for model in (eager, sdpa):
            torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)
        if not options.get("reorder_and_upcast_attn"):  # that one changes nothing in float32
            assert not torch.allclose(plain(ids).logits, expected, atol=1e-6)
        # Under bfloat16, the upcast path computes attention in float32 in every backend alike.
        if options.get("reorder_and_upcast_attn"):
            a = eager.to(torch.bfloat16)(ids).logits.float()
            b = sdpa.to(torch.bfloat16)(ids).logits.float()
            torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)


def test_flash_attention_2_where_installed():
    pytest.importorskip("flash_attn", reason="flash-attn is a CUDA-only optional package")
    if not torch.cuda.is_available():
        pytest.skip("flash_attention_2 needs a CUDA device")
    peer, ours = make_pair(GPTForCausalLM, "pre")
    ours = ours.to("cuda", torch.bfloat16)
    ours.set_attn_implementation("flash_attention_2")
    ids = random_ids().cuda()
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids).logits.float().cpu(), peer(ids.cpu()).logits, atol=0.05, rtol=0.05
        )


@pytest.mark.parametrize("norm", NORMS)
def test_static_cache_generation_equals_dynamic(norm):
    _, ours = make_pair(GPTForCausalLM, norm)
    ids = random_ids(2, 8)
    mask = torch.ones_like(ids)
    common = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    dynamic = ours.generate(ids, **common)
    static = ours.generate(ids, cache_implementation="static", **common)
    assert torch.equal(static, dynamic)


def test_static_cache_with_torch_compile():
    _, ours = make_pair(GPTForCausalLM, "pre")
    ids = random_ids(1, 8)
    common = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
    )
    expected = ours.generate(ids, **common)
    # generate() compiles the decoding step itself (fullgraph) for a static cache; on CPU only when asked.
    config = transformers.CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True  # transformers' switch for compiling off GPU
    torch._dynamo.reset()
    got = ours.generate(ids, compile_config=config, **common)
    assert torch.equal(got, expected)
    assert "_compiled_call" in vars(ours)  # the compiled step really ran


def test_gradient_checkpointing_gives_same_gradients():
    _, ours = make_pair(GPTForCausalLM, "pre", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = random_ids(2, 10)
    ours.train()

    def grads():
        ours.zero_grad()
        ours(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in ours.named_parameters()}

    plain = grads()
    ours.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert ours.is_activation_checkpointing
    checkpointed = grads()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5)


def test_causal_lm_loss_is_shifted_cross_entropy():
    _, ours = make_pair(GPTForCausalLM, "pre")
    ids = random_ids(2, 10)
    labels = ids.clone()
    labels[0, :4] = -100
    with torch.no_grad():
        out = ours(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, VOCAB)
    expected = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)


def test_resize_token_embeddings_keeps_lm_head_tied():
    _, ours = make_pair(GPTForCausalLM, "post")
    ours.resize_token_embeddings(VOCAB + 3)
    assert ours.config.vocab_size == VOCAB + 3
    assert ours.lm_head.weight.data_ptr() == ours.transformer.wte.weight.data_ptr()
    with torch.no_grad():
        logits = ours(torch.tensor([[VOCAB + 2, 5, 6]])).logits
    assert logits.shape == (1, 3, VOCAB + 3)


HEADS_BY_AUTO = [
    (AutoModel, GPTModel),
    (AutoModelForCausalLM, GPTForCausalLM),
    (AutoModelForSequenceClassification, GPTForSequenceClassification),
    (AutoModelForTokenClassification, GPTForTokenClassification),
    (AutoModelForQuestionAnswering, GPTForQuestionAnswering),
]


@pytest.mark.parametrize(("auto", "head"), HEADS_BY_AUTO)
def test_save_and_reload_through_auto_classes(tmp_path, auto, head):
    _, ours = make_pair(head, "pre", pad_token_id=0)
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "hfgpt"
    assert set(saved["auto_map"]) == {
        "AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
        "AutoModelForTokenClassification", "AutoModelForQuestionAnswering",
    }  # fmt: skip
    # The plain model's two files, and no other code, travel with a checkpoint.
    assert sorted(path.name for path in tmp_path.glob("*.py")) == [
        "configuration_hfgpt.py",
        "modeling_hfgpt.py",
    ]
    for name in ("configuration_hfgpt.py", "modeling_hfgpt.py"):
        assert (tmp_path / name).read_text() == (MODELING_DIR / name).read_text(), name
    assert (tmp_path / "model.safetensors").exists()
    assert isinstance(AutoConfig.from_pretrained(tmp_path), GPTConfig)
    reloaded = auto.from_pretrained(tmp_path).eval()
    assert type(reloaded) is head
    ids = random_ids()
    with torch.no_grad():
        a, b = ours(ids), reloaded(ids)
    key = next(k for k in ("logits", "start_logits", "last_hidden_state") if k in a)
    torch.testing.assert_close(b[key], a[key], atol=0, rtol=0)


@pytest.mark.parametrize("norm", NORMS)
def test_offloaded_checkpoint_gives_the_values_of_one_in_memory(tmp_path, norm):
    """device_map offloading (accelerate) keeps the weights on the meta device outside each module's own
    call: the CPU fast paths that read weights without calling the module (the MLP's fused activation,
    the LM head's product and loss) must step aside, as for any hooked module."""
    ids = random_ids()
    for head in (GPTModel, GPTForCausalLM, GPTDoubleHeadsModel):
        _, ours = make_pair(head, norm)
        ours.save_pretrained(tmp_path / head.__name__)
        offloaded = head.from_pretrained(
            tmp_path / head.__name__, device_map={"": "disk"}, offload_folder=tmp_path / "offload"
        ).eval()
        assert offloaded.base_model.h[0].mlp.c_fc.weight.is_meta
        key = "last_hidden_state" if head is GPTModel else "logits"
        labels = None if head is GPTModel else ids
        with torch.no_grad():
            expected, got = ours(ids, labels=labels), offloaded(ids, labels=labels)
        torch.testing.assert_close(got[key], expected[key], atol=1e-6, rtol=1e-6)
        if labels is not None:
            torch.testing.assert_close(got.loss, expected.loss, atol=1e-6, rtol=1e-6)
    # GPT-1's auxiliary LM loss multiplies by the embedding matrix itself: refused while it is offloaded.
    _, ours = make_pair(GPTForSequenceClassification, norm, pad_token_id=0, lm_loss_weight=0.5)
    ours.save_pretrained(tmp_path / "clf")
    offloaded = GPTForSequenceClassification.from_pretrained(
        tmp_path / "clf", device_map={"": "disk"}, offload_folder=tmp_path / "offload_clf"
    )
    with pytest.raises(ValueError, match="lm_loss_weight.*offloaded"):
        offloaded(ids, labels=torch.tensor([0, 1]))


@pytest.mark.parametrize("norm", NORMS)
def test_hooks_on_the_lm_head_run_as_in_transformers(norm):
    """A forward hook on lm_head sees, and may replace, the logits in every path: prefill, a decoding
    step, and the loss (computed from the hook's logits, as transformers does)."""
    peer, ours = make_pair(GPTForCausalLM, norm)
    calls = []
    ours.lm_head.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    for model in (ours, peer):
        model.lm_head.register_forward_hook(lambda module, args, output: output * 0.5 + 1.0)
    for ids in (random_ids(2, 12), random_ids(1, 3)):  # more rows than a decoding step, and fewer
        calls.clear()
        with torch.no_grad():
            expected, got = peer(ids, labels=ids), ours(ids, labels=ids)
        assert calls == ["pre"]
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)


REMOTE_CODE_SCRIPT = textwrap.dedent(
    """
    import sys, json, torch
    sys.modules["hfgpt"] = None  # hfgpt cannot be imported here: only the checkpoint's own code can run
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    path, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
    lm = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    clf = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=True, num_labels=2)
    assert type(lm).__module__.startswith("transformers_modules"), type(lm).__module__
    with torch.no_grad():
        print(json.dumps(lm(ids).logits.tolist()))
    print(type(clf).__name__)
    """
)


@pytest.mark.slow
def test_trust_remote_code_loads_without_hfgpt(tmp_path):
    _, ours = make_pair(GPTForCausalLM, "pre")
    ours.save_pretrained(tmp_path / "ckpt")
    ids = random_ids(1, 6)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_CODE_SCRIPT, str(tmp_path / "ckpt"), json.dumps(ids.tolist())],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    with torch.no_grad():
        expected = ours(ids).logits
    torch.testing.assert_close(torch.tensor(json.loads(lines[-2])), expected, atol=1e-6, rtol=1e-6)
    assert lines[-1] == "GPTForSequenceClassification"


@pytest.mark.parametrize("norm", NORMS)
def test_transformers_checkpoints_load_directly_and_export_back(tmp_path, norm):
    peer, _ = make_pair(GPTForCausalLM, norm)
    peer.save_pretrained(tmp_path / "theirs")
    ours = GPTForCausalLM.from_pretrained(tmp_path / "theirs").eval()
    assert ours.config.layer_norm_position == norm
    ids = random_ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, peer(ids).logits, atol=1e-5, rtol=1e-5)
    # And back: our model exported to transformers' class, saved, reloaded by plain transformers.
    to_transformers(ours).save_pretrained(tmp_path / "exported")
    again = getattr(transformers, type(peer).__name__).from_pretrained(tmp_path / "exported").eval()
    for name, tensor in peer.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


@pytest.mark.parametrize("preset", list(PRESETS))
def test_full_size_presets_have_the_released_shapes(preset):
    config = GPTConfig.from_preset(preset)
    norm = config.layer_norm_position
    size = dict(
        n_embd=config.n_embd, n_layer=config.n_layer, n_head=config.n_head, n_positions=config.n_positions
    )
    with torch.device("meta"):
        ours = GPTForCausalLM(config)
        if norm == "pre":
            peer = transformers.GPT2LMHeadModel(transformers.GPT2Config(**size, vocab_size=config.vocab_size))
        else:
            peer = transformers.OpenAIGPTLMHeadModel(
                transformers.OpenAIGPTConfig(**size, vocab_size=config.vocab_size)
            )
    theirs = {
        k.replace("tokens_embed", "wte").replace("positions_embed", "wpe"): v.shape
        for k, v in peer.state_dict().items()
    }
    ours_shapes = {k: v.shape for k, v in ours.state_dict().items()}
    assert ours_shapes == {k: v for k, v in theirs.items() if not k.endswith(".attn.bias")}
    # Published sizes: GPT-2 124M/355M/774M/1558M (openai/gpt-2 model folders); GPT-1 ~117M (paper).
    millions = {"openai-gpt": 117, "gpt2": 124, "gpt2-medium": 355, "gpt2-large": 774, "gpt2-xl": 1558}[
        preset
    ]
    assert abs(ours.num_parameters() / 1e6 - millions) / millions < 0.01


def test_bad_inputs_get_clear_errors():
    _, ours = make_pair(GPTForCausalLM, "pre")
    with pytest.raises(ValueError, match=r"Sequence length 65 .* context of 64 positions"):
        ours(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"token id {VOCAB + 5}, outside the vocabulary \[0, {VOCAB}\)"):
        ours(torch.tensor([[1, 2, VOCAB + 5]]))
    with pytest.raises(ValueError, match=r"token id -1"):
        ours(torch.tensor([[1, -1]]))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 5\), expected \(1, 3\)"):
        ours(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        ours()
    with pytest.raises(ValueError, match=r"position_ids contains 64, outside the context \[0, 64\)"):
        ours(torch.tensor([[1, 2]]), position_ids=torch.tensor([[63, 64]]))
    with pytest.raises(ValueError, match=r"position_ids contains -1"):
        ours(torch.tensor([[1, 2]]), position_ids=torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError, match=rf"token_type_ids contains {VOCAB}, outside \[0, {VOCAB}\)"):
        ours(torch.tensor([[1, 2]]), token_type_ids=torch.tensor([[0, VOCAB]]))
    _, clf = make_pair(GPTForSequenceClassification, "pre")
    with pytest.raises(ValueError, match="batch of 2 sequences without a pad token"):
        clf(random_ids(2, 5))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(n_embd=30, n_head=4), r"n_embd \(30\) must be divisible by GPTConfig.n_head \(4\)"),
        (dict(n_layer=0), "n_layer must be a positive integer, got 0"),
        (dict(vocab_size=-3), "vocab_size must be a positive integer"),
        (dict(layer_norm_position="middle"), "layer_norm_position"),
        (dict(activation_function="gelu_fast"), "activation_function"),
        (dict(resid_pdrop=1.5), r"resid_pdrop must be in \[0, 1\)"),
        (
            dict(summary_activation="tanhh"),
            "summary_activation 'tanhh' is not an activation transformers knows",
        ),
    ],
)
def test_bad_config_values_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(Exception, match=message):
        GPTConfig(**kwargs)


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match="unknown preset 'gpt3'.*gpt2-xl"):
        GPTConfig.from_preset("gpt3")


def test_stop_strings_end_generation():
    from hfgpt.tokenization import GPT2Tokenizer

    tokenizer = GPT2Tokenizer()  # GPT-2 ids below 96 are single printable characters
    _, ours = make_pair(GPTForCausalLM, "pre")
    ids = random_ids(1, 6)
    common = dict(attention_mask=torch.ones_like(ids), do_sample=True, pad_token_id=0)
    torch.manual_seed(7)
    new = ours.generate(ids, max_new_tokens=20, **common)[0, 6:].tolist()
    # The first generated token not seen earlier in the continuation: stopping on its text must end
    # generation right after it.
    k = next(i for i in range(2, len(new)) if new[i] not in new[:i])
    stop = tokenizer.decode([new[k]])
    torch.manual_seed(7)  # the same draws up to the stop
    stopped = ours.generate(ids, max_new_tokens=20, stop_strings=[stop], tokenizer=tokenizer, **common)
    assert stopped[0, 6:].tolist() == new[: k + 1]


def test_double_heads_default_pooling():
    peer, ours = make_pair(GPTDoubleHeadsModel, "post")
    ids = random_ids(2 * 2, 9).view(2, 2, 9)
    with torch.no_grad():
        # No pad and no classify token: the last position, as transformers does.
        torch.testing.assert_close(ours(ids).mc_logits, peer(ids).mc_logits, atol=1e-5, rtol=1e-5)
        # GPT-1's recipe: pooled at the `_classify_` token wherever the transform put it.
        clf = VOCAB - 1
        ids = ids.clamp(max=VOCAB - 2)
        ids[0, 0, 4] = ids[0, 1, 6] = ids[1, 0, 8] = ids[1, 1, 2] = clf
        ours.config.classify_token_id = clf
        expected = peer(ids, mc_token_ids=torch.tensor([[4, 6], [8, 2]])).mc_logits
        torch.testing.assert_close(ours(ids).mc_logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("num_labels", "labels"),
    [
        (1, torch.tensor([0.5, -1.0, 2.0])),  # regression
        (3, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])),  # multi-label
    ],
)
def test_sequence_classification_regression_and_multi_label_losses(num_labels, labels):
    peer, ours = make_pair(GPTForSequenceClassification, "pre", num_labels=num_labels, pad_token_id=0)
    ids = random_ids(3, 8)
    with torch.no_grad():
        expected, got = peer(ids, labels=labels), ours(ids, labels=labels)
    assert ours.config.problem_type == peer.config.problem_type
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)


def test_label_outside_num_labels_is_refused():
    _, ours = make_pair(GPTForSequenceClassification, "pre", num_labels=3, pad_token_id=0)
    with pytest.raises(ValueError, match=r"label 5 is outside \[0, 3\)"):
        ours(random_ids(2, 6), labels=torch.tensor([1, 5]))


@pytest.mark.parametrize("head", [GPTForCausalLM, GPTDoubleHeadsModel])
@pytest.mark.parametrize("norm", NORMS)
def test_in_memory_conversion_from_transformers(head, norm):
    peer, ours = make_pair(head, norm)
    converted = from_transformers(peer)
    assert type(converted) is head and converted.config.layer_norm_position == norm
    for name, tensor in ours.state_dict().items():
        assert torch.equal(converted.state_dict()[name], tensor), name


HEADS_WITH_PEERS = [
    (head, norm) for head, peers in PEERS.items() for norm in NORMS if peers[NORMS.index(norm)]
]


@pytest.mark.parametrize(("head", "norm"), HEADS_WITH_PEERS)
def test_return_dict_false_gives_transformers_tuple(head, norm):
    extra = dict(pad_token_id=0) if head is GPTForSequenceClassification else {}
    peer, ours = make_pair(head, norm, **extra)
    ids = random_ids(1, 7)
    mc_ids = ids.view(1, 1, 7).expand(1, 2, 7)
    ids = mc_ids if head is GPTDoubleHeadsModel else ids
    labels = {
        GPTForCausalLM: dict(labels=ids),
        GPTForSequenceClassification: dict(labels=torch.tensor([1])),
        GPTDoubleHeadsModel: dict(labels=mc_ids, mc_labels=torch.tensor([1])),
        GPTForTokenClassification: dict(labels=torch.ones(1, 7, dtype=torch.long)),
        GPTForQuestionAnswering: dict(start_positions=torch.tensor([1]), end_positions=torch.tensor([3])),
    }.get(head, {})
    with torch.no_grad():
        expected = peer(ids, return_dict=False, **labels)
        # transformers' GPT-1 has no cache to return; ours does unless told not to.
        got = ours(ids, return_dict=False, use_cache=norm == "pre", **labels)
    # hfgpt's heads report their loss terms after transformers' fields (the loss of GPT-1's recipe,
    # L3, where transformers' DoubleHeads report the LM loss first).
    assert isinstance(got, tuple) and len(got) >= len(expected)
    for position, (ours_item, theirs) in enumerate(zip(got, expected, strict=False)):
        if position == 0 and head is GPTDoubleHeadsModel:
            torch.testing.assert_close(got[-1], theirs, atol=1e-5, rtol=1e-5)  # lm_loss, reported last
        elif isinstance(theirs, torch.Tensor):
            torch.testing.assert_close(ours_item, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", NORMS)
def test_untied_model_exports_untied(norm):
    torch.manual_seed(0)
    ours = GPTForCausalLM(GPTConfig(**TINY, layer_norm_position=norm, tie_word_embeddings=False)).eval()
    assert ours.lm_head.weight.data_ptr() != ours.transformer.wte.weight.data_ptr()
    exported = to_transformers(ours)
    assert exported.config.tie_word_embeddings is False
    ids = random_ids(1, 9)
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, ours(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["tanh", "relu", "gelu", "sigmoid"])
def test_summary_activation_is_applied_as_transformers_does(activation):
    peer, ours = make_pair(GPTDoubleHeadsModel, "pre", summary_activation=activation)
    ids = random_ids(2 * 3, 9).view(2, 3, 9)
    mc_token_ids = torch.tensor([[8, 5, 7], [3, 8, 8]])
    with torch.no_grad():
        expected = peer(ids, mc_token_ids=mc_token_ids).mc_logits
        got = ours(ids, mc_token_ids=mc_token_ids).mc_logits
        plain = GPTDoubleHeadsModel(
            ours.config.__class__(**{**ours.config.to_dict(), "summary_activation": None})
        )
        plain.load_state_dict(ours.state_dict())
        without = plain.eval()(ids, mc_token_ids=mc_token_ids).mc_logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(without, expected, atol=1e-3)  # the activation changes the logits


def test_gradient_checkpointing_leaves_a_passed_cache_alone():
    from transformers import DynamicCache

    peer, ours = make_pair(GPTForCausalLM, "pre")
    ids = random_ids(1, 8)
    lengths = []
    for model in (peer, ours):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        cache = DynamicCache(config=model.config)
        # (the cache by transformers' installed name, which GPT2LMHeadModel takes)
        model(ids, labels=ids, **{CACHE_FIELD: cache}, use_cache=True).loss.backward()  # recomputes blocks
        lengths.append(cache.get_seq_length())
    assert lengths[1] == lengths[0] == 0


def _batch_for(head: type, size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(size)
    ids = torch.randint(1, VOCAB, (size, 6))
    if head is GPTForSequenceClassification:
        return dict(input_ids=ids, labels=torch.randint(0, 2, (size,)))
    if head is GPTForTokenClassification:
        labels = torch.randint(0, 2, (size, 6))
        labels[:, :2] = -100  # uneven counts of real labels per row
        return dict(input_ids=ids, labels=labels)
    if head is GPTDoubleHeadsModel:
        return dict(input_ids=ids.view(size, 1, 6).expand(size, 2, 6), mc_labels=torch.randint(0, 2, (size,)))
    return dict(input_ids=ids, labels=ids)


@pytest.mark.parametrize(
    "head", [GPTForSequenceClassification, GPTForTokenClassification, GPTDoubleHeadsModel, GPTForCausalLM]
)
def test_gradient_accumulation_gives_the_update_of_one_large_batch(head, tmp_path):
    """Trainer with batch 2 x 2 accumulation steps must take the step of batch 4 (it scales a batch-mean
    loss itself unless the model says it handles num_items_in_batch)."""
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    rows = _batch_for(head, 4)

    class Rows(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {k: v[i] for k, v in rows.items()}

    def step(batch: int, accumulation: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        zero = dict(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, summary_first_dropout=0)
        model = head(GPTConfig(**TINY, **zero, pad_token_id=0))
        args = TrainingArguments(
            output_dir=str(tmp_path / f"{batch}x{accumulation}"),
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation,
            max_steps=1,
            learning_rate=1.0,
            optim="sgd",
            max_grad_norm=0,
            lr_scheduler_type="constant",
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            dataloader_drop_last=False,
        )
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        Trainer(model=model, args=args, train_dataset=Rows()).train()
        return {n: p.detach() - before[n] for n, p in model.named_parameters()}

    whole, accumulated = step(4, 1), step(2, 2)
    for name, update in whole.items():
        torch.testing.assert_close(accumulated[name], update, atol=1e-6, rtol=1e-4, msg=name)


def test_score_dropout_acts_in_training_only():
    config = GPTConfig(**TINY, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, pad_token_id=0)
    ids = random_ids(2, 7)
    plain = GPTForSequenceClassification(config).train()
    assert torch.equal(plain(ids).logits, plain(ids).logits)  # default 0: transformers' head, no dropout
    dropped = GPTForSequenceClassification(GPTConfig(**config.to_dict() | {"score_dropout": 0.5})).train()
    dropped.load_state_dict(plain.state_dict())
    assert not torch.equal(dropped(ids).logits, dropped(ids).logits)
    dropped.eval()
    torch.testing.assert_close(dropped(ids).logits, plain.eval()(ids).logits)


def test_summary_dropout_shared_draws_one_mask_for_all_choices():
    # GPT-1's train.py: dropout on the (B, 2, E) pooled states with noise shape [B, 1, E].
    settings = dict(TINY, summary_use_proj=False, summary_type="first", summary_first_dropout=0.5)
    hidden = torch.ones(3, 4, 5, TINY["n_embd"])  # (B, C, T, E)
    shared = GPTSequenceSummary(GPTConfig(**settings, summary_dropout_shared=True), num_outputs=1).train()
    own = GPTSequenceSummary(GPTConfig(**settings), num_outputs=1).train()
    torch.manual_seed(0)
    kept, dropped = shared(hidden), own(hidden)
    assert set(kept.unique().tolist()) == set(dropped.unique().tolist()) == {0.0, 2.0}
    assert all(torch.equal(kept[:, c], kept[:, 0]) for c in range(4))
    assert not torch.equal(kept[0], kept[1])  # examples still differ
    assert not all(torch.equal(dropped[:, c], dropped[:, 0]) for c in range(4))
    torch.testing.assert_close(shared.eval()(hidden), hidden[..., 0, :], rtol=0, atol=0)


def test_shape_only_passes_on_meta_and_fake_tensors():
    # Memory and FLOP estimates run the model on tensors without values: the input checks must not read them.
    from torch._subclasses.fake_tensor import FakeTensorMode

    peer, ours = make_pair(GPTForCausalLM, "pre")
    for model in (peer, ours):
        meta = model.to("meta")
        assert meta(torch.zeros(2, 5, dtype=torch.long, device="meta")).logits.shape == (2, 5, VOCAB)
    _, ours = make_pair(GPTForCausalLM, "pre")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        ids = mode.from_tensor(random_ids(2, 5))
        assert ours(ids).logits.shape == (2, 5, VOCAB)


class Logits(torch.nn.Module):
    """A causal LM's logits alone, without a cache: what `torch.jit.trace` can record."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, use_cache=False).logits


def test_torch_jit_trace_with_its_checks():
    _, ours = make_pair(GPTForCausalLM, "pre")
    ids = random_ids(2, 9)
    traced = torch.jit.trace(Logits(ours), (ids,))  # traces twice and compares the graphs
    torch.testing.assert_close(traced(ids), ours(ids).logits)


def test_cache_of_another_batch_size_is_refused():
    _, ours = make_pair(GPTForCausalLM, "pre")
    cache = ours(random_ids(1, 4), use_cache=True)[CACHE_FIELD]
    with pytest.raises(ValueError, match="The cache holds 1 sequences, but the input has 2"):
        ours(random_ids(2, 1), cache=cache)


def test_trainer_predict_gives_logits_first_for_multiple_choice(tmp_path):
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    model = GPTDoubleHeadsModel(GPTConfig(**TINY))
    ids = random_ids(3 * 2, 5).view(3, 2, 5)

    class Choices(Dataset):  # mc_labels only: Trainer then keeps the model's outputs as predictions
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": ids[i], "mc_labels": torch.tensor(i % 2)}

    args = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_eval_batch_size=3
    )
    predictions = Trainer(model=model, args=args).predict(Choices()).predictions
    assert predictions[0].shape == (3, 2, 5, VOCAB) and predictions[1].shape == (3, 2)


# --- interop: every head transformers has, every OpenAIGPT activation, refused conversions ---------------


@pytest.mark.parametrize("head", [GPTForTokenClassification, GPTForQuestionAnswering])
def test_token_classification_and_question_answering_convert_both_ways(head):
    from hfgpt.modeling.interop import ExportError

    peer, ours = make_pair(head, "pre", classifier_dropout=0.3)
    converted = from_transformers(peer)
    assert type(converted) is head
    for name, tensor in ours.state_dict().items():
        assert torch.equal(converted.state_dict()[name], tensor), name
    exported = to_transformers(ours)
    assert type(exported).__name__ == PEERS[head][0]
    ids = random_ids()
    with torch.no_grad():
        expected, got = peer(ids), exported(ids)
    for key in ("logits", "start_logits", "end_logits"):
        if key in expected:
            torch.testing.assert_close(got[key], expected[key], atol=0, rtol=0)
    if head is GPTForTokenClassification:  # transformers reads the same dropout before its classifier
        assert exported.dropout.p == 0.3
    # transformers has no OpenAIGPT token-classification or question-answering class.
    post = head(GPTConfig(**TINY, layer_norm_position="post"))
    with pytest.raises(ExportError, match=rf"no OpenAIGPT class equivalent to {head.__name__} .*'post'"):
        to_transformers(post)


# hfgpt activation -> OpenAIGPTConfig.afn computing the same function (modeling_openai.ACT_FNS).
POST_NORM_ACTIVATIONS = {
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "swish",
}


@pytest.mark.parametrize(("activation", "afn"), sorted(POST_NORM_ACTIVATIONS.items()))
def test_post_norm_models_export_each_activation_openai_gpt_has(activation, afn):
    from transformers.models.openai.modeling_openai import ACT_FNS

    torch.manual_seed(0)
    ours = GPTForCausalLM(
        GPTConfig(**TINY, layer_norm_position="post", activation_function=activation)
    ).eval()
    exported = to_transformers(ours).eval()
    assert type(exported) is transformers.OpenAIGPTLMHeadModel and exported.config.afn == afn
    assert type(exported.transformer.h[0].mlp.act) is type(ACT_FNS[afn])
    ids = random_ids()
    with torch.no_grad():
        expected = exported(ids).logits
        torch.testing.assert_close(ours(ids).logits, expected, atol=1e-5, rtol=1e-5)
        # Another activation gives other logits: the comparison above sees the activation.
        other_activation = "silu" if activation == "relu" else "relu"
        other = GPTForCausalLM(
            GPTConfig(**{**ours.config.to_dict(), "activation_function": other_activation})
        )
        other.load_state_dict(ours.state_dict())
        assert not torch.allclose(other.eval()(ids).logits, expected, atol=1e-4)
    back = from_transformers(exported)
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_post_norm_exact_gelu_is_refused_naming_activation_function():
    from hfgpt.modeling.interop import ExportError

    ours = GPTForCausalLM(GPTConfig(**TINY, layer_norm_position="post", activation_function="gelu"))
    with pytest.raises(ExportError, match="activation_function='gelu' has no OpenAIGPT equivalent"):
        to_transformers(ours)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("summary_type", ["last", "first", "mean"])
def test_double_heads_pooling_transformers_computes_differently_is_refused(norm, summary_type):
    """transformers' summary pools "last" / "first" / "mean" over the choices axis of its
    (batch, choices, length, E) input; hfgpt's over each choice's tokens."""
    from hfgpt.modeling.interop import ExportError

    peer, ours = make_pair(GPTDoubleHeadsModel, norm, summary_type=summary_type)
    ids = random_ids(2 * 3, 9).view(2, 3, 9)
    with torch.no_grad():  # the reason: one logit per position (B, T) there, one per choice (B, C) here
        assert peer(ids).mc_logits.shape == (2, 9) and ours(ids).mc_logits.shape == (2, 3)
    refused = f"GPTDoubleHeadsModel with config.summary_type='{summary_type}'"
    with pytest.raises(ExportError, match=refused):
        to_transformers(ours)
    with pytest.raises(ExportError, match=f"{type(peer).__name__} with config.summary_type='{summary_type}'"):
        from_transformers(peer)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (dict(activation_function="gelu_fast"), "activation_function='gelu_fast', which hfgpt does not"),
        (dict(activation_function="quick_gelu"), "activation_function='quick_gelu', which hfgpt does not"),
        (dict(activation_function="tanh"), "activation_function='tanh', which hfgpt does not"),
        (dict(add_cross_attention=True), "add_cross_attention=True; hfgpt has no cross-attention"),
    ],
)
def test_gpt2_models_hfgpt_cannot_express_are_refused_naming_the_field(extra, message):
    from hfgpt.modeling.interop import ExportError

    peer = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY, **extra))
    with pytest.raises(ExportError, match=f"GPT2LMHeadModel has config.{message}"):
        from_transformers(peer)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_export_keeps_the_dtype(dtype):
    _, ours = make_pair(GPTForCausalLM, "pre")
    ours = ours.to(dtype)
    exported = to_transformers(ours)
    assert exported.dtype == dtype
    theirs = exported.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(theirs[name], tensor), name  # the same bits, no round trip through float32


@pytest.mark.parametrize("preset", ["gpt2", "openai-gpt"])
def test_initialisation_scales_residual_projections_as_gpt2(preset):
    """GPT-2 §2.3 (`scale_residual_init`): both residual projections of each block start at std 0.02 /
    sqrt(2 n_layer), as GPT2LMHeadModel's do; GPT-1 used 0.02 everywhere. transformers never calls
    `_init_weights` on a custom-code module without parameters of its own (it did nothing here until
    session 12)."""
    torch.manual_seed(0)
    sizes = dict(n_embd=256, n_layer=3, n_head=4, vocab_size=VOCAB)
    block = GPTForCausalLM(GPTConfig.from_preset(preset, **sizes)).transformer.h[1]
    scaled = 0.02 / (2 * 3) ** 0.5 if preset == "gpt2" else 0.02
    for projection, std in (
        (block.attn.c_proj, scaled),
        (block.mlp.c_proj, scaled),
        (block.attn.c_attn, 0.02),
        (block.mlp.c_fc, 0.02),
    ):
        assert abs(projection.weight.std().item() - std) < 0.03 * std, (projection, std)
        assert not projection.bias.any()
    if preset == "gpt2":
        peer = transformers.GPT2LMHeadModel(transformers.GPT2Config(**sizes)).transformer.h[1]
        for name in ("attn.c_proj", "mlp.c_proj"):
            theirs = peer.get_submodule(name).weight.std().item()
            assert abs(block.get_submodule(name).weight.std().item() - theirs) < 0.03 * theirs


def test_classification_of_embeddings_without_a_pad_token_is_refused_for_a_batch():
    """As GPT2ForSequenceClassification: with `inputs_embeds` no padding can be found, so a batch of several
    sequences needs a pad token; one sequence is pooled at its last position."""
    peer, ours = make_pair(GPTForSequenceClassification, "pre")
    embeds = torch.randn(2, 6, TINY["n_embd"])
    with torch.no_grad():
        with pytest.raises(ValueError, match="no padding token"):
            peer(inputs_embeds=embeds)  # transformers refuses it too
        with pytest.raises(ValueError, match="Cannot pool a batch of 2 sequences without a pad token"):
            ours(inputs_embeds=embeds)
        torch.testing.assert_close(
            ours(inputs_embeds=embeds[:1]).logits, peer(inputs_embeds=embeds[:1]).logits
        )


def test_empty_batch_with_eager_attention_as_openai_gpt():
    """OpenAIGPTLMHeadModel runs a batch of zero sequences; so does hfgpt's post-norm model with eager
    attention (sdpa refuses it inside transformers, as for GPT2LMHeadModel)."""
    peer, ours = make_pair(GPTForCausalLM, "post", attn="eager")
    ids = torch.zeros(0, 5, dtype=torch.long)
    with torch.no_grad():
        assert ours(ids).logits.shape == peer(ids).logits.shape == (0, 5, VOCAB)
