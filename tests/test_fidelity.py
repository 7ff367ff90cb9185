"""A model with the CPU backend behaves as the plain model, whatever a user does to it.

Each case edits a kernelized model and its plain twin alike (hooks, class patches, transformers' attention
registry, parametrizations, pruning, adapters, module edits, weight swaps of any layout or dtype, modes,
settings), between two `generate()` calls, so that the backend has already run its fast path on the model
before the edit. Then both generate again: the same tokens, the same scores (to float rounding: the C step
sums in another order), or the same exception. Edits that change the computation are checked to change the
plain model's tokens or scores, so that a backend ignoring them would fail. The unedited model runs its
decoding steps in C, so that the cases test the path they are about.

Then: generate()'s own options (sampling from the same seed, beams, several sequences a prompt, penalties,
extra outputs, other caches) give the plain model's tokens and scores; serialization (torch.save, pickle,
deepcopy, save_pretrained) keeps the model fast and equal; export, tracing and compilation see the plain
model; threads; the layout of what comes back (contiguous logits).
"""

import copy
import io
import pickle
import threading
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize, prune
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.pytorch_utils import Conv1D

from hfgpt.cpu import is_kernelized, kernelize, kernels, unkernelize
from hfgpt.modeling import GPTConfig, GPTForCausalLM
from hfgpt.modeling.modeling_hfgpt import GPTMLP, GPTAttention, GPTBlock

FAMILIES = {"gpt2": "pre", "gpt1": "post"}  # layer_norm_position: GPT-2's pre-norm blocks, GPT-1's post-norm
WIDTH = 128  # two heads of 64, the heads the C step computes
NEW_TOKENS = 6


def make_models(family: str) -> tuple[GPTForCausalLM, GPTForCausalLM]:
    """A kernelized model with random weights and its plain twin (the same weights)."""
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=300,
        n_positions=64,
        n_embd=WIDTH,
        n_layer=2,
        n_head=2,
        layer_norm_position=FAMILIES[family],
        bos_token_id=0,
        eos_token_id=None,
        initializer_range=0.1,  # (weights large enough that an edit moves the scores well past float rounding)
    )
    fast = kernelize(GPTForCausalLM(config).eval())
    return fast, unkernelize(copy.deepcopy(fast))


def prompts() -> dict[str, torch.Tensor]:
    """Two prompts, the first left-padded, with their mask."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 300, (2, 7), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def generate(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | tuple[type, str]:
    """(tokens, scores) of greedy decoding, or (exception type, message) where it raises."""
    try:
        with torch.no_grad():
            out = model.generate(
                **prompts(),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
    except Exception as error:  # noqa: BLE001  (the plain model's exception is the expected outcome)
        return type(error), str(error)
    return out.sequences, torch.stack(out.scores).float()


def assert_same(fast: tuple, plain: tuple) -> None:
    if isinstance(plain[0], type) or isinstance(fast[0], type):
        assert fast == plain
        return
    assert torch.equal(fast[0], plain[0]), "different tokens"
    torch.testing.assert_close(fast[1], plain[1], rtol=1e-4, atol=1e-4)


def changed(before: tuple, after: tuple) -> bool:
    if isinstance(after[0], type):
        return True
    return not torch.equal(before[0], after[0]) or not torch.allclose(before[1], after[1], atol=1e-3)


class StepCounter:
    """Counts the decoding steps run in C (`torch.ops.hfgpt.float_decode_step`)."""

    def __init__(self) -> None:
        self.calls = 0

    def __enter__(self) -> "StepCounter":
        step = kernels.float_decode_step
        self._patch = mock.patch.object(kernels, "float_decode_step", side_effect=self._count(step))
        self._patch.__enter__()
        return self

    def _count(self, step: Callable) -> Callable:
        def counted(*args):
            self.calls += 1
            return step(*args)

        return counted

    def __exit__(self, *exc) -> None:
        self._patch.__exit__(*exc)


def direction(seed: int, size: int = WIDTH) -> torch.Tensor:
    """A fixed random direction: a uniform shift would vanish in the next layer norm."""
    return torch.randn(size, generator=torch.Generator().manual_seed(seed))


# --- the edits: each takes (model, monkeypatch) and edits the model, or the classes and registries it uses
# (monkeypatch and `UNDO` undo those); `True` in `EDITS`: the edit changes what the model computes.


def block_forward_hook(model, monkeypatch):
    model.transformer.h[0].register_forward_hook(lambda m, args, out: out + 3 * direction(1))


def mlp_forward_pre_hook(model, monkeypatch):
    model.transformer.h[1].mlp.register_forward_pre_hook(lambda m, args: (args[0] + 3 * direction(2),))


def c_attn_forward_hook(model, monkeypatch):
    model.transformer.h[0].attn.c_attn.register_forward_hook(
        lambda m, args, out: out + direction(3, 3 * WIDTH)
    )


def layer_norm_hook(model, monkeypatch):
    model.transformer.h[1].ln_2.register_forward_hook(lambda m, args, out: out * 2 + direction(4))


def base_model_hook(model, monkeypatch):
    def shift(module, args, out):
        out.last_hidden_state = out.last_hidden_state + 3 * direction(5)
        return out

    model.transformer.register_forward_hook(shift)


def lm_head_hook(model, monkeypatch):
    bias = torch.zeros(300)
    bias[17] = 50.0
    model.lm_head.register_forward_hook(lambda m, args, out: out + bias)


def global_forward_hook(model, monkeypatch):
    def hook(module, args, out):
        return out + direction(6) if isinstance(module, GPTBlock) else None

    UNDO.append(torch.nn.modules.module.register_module_forward_hook(hook).remove)


def _patch(monkeypatch, owner, name, wrap):
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, wrap(original))


def class_patch_block(model, monkeypatch):
    _patch(monkeypatch, GPTBlock, "forward", lambda f: lambda self, *a, **k: f(self, *a, **k) + direction(7))


def class_patch_mlp(model, monkeypatch):
    _patch(monkeypatch, GPTMLP, "forward", lambda f: lambda self, x: f(self, x) * 1.5 + direction(8))


def class_patch_conv1d(model, monkeypatch):
    _patch(monkeypatch, Conv1D, "forward", lambda f: lambda self, x: f(self, x) * 1.2)


def class_patch_layer_norm(model, monkeypatch):
    _patch(monkeypatch, nn.LayerNorm, "forward", lambda f: lambda self, x: f(self, x) + 0.5 * direction(9))


def class_patch_linear(model, monkeypatch):
    _patch(monkeypatch, nn.Linear, "forward", lambda f: lambda self, x: f(self, x) * -1.0)


def class_patch_attention_interface(model, monkeypatch):
    def interface(self):
        def attend(*args, **kwargs):
            out, weights = sdpa_attention_forward(*args, **kwargs)
            return out * 2, weights

        return attend

    monkeypatch.setattr(GPTAttention, "attention_interface", interface)


def registry_sdpa(model, monkeypatch):
    def my_sdpa(*args, **kwargs):
        out, weights = sdpa_attention_forward(*args, **kwargs)
        return out + 0.5, weights

    AttentionInterface.register("sdpa", my_sdpa)
    UNDO.append(lambda: AttentionInterface.register("sdpa", sdpa_attention_forward))


def eager_attention(model, monkeypatch):
    model.set_attn_implementation("eager")


def parametrized_weight(model, monkeypatch):
    class Scale(nn.Module):
        def forward(self, weight):
            return weight * 1.5

    parametrize.register_parametrization(model.transformer.h[0].mlp.c_fc, "weight", Scale())


def pruned_weight(model, monkeypatch):
    prune.l1_unstructured(model.transformer.h[0].attn.c_attn, "weight", amount=0.5)


def lora_adapter(model, monkeypatch):
    peft = pytest.importorskip("peft")  # the test extra installs it
    torch.manual_seed(3)
    config = peft.LoraConfig(target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True)
    return peft.get_peft_model(model, config)


def append_block(model, monkeypatch):
    model.transformer.h.append(copy.deepcopy(model.transformer.h[-1]))


def delete_block(model, monkeypatch):
    del model.transformer.h[-1]


def reorder_blocks(model, monkeypatch):
    h = model.transformer.h
    model.transformer.h = nn.ModuleList([h[1], h[0]])


class Shift(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 3 * direction(11)


def wrap_layer_norm(model, monkeypatch):
    block = model.transformer.h[0]
    block.ln_2 = nn.Sequential(block.ln_2, Shift())


def replace_layer_norm(model, monkeypatch):
    torch.manual_seed(6)
    norm = nn.LayerNorm(WIDTH)
    nn.init.normal_(norm.bias)
    model.transformer.h[1].ln_1 = norm


def replace_activation(model, monkeypatch):
    model.transformer.h[1].mlp.act = F.silu


def replace_head(model, monkeypatch):
    torch.manual_seed(4)
    model.lm_head = nn.Linear(WIDTH, 300, bias=True)


def instance_forward(model, monkeypatch):
    mlp = model.transformer.h[1].mlp
    mlp.forward = lambda x: GPTMLP.forward(mlp, x) + direction(10)


def weight_data_assigned(model, monkeypatch):
    layer = model.transformer.h[0].mlp.c_proj
    layer.weight.data = layer.weight.data * 1.5  # the same Parameter, holding a new tensor


def weight_data_strided(model, monkeypatch):
    layer = model.transformer.h[0].attn.c_proj
    layer.weight.data = layer.weight.data.t().contiguous().t()  # the same Parameter: equal values, strided


def weight_data_narrowed(model, monkeypatch):
    layer = model.transformer.h[1].mlp.c_proj
    layer.weight.data = layer.weight.data[:-64]  # the same Parameter, contiguous, 64 inputs short: an error


def position_table_cut(model, monkeypatch):
    wpe = model.transformer.wpe
    wpe.weight.data = wpe.weight.data[:9]  # the same Parameter, fewer rows: position 9 is out of range


def weight_edited_in_place(model, monkeypatch):
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight.mul_(1.5)


def weight_transposed_layout(model, monkeypatch):
    layer = model.transformer.h[0].attn.c_proj
    layer.weight = nn.Parameter(layer.weight.detach().t().contiguous().t())  # equal values, strided


def float64_weights(model, monkeypatch):
    model.double()


def bfloat16_weights(model, monkeypatch):
    model.to(torch.bfloat16)


def layer_norm_epsilon(model, monkeypatch):
    model.transformer.h[0].ln_1.eps = 0.5


def attention_scaling(model, monkeypatch):
    model.transformer.h[1].attn.scaling *= 3


def training_mode(model, monkeypatch):
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(module, GPTAttention):
            module.attn_dropout = 0.0
    model.train()


def token_embeddings_resized(model, monkeypatch):
    torch.manual_seed(5)
    model.resize_token_embeddings(310)


EDITS: dict[str, tuple[Callable, bool]] = {
    "block_forward_hook": (block_forward_hook, True),
    "mlp_forward_pre_hook": (mlp_forward_pre_hook, True),
    "c_attn_forward_hook": (c_attn_forward_hook, True),
    "layer_norm_hook": (layer_norm_hook, True),
    "base_model_hook": (base_model_hook, True),
    "lm_head_hook": (lm_head_hook, True),
    "global_forward_hook": (global_forward_hook, True),
    "class_patch_block": (class_patch_block, True),
    "class_patch_mlp": (class_patch_mlp, True),
    "class_patch_conv1d": (class_patch_conv1d, True),
    "class_patch_layer_norm": (class_patch_layer_norm, True),
    "class_patch_linear": (class_patch_linear, True),
    "class_patch_attention_interface": (class_patch_attention_interface, True),
    "registry_sdpa": (registry_sdpa, True),
    "eager_attention": (eager_attention, False),
    "parametrized_weight": (parametrized_weight, True),
    "pruned_weight": (pruned_weight, True),
    "lora_adapter": (lora_adapter, True),
    "append_block": (append_block, True),
    "delete_block": (delete_block, True),
    "reorder_blocks": (reorder_blocks, True),
    "wrap_layer_norm": (wrap_layer_norm, True),
    "replace_layer_norm": (replace_layer_norm, True),
    "replace_activation": (replace_activation, True),
    "replace_head": (replace_head, True),
    "instance_forward": (instance_forward, True),
    "weight_data_assigned": (weight_data_assigned, True),
    "weight_data_strided": (weight_data_strided, False),
    "weight_data_narrowed": (weight_data_narrowed, True),
    "position_table_cut": (position_table_cut, True),
    "weight_edited_in_place": (weight_edited_in_place, True),
    "weight_transposed_layout": (weight_transposed_layout, False),
    "float64_weights": (float64_weights, False),
    "bfloat16_weights": (bfloat16_weights, True),
    "layer_norm_epsilon": (layer_norm_epsilon, True),
    "attention_scaling": (attention_scaling, True),
    "training_mode": (training_mode, False),
    "token_embeddings_resized": (token_embeddings_resized, False),
}


# what undoes the edits of process-wide registries (global hooks, transformers' attention registry)
UNDO: list[Callable[[], None]] = []


# edits of classes and registries, made once for both models
PROCESS_WIDE = {name for name in EDITS if name.startswith(("class_patch", "registry", "global"))}


@pytest.fixture
def undo_global_hooks():
    yield
    while UNDO:
        UNDO.pop()()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", EDITS)
def test_an_edit_between_two_generate_calls_gives_what_the_plain_model_gives(
    name, family, monkeypatch, undo_global_hooks
):
    edit, changes = EDITS[name]
    fast, plain = make_models(family)
    before = generate(plain)
    with StepCounter() as steps:
        assert_same(generate(fast), before)  # (the backend has now run, and checked, this model)
    assert steps.calls == NEW_TOKENS - 1  # every step after the prompt's
    with monkeypatch.context() as patches:
        fast = edit(fast, patches) or fast
        if name not in PROCESS_WIDE:
            plain = edit(plain, patches) or plain
        assert_same(generate(fast), expected := generate(plain))
        if changes:
            assert changed(before, expected), "the edit should change what the model computes"
        else:
            assert not isinstance(expected[0], type)
            assert torch.equal(expected[0], before[0])
    # Undone (hooks and registrations aside, which the model keeps), the backend's steps come back.
    if name in ("eager_attention", "weight_edited_in_place", "float64_weights"):
        with StepCounter() as steps:
            generate(fast.float())
        assert steps.calls > 0


def test_the_plain_twin_runs_no_step_in_c():
    _, plain = make_models("gpt2")
    with StepCounter() as steps:
        generate(plain)
    assert steps.calls == 0 and not is_kernelized(plain)


# --- generate()'s own options ----------------------------------------------------------------------------

# generate() arguments that change how it drives the model (sampling, beams and their cache reordering,
# several sequences a prompt, penalties, extra outputs, other caches), each with whether the C step runs.
GENERATE_OPTIONS = {
    "sampling": (dict(do_sample=True, top_k=20, temperature=0.7), True),
    "beam_search": (dict(num_beams=3), True),
    "beam_sampling": (dict(num_beams=2, do_sample=True), True),
    "several_sequences": (dict(do_sample=True, num_return_sequences=2), True),
    "repetition_penalty": (dict(repetition_penalty=1.5), True),
    "hidden_states": (dict(output_hidden_states=True), False),
    "static_cache": (dict(cache_implementation="static"), False),
    "no_cache": (dict(use_cache=False), False),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", GENERATE_OPTIONS)
def test_generate_options_give_what_the_plain_model_gives(name, family):
    options, fast_path = GENERATE_OPTIONS[name]
    fast, plain = make_models(family)
    results = []
    for model in (fast, plain):
        torch.manual_seed(7)  # (sampling draws the same numbers in both)
        with StepCounter() as steps, torch.no_grad():
            out = model.generate(**prompts(), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True, **options)  # fmt: skip
        results.append((out, steps.calls))
    (fast_out, fast_steps), (plain_out, _) = results
    assert (fast_steps > 0) == fast_path
    assert torch.equal(fast_out.sequences, plain_out.sequences), "different tokens"
    for fast_scores, plain_scores in zip(fast_out.scores, plain_out.scores, strict=True):
        torch.testing.assert_close(fast_scores, plain_scores, rtol=1e-4, atol=1e-4, equal_nan=True)
    for field in ("hidden_states", "beam_indices"):
        if getattr(plain_out, field, None) is not None:
            torch.testing.assert_close(
                getattr(fast_out, field), getattr(plain_out, field), rtol=1e-4, atol=1e-4
            )


# --- serialization ----------------------------------------------------------------------------------


def _round_trips(model: nn.Module, tmp_path) -> dict[str, nn.Module]:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    model.save_pretrained(tmp_path / "saved")
    return {
        "torch.save": torch.load(buffer, weights_only=False),
        "pickle": pickle.loads(pickle.dumps(model)),
        "deepcopy": copy.deepcopy(model),
        "save_pretrained": GPTForCausalLM.from_pretrained(tmp_path / "saved").eval(),
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_a_kernelized_model_that_has_generated_saves_loads_and_stays_fast(family, tmp_path):
    fast, plain = make_models(family)
    expected = generate(plain)
    assert_same(generate(fast), expected)
    for how, loaded in _round_trips(fast, tmp_path).items():
        with StepCounter() as steps:
            assert_same(generate(loaded), expected)
        assert steps.calls == NEW_TOKENS - 1, how
        assert is_kernelized(loaded), how


def test_an_unkernelized_copy_stays_plain_through_pickling():
    _, plain = make_models("gpt2")
    with StepCounter() as steps:
        generate(pickle.loads(pickle.dumps(plain)))
        generate(copy.deepcopy(plain))
    assert steps.calls == 0


# --- what comes back ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_cache_have_the_plain_models_layout(family):
    fast, plain = make_models(family)
    inputs = prompts()
    with torch.no_grad():
        outputs = [model(**inputs) for model in (fast, plain)]
        steps = [
            model(
                input_ids=torch.tensor([[5], [6]]),
                attention_mask=torch.cat([inputs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1),
                cache=out.cache,
            )
            for model, out in zip((fast, plain), outputs, strict=True)
        ]
    for fast_out, plain_out in (outputs, steps):
        assert fast_out.logits.is_contiguous() and fast_out.logits.shape == plain_out.logits.shape
        torch.testing.assert_close(fast_out.logits, plain_out.logits, rtol=1e-4, atol=1e-4)
        fast_out.logits.view(-1)  # (a non-contiguous tensor refuses view(-1))
    fast_cache, plain_cache = steps[0].cache, steps[1].cache
    assert fast_cache.get_seq_length() == plain_cache.get_seq_length() == 8
    for fast_layer, plain_layer in zip(fast_cache.layers, plain_cache.layers, strict=True):
        torch.testing.assert_close(fast_layer.keys, plain_layer.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fast_layer.values, plain_layer.values, rtol=1e-4, atol=1e-4)


def test_logits_save_with_safetensors(tmp_path):
    from safetensors.torch import save_file

    fast, _ = make_models("gpt2")
    out = fast.generate(**prompts(), max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True,
                        return_dict_in_generate=True)  # fmt: skip
    save_file({f"step{i}": logits for i, logits in enumerate(out.logits)}, tmp_path / "logits.safetensors")


# --- export, trace, compile, threads ------------------------------------------------------------------


class Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, use_cache=False).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_export_with_a_dynamic_length_sees_the_plain_model(family):
    fast, plain = make_models(family)
    ids = prompts()["input_ids"]
    length = torch.export.Dim("length", min=2, max=63)
    exported = torch.export.export(Logits(fast), (ids,), dynamic_shapes=({1: length},))
    for n in (3, 7, 40):
        other = torch.randint(0, 300, (2, n), generator=torch.Generator().manual_seed(n))
        torch.testing.assert_close(exported.module()(other), plain(other).logits)


def test_jit_trace_and_torch_compile_see_the_plain_model():
    fast, plain = make_models("gpt2")
    ids = prompts()["input_ids"]
    traced = torch.jit.trace(Logits(fast), (ids,))
    torch.testing.assert_close(traced(ids), plain(ids).logits)
    compiled = torch.compile(fast, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, plain(ids).logits)


def test_two_threads_generating_with_one_model_get_the_plain_tokens():
    fast, plain = make_models("gpt2")
    expected = generate(plain)
    results = [None, None]

    def run(index: int) -> None:
        results[index] = generate(fast)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        assert_same(result, expected)
