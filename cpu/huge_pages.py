"""Weights in transparent huge pages, for the CPU decoding copies (`quantize_for_decoding`).

A decoding step streams every weight from memory once. Spread over 4 KiB pages, that stream pays a TLB
miss every 4 KiB; in 2 MiB pages, one every 2 MiB. A plain read of GPT-2's weights from huge pages, and
the int8 products of a decoding step, are faster than from 4 KiB pages (less so when the host is busy);
benchmarks/RESULTS.md has the figures.

Linux gives huge pages to memory advised with `madvise(MADV_HUGEPAGE)` when
/sys/kernel/mm/transparent_hugepage/enabled says `madvise` or `always`, and only to pages first touched
after the advice: so the weights go into one fresh anonymous mapping, advised before anything is
written to it. (An allocation through torch would come from malloc, which may hand back heap memory
already faulted in 4 KiB pages, as it always does after `hfgpt.cpu.runtime.keep_freed_memory`.)
Elsewhere the same layout is made in ordinary memory.
"""

import mmap
from collections.abc import Iterator

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # x86-64's and (with 4 KiB base pages) arm64's transparent huge page
ALIGNMENT = 64  # each tensor starts on a cache line
SMALLEST = 1 << 16  # tensors below this stay where they are (layer norms, biases, scales)


def huge_page_buffer(nbytes: int) -> tuple[torch.Tensor, bool]:
    """`nbytes` of fresh zeroed memory as a uint8 CPU tensor starting on a `HUGE_PAGE` boundary, and
    whether the kernel took the advice to back it with huge pages (False off Linux, or on a kernel
    built without them). The tensor keeps its mapping alive; the mapping is unmapped when the last
    tensor viewing it is freed."""
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
    `huge_page_buffer`, in place, values unchanged. A parameter keeps its identity (its `.data` is
    replaced), so tied weights stay tied and are stored once. Returns whether the buffer was advised
    into huge pages.

    For inference copies: the tensors then share one storage, which checkpoint writers refuse as
    shared memory (the decoding copies refuse `save_pretrained` anyway), and an optimizer step or
    `.to()` works but the copies it makes are ordinary memory again. While moving, the old tensors and
    the new buffer are both held: peak memory rises by the bytes moved."""
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
