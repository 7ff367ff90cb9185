"""What the CPU backend checks before a C kernel stands in for torch's ops: that the kernel reads the tensors
as they are (plain CPU tensors with memory, of the dtype and layout it takes), and that no code the kernel
would skip is attached to a module (hooks, a forward set on the instance)."""

import torch
from torch import nn

# The only view of the hooks registered for every module (`register_module_forward_hook`): torch has no public
# query for them, and a path that computes a module's work without calling it must see them.
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

_PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)


def eager() -> bool:
    """Outside a compiled graph, an export and a TorchScript trace: where Python runs each op as it comes."""
    return not (torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing())


def plain_tensors(*tensors: torch.Tensor) -> bool:
    """Whether these are tensors or parameters themselves, not subclasses: a subclass (FakeTensor, DTensor, a
    `__torch_function__` wrapper, export's and compile's tracing tensors) runs torch's ops, which it knows how
    to handle, rather than an hfgpt kernel, which it may not."""
    return all(type(t) in _PLAIN_TENSOR_TYPES for t in tensors)


def has_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has memory a kernel can read (functorch's vmap and grad wrappers have none)."""
    try:
        tensor.data_ptr()
    except RuntimeError:
        return False
    return True


def float32_vector(tensor: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """A contiguous float32 CPU tensor of `shape` with memory: what a kernel reads as a plain array."""
    return (
        tensor.dtype == torch.float32
        and tuple(tensor.shape) == shape
        and tensor.is_contiguous()
        and tensor.is_cpu
        and has_storage(tensor)
    )


def layer_norm_fits_kernel(norm: nn.Module, width: int) -> bool:
    """Whether `norm` is an affine `nn.LayerNorm` over `width` features whose weight and bias a kernel reads
    as plain arrays of floats."""
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
    """Whether calling `module` would run code of a user's beside its class's forward: forward or forward-pre
    hooks (its own or global ones), or a `forward` set on the instance (accelerate's offloading hooks wrap it
    so). A path that computes the module's work without calling it must then step aside."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or has_global_forward_hooks()
        or "forward" in module.__dict__
    )
