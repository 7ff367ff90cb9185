"""The computations behind hfgpt's layers where torch's plain expression is slower or needs more memory:
each function names the plain expression it stands for, and the tests hold the two to the same values.

- Linear products on oneDNN (`onednn_mm`, `_OneDNNConv1D`, `use_onednn_products`), an activation applied
  inside the product (`ONEDNN_ACTIVATIONS`), weight casts into reused memory (`workspace`), one-row
  products split between the threads (`one_row_conv1d`, `one_row_product`), on hfgpt's C kernel where it
  is built (`torch.ops.hfgpt.row_product`, `row_conv1d`).
- Dropout with byte masks from a counter-based generator, in C where it is built (`dropout`, `keep_mask`).
- Causal attention in bands of query rows on the CPU: with dropout for training (`cpu_dropout_attention`,
  `_BandedDropoutAttention`), without for prefill (`cpu_banded_attention`); without a mask, on hfgpt's
  C kernel in both (`native_causal_attention`, `_native_dropout_attention`); a decoding step's query
  against the cache, with or without a key mask, on the same kernel (`native_decode_attention`).
- The LM head and its loss without a full vocabulary-wide gradient (`project_to_vocab`,
  `lm_logits_and_loss`, `_LinearCrossEntropy`), its log-sum-exp and softmax gradient on hfgpt's C kernel
  where it is built (`blockwise_logits_and_lse`, `torch.ops.hfgpt.lse_block`, `softmax_grad`), and its
  gradient shared with the tied
  embeddings (`TiedHeadGradient`, `_TiedEmbedding`).

hfgpt's C kernels (csrc/) are torch operators defined in `hfgpt.cpu.kernels`; `kernel_runs` says where
one may stand in for torch's ops. Where each path is chosen, and why, is in its docstring; what it
measured is in benchmarks/RESULTS.md. The layers that call these functions are swapped into a model by
`hfgpt.cpu.layers.kernelize`; the model files never import this one.
"""

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad
from torch.nn.modules.module import (
    _global_backward_hooks,
    _global_backward_pre_hooks,
    _global_forward_hooks,
    _global_forward_pre_hooks,
)
from transformers.loss.loss_utils import ForCausalLMLoss

from . import kernels, runtime
from .huge_pages import huge_page_buffer


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh GELU of both originals (GPT-1 train.py `gelu`, GPT-2 model.py `gelu`), as one fused kernel
    instead of the ~8 element-wise ops of transformers' `gelu_new`: same values to float precision, less
    time and no saved intermediates in training. `F.gelu(x, approximate="tanh")`, or hfgpt's C kernel
    (`torch.ops.hfgpt.gelu_tanh`, csrc/gelu.c) for contiguous float32 CPU tensors where it is built (any
    CPU with a C compiler).

    The kernel computes x sigmoid(2u) (the same function): one exp and one division an element where torch's
    kernel evaluates a tanh, so forward and backward take a fraction of torch's time on the MLP's 4E-wide
    activations (benchmarks/RESULTS.md). On normal x 3 and -20..20 inputs, values within 5.2e-7 of the
    float64 GELU where torch's are within 4.3e-7, gradients within 2.1e-7 where torch's are within 1.0e-6
    (tests/test_gelu_kernel.py). NaN and the infinities give torch's values and NaN gradients; a finite x
    beyond 1.8e19 in magnitude the GELU's slope (1 or 0) where torch's float32 formula overflows to NaN. A
    backward that builds a graph (`create_graph=True`) runs torch's `gelu_backward`."""
    if _native_gelu_applies(x):
        return kernels.gelu_tanh(x)
    return F.gelu(x, approximate="tanh")


def _native_gelu_applies(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.is_contiguous() and kernel_runs("gelu", x)


def gelu_tanh_(x: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh` written over `x`, which it returns: hfgpt's C kernel where `gelu_tanh` runs it, else
    torch's in-place tanh GELU."""
    if _native_gelu_applies(x):
        kernels.gelu_tanh_(x)
        return x
    return torch.ops.aten.gelu_(x, approximate="tanh")


# Each of those functions overwriting its input, for the MLP when nothing else can hold that input: the
# 4E-wide activation then needs no fresh buffer, whose pages would be faulted in on their first writes.
IN_PLACE: dict[Callable, Callable[[torch.Tensor], torch.Tensor]] = {
    gelu_tanh: gelu_tanh_,
    F.gelu: torch.ops.aten.gelu_,
    F.relu: torch.relu_,
    F.silu: lambda x: F.silu(x, inplace=True),
}

# Activations oneDNN applies inside the product that feeds them (`hfgpt.cpu.layers.conv1d_activated`), as
# (post-op, algorithm): its tanh GELU agrees with `gelu_tanh` to float rounding (2.4e-7 at most on GPT-2
# MLP inputs).
ONEDNN_ACTIVATIONS: dict[Callable, tuple[str, str]] = {
    gelu_tanh: ("gelu", "tanh"),
    F.gelu: ("gelu", "none"),
    F.relu: ("relu", ""),
}

_workspaces = threading.local()


def workspace(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scratch tensor of `shape`, from one buffer per thread, dtype and device that grows to the
    largest size asked for and is kept (for GPT-2 124M, a block of `CAST_BLOCK_ROWS` rows of the LM head
    in bfloat16). The next call on the same thread overwrites it: for values used at once.

    On the CPU the first writes to freshly allocated memory are what a weight cast costs: each page of a
    fresh tensor is faulted in as it is written, while memory kept from the last call is written at the
    memory's rate. A bfloat16-autocast prefill that casts its weights into a workspace is therefore faster,
    with far fewer page faults, than one that takes autocast's fresh copies."""
    key = (dtype, device)
    numel = math.prod(shape)
    buffer = _workspaces.__dict__.get(key)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor, writable outside inference mode too
            buffer = _workspaces.__dict__[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)


def inference_autocast_dtype(x: torch.Tensor, *params: torch.Tensor) -> torch.dtype | None:
    """bfloat16 inside CPU autocast to bfloat16 where nothing needs a gradient and the parameters are
    float32 (inference, evaluation), else None: then a product may cast its weight into `workspace`,
    since autograd saves no cast for backward."""
    if not (
        x.device.type == "cpu"
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and all(p.dtype == torch.float32 for p in params)
        and not torch.compiler.is_compiling()
    ):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params)):
        return None
    return torch.bfloat16


def _find_onednn_linear() -> Callable | None:
    """oneDNN's fp32/bf16 linear product (`mkldnn::_linear_pointwise`, the op torch.compile's CPU backend
    emits), where this torch build has oneDNN (x86-64 wheels do), else None."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


_ONEDNN_LINEAR = _find_onednn_linear()


@functools.cache
def onednn_bfloat16_runs() -> bool:
    """Whether oneDNN's linear op takes bfloat16 on this CPU: it refuses ("could not create a primitive
    descriptor") where the CPU lacks the instructions its bfloat16 products need (AVX-512 on x86)."""
    if _ONEDNN_LINEAR is None:
        return False
    x = torch.ones(2, 2, dtype=torch.bfloat16)
    try:
        _ONEDNN_LINEAR(x, x, None, "none", [], "")
    except RuntimeError:
        return False
    return True


@functools.cache
def avx512_cpu() -> bool:
    """Whether torch runs its CPU kernels with AVX-512 here (`torch.backends.cpu.get_cpu_capability()`,
    which `ATEN_CPU_CAPABILITY` can lower): the CPUs on which hfgpt's oneDNN products
    (`onednn_products_apply`) and banded attention (`banded_attention_applies`) were measured faster than
    the plain model's MKL products and sdpa (benchmarks/RESULTS.md). On CPUs where torch's kernels stop
    at AVX2 both were measured slower at prefill sizes, and step aside there (but for the LM head's product
    on AMD's CPUs, `onednn_products_apply`)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def _intel_cpu() -> bool:
    try:
        with open("/proc/cpuinfo") as info:
            return any(
                line.split(":", 1)[-1].strip() == "GenuineIntel"
                for line in info
                if line.startswith("vendor_id")
            )
    except OSError:
        return False


_INTEL_CPU = _intel_cpu()


def mkl_decodes_fast() -> bool:
    """Whether MKL, which the plain layers' products run on, reads the weights of a decoding step's rows as
    fast as hfgpt's own one-row products (`one_row_conv1d`, `one_row_product`, `few_rows_product`'s
    `weight @ flat^T`): on Intel's CPUs (`vendor_id` GenuineIntel), where the plain products decoded GPT-2
    faster, with torch at AVX-512 and capped at AVX2, at 1 and 2 threads (benchmarks/RESULTS.md); not on
    AMD's, where MKL takes slower paths and hfgpt's products were measured the faster."""
    return _INTEL_CPU


# Where the float32 products run on oneDNN (`use_onednn_products`): None where it is the faster on this CPU,
# True wherever it can, False nowhere.
_cpu_products: dict[str, bool | None] = {"onednn": None if _ONEDNN_LINEAR is not None else False}


def use_onednn_products(enabled: bool | None) -> bool | None:
    """Where the float32 CPU products of hfgpt's linear layers run on oneDNN, process-wide: with None (the
    default where torch has oneDNN) where oneDNN is the faster on this CPU (`onednn_products_apply`), with
    True every product of two or more rows, with False none: they run `torch.addmm` (MKL's sgemm, what
    transformers' `Conv1D` runs). Returns the previous setting.

    On CPUs with AVX-512 oneDNN runs GPT-2's products faster than MKL, most of all at the few rows of a
    batched decoding step (benchmarks/RESULTS.md, "Where hfgpt's speed comes from"). Values equal
    `addmm`'s to float rounding (a different summation order), not bit for bit."""
    previous = _cpu_products["onednn"]
    if _ONEDNN_LINEAR is None:
        enabled = False
    _cpu_products["onednn"] = None if enabled is None else bool(enabled)
    return previous


@contextlib.contextmanager
def onednn_products(enabled: bool | None) -> Iterator[bool]:
    """`use_onednn_products(enabled)` for the block, the previous setting restored after it as it was
    (not re-checked against oneDNN's availability, which a test may have patched meanwhile); yields
    whether oneDNN may run in it (False without oneDNN whatever `enabled`)."""
    previous = use_onednn_products(enabled)
    try:
        yield _cpu_products["onednn"] is not False
    finally:
        _cpu_products["onednn"] = previous


def onednn_products_apply(x: torch.Tensor, *params: torch.Tensor, head: bool = False) -> bool:
    """Whether `x @ weight (+ bias)` goes through oneDNN: float32 CPU tensors outside autocast, a
    compiled graph or a TorchScript trace, and at least two rows (one row is MKL's faster
    matrix-vector kernel), where `onednn_runs_here`; in the default setting (`use_onednn_products(None)`)
    on a CPU without AVX-512 (`avx512_cpu`), only up to `FEW_ROWS` rows, and on AMD's CPUs (not
    `mkl_decodes_fast`) the LM head's forward product at any row count (`head=True`).

    Where torch's kernels stop at AVX2, oneDNN's float32 products at prefill and training sizes are
    slower than MKL's sgemm on Intel's CPUs (the MLP's product with oneDNN's tanh GELU and the transposed
    weight gradients most of all), so those run on MKL, as the plain model's do. On AMD's, MKL takes slower
    paths: a decoding step's few rows, split between the threads, and the head's product, whose (V, E) weight
    is already in the layout oneDNN reads (unlike the Conv1D layers' (E, out) weights, on which oneDNN chose a
    slower kernel for GPT-2's MLP), run faster on oneDNN there (benchmarks/RESULTS.md)."""
    # The row count first, which rules out a one-row decoding step's products at the least cost; the CPU's
    # capability after `onednn_runs_here`'s compile check (torch.compile cannot trace its lookup).
    return (
        x.numel() >= 2 * x.shape[-1]
        and onednn_runs_here(x)
        and float32_outside_autocast(x, *params)
        and (
            bool(_cpu_products["onednn"])
            or avx512_cpu()
            or ((head or x.numel() <= FEW_ROWS * x.shape[-1]) and not mkl_decodes_fast())
        )
    )


def onednn_runs_here(x: torch.Tensor) -> bool:
    """Whether hfgpt may call oneDNN's linear op on `x` at all, whatever the dtype: products on oneDNN
    (`use_onednn_products` not False), `eager_on_cpu`, and oneDNN not switched off
    (`torch.backends.mkldnn.flags(enabled=False)`). The compile check comes before the flag's lookup,
    which torch.compile cannot trace."""
    return _cpu_products["onednn"] is not False and eager_on_cpu(x) and torch.backends.mkldnn.enabled


def _eager() -> bool:
    """Outside a compiled graph and a TorchScript trace: Python runs each op as it comes; and outside
    the transforms that this file's autograd Functions and oneDNN's op cannot run under (`_transformed`)."""
    return not torch.compiler.is_compiling() and not torch.jit.is_tracing() and not _transformed()


def _transformed() -> bool:
    """Inside a torch.func transform (`grad`, `vmap`, `jvp`, `functional_call` under them, ...) or a
    forward-mode AD level (`torch.autograd.forward_ad.dual_level`): this file's autograd Functions define
    neither the `setup_context` those transforms require nor a `jvp`, and oneDNN's linear op has no
    forward derivative or batching rule, so their paths step aside there for torch's own ops (which
    transformers' models run)."""
    return torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0


def eager_on_cpu(x: torch.Tensor) -> bool:
    """A CPU tensor, run eagerly, where hfgpt's own CPU products (`onednn_runs_here`, `one_row_parts`) may
    run."""
    return _eager() and x.device.type == "cpu"


def values_readable(*tensors: torch.Tensor) -> bool:
    """Whether the host may read these tensors' values (for input checks): run eagerly, and not meta or
    fake tensors (shape-only passes that estimate memory or FLOPs)."""
    return _eager() and plain_tensors(*tensors) and not any(t.is_meta for t in tensors)


_PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)


def plain_tensors(*tensors: torch.Tensor) -> bool:
    """Whether these are tensors or parameters themselves, not subclasses: a subclass (FakeTensor,
    DTensor, a `__torch_function__` wrapper) runs torch's ops, which it knows how to handle, rather than an
    hfgpt kernel, which it may not."""
    return all(type(t) in _PLAIN_TENSOR_TYPES for t in tensors)


def kernel_runs(name: str, *tensors: torch.Tensor) -> bool:
    """Whether hfgpt's C kernel csrc/{name}.c (`torch.ops.hfgpt.*`, `hfgpt.cpu.kernels`) may stand in for
    torch's ops on these tensors (of the dtypes its callers check): plain CPU tensors whose rows are
    contiguous, run eagerly (`eager_on_cpu`; a compiled graph keeps torch's ops, which the compiler fuses),
    and the library built for this CPU (`kernels.available`)."""
    return (
        eager_on_cpu(tensors[0])
        and plain_tensors(*tensors)
        and all(t.dim() == 0 or t.stride(-1) == 1 for t in tensors)
        and kernels.available(name)
    )


def float32_outside_autocast(*tensors: torch.Tensor) -> bool:
    """Every tensor float32, and CPU autocast off (autocast would run the product in its own dtype)."""
    return all(t.dtype == torch.float32 for t in tensors) and not torch.is_autocast_enabled("cpu")


def has_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has memory a kernel can read (functorch's vmap and grad wrappers have none). While
    torch.compile traces, yes: the compiled graph calls the kernels' operators on the real tensors."""
    if torch.compiler.is_compiling():
        return True
    try:
        tensor.data_ptr()
    except RuntimeError:
        return False
    return True


def float32_vector(tensor: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """A contiguous float32 CPU tensor of `shape`: what a kernel reads as a plain array of floats."""
    return (
        tensor.dtype == torch.float32
        and tuple(tensor.shape) == shape
        and tensor.is_contiguous()
        and tensor.is_cpu
        and has_storage(tensor)
    )


def layer_norm_fits_kernel(norm: nn.Module, width: int) -> bool:
    """Whether `norm` is an affine `nn.LayerNorm` over `width` features whose weight and bias a kernel reads
    as plain arrays of floats (`float32_vector`, plain tensors)."""
    return (
        type(norm) is nn.LayerNorm
        and norm.normalized_shape == (width,)
        and all(
            p is not None and float32_vector(p, (width,)) and plain_tensors(p)
            for p in (norm._parameters.get("weight"), norm._parameters.get("bias"))
        )
    )


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def has_global_forward_hooks() -> bool:
    """Whether forward or forward-pre hooks are registered for every module (`register_module_forward_hook`)."""
    return bool(_global_forward_hooks or _global_forward_pre_hooks)


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether calling `module` would run forward or forward-pre hooks (its own or global ones), or a
    `forward` set on the instance (accelerate's hooks wrap it so: with `device_map` offloading, the weights
    are on the meta device until that wrapper loads them): a path that computes its work without calling
    it must then step aside."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or has_global_forward_hooks()
        or _foreign_forward(module)
    )


# The forwards hfgpt.cpu.layers sets on instances (`kernelize`): unlike accelerate's, they call the module's
# own parameters directly, so a fused path may still skip the call.
CPU_FORWARDS: set[Callable] = set()


def _foreign_forward(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return forward is not None and getattr(forward, "__func__", None) not in CPU_FORWARDS


def has_backward_hooks(module: nn.Module) -> bool:
    """Whether calling `module` would attach backward or backward-pre hooks (`register_full_backward_hook`
    and the like, its own or global ones) to the gradients of its inputs and outputs: a path that
    computes its work without calling it must then step aside, as for `has_forward_hooks`, or the hooks
    never run."""
    return bool(
        module._backward_hooks
        or module._backward_pre_hooks
        or _global_backward_hooks
        or _global_backward_pre_hooks
    )


def onednn_mm(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    bias: torch.Tensor | None = None,
    post_op: tuple[str, str] = ("none", ""),
) -> torch.Tensor:
    """`x @ weight_t.T + bias` for a 2-D `x` `[N, in]` and `weight_t` `[out, in]` (any strides), by oneDNN,
    then `post_op` (oneDNN's name and algorithm of an element-wise function applied as each output block is
    written: `ONEDNN_ACTIVATIONS`); no gradient (the op has no derivative: `_OneDNNConv1D` and the head's
    functions call it). The op reads `bias` as contiguous whatever its strides (a strided view gave other
    elements' values, an expanded one memory past its end), so a bias that is not is copied first."""
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    return _ONEDNN_LINEAR(x, weight_t, bias, post_op[0], [], post_op[1])


def weight_gradient(
    inputs: torch.Tensor, grads: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`inputs.T @ grads` for 2-D float32 `inputs` [N, M] and `grads` [N, K], in `out` when given: a weight's
    gradient, summed over the N rows of a batch. oneDNN where the result is wider than tall (K > M), MKL's
    sgemm otherwise: oneDNN reads the transposed operands of a narrow result slowly, so of GPT-2's weight
    gradients it runs the wide ones (768 x 3072, 768 x 2304) faster and MKL the square and tall ones and
    the tied head's blocks (and MKL writes into `out`, where oneDNN's result is copied there). No rows
    (N = 0): zeros, from MKL (oneDNN refuses an empty product)."""
    if grads.shape[1] > inputs.shape[1] and inputs.shape[0] > 0:
        result = onednn_mm(inputs.T, grads.T)
        return result if out is None else out.copy_(result)
    return torch.mm(inputs.T, grads, out=out)


class _OneDNNConv1D(torch.autograd.Function):
    """`x @ weight + bias` (`weight` `[in, out]`) and its gradients, each product by oneDNN. A backward
    that builds a graph itself (`create_graph=True`, for second derivatives) runs torch's differentiable
    products instead."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return onednn_mm(x, weight.t(), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        differentiable = torch.is_grad_enabled()
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ weight.t() if differentiable else onednn_mm(grad, weight)
        if ctx.needs_input_grad[1]:
            grad_weight = x.t() @ grad if differentiable else weight_gradient(x, grad)
        if ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias


def _signed(word: int) -> int:
    """A 64-bit word as torch's int64 holds it."""
    return word - 2**64 if word >= 2**63 else word


# SplitMix64 (csrc/dropout.c): the counter step and the two multipliers of its output function.
_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 words (torch's `>>` on int64 keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _keep_mask_torch(n: int, seed: torch.Tensor, threshold: int) -> torch.Tensor:
    """csrc/dropout.c's `hfgpt_keep_mask` in torch's integer ops, on any device (int64 products wrap
    modulo 2^64 as the C's unsigned ones do): the same bits."""
    z = torch.arange(1, (n + 1) // 2 + 1, dtype=torch.int64, device=seed.device).mul_(_GOLDEN).add_(seed)
    z = (z ^ _shift_right(z, 30)).mul_(_MIX1)
    z = (z ^ _shift_right(z, 27)).mul_(_MIX2)
    z = z ^ _shift_right(z, 31)
    halves = torch.stack([z & 0xFFFFFFFF, _shift_right(z, 32)], -1).view(-1)[:n]  # low half first
    return halves >= threshold


def keep_mask(shape: tuple[int, ...], p: float, device: torch.device) -> torch.Tensor:
    """Bernoulli(1 - p) keep mask for dropout: a counter-based generator (SplitMix64, csrc/dropout.c)
    seeded by one 64-bit draw from the device's default generator.

    Dropout draws one value for every activation and attention weight of a training step, and on the
    CPU `bernoulli_`, or 32-bit draws cut from `randint`'s 64-bit words, take a noticeable share of the
    step; hfgpt's C generator computes each element's bits from a counter with a few integer operations,
    on every thread (benchmarks/RESULTS.md). Where it is not loaded (no compiler, a torch dispatch mode,
    another device) torch's integer ops compute the same bits, more slowly. An element is dropped when its 32
    bits fall in the lowest round(p * 2^32) of the 2^32 values: P(drop) = p to 2^-33. Seeded by
    `torch.manual_seed` like any other draw, and replayed by gradient checkpointing, which restores the
    generator's state (the stream differs from `F.dropout`'s).
    """
    n = math.prod(shape)
    threshold = min(round(p * 2**32), 2**32 - 1)
    seed = torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64, device=device)
    if device.type != "cpu" or not kernels.available("dropout"):
        return _keep_mask_torch(n, seed, threshold).view(shape)
    return kernels.keep_mask(list(shape), seed, threshold)


class _MaskedScale(torch.autograd.Function):
    """`x * keep / (1 - p)`, saving the keep mask as one byte an element (F.dropout saves 4)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return masked_scale(x, keep, scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (keep,) = ctx.saved_tensors
        return masked_scale(grad, keep, ctx.scale), None, None


def masked_scale(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    # The boolean mask read as its bytes (0 or 1): float x uint8 runs in one kernel, where float x bool
    # first converts the mask to a float tensor of x's size, one more pass over memory.
    return x.mul(keep.view(torch.uint8)).mul_(scale)


def fast_dropout_applies(x: torch.Tensor, p: float, training: bool) -> bool:
    # CUDA's fused dropout is already fast; compiled graphs fuse F.dropout themselves.
    return (
        training
        and 0.0 < p < 1.0
        and x.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not _transformed()
    )


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """`F.dropout(x, p, training)`: same distribution, faster and leaner on the CPU (`keep_mask`)."""
    if not training:  # (F.dropout returns `x` itself too; the config has checked p)
        return x
    if not fast_dropout_applies(x, p, training):
        return F.dropout(x, p, training)
    return _MaskedScale.apply(x, keep_mask(x.shape, p, x.device), 1.0 / (1.0 - p))


# Query rows at a time in causal CPU attention (`cpu_dropout_attention`, `cpu_banded_attention`).
ATTENTION_BAND = 64


def cpu_dropout_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Training attention with dropout on the CPU, in place of sdpa.

    With dropout, torch's CPU sdpa leaves its fused kernel for the same sequence of ops as here, but
    samples the mask with `bernoulli_` and saves it as float32; this runs `keep_mask` and saves a byte
    mask. Masks are those transformers builds for sdpa: None (causal when T > 1) or boolean (True =
    attend), or an additive float mask. As in sdpa, a query row with nothing to attend to (a left-padding
    position) gets zero weights (`torch._safe_softmax`, the softmax sdpa's own math path uses).

    Causal self-attention over 128 positions or more runs `ATTENTION_BAND` query rows at a time against
    the keys up to each band's last row, skipping the masked upper triangle (`_BandedDropoutAttention`):
    the scores, softmax and products above each band's diagonal block, forward and backward, are never
    computed. That covers no mask, and a boolean mask that attends to no later position (transformers'
    causal mask with padding): each band then takes its rows of the mask.
    """
    seq_len, total = query.shape[-2], key.shape[-2]
    if (
        seq_len == total
        and seq_len >= 2 * ATTENTION_BAND
        and (attention_mask is None or attends_to_no_later_position(attention_mask))
    ):
        return _BandedDropoutAttention.apply(query, key, value, attention_mask, scaling, dropout), None
    scores = torch.matmul(query, key.transpose(-1, -2)).mul_(scaling)  # (B, H, T, S)
    if attention_mask is None:
        if seq_len > 1:  # causal: every query keeps at least its own position
            causal = torch.ones(seq_len, total, dtype=torch.bool, device=scores.device).tril(total - seq_len)
            scores = scores.masked_fill_(~causal, float("-inf"))
        weights = F.softmax(scores, dim=-1)
    else:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill_(~attention_mask, float("-inf"))
        else:
            scores = scores.add_(attention_mask)
        weights = torch._safe_softmax(scores, -1)
    return _dropout_and_values(weights, value, dropout), None


class _BandedDropoutAttention(torch.autograd.Function):
    """Causal attention with dropout, `ATTENTION_BAND` query rows at a time against the keys up to each
    band's last row, with a backward written out per band (`cpu_dropout_attention`).

    Autograd through the same ops per band spent a large share of the time outside the products: each
    band's slices of the queries, keys and values got zero-filled gradients that were then summed, and each
    4-D `matmul` of the (B, T, 3, H, D) projections copied its operands. Here queries, keys and values are
    copied once to (B*H, T, D); the backward writes each band's query gradient into place and adds the key
    and value gradients in (a `baddbmm_` into those views ran one matrix product per batch entry, slower).
    Saved: the inputs, and per band its softmax probabilities and keep mask (a byte an element); the
    backward copies the inputs to (B*H, T, D) again. A backward that builds a graph (`create_graph=True`)
    recomputes the bands with autograd's ops instead (`_differentiable_band_grads`), so second
    derivatives are right. The same draws as autograd through `_dropout_and_values` would make, one keep
    mask per band, and the same values to rounding (tests/test_performance.py).

    Where hfgpt's C kernel takes the inputs (`native_attention_takes`: float32, heads of 64, no mask),
    forward and backward run on it instead, with the same keep masks and saved probabilities and in less
    time, the backward most of all (`_native_dropout_attention`; benchmarks/RESULTS.md;
    tests/test_attention_kernel.py)."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,  # (B, H, T, D)
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,  # None (causal) or boolean, attending to no later position
        scaling: float,
        p: float,
    ) -> torch.Tensor:
        ctx.mask, ctx.scaling, ctx.p = attention_mask, scaling, p
        ctx.native = native_attention_takes(query, key, value, attention_mask)
        if ctx.native:
            out, saved = _native_dropout_attention(query, key, value, scaling, p)
            ctx.save_for_backward(query, key, value, *saved)
            return out
        batch, heads, length, dim = query.shape
        q, k, v = (t.reshape(batch * heads, length, dim) for t in (query, key, value))
        hidden = None if attention_mask is None else ~attention_mask
        future = torch.ones(ATTENTION_BAND, ATTENTION_BAND, dtype=torch.bool, device=query.device).triu(1)
        out = query.new_empty(batch, length, heads, dim)
        saved = []
        for start in range(0, length, ATTENTION_BAND):
            stop = min(start + ATTENTION_BAND, length)
            rows = stop - start
            scores = torch.bmm(q[:, start:stop], k[:, :stop].transpose(1, 2)).mul_(scaling)
            if hidden is None:
                scores[..., start:].masked_fill_(future[:rows, :rows], float("-inf"))
                probs = F.softmax(scores, dim=-1)
            else:
                scores.view(batch, heads, rows, stop).masked_fill_(
                    hidden[..., start:stop, :stop], float("-inf")
                )
                probs = torch._safe_softmax(scores, -1)
            keep = keep_mask((batch, heads, rows, stop), p, query.device).view(batch * heads, rows, stop)
            band = torch.bmm(masked_scale(probs, keep, 1.0 / (1.0 - p)), v[:, :stop])
            out[:, start:stop] = band.view(batch, heads, rows, dim).transpose(1, 2)
            saved += [probs, keep]
        ctx.save_for_backward(query, key, value, *saved)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, *saved = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a backward that can itself be differentiated
            keeps = saved[1::2]
            return _differentiable_band_grads(
                query, key, value, ctx.mask, ctx.scaling, ctx.p, keeps, grad_out
            )
        if ctx.native and plain_tensors(grad_out):
            return (
                *_native_dropout_attention_backward(query, key, value, saved, grad_out, ctx),
                None,
                None,
                None,
            )
        batch, heads, length, dim = query.shape
        q, k, v = (t.reshape(batch * heads, length, dim) for t in (query, key, value))
        scale = 1.0 / (1.0 - ctx.p)
        grad = grad_out.transpose(1, 2).reshape(batch * heads, length, dim)
        grad_q = torch.empty_like(q)
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        for band, start in enumerate(range(0, length, ATTENTION_BAND)):
            stop = min(start + ATTENTION_BAND, length)
            probs, keep = saved[2 * band], saved[2 * band + 1]
            grad_v[:, :stop] += torch.bmm(
                masked_scale(probs, keep, scale).transpose(1, 2), grad[:, start:stop]
            )
            grad_probs = masked_scale(
                torch.bmm(grad[:, start:stop], v[:, :stop].transpose(1, 2)), keep, scale
            )
            grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype).mul_(ctx.scaling)
            grad_q[:, start:stop] = torch.bmm(grad_scores, k[:, :stop])
            grad_k[:, :stop] += torch.bmm(grad_scores.transpose(1, 2), q[:, start:stop])
        shape = (batch, heads, length, dim)
        return grad_q.view(shape), grad_k.view(shape), grad_v.view(shape), None, None, None


def _native_dropout_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, p: float
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`_BandedDropoutAttention`'s forward by the C kernel (`torch.ops.hfgpt.attention_train_forward`): the
    same keep masks, drawn band by band in the same order, and the same saved probabilities (each band's
    (B*H, rows, keys up to its last row))."""
    batch, heads, length, dim = query.shape
    keeps, probs = [], []
    for start in range(0, length, ATTENTION_BAND):
        stop = min(start + ATTENTION_BAND, length)
        shape = (batch * heads, stop - start, stop)
        keeps.append(keep_mask((batch, heads, stop - start, stop), p, query.device).view(shape))
        probs.append(query.new_empty(shape))
    out = kernels.attention_train_forward(query, key, value, keeps, probs, scaling, p)
    return out, [t for pair in zip(probs, keeps, strict=True) for t in pair]


def _native_dropout_attention_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    saved: list[torch.Tensor],
    grad_out: torch.Tensor,  # (B, T, H, D)
    ctx: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query, key and value gradients of `_native_dropout_attention` by the C kernel
    (`torch.ops.hfgpt.attention_train_backward`), from its saved probabilities and keep masks."""
    grad = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    return kernels.attention_train_backward(
        query, key, value, grad, list(saved[1::2]), list(saved[0::2]), ctx.scaling, ctx.p
    )


def _differentiable_band_grads(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    p: float,
    keeps: list[torch.Tensor],
    grad_out: torch.Tensor,
) -> tuple[torch.Tensor | None, ...]:
    """`_BandedDropoutAttention`'s gradients for a backward with `create_graph=True`: the bands recomputed
    with autograd's ops and the saved keep masks, differentiated so that second derivatives are taken
    through them (the hand-written backward's saved probabilities are not connected to the inputs)."""
    batch, heads, length, _ = query.shape
    with torch.enable_grad():
        bands = []
        for band, start in enumerate(range(0, length, ATTENTION_BAND)):
            stop = min(start + ATTENTION_BAND, length)
            scores = torch.matmul(query[:, :, start:stop], key[:, :, :stop].transpose(-1, -2)) * scaling
            if attention_mask is None:
                visible = torch.ones(stop - start, stop, dtype=torch.bool, device=query.device).tril(start)
                probs = F.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            else:
                probs = torch._safe_softmax(
                    scores.masked_fill(~attention_mask[..., start:stop, :stop], float("-inf")), -1
                )
            keep = keeps[band].view(batch, heads, stop - start, stop)
            bands.append(torch.matmul(masked_scale(probs, keep, 1.0 / (1.0 - p)), value[:, :, :stop]))
        out = torch.cat(bands, dim=2).transpose(1, 2)
    grads = torch.autograd.grad(out, (query, key, value), grad_out, create_graph=True, allow_unused=True)
    return (*grads, None, None, None)


def _dropout_and_values(weights: torch.Tensor, value: torch.Tensor, p: float) -> torch.Tensor:
    """dropout(weights) @ value, as (B, T, H, D), the mask drawn by `keep_mask`."""
    weights = _MaskedScale.apply(weights, keep_mask(weights.shape, p, weights.device), 1.0 / (1.0 - p))
    return torch.matmul(weights, value).transpose(1, 2)


def banded_attention_applies(query: torch.Tensor, key: torch.Tensor, attention_mask: Any) -> bool:
    """Whether `cpu_banded_attention` stands in for sdpa: causal self-attention over 128-767 positions
    (no cached keys; no mask, or a boolean one that attends to no later position) in float32 or
    bfloat16 (a bfloat16 model, or inside autocast) on the CPU, without autograd, outside compiled
    graphs, where torch's kernels run AVX-512 (`avx512_cpu`). Where they stop at AVX2, torch's flash
    kernel computes the whole causal square faster than the bands' several calls, each a parallel region
    of its own, so sdpa keeps it there."""
    length = query.shape[-2]
    return (
        key.shape[-2] == length
        and 2 * ATTENTION_BAND <= length < 768
        and query.dtype in (torch.float32, torch.bfloat16)
        and query.device.type == "cpu"
        and not query.requires_grad
        and not torch.compiler.is_compiling()
        and avx512_cpu()
        and (attention_mask is None or attends_to_no_later_position(attention_mask))
    )


def attends_to_no_later_position(attention_mask: torch.Tensor) -> bool:
    """Whether a boolean (..., T, T) mask is causal: transformers' sdpa mask with padding is; a custom
    4D mask may not be, and then attention takes the whole square."""
    return attention_mask.dtype == torch.bool and not attention_mask.triu(1).any()


def cpu_banded_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal sdpa run `ATTENTION_BAND` query rows at a time, each band against the keys up to its last
    row (and its rows of a causal boolean mask, where there is one), written straight into the
    (B, T, H, D) output.

    Below 768 positions torch's CPU flash-attention kernel is slower on the causal square than on these
    bands, in float32 and in bfloat16; from 768 positions on, where the kernel takes larger blocks, it is
    about as fast as the bands, so sdpa keeps those lengths (benchmarks/RESULTS.md, "Tried and dropped").
    Each query row sees exactly the keys it sees in one causal call, so the values agree to rounding
    (tests/test_performance.py).
    """
    batch, heads, length, dim = query.shape
    output = query.new_empty(batch, length, heads, dim)
    if attention_mask is None:
        attention_mask = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    for start in range(0, length, ATTENTION_BAND):
        stop = min(start + ATTENTION_BAND, length)
        band = F.scaled_dot_product_attention(
            query[:, :, start:stop],
            key[:, :, :stop],
            value[:, :, :stop],
            attn_mask=attention_mask[..., start:stop, :stop],
            scale=scaling,
        )
        output[:, start:stop] = band.transpose(1, 2)
    return output, None


# Head size of hfgpt's C attention kernel (csrc/attention.c): every GPT-1 and GPT-2 size has heads of 64.
NATIVE_HEAD_SIZE = 64


def native_attention_takes(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any
) -> bool:
    """Whether the C attention kernel can compute this attention: causal self-attention without a mask (no
    cached keys, no padding) of queries, keys and values of one (B, H, T, 64) shape, float32 CPU tensors that
    the kernel can read (`_attention_kernel_reads`)."""
    return (
        attention_mask is None
        and query.dim() == 4
        and query.shape[-1] == NATIVE_HEAD_SIZE
        and key.shape == query.shape == value.shape
        and _attention_kernel_reads(query, key, value)
    )


def _attention_kernel_reads(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *masks: torch.Tensor
) -> bool:
    """What every use of the C attention kernel needs of its inputs: float32 CPU queries, keys and values
    with contiguous rows, outside autocast (sdpa would run in autocast's dtype), plain tensors, masks
    included, and the kernel available (`kernel_runs`)."""
    return (
        query.dtype == key.dtype == value.dtype == torch.float32
        and query.is_cpu
        and key.is_cpu
        and value.is_cpu
        and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
        and not torch.is_autocast_enabled("cpu")
        and not any(t.is_meta for t in (query, key, value))
        and plain_tensors(*masks)
        and kernel_runs("attention", query, key, value)
    )


def native_attention_applies(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any
) -> bool:
    """Whether `native_causal_attention` stands in for sdpa: `native_attention_takes`, without autograd
    (training attention runs the kernel inside `_BandedDropoutAttention`)."""
    return not (query.requires_grad or key.requires_grad or value.requires_grad) and native_attention_takes(
        query, key, value, attention_mask
    )


def native_causal_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal sdpa (no mask, no dropout) by hfgpt's C kernel (`csrc/attention.c`), into a (B, T, H, D)
    output. Where `native_attention_applies`.

    torch's CPU flash-attention kernel, called on the whole causal square or in `cpu_banded_attention`'s
    bands, spends much of its time outside the arithmetic on GPT-2's short heads of 64; the kernel
    computes each block of 8 query rows' scores against the head's keys held transposed in cache, an exact
    softmax over them, and their weighted values, at a higher share of the CPU's arithmetic rate
    (benchmarks/RESULTS.md). The values agree with sdpa's to float rounding
    (tests/test_attention_kernel.py)."""
    return kernels.causal_attention(query, key, value, scaling), None


def native_decode_attention_applies(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any
) -> bool:
    """Whether `native_decode_attention` stands in for sdpa: one query position (a decoding step, or a
    one-token prompt) of float32 CPU heads of 64 against keys and values of the same batch and heads, rows
    contiguous, no autograd, and no mask or a boolean key mask of shape (B or 1, 1, 1, T) as transformers
    makes for padded prompts, that the kernel can read (`_attention_kernel_reads`)."""
    batch, heads, new, dim = query.shape if query.dim() == 4 else (0, 0, 0, 0)
    return (
        new == 1
        and dim == NATIVE_HEAD_SIZE
        and key.dim() == 4
        and key.shape[:2] == (batch, heads)
        and key.shape[-1] == dim
        and value.shape == key.shape
        and not (query.requires_grad or key.requires_grad or value.requires_grad)
        and (attention_mask is None or _decode_key_mask(attention_mask, batch, key.shape[-2]))
        and _attention_kernel_reads(query, key, value, *(() if attention_mask is None else (attention_mask,)))
    )


def _decode_key_mask(mask: Any, batch: int, keys: int) -> bool:
    return (
        isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[0] in (1, batch)
        and mask.shape[1:] == (1, 1, keys)
        and mask.is_cpu
        and (keys == 1 or mask.stride(-1) == 1)
    )


def native_decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """sdpa for one decoding step (`native_decode_attention_applies`) by hfgpt's C kernel
    (`hfgpt_attention_decode` in csrc/attention.c), into a (B, 1, H, D) output: per head, the query's 64-wide
    dot products with the cached keys, an exact softmax over the keys the mask keeps, and the weighted
    values; a row that attends to no key gets zeros, as sdpa's. No dropout: training attention with dropout
    takes `cpu_dropout_attention` first. Masked keys and values are not read, so a NaN or an infinity there
    does not reach the output (in sdpa it still gives NaN). torch's sdpa spends most of such a step
    outside the arithmetic, and each layer's cached keys and values come from memory after the step's
    weights have gone through the caches: the kernel reads each kept key and value row once, in one call
    per layer (benchmarks/RESULTS.md)."""
    return kernels.decode_attention(query, key, value, attention_mask, scaling), None


# Rows of a float32 weight cast at a time when `row_aligned_mm` multiplies it in a lower precision.
CAST_BLOCK_ROWS = 4096


def weight_blocks(
    weight: torch.Tensor, dtype: torch.dtype, rows: int
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(start, stop, `weight[start:stop]` in `dtype`) for blocks of `rows` rows of `weight`: views where
    `weight` has `dtype`, else casts into a `workspace` (the next block overwrites it), rather than one
    fresh whole-weight copy as autocast makes, whose every page is faulted in again on each call."""
    for start in range(0, len(weight), rows):
        stop = min(start + rows, len(weight))
        if weight.dtype == dtype:
            yield start, stop, weight[start:stop]
        else:
            block = workspace((stop - start, weight.shape[1]), dtype, weight.device)
            yield start, stop, block.copy_(weight[start:stop])


HUGE_PAGES_FROM = 32 << 20  # bytes: glibc's malloc maps any block this large afresh from the kernel


def large_empty(rows: int, columns: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised (rows, columns) tensor like `like` (`new_empty`); for a plain CPU tensor of
    `HUGE_PAGES_FROM` bytes or more, run eagerly (not in a trace, which would keep one such buffer as a
    constant), in transparent huge pages (`huge_page_buffer`, where Linux gives them).

    Memory that large comes fresh from the kernel on every call (malloc maps it, and unmaps it when freed),
    and its first writes fault it in: 4 KiB pages cost GPT-2's logits of 512 positions (103 MB) about a
    tenth of the head's product, 2 MiB pages a fraction of that (benchmarks/RESULTS.md). After
    `hfgpt.cpu.runtime.keep_freed_memory()`, malloc's heap serves it already faulted in: `new_empty` then."""
    nbytes = rows * columns * like.element_size()
    if (
        nbytes < HUGE_PAGES_FROM
        or not eager_on_cpu(like)
        or not plain_tensors(like)
        or runtime.freed_memory_kept()
    ):
        return like.new_empty(rows, columns)
    buffer, _ = huge_page_buffer(nbytes)
    return buffer.view(like.dtype).view(rows, columns)


def row_aligned_mm(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`hidden @ weight.T` in `hidden`'s dtype: by oneDNN where `onednn_products_apply` for the head
    (contiguous logits), else written into rows padded to a multiple of 64 elements, returning the unpadded
    view.

    oneDNN runs GPT-2's head faster than MKL's row-aligned product. MKL's float32 GEMM runs GPT-2's
    50257-wide LM head faster when each output row starts on a 256-byte boundary (benchmarks/RESULTS.md,
    "Tried and dropped"), hence the padding where MKL runs it. The logits are then a
    view with row stride 50304 (`logits.view(-1, V)` works, a flat `.view(-1)` needs `.contiguous()`).
    A float32 `weight` with bfloat16 `hidden` is multiplied a block of `weight_blocks` at a time, with the
    values of autocast's `F.linear`.
    """
    if hidden.dtype == weight.dtype and onednn_products_apply(hidden, weight, head=True):
        return onednn_mm(hidden, weight)
    vocab = weight.shape[0]
    buffer = large_empty(hidden.shape[0], -(-vocab // 64) * 64, hidden)
    logits = buffer[:, :vocab]
    if weight.dtype == hidden.dtype:
        return torch.mm(hidden, weight.T, out=logits)
    for start, stop, block in weight_blocks(weight, hidden.dtype, CAST_BLOCK_ROWS):
        torch.mm(hidden, block.T, out=logits[:, start:stop])
    return logits


class _RowAlignedLinear(torch.autograd.Function):
    """`row_aligned_mm` with the gradients of `F.linear(hidden, weight)`."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        return row_aligned_mm(hidden, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        hidden, weight = ctx.saved_tensors
        if onednn_products_apply(grad, weight) and not torch.is_grad_enabled():  # no create_graph=True
            grad_hidden = onednn_mm(grad, weight.T) if ctx.needs_input_grad[0] else None
            grad_weight = weight_gradient(grad, hidden) if ctx.needs_input_grad[1] else None
        else:
            grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
            grad_weight = grad.T @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight


def vocab_product_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The dtype in which this file computes `hidden @ weight.T` for the vocabulary itself
    (`project_to_vocab`, `_LinearCrossEntropy`), or None where the plain ops run: float32 hidden states
    and weights on the CPU, outside compiled graphs, compute in float32, or in bfloat16 inside
    `torch.autocast("cpu", dtype=torch.bfloat16)`, where `F.linear` would run in bfloat16 too."""
    if not (
        weight.device.type == "cpu"
        and weight.dtype == hidden.dtype == torch.float32
        and not torch.compiler.is_compiling()
        and not _transformed()
    ):
        return None
    if not torch.is_autocast_enabled("cpu"):
        return torch.float32
    return torch.bfloat16 if torch.get_autocast_dtype("cpu") == torch.bfloat16 else None


def fast_product_applies(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this file computes `hidden @ weight.T` itself in float32 (`vocab_product_dtype`)."""
    return vocab_product_dtype(hidden, weight) == torch.float32


# Up to this many rows (a decoding step), a product with a weight runs as `few_rows_product`.
FEW_ROWS = 16
ONEDNN_FEW_ROWS = 4


def one_row_parts(x: torch.Tensor, *params: torch.Tensor | None) -> int:
    """Into how many slices `one_row_product` and `one_row_conv1d` split a product of one row `x` with a
    weight: one per intra-op thread, for float32 CPU tensors without gradients, outside autocast, compiled
    graphs and TorchScript traces (`eager_on_cpu`, which comes first: torch.compile cannot trace the
    thread count); 0 (no split) elsewhere or with a single thread."""
    tensors = [x, *(p for p in params if p is not None)]
    if not (eager_on_cpu(x) and float32_outside_autocast(*tensors)) or needs_grad(*tensors):
        return 0
    threads = torch.get_num_threads()
    return threads if threads >= 2 else 0


def one_row_product(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """`flat @ weight.T` for one row `flat` (1, in) and an `[out, in]` weight, as one matrix-vector product
    per thread, each over its slice of the weight's rows (`torch.bmm` over the slices); None where
    `one_row_parts` gives no split or the weight is not contiguous.

    A decoding step at batch size 1 reads every weight once for one multiply-add per element, so it is
    bound by memory, not arithmetic, and MKL's matrix-vector kernel reads a weight on one thread (as does
    `few_rows_product`'s two-column product). Split between the threads, the weight is read at more of the
    memory's bandwidth, with the same values and the same greedy tokens (benchmarks/RESULTS.md).

    Where hfgpt's C kernel is built (csrc/row_product.c, `torch.ops.hfgpt.row_product`), each thread computes the
    dot products of its run of rows itself, as one sequential read, closer to the rate of a plain sum over
    the same memory than the split `bmm`, on a busy host too."""
    parts = one_row_parts(flat, weight)
    if not parts or not weight.is_contiguous():
        return None
    out, width = weight.shape
    if kernel_runs("row_product", flat, weight):
        return kernels.row_product(flat, weight, parts)
    size = out // parts
    column = flat.T.expand(parts, width, 1)  # (parts, in, 1), no copy
    sliced = torch.bmm(weight[: size * parts].view(parts, size, width), column).view(1, size * parts)
    if size * parts == out:
        return sliced
    return torch.cat([sliced, flat @ weight[size * parts :].T], dim=1)  # the rows left over


def one_row_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`x @ weight + bias` for one row `x` (1, in) and a Conv1D `[in, out]` weight, each thread reading a
    contiguous block of the weight's rows (`torch.bmm` of a slice of `x` with each block, no copy) and the
    partial sums then added; None where `one_row_parts` gives no split, the rows do not divide evenly or a
    tensor is not contiguous. Conv1D's `addmm` reads a one-row product's weight on one thread.

    Row blocks rather than column slices: a column slice reads each of the weight's rows in strided pieces
    of out / threads floats, a row block one contiguous run of memory, which GPT-2's four weight shapes and
    greedy decoding of GPT-1 and GPT-2 read faster, with the same tokens (benchmarks/RESULTS.md). The sum
    runs in another order than `addmm`'s: equal to float rounding.

    Where hfgpt's C kernel is built (csrc/row_product.c), it computes the same split, whatever the row
    count, eight rows at a time into each thread's partial sums: the Conv1D weights are read faster than
    by the `bmm` split, though a greedy step of the whole model, whose weights lie in 4 KiB pages, gains
    little from it."""
    parts = one_row_parts(x, weight, bias)
    width, out = weight.shape
    if not parts or not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return None
    if kernel_runs("row_product", x, weight, *([] if bias is None else [bias])):
        return kernels.row_conv1d(x, weight, bias, parts)
    if width % parts:
        return None
    blocks = weight.view(parts, width // parts, out)  # (parts, in / parts, out)
    partial = torch.bmm(x.reshape(parts, 1, width // parts), blocks)  # (parts, 1, out)
    total = partial.sum(0)  # (1, out)
    return total if bias is None else total.add_(bias)


def one_row_bfloat16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for one bfloat16 row `x` (1, in) and a contiguous bfloat16 `[out, in]`
    weight (and bias), without gradients, on hfgpt's C kernel (csrc/row_product.c): each thread reads
    its run of the weight's rows once, the products summed in float32 as oneDNN's bfloat16 product sums
    them, the bias added and the sum rounded to bfloat16 once. None where it does not apply (no kernel,
    gradients, another dtype, a non-contiguous weight): callers run their product. The CPU's bfloat16
    one-row products through oneDNN or torch read the weight well below the memory's rate, which bounds
    a one-row decoding step (benchmarks/RESULTS.md)."""
    tensors = [x, weight, *([] if bias is None else [bias])]
    if (
        any(t.dtype != torch.bfloat16 for t in tensors)
        or not weight.is_contiguous()
        or (bias is not None and not bias.is_contiguous())
        or needs_grad(*tensors)
        or torch.is_autocast_enabled("cpu")
    ):
        return None
    if not kernel_runs("row_product", *tensors):
        return None
    return kernels.row_product_bf16(x, weight, bias)


def few_rows_product(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`flat @ weight.T` for 1-`FEW_ROWS` rows of `flat` (rows, in) and an `[out, in]` weight, computed as
    `weight @ flat^T` with at least two columns: MKL's one-row kernel for `F.linear` reads a tall weight
    such as GPT-2's 50257 x 768 head several times slower on AMD's CPUs (benchmarks/RESULTS.md). One row
    is split between the threads where `one_row_product` applies; from `ONEDNN_FEW_ROWS` rows on, oneDNN's
    product where it applies, without gradients. Where `mkl_decodes_fast` (Intel's CPUs), MKL's
    `flat @ weight.T` instead of the split and of `weight @ flat^T`. Contiguous (rows, out)."""
    rows = len(flat)
    if rows == 1 and not mkl_decodes_fast() and (split := one_row_product(flat, weight)) is not None:
        return split
    if rows >= ONEDNN_FEW_ROWS and onednn_products_apply(flat, weight) and not needs_grad(flat, weight):
        return onednn_mm(flat, weight)
    if mkl_decodes_fast():
        return torch.mm(flat, weight.T)
    columns = torch.cat([flat, flat]) if rows == 1 else flat  # one column takes the slow kernel again
    return torch.mm(weight, columns.T)[:, :rows].T.contiguous()


def head_product_dtype(hidden_states: torch.Tensor, head: nn.Module) -> torch.dtype | None:
    """`vocab_product_dtype` for a plain `nn.Linear` head without bias or hooks (`has_forward_hooks`,
    `has_backward_hooks`); None (`head(...)`) for others."""
    if (
        type(head) is not nn.Linear
        or head.bias is not None
        or has_forward_hooks(head)
        or has_backward_hooks(head)
    ):
        return None
    return vocab_product_dtype(hidden_states, head.weight)


def project_to_vocab(hidden_states: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """`head(hidden_states)`, computed faster where `head_product_dtype` names a dtype.

    - 1-`FEW_ROWS` rows (a decoding step): `few_rows_product` (MKL's matrix-vector kernel reads a tall
      head such as GPT-2's 50257 x 768 slowly). Under CPU bfloat16 autocast too, from the float32 weight,
      the logits then rounded to bfloat16 (autocast's dtype): autocast would first cast the whole head
      to bfloat16 and, for a (B, 1, E) input, multiply through a batched copy of it, which costs many
      times the product itself.
    - More rows (prefill): `row_aligned_mm`, in float32, or under autocast in bfloat16 from the float32
      weight a block at a time; under autocast with gradients, `head(...)`.
    Values and gradients agree with `head(hidden_states)` to float precision (tests/test_performance.py).
    """
    dtype = head_product_dtype(hidden_states, head)
    rows = hidden_states.numel() // hidden_states.shape[-1] if hidden_states.shape[-1] else 0
    if dtype is None:
        return head(hidden_states)
    # (a plain nn.Linear without hooks from here on: its product is F.linear's)
    if rows == 0:  # (an empty batch has nothing to compute faster)
        return F.linear(hidden_states, head.weight)
    if (
        dtype != torch.float32
        and rows > FEW_ROWS
        and inference_autocast_dtype(hidden_states, head.weight) is None
    ):
        return F.linear(hidden_states, head.weight)  # autograd saves autocast's cast of the head for backward
    flat = hidden_states.reshape(rows, -1)
    if rows > FEW_ROWS and dtype == torch.float32:
        return _RowAlignedLinear.apply(flat, head.weight).view(*hidden_states.shape[:-1], -1)
    if rows > FEW_ROWS:
        return row_aligned_mm(flat.to(dtype), head.weight).view(*hidden_states.shape[:-1], -1)
    with torch.autocast("cpu", enabled=False):
        logits = few_rows_product(flat, head.weight).to(dtype)
    return logits.view(*hidden_states.shape[:-1], -1)


def subtract_per_row(x: torch.Tensor, row_values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`torch.sub(x, row_values, out=out)` for float32 `out` and `row_values`, `x` float32 or bfloat16.
    From bfloat16, `torch.sub` converts on a slow mixed-dtype path; a copy then an in-place subtraction
    is several times faster."""
    if x.dtype == out.dtype:
        return torch.sub(x, row_values, out=out)
    return out.copy_(x).sub_(row_values)


def log_sum_exp(logits: torch.Tensor, rows_at_once: int = 16) -> torch.Tensor:
    """`torch.logsumexp(logits, dim=-1)` for (N, V) logits, `rows_at_once` rows at a time through one
    reused float32 buffer of `rows_at_once` rows, small enough to stay in cache. Chunks of
    `torch.logsumexp` allocate a fresh temporary each, paid again in page faults on the CPU. Computed, and
    returned, in float32 (also for bfloat16 logits)."""
    lse = logits.new_empty(logits.shape[0], dtype=torch.float32)
    buffer = logits.new_empty(min(rows_at_once, len(logits)), logits.shape[1], dtype=torch.float32)
    for start in range(0, len(logits), rows_at_once):
        chunk = logits[start : start + rows_at_once]
        peak = chunk.amax(dim=-1, keepdim=True).float()  # float32, so that the difference below is too
        peak.masked_fill_(~peak.isfinite(), 0.0)  # rows of -inf give -inf, a +inf gives +inf, as logsumexp
        exps = subtract_per_row(chunk, peak, out=buffer[: len(chunk)]).exp_()
        torch.add(exps.sum(dim=-1).log_(), peak.squeeze(1), out=lse[start : start + len(chunk)])
    return lse


# Vocabulary columns per product in `blockwise_logits_and_lse` (at 1,024 rows an 8 MB block, which
# stays in a server CPU's L3 cache while its exponentials are summed; half and twice the width gained
# less).
LOGIT_BLOCK_COLUMNS = 2048


def blockwise_logits_and_lse(
    hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`out` = `hidden @ weight.T`, its log-sum-exp per row) for float32 (N, E) `hidden` and (V, E) `weight`
    into a float32 (N, V) `out`, `LOGIT_BLOCK_COLUMNS` columns of the vocabulary at a time (by oneDNN where
    `onednn_products_apply`, else MKL): each block's exponentials are summed while the block is still in cache,
    against a running maximum that rescales the earlier sums (as `torch.logsumexp`: a row of -inf gives -inf, a
    +inf entry +inf). `out` can be memory kept from the last step (`RecycledBuffer`), where oneDNN's single
    product writes a fresh N x V tensor (for GPT-2 at 1,024 rows, 206 MB), faulted in page by page; and
    `log_sum_exp` then reads all of it again. Float32 training steps of GPT-1 and GPT-2 are faster this way than
    with the single product and `log_sum_exp` (benchmarks/RESULTS.md).

    Each block's copy into `out` and its sum run as one pass over each row on hfgpt's C kernel
    (csrc/loss.c, `torch.ops.hfgpt.lse_block`) where it is built, the running sum kept in float64; torch's copy,
    amax, subtraction, exp and sum otherwise, several passes over each block: the kernel cuts much of the
    time the head and its log-sum-exp take beyond the products themselves (also where MKL's products run:
    a GPT-2 training step 1.6% faster with torch capped at AVX2)."""
    rows = hidden.shape[0]
    product = onednn_mm if onednn_products_apply(hidden, weight) else lambda h, block: torch.mm(h, block.T)
    if kernel_runs("loss", hidden, weight, out):  # csrc/loss.c: the same arithmetic, one pass over each row
        peak = hidden.new_full((rows,), float("-inf"))
        total = hidden.new_zeros(rows, dtype=torch.float64)
        for start, stop, block in weight_blocks(weight, hidden.dtype, LOGIT_BLOCK_COLUMNS):
            part = product(hidden, block).contiguous()
            kernels.lse_block(part, out[:, start:stop], peak, total)
        shift = peak.masked_fill_(~peak.isfinite(), 0.0)
        return out, total.log_().add_(shift).float()
    peak = hidden.new_full((rows, 1), float("-inf"))  # the running maximum
    shift = hidden.new_zeros(rows, 1)  # the same where finite, else 0: what the sums are taken against
    total = hidden.new_zeros(rows, 1)  # sum of exp(logit - shift) so far
    for start, stop, block in weight_blocks(weight, hidden.dtype, LOGIT_BLOCK_COLUMNS):
        part = product(hidden, block)
        out[:, start:stop] = part
        peak = torch.maximum(peak, part.amax(dim=1, keepdim=True))
        new_shift = peak.masked_fill(~peak.isfinite(), 0.0)
        # (a total of 0, only -inf so far, stays 0 where the factor overflows: a first finite block below -88)
        total.mul_((shift - new_shift).exp_().masked_fill_(total == 0, 0.0))
        total.add_(part.sub_(new_shift).exp_().sum(dim=1, keepdim=True))
        shift = new_shift
    return out, total.log_().add_(shift).squeeze(1)


def _storage_holders(tensor: torch.Tensor) -> int | None:
    """How many tensors (and other owners) hold `tensor`'s memory, or None where this torch cannot say."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    storage = tensor.untyped_storage()  # this handle holds the memory too: not counted
    return use_count(storage._cdata) - 1


class RecycledBuffer:
    """One float32 tensor handed out again once nothing else holds it (`empty`), for the tied LM head's
    weight gradient (`TiedHeadGradient`) and its logits in training (`blockwise_logits_and_lse`), kept by
    the model between training steps (`HeadBuffers`).

    The gradient is a fresh V x E tensor every backward (GPT-2: 154 MB) that becomes the weight's `.grad`
    and is freed by `zero_grad(set_to_none=True)`. glibc maps a block that size afresh from the kernel
    each time, so every step pays one page fault per 4 KiB page on its first writes. Here the step after
    gets the same memory back when no tensor shares it any more; a gradient still held (`.grad` kept by
    `zero_grad(set_to_none=False)` or gradient accumulation, a reference the caller kept) is left alone
    and a fresh tensor is made, which this buffer then keeps instead. Float32 training steps take fewer
    page faults this way; the time gained is the faults' cost, which moves with the host's load
    (benchmarks/RESULTS.md). The buffer holds the memory until `eval()` (the model's `train(False)`); a
    copy of the model (`copy.deepcopy`, pickling) starts with an empty one."""

    def __init__(self) -> None:
        self._tensor: torch.Tensor | None = None
        self._lock = threading.Lock()

    def empty(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous float32 tensor of `shape`: the start of the kept memory where it is
        large enough and nothing else holds it, else fresh memory, which is kept from then on. A view
        either way (a new tensor object), so that whoever holds the result counts as a holder of it."""
        numel = math.prod(shape)
        with self._lock:
            kept = self._tensor
            if kept is None or kept.numel() < numel or kept.device != device or _storage_holders(kept) != 1:
                with torch.inference_mode(False):
                    kept = self._tensor = torch.empty(numel, dtype=torch.float32, device=device)
            return kept[:numel].view(shape)

    def __deepcopy__(self, memo: dict) -> "RecycledBuffer":
        return RecycledBuffer()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


def empty_float32(shape: torch.Size, device: torch.device, buffer: RecycledBuffer | None) -> torch.Tensor:
    """An uninitialised float32 tensor of `shape`: from `buffer` where there is one, else fresh memory."""
    if buffer is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    return buffer.empty(shape, device)


class HeadBuffers:
    """What a model keeps between training steps for its tied LM head and loss: memory for the float32
    logits and for the head's weight gradient, each taken again once nothing holds it (`RecycledBuffer`)."""

    def __init__(self) -> None:
        self.logits = RecycledBuffer()
        self.gradient = RecycledBuffer()


class TiedHeadGradient:
    """Carries the LM head's weight gradient from `_LinearCrossEntropy`'s backward to `_TiedEmbedding`'s, for
    a head tied to the token embeddings (GPT-1 and GPT-2 share one V x E matrix): the embedding's backward
    adds its rows into the head's gradient in place and returns the whole. The head's backward takes the
    memory for that gradient from `buffers` where the model keeps them (`HeadBuffers`).

    Autograd would instead build the embedding's gradient as a fresh zero-filled V x E tensor and sum the
    two into a third: for GPT-2 two more 154 MB tensors written from fresh pages every training step,
    each faulted in page by page. Float32 training steps are faster this way (benchmarks/RESULTS.md).
    The hand-over holds within one backward pass only (autograd's graph task): a backward that runs the
    embedding without the head first computes the embedding's gradient as usual."""

    def __init__(self, buffers: HeadBuffers | None = None) -> None:
        self._grad: torch.Tensor | None = None
        self._task: int | None = None
        # The model's memory for the head's logits and gradient; without it, memory for this pass alone.
        self.buffers = buffers if buffers is not None else HeadBuffers()

    def hand_over(self, grad: torch.Tensor) -> None:
        self._grad, self._task = grad, torch._C._current_graph_task_id()

    def take(self) -> torch.Tensor | None:
        grad, task = self._grad, self._task
        self._grad = self._task = None
        return grad if task is not None and task == torch._C._current_graph_task_id() else None


class _TiedEmbedding(torch.autograd.Function):
    """`F.embedding(ids, weight)`, whose weight gradient is accumulated into the tied head's
    (`TiedHeadGradient`) when that head's backward handed one over in this backward pass."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, tied: TiedHeadGradient) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.tied, ctx.rows = tied, len(weight)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, None]:
        (ids,) = ctx.saved_tensors
        head_grad = ctx.tied.take()
        if not ctx.needs_input_grad[1]:
            return None, None, None
        if head_grad is None or head_grad.dtype != grad.dtype:
            return None, torch.ops.aten.embedding_dense_backward(grad, ids, ctx.rows, -1, False), None
        return None, head_grad.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1])), None


HEAD_SLICE_ELEMENTS = 4 << 20  # 16 MB of float32 gradient at a time in `_LinearCrossEntropy`


class _LinearCrossEntropy(torch.autograd.Function):
    """(logits, sum over rows of row weight x token cross-entropy, / divisor) of `hidden @ weight.T`, for
    `lm_logits_and_loss` and `weighted_lm_loss`.

    Backward forms softmax - onehot a slice of the vocabulary at a time (~16 MB) and feeds each slice
    straight into the two head products, so the full N x V gradient never exists. For float32 logits a
    slice is one pass of hfgpt's C kernel (csrc/loss.c), where torch's subtraction, exp, multiplication
    and index_put make four. Saved: the logits (which the caller holds anyway) and one log-sum-exp per
    row. `F.cross_entropy` on materialised logits saves a log-softmax copy and builds two full N x V
    gradients (NLL's, then log-softmax's), so this head and loss, forward and backward, peak at less
    memory and take less time (benchmarks/RESULTS.md). A gradient reaching the returned logits from other uses is added in.

    The products run in `dtype` (`vocab_product_dtype`): float32, or bfloat16 under CPU autocast, as
    autocast would run `F.linear` — bfloat16 logits, the softmax, loss and gradient sums in float32, and
    float32 gradients for the float32 inputs. The weight is cast a block at a time (`weight_blocks`), so
    no whole low-precision copy of the head is made or saved. A backward that builds a graph
    (`create_graph=True`: second derivatives, `torch.autograd.functional.jvp` / `hvp`) recomputes the
    head and loss with autograd's ops instead (`_differentiable_head_grads`).
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # (N, E) float32
        weight: torch.Tensor,  # (V, E) float32
        targets: torch.Tensor,  # (N,) token ids, 0 where not counted
        row_weights: torch.Tensor,  # (N,) float weight of each row's loss, 0.0 where not counted
        divisor: torch.Tensor,  # () the number the weighted sum is divided by
        dtype: torch.dtype = torch.float32,  # of the products (and the logits)
        tied: TiedHeadGradient | None = None,  # where `weight` is also the token embeddings'
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)  # no N x V of zeros when the logits get no gradient
        ctx.tied, ctx.dtype = tied, dtype
        source, hidden = hidden, hidden.to(dtype)  # no copy when dtype is float32
        if dtype == torch.float32 and (
            onednn_products_apply(hidden, weight) or kernel_runs("loss", hidden, weight)
        ):
            shape = torch.Size((hidden.shape[0], weight.shape[0]))
            kept = tied.buffers.logits if tied is not None else None
            logits, lse = blockwise_logits_and_lse(hidden, weight, empty_float32(shape, hidden.device, kept))
        else:
            logits = row_aligned_mm(hidden, weight)  # (N, V); a float32 weight cast a block at a time
            lse = log_sum_exp(logits)
        picked = logits.gather(1, targets[:, None]).squeeze(1).float()
        # The input as given: backward casts it again (a graph-building backward differentiates through it).
        ctx.save_for_backward(source, weight, logits, targets, row_weights, lse, divisor)
        return logits, ((lse - picked) * row_weights).sum() / divisor

    @staticmethod
    def backward(
        ctx: Any, grad_logits: torch.Tensor | None, grad_loss: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        source, weight, logits, targets, row_weights, lse, divisor = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a backward that can itself be differentiated
            return _differentiable_head_grads(
                ctx, source, weight, targets, row_weights, divisor, grad_logits, grad_loss
            )
        if grad_loss is None:  # only the logits were used (the loss got no gradient)
            grad_loss = lse.new_zeros(())
        hidden = source.to(ctx.dtype)  # no copy when dtype is float32
        rows, vocab = logits.shape
        scale = loss_row_scale(row_weights, grad_loss, divisor)  # d loss / d log-probability, per row
        float32 = hidden.dtype == torch.float32
        onednn = onednn_products_apply(hidden, weight)  # float32 only; MKL's addmm_ / mm(out=) otherwise
        grad_hidden = hidden.new_zeros(hidden.shape, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            tied = ctx.tied
            kept = tied.buffers.gradient if tied is not None else None
            grad_weight = empty_float32(weight.shape, weight.device, kept)
        width = max(64, HEAD_SLICE_ELEMENTS // rows // 64 * 64)  # columns per slice
        if not float32:  # each slice's weight is cast into the workspace, which keeps its largest size
            width = min(width, CAST_BLOCK_ROWS)
        on_kernel = False  # csrc/loss.c for float32 logits: softmax - onehot in one pass over a slice
        if (
            float32
            and logits.dtype == lse.dtype == scale.dtype == torch.float32
            and targets.dtype == torch.int64
        ):
            # (N,) each, contiguous: the kernel reads row r's values at index r
            lse, row_scale, targets = lse.contiguous(), scale.reshape(-1).contiguous(), targets.contiguous()
            on_kernel = kernel_runs("loss", logits, lse, row_scale, targets)
        row_ids = None if on_kernel else torch.arange(rows, device=logits.device)
        # One slice's gradient (float32, and its copy in the products' dtype), reused by every slice.
        buffer = logits.new_empty(rows * width, dtype=torch.float32)
        low = buffer if float32 else logits.new_empty(rows * width)
        for start, stop, weight_slice in weight_blocks(weight, hidden.dtype, width):  # in the products' dtype
            grad = buffer[: rows * (stop - start)].view(rows, stop - start)
            if on_kernel:
                kernels.softmax_grad(logits[:, start:stop], lse, row_scale, targets, start, grad)
            else:
                subtract_per_row(logits[:, start:stop], lse[:, None], out=grad).exp_().mul_(scale)  # softmax
                hit = (targets >= start) & (targets < stop)
                grad.index_put_((row_ids[hit], targets[hit] - start), -scale[hit, 0], accumulate=True)
            if grad_logits is not None:
                grad += grad_logits[:, start:stop]
            product = grad if float32 else low[: grad.numel()].view(grad.shape).copy_(grad)
            if grad_hidden is not None:
                if onednn:
                    grad_hidden += onednn_mm(product, weight_slice.T)
                elif float32:
                    grad_hidden.addmm_(product, weight_slice)
                else:  # addmm_ takes one dtype: the slices' sum stays float32
                    grad_hidden += product @ weight_slice
            if grad_weight is not None:
                if onednn:
                    weight_gradient(product, hidden, out=grad_weight[start:stop])
                elif float32:
                    torch.mm(product.T, hidden, out=grad_weight[start:stop])
                else:
                    grad_weight[start:stop] = product.T @ hidden
        if grad_weight is not None and ctx.tied is not None:
            ctx.tied.hand_over(grad_weight)  # the embedding's backward adds its part and returns the sum
            grad_weight = None
        return grad_hidden, grad_weight, None, None, None, None, None


def loss_row_scale(row_weights: torch.Tensor, grad_loss: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """Each row's `row_weights x grad_loss / divisor` (N, 1), 0 for rows of weight 0 even where the divisor is 0:
    a batch whose labels are all `ignore_index` has loss 0 / 0 = NaN and, as `F.cross_entropy` gives it, zero
    gradients, where 0 x (1 / 0) would write NaN into every parameter."""
    return torch.where(row_weights != 0, row_weights * (grad_loss / divisor), 0.0)[:, None]


def _differentiable_head_grads(
    ctx: Any,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    row_weights: torch.Tensor,
    divisor: torch.Tensor,
    grad_logits: torch.Tensor | None,
    grad_loss: torch.Tensor | None,
) -> tuple[torch.Tensor | None, ...]:
    """`_LinearCrossEntropy`'s gradients for a backward with `create_graph=True`, written out with
    autograd's ops on the inputs (the logits in `ctx.dtype`, as autocast's `F.linear`), so that gradients
    of these gradients are taken through them: d loss / d logits = (softmax - onehot) x each row's scale,
    plus any gradient reaching the logits, then its two products. Not `torch.autograd.grad` through a
    recomputed loss: where the weight is the tied embeddings', the hidden states depend on it too, and
    that would count the embeddings' part twice. The head's gradient is returned, not handed to the
    tied embeddings, whose backward then computes its own."""
    with torch.enable_grad():
        low_hidden, low_weight = hidden.to(ctx.dtype), weight.to(ctx.dtype)
        logits = F.linear(low_hidden, low_weight)
        grad = logits.new_zeros(logits.shape, dtype=torch.float32)
        if grad_loss is not None:
            scale = loss_row_scale(row_weights, grad_loss, divisor)
            onehot = torch.zeros_like(grad).scatter(1, targets[:, None], scale)
            grad = torch.softmax(logits.float(), dim=-1) * scale - onehot
        if grad_logits is not None:
            grad = grad + grad_logits
        grad = grad.to(ctx.dtype)
        grad_hidden = (grad @ low_weight).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad.T @ low_hidden).to(weight.dtype) if ctx.needs_input_grad[1] else None
    return grad_hidden, grad_weight, None, None, None, None, None


def lm_logits_and_loss(
    hidden_states: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    tied: TiedHeadGradient | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits = head(hidden_states)` and transformers' `ForCausalLMLoss(logits, labels, ...)`: the same
    arguments and values (next-token cross-entropy, labels shifted inside, `ignore_index` skipped, mean
    over the counted tokens or sum / `num_items_in_batch` for Trainer's gradient accumulation).
    Where `head_product_dtype` names a dtype, both come from `_LinearCrossEntropy` (which hands the head's
    weight gradient to `tied`, given one); elsewhere from the plain calls."""
    rows = hidden_states.numel() // hidden_states.shape[-1]
    dtype = head_product_dtype(hidden_states, head)
    if dtype is None or rows <= FEW_ROWS:
        logits = project_to_vocab(hidden_states, head)
        return logits, ForCausalLMLoss(
            logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs
        )
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden_states.device)
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    if len(targets) != len(flat):
        raise ValueError(
            f"labels hold {len(targets)} positions but the logits {len(flat)} "
            f"(labels shape {tuple((labels if labels is not None else shift_labels).shape)}, "
            f"hidden states {tuple(hidden_states.shape[:-1])}; logits_to_keep cannot be used with labels)"
        )
    counted = targets != ignore_index
    targets = targets.masked_fill(~counted, 0)
    low, high = (int(t) for t in torch.aminmax(targets)) if len(targets) else (0, 0)
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"labels contain {low if low < 0 else high}, neither a token id in [0, {vocab_size}) nor "
            f"ignore_index {ignore_index}"
        )
    if num_items_in_batch is None:
        divisor = counted.sum().to(flat.dtype)
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=flat.device).to(flat.dtype)
    logits, loss = _LinearCrossEntropy.apply(
        flat, head.weight, targets, counted.to(flat.dtype), divisor, dtype, tied
    )
    return logits.view(*hidden_states.shape[:-1], -1), loss


def weighted_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    tied: TiedHeadGradient | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`logits = hidden @ weight.T`, the sum over rows of `weights` x the cross-entropy of `targets`),
    for hidden (N, E), weight (V, E), targets and weights (N,). `_LinearCrossEntropy` where
    `vocab_product_dtype` names a dtype, else `F.linear` and `F.cross_entropy`."""
    dtype = vocab_product_dtype(hidden, weight)
    if len(hidden) > FEW_ROWS and dtype is not None:
        divisor = hidden.new_tensor(1.0)
        return _LinearCrossEntropy.apply(hidden, weight, targets, weights.float(), divisor, dtype, tied)
    logits = F.linear(hidden, weight)
    return logits, weighted_cross_entropy(logits, targets, weights)


def weighted_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The sum over rows of `weights` x the cross-entropy of `targets`, for (N, V) logits (in float32)."""
    return (F.cross_entropy(logits.float(), targets, reduction="none") * weights).sum()
