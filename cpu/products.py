"""Products of a decoding step's few rows with a weight (the LM head's logits, a decoding copy's layers),
bound by how fast the weight is read. `F.linear` of a few rows with a tall weight, such as GPT-2's 50257 x 768
LM head, runs MKL's small-matrix kernel, which reads it several times over on some CPUs (benchmarks/RESULTS.md);
hfgpt's C kernel reads it once for all the rows, each thread its run of the weight's rows.
"""

import torch

from . import kernels
from .checks import eager, float32_vector, has_storage, needs_grad, plain_tensors

# Up to this many rows (a decoding step), a product with a weight runs as `few_rows_product`.
FEW_ROWS = 16


def few_rows_applies(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `few_rows_product` computes `F.linear(rows, weight, bias)`: 1 to `FEW_ROWS` float32 rows
    (rows, in), a contiguous float32 `[out, in]` weight and bias, plain CPU tensors without gradients, run
    eagerly outside autocast, the C kernel built."""
    tensors = (rows, weight) if bias is None else (rows, weight, bias)
    return (
        rows.dim() == 2
        and 0 < rows.shape[0] <= FEW_ROWS
        and rows.dtype == torch.float32
        and rows.is_cpu
        and has_storage(rows)
        and weight.dim() == 2
        and rows.shape[1] == weight.shape[1]
        and float32_vector(weight, tuple(weight.shape))
        and (bias is None or float32_vector(bias, tuple(weight.shape[:1])))
        and plain_tensors(*tensors)
        and not needs_grad(*tensors)
        and not torch.is_autocast_enabled("cpu")
        and eager()
        and kernels.available("row_product")
    )


def few_rows_product(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(rows, weight, bias)` where `few_rows_applies`, contiguous (rows, out), on hfgpt's C kernel
    (`torch.ops.hfgpt.row_product`): each thread reads its run of the weight once for all the rows."""
    return kernels.row_product(rows.contiguous(), weight, bias)


def one_row_bfloat16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for one bfloat16 row `x` (1, in) and a contiguous bfloat16 `[out, in]`
    weight (and bias), without gradients, on hfgpt's C kernel (`row_product_bf16`), or None where that does
    not apply. torch's bfloat16 one-row product reads the weight well below the memory's rate
    (benchmarks/RESULTS.md)."""
    tensors = [x, weight, *([] if bias is None else [bias])]
    if (
        any(t.dtype != torch.bfloat16 or not t.is_cpu for t in tensors)
        or not all(t.is_contiguous() for t in tensors)
        or not plain_tensors(*tensors)
        or needs_grad(*tensors)
        or torch.is_autocast_enabled("cpu")
        or not eager()
        or not kernels.available("row_product")
    ):
        return None
    return kernels.row_product_bf16(x, weight, bias)
