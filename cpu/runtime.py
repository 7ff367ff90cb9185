"""Process-wide settings for running hfgpt models on the CPU, applied only where asked for (the training
command lines do by default; importing hfgpt changes nothing)."""

import ctypes
import ctypes.util
import sys

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP_FREED_BYTES = 2**31 - 1  # the largest trim threshold mallopt takes (an int)

_kept = False  # whether `keep_freed_memory` was applied in this process


def keep_freed_memory() -> bool:
    """Have glibc's malloc serve every allocation from its heap and keep freed memory for reuse, instead
    of mapping each large block (>= 32 MB at most) freshly from the kernel and unmapping it when freed.

    A training step allocates its largest buffers anew each time: GPT-2's 1024 x 50257 logits (206 MB)
    and the 154 MB head gradient. From fresh mappings every page is faulted in again on every step; from
    the heap's kept memory it is not, so a float32 training step takes far fewer page faults and less
    time, with the same peak memory (benchmarks/RESULTS.md). Freed memory then stays with the process
    (up to 2 GB above the heap's top) rather than going back to the system.

    The same as starting Python with `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647`, for
    allocations from now on. Returns whether it was applied: False off Linux, or with a C library that
    is not glibc (musl has no mallopt)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    global _kept
    _kept = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES) == 1
    return _kept


def freed_memory_kept() -> bool:
    """Whether `keep_freed_memory()` was applied in this process: large blocks then come from malloc's
    heap, already faulted in, rather than fresh from the kernel."""
    return _kept
