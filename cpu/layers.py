"""`kernelize(model)`: hfgpt's CPU layers swapped into a plain hfgpt model, and `unkernelize` to undo it.

The model file (`hfgpt.modeling.modeling_hfgpt`) is the plain computation. This module makes it faster on
the CPU from outside, the way the `kernels` package's `kernelize` does: it replaces the `forward` of the
model's layers on the instances (never on the classes, so other models and checkpoints' copies of the
code are untouched), and registers its attention with transformers' `AttentionInterface` as
`hfgpt_cpu`, which each swapped attention layer calls where the model asked for `sdpa` (the config keeps
saying `sdpa`: the backend never renames what the user asked for). Every swapped forward checks, call by
call, whether its faster path applies (CPU tensors, float32 or bfloat16, eager, no hooks it would skip)
and otherwise runs the layer's own forward, so a kernelized model moved to a GPU or to float16 computes
exactly the plain model.

What is swapped:
- transformers' `Conv1D` products (`conv1d_forward`): oneDNN's product forward and backward, one-row
  products on hfgpt's C kernel, bfloat16 autocast casts into reused memory;
- the MLP (`mlp_forward`): the GELU inside oneDNN's product, or in place, or on the C kernel;
- the blocks' and embeddings' dropout (`dropout_forward`): byte masks from a counter-based generator;
- attention (`attention_function`, calling `cpu_attention`, registered as `hfgpt_cpu`, where the model
  asked for `sdpa`): causal attention in bands of query rows, on the C kernel where it is built;
- the LM head (`lm_head_forward`) and, in `GPTForCausalLM` with labels, the head and its loss together
  (`causal_lm_forward`): no vocabulary-wide gradient held at once, the gradient handed to the tied
  embeddings; GPT-1's auxiliary LM loss likewise (`auxiliary_lm_loss`);
- `GPTModel.forward` (`model_forward`): a decoding step of the whole model in one call into C
  (`hfgpt.cpu.decoding`).
"""

import functools
import os
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.pytorch_utils import Conv1D

from hfgpt.modeling import modeling_hfgpt
from hfgpt.modeling.modeling_hfgpt import (
    GPTMLP,
    GPTAttention,
    GPTBlock,
    GPTDoubleHeadsModel,
    GPTForCausalLM,
    GPTForSequenceClassification,
    GPTModel,
    GPTPreTrainedModel,
)

from . import decoding, kernels, ops
from .cache import grow_in_place

ATTENTION = "hfgpt_cpu"
ENV_SWITCH = "HFGPT_CPU_BACKEND"


# --- attention ----------------------------------------------------------------------------------------


def cpu_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' sdpa attention, computed on the CPU in bands of query rows (with dropout in training,
    on hfgpt's C kernel where it is built), or as sdpa itself where none of those applies."""
    if query.shape[0] == 0:  # an empty batch (sdpa's reshapes refuse it): nothing to attend
        return query.transpose(1, 2), None
    interface = sdpa_attention_forward
    if ops.fast_dropout_applies(query, dropout, module.training):
        interface = ops.cpu_dropout_attention
    elif ops.native_attention_applies(query, key, value, attention_mask):
        interface = ops.native_causal_attention
    elif ops.native_decode_attention_applies(query, key, value, attention_mask):
        interface = ops.native_decode_attention
    elif ops.banded_attention_applies(query, key, attention_mask):
        interface = ops.cpu_banded_attention
    return interface(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register(ATTENTION, cpu_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the masks sdpa takes: boolean, or None where causal


def attention_function(module: nn.Module) -> Callable:
    """`GPTAttention.attention_interface` of a kernelized layer: `cpu_attention` where its config asks for
    `sdpa` (the same values as sdpa, which it runs wherever its faster paths do not apply), else the one the
    config names. The config keeps what the user asked for (transformers' common test
    `test_sdpa_can_dispatch_non_composite_models` checks it), and transformers' own `sdpa` entry stays
    untouched, so its models (GPT2LMHeadModel, ...) are unchanged."""
    implementation = module.config._attn_implementation
    if implementation == "sdpa":
        return cpu_attention
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, modeling_hfgpt.eager_attention_forward)


# --- layers -------------------------------------------------------------------------------------------


def conv1d_forward(self: Conv1D, x: torch.Tensor) -> torch.Tensor:
    """`Conv1D.forward`: on oneDNN (forward and backward) for float32 CPU tensors, on the C kernel for one
    row (but where MKL's one-row product is the faster, `mkl_decodes_fast`), and inside CPU bfloat16
    autocast without gradients from a weight cast into reused memory."""
    if x.numel() == x.shape[-1] and not ops.mkl_decodes_fast():  # one row: a decoding step at batch size 1
        out = ops.one_row_conv1d(x.reshape(1, -1), self.weight, self.bias)
        if out is not None:
            return out.view(*x.shape[:-1], self.nf)
    if ops.onednn_products_apply(x, self.weight, self.bias):
        rows = x.reshape(-1, x.shape[-1])
        if ops.needs_grad(x, self.weight, self.bias):
            out = ops._OneDNNConv1D.apply(rows, self.weight, self.bias)
        else:
            out = ops.onednn_mm(rows, self.weight.t(), self.bias)
        return out.view(*x.shape[:-1], self.nf)
    dtype = ops.inference_autocast_dtype(x, self.weight, self.bias)
    if dtype is None:
        return Conv1D.forward(self, x)
    weight = ops.workspace(self.weight.shape, dtype, self.weight.device).copy_(self.weight)
    with torch.autocast("cpu", enabled=False):
        out = torch.addmm(self.bias.to(dtype), x.reshape(-1, x.shape[-1]).to(dtype), weight)
    return out.view(*x.shape[:-1], self.nf)


def conv1d_activated(
    layer: nn.Module, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor | None:
    """`act(layer(x))` with the activation computed inside oneDNN's product as each block of the output is
    written (no second pass over the 4E-wide activations); None where that does not apply: an activation
    oneDNN lacks, products not on oneDNN, autograd, or hooks on the layer, which the fused product would
    skip."""
    post_op = ops.ONEDNN_ACTIVATIONS.get(act)
    if (
        post_op is None
        or type(layer) is not Conv1D
        or not ops.onednn_products_apply(x, layer.weight, layer.bias)
        or ops.needs_grad(x, layer.weight, layer.bias)
        or ops.has_forward_hooks(layer)
    ):
        return None
    out = ops.onednn_mm(x.reshape(-1, x.shape[-1]), layer.weight.t(), layer.bias, post_op)
    return out.view(*x.shape[:-1], layer.nf)


# The plain model's activations by their CPU counterparts (the same values; `ops.gelu_tanh` runs the C
# kernel where it applies, and oneDNN and the in-place forms know it).
_CPU_ACTIVATIONS = {modeling_hfgpt.gelu_tanh: ops.gelu_tanh}


def mlp_forward(self: GPTMLP, hidden_states: torch.Tensor) -> torch.Tensor:
    """`GPTMLP.forward`, with the activation inside c_fc's product, or applied in place where nothing else
    can hold c_fc's output (no autograd, no forward hook, no trace)."""
    act = _CPU_ACTIVATIONS.get(self.act, self.act)
    inner = conv1d_activated(self.c_fc, hidden_states, act)
    if inner is None:
        inner = self.c_fc(hidden_states)
        in_place = ops.IN_PLACE.get(act)
        if (
            in_place is None
            or inner.requires_grad
            or ops.has_forward_hooks(self.c_fc)
            or torch.jit.is_tracing()  # a trace is checked by tracing again, with grad mode as it was
        ):
            inner = act(inner)
        else:
            inner = in_place(inner)
    return self.dropout(self.c_proj(inner))


def dropout_forward(self: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    """`nn.Dropout.forward`: the same distribution, from byte masks of a counter-based generator."""
    return ops.dropout(x, self.p, self.training)


def lm_head_forward(self: nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward` for the vocabulary projection: split between the threads for a decoding step's
    few rows, by row blocks for more (`ops.project_to_vocab`)."""
    if ops.head_product_dtype(hidden_states, self) is None:
        return nn.Linear.forward(self, hidden_states)
    return ops.project_to_vocab(hidden_states, self)


GPTPreTrainedModel.linear_head_forwards.add(lm_head_forward)  # (the fused loss may read its weight)


# --- heads --------------------------------------------------------------------------------------------


def _embed_for_tied_head(
    model: GPTPreTrainedModel, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, ops.TiedHeadGradient | None]:
    """(input_ids, inputs_embeds, tied) for the base model, where the LM loss will run with the LM head's
    weight. When that weight is the token embeddings' and the loss runs `_LinearCrossEntropy` with
    gradients, the embeddings are looked up here through `_TiedEmbedding`, with the `TiedHeadGradient` the
    loss hands the head's gradient to: (None, embeddings, tied). Elsewhere the inputs unchanged and None."""
    wte = model.transformer.wte
    head_weight = getattr(model.lm_head, "weight", None)
    if (
        input_ids is None
        or inputs_embeds is not None
        or not torch.is_grad_enabled()
        or type(wte) is not nn.Embedding
        or wte.weight is not head_weight
        or not head_weight.requires_grad
        or ops.vocab_product_dtype(head_weight, head_weight) is None
        or ops.has_forward_hooks(wte)
        or ops.has_backward_hooks(wte)
        or (wte.padding_idx, wte.max_norm, wte.scale_grad_by_freq, wte.sparse) != (None, None, False, False)
    ):
        return input_ids, inputs_embeds, None
    model.transformer.check_input_ids(input_ids)
    buffers = model.__dict__.get("_head_buffers")
    if buffers is None:  # kept between training steps, dropped by eval() (`train_forward`)
        buffers = model.__dict__["_head_buffers"] = ops.HeadBuffers()
    tied = ops.TiedHeadGradient(buffers)
    return None, ops._TiedEmbedding.apply(input_ids, head_weight, tied), tied


@functools.wraps(GPTForCausalLM.forward)
def causal_lm_forward(
    self: GPTForCausalLM,
    input_ids: torch.LongTensor | None = None,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    token_type_ids: torch.LongTensor | None = None,
    position_ids: torch.LongTensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs: Any,
) -> CausalLMOutputWithPast | tuple:
    """`GPTForCausalLM.forward`; with labels (and transformers' own loss function), the head and the loss
    computed together by `ops.lm_logits_and_loss`. On the CPU, a plain `DynamicCache` it is given appends
    without copying the cache (`hfgpt.cpu.cache.grow_in_place`). Off the CPU, the plain forward, once the
    backend has taken itself out of the model (`unkernelize`)."""
    plain = functools.partial(GPTForCausalLM.forward, self)
    on_cpu = self.transformer.wte.weight.device.type == "cpu"
    if on_cpu:
        grow_in_place(cache if cache is not None else kwargs.get("past_key_values"))
    elif not torch.compiler.is_compiling():
        # The model lives on another device (a GPU), where every layer of the backend would step aside call
        # by call: it takes itself out, so that it costs nothing there from now on (a compiled decoding step
        # then traces and guards the plain model). Moved back to the CPU, `kernelize(model)` puts it back.
        unkernelize(self)
    if (
        labels is None
        or getattr(self, "_loss_function", None) is not None
        or logits_to_keep != 0
        or not on_cpu  # elsewhere the plain model's fused loss
    ):
        return plain(
            input_ids, cache, attention_mask, token_type_ids, position_ids, inputs_embeds,
            labels, use_cache, logits_to_keep, **kwargs,
        )  # fmt: skip
    return_dict = kwargs.pop("return_dict", None)
    input_ids, inputs_embeds, tied = _embed_for_tied_head(self, input_ids, inputs_embeds)
    outputs: BaseModelOutputWithPast = self.transformer(
        input_ids,
        cache=cache,
        attention_mask=attention_mask,
        token_type_ids=token_type_ids,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        return_dict=True,
        **kwargs,
    )
    logits, loss = ops.lm_logits_and_loss(
        outputs.last_hidden_state, self.lm_head, labels, self.config.vocab_size, tied=tied, **kwargs
    )
    output = CausalLMOutputWithPast(
        loss=loss,
        logits=logits,
        **modeling_hfgpt.cache_field(outputs),
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
    if return_dict is False or (return_dict is None and not self.config.return_dict):
        return output.to_tuple()
    return output


def auxiliary_lm_loss(
    self: GPTPreTrainedModel,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    head: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`GPTPreTrainedModel._auxiliary_lm_loss`, the head and the loss computed together
    (`ops.weighted_lm_loss`) where the head is a plain float `nn.Linear` (or the tied embeddings) on the
    CPU; elsewhere (an int8 decoding copy's head, a head with hooks) the plain method."""
    if type(head) is nn.Embedding:
        dtype = ops.vocab_product_dtype(hidden_states, head.weight)
    else:
        dtype = ops.head_product_dtype(hidden_states, head)
    if dtype is None or head.weight.is_meta:
        return type(self)._auxiliary_lm_loss(self, hidden_states, input_ids, attention_mask, head)
    targets, weights = self._auxiliary_lm_targets(input_ids, attention_mask)
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    logits, loss = ops.weighted_lm_loss(flat, head.weight, targets, weights)
    return logits.view(*hidden_states.shape[:-1], -1), loss


def train_forward(self: GPTPreTrainedModel, mode: bool = True) -> GPTPreTrainedModel:
    """`nn.Module.train`; switching to evaluation (`eval()`) also frees the memory kept for the tied LM
    head's logits and gradient between training steps (`ops.HeadBuffers`). On a model that lives off the
    CPU (`Trainer` calls `train()` once the model is on its GPU), the backend takes itself out first, as
    `causal_lm_forward` does."""
    if not mode:
        self.__dict__.pop("_head_buffers", None)
    if self.device.type != "cpu" and not torch.compiler.is_compiling():
        unkernelize(self)
    return nn.Module.train(self, mode)


# --- a decoding step in one call ------------------------------------------------------------------------


def _float_block_computes(block: GPTBlock, width: int) -> bool:
    """Whether `torch.ops.hfgpt.float_decode_step` computes what `block` (a plain `GPTBlock`) would for
    hidden states of `width`: inference (no module training), Conv1D layers of float32 weights and biases
    that need no gradient, affine layer norms of one epsilon, the tanh GELU, attention as the config names
    it or the backend's, and no hook or foreign forward on a module the step would not call."""
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
    interface = attn.__dict__.get("attention_interface")
    return not (
        block.training
        or attn.training
        or mlp.training
        or not all(
            ops.float32_vector(layer.weight, shape)
            and layer.bias is not None
            and ops.float32_vector(layer.bias, shape[1:])
            for layer, shape in zip(layers, shapes, strict=True)
        )
        or mlp.act is not modeling_hfgpt.gelu_tanh
        or not (ops.layer_norm_fits_kernel(ln_1, width) and ops.layer_norm_fits_kernel(ln_2, width))
        or ln_1.eps != ln_2.eps
        or not ops.plain_tensors(*tensors)
        or ops.needs_grad(*tensors)
        or (interface is not None and getattr(interface, "__func__", None) is not attention_function)
        or any(ops.has_forward_hooks(module) for module in (attn, mlp, ln_1, ln_2, *layers, *dropouts))
        or not kernels.available("row_product")
    )


decoding.STEP_KINDS[GPTBlock] = decoding.StepKind(
    layer_tensors=("weight", "bias"),
    computes=_float_block_computes,
    inner=lambda block: block.mlp.c_fc.nf,
    step="float_decode_step",
)


@functools.wraps(GPTModel.forward)
def model_forward(self: GPTModel, *args: Any, **kwargs: Any) -> BaseModelOutputWithPast:
    """`GPTModel.forward`, whose float32 decoding steps run in one call into C (`hfgpt.cpu.decoding`)."""
    return decoding.one_call_forward(self, *args, **kwargs)


# --- kernelize ----------------------------------------------------------------------------------------


def _swap(module: nn.Module, name: str, function: Callable) -> None:
    setattr(module, name, MethodType(function, module))


_SWAPPED = ("forward", "attention_interface", "_auxiliary_lm_loss", "train")
ops.CPU_FORWARDS.update(
    {
        conv1d_forward,
        mlp_forward,
        dropout_forward,
        lm_head_forward,
        causal_lm_forward,
        train_forward,
        model_forward,
    }
)


def kernelize(model: nn.Module) -> nn.Module:
    """Swap hfgpt's CPU layers into `model` (an hfgpt model, or any module holding hfgpt models); its
    attention layers run the `hfgpt_cpu` attention where the config asks for `sdpa`, and the config is left
    as it is. Idempotent; returns `model`.

    Layers a user's code already replaced (a forward set on the instance, such as accelerate's offloading
    hooks) are left alone."""
    for module in model.modules():
        if "forward" in module.__dict__:
            continue
        if isinstance(module, GPTModel):
            for name in ("drop",):
                child = getattr(module, name)
                if type(child) is nn.Dropout and "forward" not in child.__dict__:
                    _swap(child, "forward", dropout_forward)
            for block in module.h:
                for child in (block.attn.resid_dropout, block.mlp.dropout):
                    if type(child) is nn.Dropout and "forward" not in child.__dict__:
                        _swap(child, "forward", dropout_forward)
                for child in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                    if type(child) is Conv1D and "forward" not in child.__dict__:
                        _swap(child, "forward", conv1d_forward)
                if type(block.mlp) is GPTMLP and "forward" not in block.mlp.__dict__:
                    _swap(block.mlp, "forward", mlp_forward)
                if type(block.attn) is GPTAttention and "attention_interface" not in block.attn.__dict__:
                    _swap(block.attn, "attention_interface", attention_function)
            if type(module) is GPTModel:
                _swap(module, "forward", model_forward)
        if isinstance(module, GPTPreTrainedModel):
            if isinstance(module, GPTForCausalLM | GPTDoubleHeadsModel):
                head = module.lm_head
                if type(head) is nn.Linear and "forward" not in head.__dict__:
                    _swap(head, "forward", lm_head_forward)
            if type(module) is GPTForCausalLM:
                _swap(module, "forward", causal_lm_forward)
            if isinstance(module, GPTForSequenceClassification | GPTDoubleHeadsModel):
                _swap(module, "_auxiliary_lm_loss", auxiliary_lm_loss)
            if "train" not in module.__dict__:
                _swap(module, "train", train_forward)
    return model


def unkernelize(model: nn.Module) -> nn.Module:
    """Undo `kernelize`: every module of `model` computes its class's own forward again (attention as its
    config names it: transformers' sdpa where it asks for `sdpa`). Returns `model`."""
    swapped = ops.CPU_FORWARDS | {auxiliary_lm_loss, attention_function}
    for module in model.modules():
        for name in _SWAPPED:
            method = module.__dict__.get(name)
            if isinstance(method, MethodType) and method.__func__ in swapped:
                del module.__dict__[name]
        module.__dict__.pop("_head_buffers", None)
    return model


def is_kernelized(model: nn.Module) -> bool:
    """Whether any layer of `model` runs one of hfgpt's CPU forwards."""
    return any(
        isinstance(module.__dict__.get("forward"), MethodType)
        and module.__dict__["forward"].__func__ in ops.CPU_FORWARDS
        for module in model.modules()
    )


def enabled_by_default() -> bool:
    """Whether new hfgpt models are kernelized as they are built: yes unless the environment sets
    `HFGPT_CPU_BACKEND=0` (read at import)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _kernelize_new_model(model: nn.Module) -> None:
    """`GPTPreTrainedModel.post_init_hooks` entry: kernelize each hfgpt model as it is built (the outermost
    model's own `post_init` runs last and covers its heads)."""
    kernelize(model)


def install_by_default() -> None:
    """Kernelize every hfgpt model built from now on (`GPTPreTrainedModel.post_init_hooks`), unless
    `HFGPT_CPU_BACKEND=0`. Called once when `hfgpt.modeling` is imported."""
    hooks = GPTPreTrainedModel.post_init_hooks
    if enabled_by_default() and _kernelize_new_model not in hooks:
        hooks.append(_kernelize_new_model)
