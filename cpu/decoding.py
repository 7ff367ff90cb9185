"""A decoding step of a whole model in one call into C (csrc/decode_step.h), for float32 models and the int8
decoding copy (docs/cpu-backend.md). Block by block, a GPT-2 step makes about 40 calls into C and torch with
Python between them: at one row its blocks took about 1.5x as long as in one call (benchmarks/RESULTS.md).

`decoding_step` runs it wherever that computes what the model's own code would, decided from the model as
it is at that call (full checks once per model, then `_StepWatch`); elsewhere the caller runs the model. Each
kind of block it computes registers a `StepKind` in `STEP_KINDS` (`GPTBlock` here, `Int8Block` elsewhere).
"""

import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.pytorch_utils import Conv1D

from hfgpt.modeling import modeling_hfgpt
from hfgpt.modeling.modeling_hfgpt import CACHE_FIELD, GPTMLP, GPTAttention, GPTBlock, GPTModel

from . import kernels
from .cache import GrowingLayer, grow_in_place
from .checks import (
    eager,
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
    """How the one-call step computes a model whose blocks are of one type. `layer_tensors`: the names of
    each linear layer's tensors the operator reads, in its order; `computes(block, width)`: whether the
    operator computes what `block` would for hidden states of `width`; `inner`: a block's MLP width; `step`:
    the operator's name in `hfgpt.cpu.kernels`."""

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


def watch_code(owner: Any, name: str) -> None:
    """Record `owner.name` (a class's method, a module's function) as code the step computes instead of
    running: a step runs only while every recorded attribute is still what it was here, so that a user's
    class-level patch (`GPTBlock.forward = ...`) runs as it does in the plain model."""
    CODE.append((owner, name, getattr(owner, name)))


# (owner, name, value) of the code the step stands in for (`watch_code`)
CODE: list[tuple[Any, str, Any]] = []
for _owner, _name in (
    (nn.Module, "__call__"), (GPTModel, "__call__"), (GPTModel, "forward"), (nn.Embedding, "forward"),
    (nn.Dropout, "forward"), (nn.LayerNorm, "forward"), (modeling_hfgpt, "eager_attention_forward"),
    (modeling_hfgpt, "gelu_tanh"),
):  # fmt: skip
    watch_code(_owner, _name)


def code_unchanged() -> bool:
    """Whether the code the step stands in for is as recorded (`watch_code`)."""
    return all(getattr(owner, name) is value for owner, name, value in CODE)


def decoding_step(
    model: GPTModel, input_ids: torch.LongTensor | None, cache: Any, attention_mask: torch.Tensor | None,
    position_ids: torch.LongTensor | None, use_cache: bool | None, kwargs: dict[str, Any],
) -> BaseModelOutputWithPast | None:  # fmt: skip
    """What `model(input_ids, cache=cache, ...)` returns, computed in one call into C, or None (nothing run,
    nothing changed) where `decodes_in_one_call` says no. The cache's layers become `GrowingLayer`s
    (`hfgpt.cpu.cache`), into whose buffers the step writes its keys and values."""
    if "past_key_values" in kwargs:  # (the cache's name before transformers 5.24)
        if cache is not None:
            return None
        cache = kwargs["past_key_values"]
    if not decodes_in_one_call(model, input_ids, cache, attention_mask, position_ids, use_cache, kwargs):
        return None
    return _decoding_step(model, input_ids, cache, attention_mask, position_ids)


def decodes_in_one_call(
    model: GPTModel, input_ids: torch.Tensor | None, cache: Any, attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None, use_cache: bool | None, kwargs: dict[str, Any],
) -> bool:  # fmt: skip
    """Whether the one-call step computes this forward of `model` as `model(...)` would (docs/cpu-backend.md,
    "Where the step runs"): one new token per sequence, given as ids, on a plain `DynamicCache` of the earlier
    positions (as `generate()` passes it), and a model whose blocks a kind in `STEP_KINDS` computes."""
    config = model.config
    return_dict = kwargs.get("return_dict")
    if (
        not eager()
        or type(model) is not GPTModel
        or input_ids is None
        or input_ids.dim() != 2
        or input_ids.shape[1] != 1
        or input_ids.dtype != torch.int64
        or not input_ids.is_cpu
        or not plain_tensors(input_ids)
        or not has_storage(input_ids)
        or type(cache) is not DynamicCache
        or not (use_cache or (use_cache is None and config.use_cache))
        or any(key not in ("return_dict", "past_key_values") for key in kwargs)
        or not (config.return_dict if return_dict is None else return_dict)
        or config.output_attentions
        or config.output_hidden_states
        or model.training
        or torch.is_autocast_enabled("cpu")
        or not code_unchanged()
        or _ATTENTION.get(config._attn_implementation, _ATTENTION)
        is not ALL_ATTENTION_FUNCTIONS.get_interface(
            config._attn_implementation, modeling_hfgpt.eager_attention_forward
        )
        or has_forward_hooks(model)
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
            type(layer) not in (GrowingLayer, DynamicLayer)
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
    final norm's weight and bias), or None where the kernel would not compute what the modules do. The full
    checks (`_kernel_computes`), a sizeable share of a step, run again only where `_StepWatch` finds a
    change; finding none is a few loops in C over the watched entries."""
    watch = _WATCHES.get(model)
    if watch is None or not watch.unchanged():
        kind = _kernel_computes(model)
        watch = None if kind is None else _StepWatch(model, kind)
        _WATCHES[model] = watch
        if watch is None or not watch.unchanged():  # (hooks or training: the checks leave those to it)
            return None
    return None if needs_grad(*watch.tensors) else watch.tensors


def _kernel_computes(model: GPTModel) -> StepKind | None:
    """The `StepKind` whose operator computes what the modules do, or None: plain embeddings, blocks of one
    registered kind, epsilon, MLP width and norm order, heads of 64, an affine final layer norm or none."""
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
    if type(modules["drop"]) is not nn.Dropout:
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
        and block.attn.num_heads * kernels.HEAD_SIZE == width
        and block.attn.layer_idx == index  # (the cache layer the block's attention updates)
        and block.attn.config is model.config  # (whose attention implementation `decodes_in_one_call` read)
        and block.ln_1.eps == eps
        and kind.inner(block) == inner
        and block.pre_norm == first.pre_norm
        for index, block in enumerate(blocks)
    ):
        return kind
    return None


def _decoding_step(
    model: GPTModel, input_ids: torch.Tensor, cache: DynamicCache, attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> BaseModelOutputWithPast | None:  # fmt: skip
    """The step `decodes_in_one_call` allows, or None where the attention mask hides a row's new token
    (whose output the kernel's attention would make zeros; `GPTModel.forward` decides what it is) or where an
    id or a position is outside its embedding table (the model's own code raises its error)."""
    batch, past = input_ids.shape[0], cache.layers[0].keys.shape[2]
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
    tensors, kind = _WATCHES[model].tensors, _WATCHES[model].kind
    ids = input_ids.reshape(batch).contiguous()
    for index, table in ((ids, tensors[0]), (positions, tensors[1])):
        low, high = torch.aminmax(index)
        if int(low) < 0 or int(high) >= table.shape[0]:
            return None
    blocks, ln_f = list(model._modules["h"]), model._modules.get("ln_f")
    end = 2 + len(blocks) * kind.block_tensors
    grow_in_place(cache)
    layers = cache.layers
    buffers = [layer.reserve(1) for layer in layers]
    hidden = getattr(kernels, kind.step)(
        ids, positions, tensors[0], tensors[1], tensors[2:end],
        [keys for keys, _ in buffers], [values for _, values in buffers], past, mask,
        [block.attn.scaling for block in blocks], blocks[0].ln_1.eps, blocks[0].pre_norm, tensors[end:],
        1e-5 if ln_f is None else ln_f.eps,
    )  # fmt: skip
    for layer in layers:
        layer.advance(1)
    return BaseModelOutputWithPast(last_hidden_state=hidden.view(batch, 1, -1), **{CACHE_FIELD: cache})


# Each `GPTModel`'s `_StepWatch`, beside the model rather than in it: a copy of the model (deepcopy, pickling)
# would carry copies of the watched dictionaries, not its own, and miss its changes. (It holds the parts.)
_WATCHES: "weakref.WeakKeyDictionary[GPTModel, _StepWatch]" = weakref.WeakKeyDictionary()


class _StepWatch:
    """What `_kernel_computes` read, as (dictionary, key, object) entries: modules in their parents'
    `_modules`, tensors in `_parameters` or `_buffers`, settings (epsilons, the activation, the attention's
    scale and function, the norm order, an instance's `forward`) in `__dict__`; with the modules' hook
    dictionaries and, where the mode changes what they compute, their `__dict__`s. The objects are held,
    so none is freed and no new one can take its address."""

    def __init__(self, model: GPTModel, kind: StepKind) -> None:
        self.kind = kind
        self.registries: list[dict] = []  # the entries, as three lists
        self.names: list[str] = []
        self.values: list[Any] = []
        self.hooks: list[dict] = []
        self.modal: list[dict] = []
        self.tensors: list[torch.Tensor] = []  # (in the step operator's order)
        modules = model._modules
        self.setting(model, "config")
        h = self.module(modules, "h")
        self.blocks = (h._modules, len(h._modules))  # (a block appended: GPTModel.forward runs it too)
        wte, wpe = self.module(modules, "wte"), self.module(modules, "wpe")
        self.module(modules, "drop", modal=True)
        ln_f = self.module(modules, "ln_f")
        self.tensor(wte, "weight"), self.tensor(wpe, "weight")
        for index in h._modules:
            block = self.module(h._modules, index, modal=True)
            attn, mlp = (self.module(block._modules, name, modal=True) for name in ("attn", "mlp"))
            self.module(attn._modules, "resid_dropout", modal=True)
            self.module(mlp._modules, "dropout", modal=True)
            norms = [self.module(block._modules, name) for name in ("ln_1", "ln_2")]
            layers = [self.module(attn._modules, name) for name in ("c_attn", "c_proj")]
            layers += [self.module(mlp._modules, name) for name in ("c_fc", "c_proj")]
            self.setting(block, "pre_norm"), self.setting(attn, "scaling"), self.setting(mlp, "act")
            for name in ("attention_interface", "config", "layer_idx", "num_heads", "head_dim"):
                self.setting(attn, name)
            for norm in norms:
                self.setting(norm, "eps")
                self.tensor(norm, "weight"), self.tensor(norm, "bias")
            for layer in layers:
                for name in kind.layer_tensors:
                    self.tensor(layer, name)
        if ln_f is not None:
            self.setting(ln_f, "eps")
            self.tensor(ln_f, "weight"), self.tensor(ln_f, "bias")
        # (`.data = ...`, `swap_tensors` keep a parameter and change what it holds; the step reads each tensor
        # where it is at the call: what must stay is its class, dtype, size and contiguity)
        self.types, self.dtypes, self.sizes = (list(map(f, self.tensors)) for f in (type, _DTYPE, _SIZE))

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
        """Whether every watched object is still in place, each of the step's tensors still a contiguous CPU
        tensor of its class, dtype and size, no hook registered (on a watched module or globally) and no
        watched module of dropout in training mode."""
        return (
            # (in C loops: `registry.get(name) is value` for every entry)
            all(map(operator.is_, map(dict.get, self.registries, self.names), self.values))
            and len(self.blocks[0]) == self.blocks[1]
            and list(map(type, self.tensors)) == self.types
            and list(map(_SIZE, self.tensors)) == self.sizes
            and list(map(_DTYPE, self.tensors)) == self.dtypes
            and all(map(Tensor.is_contiguous, self.tensors))
            and all(map(_IS_CPU, self.tensors))
            and not any(self.hooks)
            and not any(map(_TRAINING, self.modal))
            and not has_global_forward_hooks()
        )


# (the attributes `_StepWatch.unchanged` reads, each in one C loop over a list: a GPT-2 step's 148 tensors)
_DTYPE, _IS_CPU, _SIZE = operator.attrgetter("dtype"), operator.attrgetter("is_cpu"), Tensor.size
_TRAINING = operator.itemgetter("training")


# --- the plain GPTBlock ---------------------------------------------------------------------------------

for _owner, _name in (
    (GPTBlock, "__call__"), (GPTBlock, "forward"), (GPTAttention, "forward"),
    (GPTAttention, "attention_interface"), (GPTMLP, "forward"), (Conv1D, "forward"),
):  # fmt: skip
    watch_code(_owner, _name)


def _float_block_computes(block: GPTBlock, width: int) -> bool:
    """Whether `float_decode_step` computes what `block` (a plain `GPTBlock`) would for hidden states of
    `width`: inference, Conv1D layers of float32 weights and biases, affine layer norms of one epsilon, the
    tanh GELU, attention as the config names it, no hook or instance `forward` on a module it would skip."""
    modules = block._modules
    attn, mlp, ln_1, ln_2 = modules["attn"], modules["mlp"], modules["ln_1"], modules["ln_2"]
    if type(attn) is not GPTAttention or type(mlp) is not GPTMLP:
        return False
    layers = (attn._modules["c_attn"], attn._modules["c_proj"], mlp._modules["c_fc"], mlp._modules["c_proj"])
    if any(type(layer) is not Conv1D for layer in layers):
        return False
    dropouts = (attn._modules["resid_dropout"], mlp._modules["dropout"])
    inner = layers[2].nf
    shapes = ((width, 3 * width), (width, width), (width, inner), (inner, width))
    norms = (*ln_1._parameters.values(), *ln_2._parameters.values())  # weight, bias (each or None)
    tensors = [*norms, *(t for layer in layers for t in (layer.weight, layer.bias))]
    return not (
        block.training
        or attn.training
        or mlp.training
        or any(type(d) is not nn.Dropout for d in dropouts)
        or not all(
            float32_vector(layer.weight, shape)
            and layer.bias is not None
            and float32_vector(layer.bias, shape[1:])
            for layer, shape in zip(layers, shapes, strict=True)
        )
        or mlp.act is not modeling_hfgpt.gelu_tanh
        or not (layer_norm_fits_kernel(ln_1, width) and layer_norm_fits_kernel(ln_2, width))
        or ln_1.eps != ln_2.eps
        or not plain_tensors(*tensors)
        or needs_grad(*tensors)
        or "attention_interface" in attn.__dict__
        or any(has_forward_hooks(module) for module in (attn, mlp, ln_1, ln_2, *layers, *dropouts))
        or not kernels.available("row_product")
    )


STEP_KINDS[GPTBlock] = StepKind(
    layer_tensors=("weight", "bias"),
    computes=_float_block_computes,
    inner=lambda block: block.mlp.c_fc.nf,
    step="float_decode_step",
)

# The functions the plain model's attention may call (`GPTAttention.attention_interface`) that the step
# computes, by the implementation's name.
_ATTENTION = {"sdpa": sdpa_attention_forward, "eager": modeling_hfgpt.eager_attention_forward}
