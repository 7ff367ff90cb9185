"""Process-wide settings for running hfgpt models on the CPU, applied only where asked for (the training
command lines do by default; importing hfgpt changes nothing)."""

import ctypes
import ctypes.util
import sys

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP_FREED_BYTES = 2**31 - 1  # the largest trim threshold mallopt takes (an int)


def keep_freed_memory() -> bool:
    """Have glibc's malloc serve every allocation from its heap and keep freed memory for reuse (up to 2 GB
    above the heap's top), instead of mapping each large block (>= 32 MB at most) freshly from the kernel
    and unmapping it when freed: as `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647`, from now on.
    A training step allocates GPT-2's 206 MB logits and 154 MB head gradient anew each time; from the kept
    heap their pages are not faulted in again, so a float32 step takes less time with the same peak memory
    (benchmarks/RESULTS.md). Returns whether it was applied: False off Linux, or with a C library that is
    not glibc (musl has no mallopt)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES) == 1
