"""Products of a decoding step's few rows with a weight (the LM head's logits, a decoding copy's layers),
bound by how fast the weight is read. `F.linear` of a few rows with a tall weight, such as GPT-2's 50257 x 768
LM head, runs MKL's small-matrix kernel, which reads it several times slower than `weight @ rows^T`
(benchmarks/RESULTS.md); one row goes to hfgpt's C kernel, each thread reading its run of the rows once.
"""

import torch

from . import kernels
from .checks import eager, needs_grad, plain_tensors

# Up to this many rows (a decoding step), a product with a weight runs as `few_rows_product`.
FEW_ROWS = 16


def few_rows_applies(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `few_rows_product` computes `rows @ weight.T`: 1 to `FEW_ROWS` float32 rows (rows, in) and a
    contiguous float32 `[out, in]` weight, plain CPU tensors without gradients, run eagerly outside autocast."""
    return (
        rows.dim() == 2
        and 0 < rows.shape[0] <= FEW_ROWS
        and rows.dtype == weight.dtype == torch.float32
        and rows.is_cpu
        and weight.is_cpu
        and weight.dim() == 2
        and weight.is_contiguous()
        and rows.shape[1] == weight.shape[1]
        and plain_tensors(rows, weight)
        and not needs_grad(rows, weight)
        and not torch.is_autocast_enabled("cpu")
        and eager()
    )


def few_rows_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`rows @ weight.T` where `few_rows_applies`, contiguous (rows, out): one row on the C kernel split
    between the threads (`torch.ops.hfgpt.row_product`), more as `weight @ rows^T`."""
    threads = torch.get_num_threads()
    if len(rows) == 1 and threads > 1 and kernels.available("row_product"):
        return kernels.row_product(rows.contiguous(), weight, threads)
    columns = torch.cat([rows, rows]) if len(rows) == 1 else rows  # one column takes the slow kernel again
    return torch.mm(weight, columns.T)[:, : len(rows)].T.contiguous()


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
