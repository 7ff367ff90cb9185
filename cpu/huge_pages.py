"""Weights in transparent huge pages, for the CPU decoding copies (`quantize_for_decoding`).

A decoding step streams every weight once: from 4 KiB pages it pays a TLB miss every 4 KiB, from 2 MiB
pages one every 2 MiB, and GPT-2's weights read faster (less so on a busy host; benchmarks/RESULTS.md).
Linux gives huge pages (`enabled` set to `madvise` or `always`) only to pages first touched after
`madvise(MADV_HUGEPAGE)`, so the weights go into one fresh anonymous mapping advised before anything is
written to it: malloc, through torch, may hand back heap memory already faulted in 4 KiB pages (as it always
does after `hfgpt.cpu.runtime.keep_freed_memory`). Elsewhere the same layout is made in ordinary memory.
"""

import mmap
from collections.abc import Iterator

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # x86-64's and (with 4 KiB base pages) arm64's transparent huge page
ALIGNMENT = 64  # each tensor starts on a cache line
SMALLEST = 1 << 16  # tensors below this stay where they are (layer norms, biases, scales)


def huge_page_buffer(nbytes: int) -> tuple[torch.Tensor, bool]:
    """`nbytes` of fresh zeroed memory as a uint8 CPU tensor starting on a `HUGE_PAGE` boundary (its mapping
    unmapped when the last tensor viewing it is freed), and whether the kernel took the advice to back it
    with huge pages (False off Linux, or on a kernel built without them)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes <= 0:
        return torch.zeros(max(nbytes, 0), dtype=torch.uint8), False
    # Private (a shared anonymous mapping is shmem, which follows shmem_enabled instead), whole huge
    # pages (the last one too), and one to spare so that the tensor can start on a huge page boundary.
    pages = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, pages + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(advice, start, pages)
        advised = True
    except OSError:  # EINVAL: a kernel without transparent huge pages
        advised = False
    return whole[start : start + nbytes], advised


def _large_tensors(module: nn.Module, smallest: int) -> Iterator[tuple[dict, str, torch.Tensor]]:
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in table.items():
                if tensor is not None and tensor.device.type == "cpu" and tensor.nbytes >= smallest:
                    yield table, name, tensor


def gather_into_huge_pages(module: nn.Module, smallest: int = SMALLEST) -> bool:
    """Move every CPU parameter and buffer of `module` of at least `smallest` bytes into one
    `huge_page_buffer`, in place, values unchanged; returns whether it was advised into huge pages. A
    parameter keeps its identity (its `.data` is replaced), so tied weights stay tied and stored once.
    For inference copies: checkpoint writers refuse the one shared storage, `.to()` makes ordinary memory
    again, and peak memory rises by the bytes moved while both are held."""
    places: dict[int, list[tuple[dict, str]]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for table, name, tensor in _large_tensors(module, smallest):
        places.setdefault(id(tensor), []).append((table, name))
        tensors[id(tensor)] = tensor
    offsets, total = {}, 0
    for key, tensor in tensors.items():
        offsets[key] = total
        total += -(-tensor.nbytes // ALIGNMENT) * ALIGNMENT
    buffer, advised = huge_page_buffer(total)
    for key, tensor in tensors.items():
        view = buffer[offsets[key] : offsets[key] + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        with torch.no_grad():
            view.copy_(tensor)
        for table, name in places[key]:
            if isinstance(tensor, nn.Parameter):
                tensor.data = view  # once per parameter; every other place holds the same object
            else:
                table[name] = view
    return advised


__all__ = ["HUGE_PAGE", "gather_into_huge_pages", "huge_page_buffer"]
