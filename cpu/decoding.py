"""A decoding step of a whole model in one call into C (csrc/decode_step.h), for the CPU backend's float32
models and for the int8 decoding copy.

Block by block, a decoding step of GPT-2 makes about 40 calls into C and torch with Python between them
(the checks, the attention's reshapes, the cache's writes): at one row its blocks took about 1.5x as long
as in one call (benchmarks/RESULTS.md). `one_call_forward`, set on a `GPTModel` instance in place of its
`forward` (by `kernelize`, through `model_forward`, and by `quantize_for_decoding`), runs the embeddings,
every block with its attention on the cache, and the final layer norm in one OpenMP parallel region
(`torch.ops.hfgpt.float_decode_step` or `int8_decode_step`), wherever that computes what
`GPTModel.forward` would; everything else runs `GPTModel.forward`.

Each kind of block the step computes registers a `StepKind` in `STEP_KINDS`: the plain `GPTBlock` with
its Conv1D layers (`hfgpt.cpu.layers`), the int8 copy's `Int8Block` (`hfgpt.cpu.quantization`).
"""

import functools
import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast

from hfgpt.modeling.modeling_hfgpt import CACHE_FIELD, GPTModel, _cache_argument

from . import kernels
from .cache import GrowingLayer, grow_in_place
from .ops import (
    float32_vector,
    has_forward_hooks,
    has_global_forward_hooks,
    has_storage,
    layer_norm_fits_kernel,
    needs_grad,
    plain_tensors,
)


@dataclass(frozen=True)
class StepKind:
    """How the one-call step computes a model whose blocks are of one type.

    `layer_tensors`: the names of each linear layer's tensors (parameters or buffers) the operator reads,
    in its order; `computes(block, width)`: whether the operator computes what `block` would for hidden
    states of `width` (its layers, norms, activation and mode, no hook on a part it would skip, the
    operator's C code built); `inner`: a block's MLP width; `step`: the operator's name in
    `hfgpt.cpu.kernels`."""

    layer_tensors: tuple[str, ...]
    computes: Callable[[nn.Module, int], bool]
    inner: Callable[[nn.Module], int]
    step: str

    @property
    def block_tensors(self) -> int:
        """Tensors per block: the two layer norms' weight and bias, then the four layers' tensors."""
        return 4 + 4 * len(self.layer_tensors)


# block type -> how the step computes a model of such blocks
STEP_KINDS: dict[type, StepKind] = {}


def one_call_forward(
    self: GPTModel,
    input_ids: torch.LongTensor | None = None,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    token_type_ids: torch.LongTensor | None = None,
    position_ids: torch.LongTensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs: Any,
) -> BaseModelOutputWithPast:
    """`GPTModel.forward`, whose decoding steps run in one call of hfgpt's C kernel.

    The step runs where a forward is one decoding step that the kernel computes exactly as
    `GPTModel.forward` would (`decodes_in_one_call`): one new token per sequence, given as ids, on top of
    a plain `DynamicCache` of the earlier positions (as `generate()` passes it), with a 2-D attention mask
    or none, no hook, no gradient, no training, no output of attentions or hidden states, outside
    compilation, every block of a kind in `STEP_KINDS` that it computes, heads of 64. Its attention is the
    CPU backend's decode attention (the C function that `hfgpt_attention_decode` runs). Everything else (a
    prompt, a static cache, ...) runs `GPTModel.forward`."""
    plain = functools.partial(GPTModel.forward, self)
    if torch.compiler.is_compiling():
        return plain(
            input_ids, cache, attention_mask, token_type_ids, position_ids, inputs_embeds, use_cache, **kwargs
        )
    cache = _cache_argument(cache, kwargs)
    if inputs_embeds is None and token_type_ids is None:
        grow_in_place(cache)  # (a plain DynamicCache's layers made `GrowingLayer`s, as the CPU backend does)
        if decodes_in_one_call(self, input_ids, cache, attention_mask, position_ids, use_cache, kwargs):
            outputs = _decoding_step(self, input_ids, cache, attention_mask, position_ids)
            if outputs is not None:
                return outputs
    return plain(
        input_ids, cache, attention_mask, token_type_ids, position_ids, inputs_embeds, use_cache, **kwargs
    )


def decodes_in_one_call(
    model: GPTModel,
    input_ids: torch.Tensor | None,
    cache: Any,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    use_cache: bool | None,
    kwargs: dict[str, Any],
) -> bool:
    """Whether the one-call step computes this forward of `model` as `GPTModel.forward` would (see
    `one_call_forward`)."""
    config = model.config
    return_dict = kwargs.get("return_dict")
    if (
        input_ids is None
        or input_ids.dim() != 2
        or input_ids.shape[1] != 1
        or input_ids.dtype != torch.int64
        or not input_ids.is_cpu
        or not plain_tensors(input_ids)
        or not has_storage(input_ids)
        or type(cache) is not DynamicCache
        or not (use_cache or (use_cache is None and config.use_cache))
        or any(key != "return_dict" for key in kwargs)
        or not (config.return_dict if return_dict is None else return_dict)
        or config.output_attentions
        or config.output_hidden_states
        or config._attn_implementation not in ("sdpa", "eager")
        or model.training
        or torch.jit.is_tracing()
        or torch.is_autocast_enabled("cpu")
    ):
        return False
    tensors = step_tensors(model)
    if tensors is None:
        return False
    # a cache of the earlier positions, every layer's keys and values of one shape, in buffers it can grow
    layers, heads = cache.layers, model._modules["wte"].embedding_dim // kernels.HEAD_SIZE
    keys = getattr(layers[0], "keys", None) if layers else None
    if (
        len(layers) != len(model._modules["h"])
        or type(keys) is not torch.Tensor
        or keys.dim() != 4
        or keys.shape[2] == 0
    ):
        return False
    batch, past = input_ids.shape[0], keys.shape[2]
    shape = (batch, heads, past, kernels.HEAD_SIZE)
    for layer in layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if (
            type(layer) is not GrowingLayer
            or type(keys) is not torch.Tensor
            or type(values) is not torch.Tensor
            or keys.shape != shape
            or values.shape != shape
            or keys.dtype != torch.float32
            or values.dtype != torch.float32
            or not keys.is_cpu
            or not values.is_cpu
            or needs_grad(keys, values)
        ):
            return False
    if attention_mask is not None and not (
        attention_mask.dim() == 2
        and tuple(attention_mask.shape) == (batch, past + 1)
        and attention_mask.is_cpu
        and plain_tensors(attention_mask)
    ):
        return False
    return position_ids is None or (
        tuple(position_ids.shape) in ((batch, 1), (1, 1))
        and position_ids.is_cpu
        and not position_ids.is_floating_point()
        and plain_tensors(position_ids)
    )


def step_tensors(model: GPTModel) -> list[torch.Tensor] | None:
    """The tensors the step reads (wte's and wpe's weights, each block's `StepKind.block_tensors`, the
    final norm's weight and bias), or None where the kernel would not compute what the modules do.

    The full checks (`_kernel_computes`) run once; what they read is then watched (`_StepWatch`): the
    modules, tensors and settings as the same objects under the same names, no hook, dropout's modules
    in eval mode. A step finds them unchanged in a few microseconds, where the checks take a
    sizeable share of a step; anything changed runs the full checks again."""
    watch = _WATCHES.get(model)
    if watch is None or not watch.unchanged():
        kind = _kernel_computes(model)
        watch = None if kind is None else _StepWatch(model, kind)
        _WATCHES[model] = watch
        if watch is None or not watch.unchanged():  # (hooks or training: the checks leave those to it)
            return None
    return None if needs_grad(*watch.tensors) else watch.tensors


def _kernel_computes(model: GPTModel) -> StepKind | None:
    """The `StepKind` whose operator computes what the modules do, or None: plain embeddings, blocks of
    one registered kind that it computes, of one layer-norm epsilon, MLP width and norm order, heads of
    64, and an affine final layer norm (GPT-2) or none (GPT-1), every tensor one the kernel reads as it
    is."""
    modules = model._modules
    wte, wpe, ln_f = modules["wte"], modules["wpe"], modules.get("ln_f")
    if type(wte) is not nn.Embedding or type(wpe) is not nn.Embedding:
        return None
    width = wte.embedding_dim
    if (
        wte.max_norm is not None
        or wpe.max_norm is not None
        or wpe.embedding_dim != width
        or width % kernels.HEAD_SIZE
        or not all(
            e.weight.dim() == 2
            and float32_vector(e.weight, (e.weight.shape[0], width))
            and plain_tensors(e.weight)
            for e in (wte, wpe)
        )
    ):
        return None
    if ln_f is not None and not layer_norm_fits_kernel(ln_f, width):
        return None
    blocks = list(modules["h"])
    kind = STEP_KINDS.get(type(blocks[0])) if blocks else None
    if kind is None or any(type(block) is not type(blocks[0]) for block in blocks):
        return None
    # (code the step would not run: the blocks' parts are the kind's to check)
    if any(m is not None and has_forward_hooks(m) for m in (wte, wpe, modules["drop"], ln_f, *blocks)):
        return None
    if not all(kind.computes(block, width) for block in blocks):
        return None
    first = blocks[0]
    eps, inner = first.ln_1.eps, kind.inner(first)
    if all(
        block.attn.head_dim == kernels.HEAD_SIZE
        and block.ln_1.eps == eps
        and kind.inner(block) == inner
        and block.pre_norm == first.pre_norm
        for block in blocks
    ):
        return kind
    return None


def _decoding_step(
    model: GPTModel,
    input_ids: torch.Tensor,
    cache: DynamicCache,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> BaseModelOutputWithPast | None:
    """The step `decodes_in_one_call` allows, or None where the attention mask hides a row's new token
    (whose output the kernel's attention would make zeros; `GPTModel.forward` decides what it is)."""
    batch = input_ids.shape[0]
    layers = cache.layers
    past = layers[0].keys.shape[2]
    model._check_inputs(input_ids, attention_mask, batch, 1, past, position_ids, None, batch)
    mask = None
    if attention_mask is not None:
        keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
        if not bool(keep.all()):
            if not bool(keep[:, -1].all()):
                return None
            mask = keep.contiguous()
    if position_ids is None:
        positions = torch.full((batch,), past, dtype=torch.int64)
    else:
        positions = position_ids.to(torch.int64).expand(batch, 1).reshape(batch).contiguous()
    # (the tensors `decodes_in_one_call` checked: wte's and wpe's weights, the blocks', the final norm's)
    watch = _WATCHES[model]
    tensors, kind = watch.tensors, watch.kind
    blocks = list(model._modules["h"])
    ln_f = model._modules.get("ln_f")
    end = 2 + len(blocks) * kind.block_tensors
    buffers = [layer.reserve(1) for layer in layers]
    hidden = getattr(kernels, kind.step)(
        input_ids.reshape(batch).contiguous(),
        positions,
        tensors[0],
        tensors[1],
        tensors[2:end],
        [keys for keys, _ in buffers],
        [values for _, values in buffers],
        past,
        mask,
        [block.attn.scaling for block in blocks],
        blocks[0].ln_1.eps,
        blocks[0].pre_norm,
        tensors[end:],
        1e-5 if ln_f is None else ln_f.eps,
    )
    for layer in layers:
        layer.advance(1)
    return BaseModelOutputWithPast(last_hidden_state=hidden.view(batch, 1, -1), **{CACHE_FIELD: cache})


# Each `GPTModel`'s `_StepWatch` of its last full check (`step_tensors`), beside the model rather than in it:
# a copy of the model (`copy.deepcopy`, pickling) would carry copies of the dictionaries it watches, not the
# copy's own, and so miss a change made to the copy. (A watch holds the model's parts, never the model.)
_WATCHES: "weakref.WeakKeyDictionary[GPTModel, _StepWatch]" = weakref.WeakKeyDictionary()


class _StepWatch:
    """What `_kernel_computes` read, as (dictionary, key, object) entries: each module under its
    name in its parent's `_modules`, each tensor in its owner's `_parameters` or `_buffers`, each setting
    (layer-norm epsilons, the activation, the attention scale and function, the norm order, an instance's
    `forward`) in its module's `__dict__`; with the modules' hook dictionaries and, for the modules whose
    mode changes what they compute (dropout), their `__dict__`s. The objects are held, so none is freed and
    no new one can take its address."""

    def __init__(self, model: GPTModel, kind: StepKind) -> None:
        self.kind = kind
        self.registries: list[dict] = []  # the entries, as three lists
        self.names: list[str] = []
        self.values: list[Any] = []
        self.hooks: list[dict] = []
        self.modal: list[dict] = []
        self.tensors: list[torch.Tensor] = []  # (in the step operator's order)
        modules = model._modules
        h = self.module(modules, "h")
        wte, wpe = self.module(modules, "wte"), self.module(modules, "wpe")
        self.module(modules, "drop", modal=True)
        ln_f = self.module(modules, "ln_f")
        self.tensor(wte, "weight"), self.tensor(wpe, "weight")
        for index in h._modules:
            block = self.module(h._modules, index, modal=True)
            attn, mlp = (
                self.module(block._modules, "attn", modal=True),
                self.module(block._modules, "mlp", modal=True),
            )
            (
                self.module(attn._modules, "resid_dropout", modal=True),
                self.module(mlp._modules, "dropout", modal=True),
            )
            norms = [self.module(block._modules, name) for name in ("ln_1", "ln_2")]
            layers = [self.module(attn._modules, name) for name in ("c_attn", "c_proj")]
            layers += [self.module(mlp._modules, name) for name in ("c_fc", "c_proj")]
            self.setting(block, "pre_norm"), self.setting(attn, "scaling"), self.setting(mlp, "act")
            self.setting(attn, "attention_interface")
            for norm in norms:
                self.setting(norm, "eps")
                self.tensor(norm, "weight"), self.tensor(norm, "bias")
            for layer in layers:
                for name in kind.layer_tensors:
                    self.tensor(layer, name)
        if ln_f is not None:
            self.setting(ln_f, "eps")
            self.tensor(ln_f, "weight"), self.tensor(ln_f, "bias")

    def module(self, registry: dict, name: str, modal: bool = False) -> Any:
        """Watch `registry[name]` (None where absent), its hooks, its instance `forward` and, where
        `modal`, its mode; returns it."""
        module = registry.get(name)
        self._watch(registry, name, module)
        if module is not None:
            self.hooks += (module._forward_hooks, module._forward_pre_hooks)
            self.setting(module, "forward")
            if modal:
                self.modal.append(module.__dict__)
        return module

    def setting(self, module: nn.Module, name: str) -> None:
        self._watch(module.__dict__, name, module.__dict__.get(name))

    def tensor(self, module: nn.Module, name: str) -> None:
        registry = module._parameters if name in module._parameters else module._buffers
        self._watch(registry, name, registry[name])
        self.tensors.append(registry[name])

    def _watch(self, registry: dict, name: str, value: Any) -> None:
        self.registries.append(registry)
        self.names.append(name)
        self.values.append(value)

    def unchanged(self) -> bool:
        """Whether every watched object is still in place, no hook is registered (on a watched module or
        globally) and no watched module of dropout is in training mode."""
        return (
            # (in C loops: `registry.get(name) is value` for every entry)
            all(map(operator.is_, map(dict.get, self.registries, self.names), self.values))
            and not any(self.hooks)
            and not any(attributes["training"] for attributes in self.modal)
            and not has_global_forward_hooks()
        )
