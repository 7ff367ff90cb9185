"""What the tests of hfgpt's C kernels (tests/test_*_kernel.py) share: a fresh kernel cache around each
test, a record of a kernel's calls and of the ops a dispatch mode sees, and builds for narrower vectors."""

import os
import platform
import shutil

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from hfgpt.cpu import kernels, native

# The kernels are one portable source each, built with the machine's C compiler for its own vectors (AVX2,
# AVX-512, NEON): they run wherever there is a compiler.
needs_kernel = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="hfgpt's C kernels need a C compiler"
)


class OpRecorder(TorchDispatchMode):
    """A torch dispatch mode that records each op it sees in `ops` (and runs it): what make_fx,
    FakeTensorMode or FlopCounterMode would see of a computation."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def fresh_kernel_cache():
    """`native.kernel`'s libraries loaded afresh for the test, and forgotten after it (a test may build
    or refuse one: `HFGPT_NATIVE=0`, a portable build). Autouse in every module that imports it."""
    native.kernel.cache_clear()
    yield
    native.kernel.cache_clear()


def cpu_flags() -> set[str]:
    """This CPU's flags as hfgpt's kernel cache reads them (`native._cpu_flags`: /proc/cpuinfo's first
    `flags` line, or arm64's `Features`; empty where there is none)."""
    return set(native._cpu_flags().partition(":")[2].split())


def _narrow_targets() -> list[str | None]:
    """The -march targets narrower than this host's that `narrow_build` can build and run here: on x86-64
    with AVX2 and FMA, x86-64-v3 (8 float lanes, as on CI's AVX2 CPUs); and everywhere the compiler's
    baseline (None: x86-64's SSE2, 4 lanes without FMA; arm64's NEON)."""
    x86_64_v3 = platform.machine() == "x86_64" and {"avx2", "fma"} <= cpu_flags()
    return (["x86-64-v3"] if x86_64_v3 else []) + [None]


NARROW_TARGETS = _narrow_targets()


def narrow_build(directory, name: str, target: str | None = None):
    """csrc/{name}.c built for `target` (-march=target; None: the compiler's baseline) instead of
    -march=native, into `directory`: the same portable source with narrower vectors than the host's,
    loaded as `native.kernel` loads the native build. (Explicit flags: HFGPT_CFLAGS does not apply.)"""
    flags = tuple(f for f in native.FLAGS if f != "-march=native")
    if target is not None:
        flags = (f"-march={target}", *flags)
    return native.load(native.build(name, flags, directory), name)


def using_library(monkeypatch, name: str, library) -> None:
    """hfgpt's operators run `library` for csrc/{name}.c (and the native build for the others)."""
    kernel = native.kernel
    monkeypatch.setattr(
        native, "kernel", lambda kernel_name: library if kernel_name == name else kernel(kernel_name)
    )


def record_kernel_calls(monkeypatch, name: str) -> list[str]:
    """The names of the entry points of csrc/{name}.c that hfgpt's operators (`hfgpt.cpu.kernels`) call, in
    order, as they are called (and still run)."""
    calls, library_of = [], kernels._library

    class Spy:
        def __init__(self, library):
            self.library = library

        def __getattr__(self, entry):
            def call(*args):
                calls.append(entry)
                return getattr(self.library, entry)(*args)

            return call

    def spied(kernel_name):
        library = library_of(kernel_name)
        return Spy(library) if kernel_name == name else library

    monkeypatch.setattr(kernels, "_library", spied)
    return calls


def without_kernel(monkeypatch, name: str) -> None:
    """Callers see csrc/{name}.c as unavailable (`kernels.available`), and run torch's ops instead."""
    available = kernels.available
    monkeypatch.setattr(
        kernels, "available", lambda kernel_name: kernel_name != name and available(kernel_name)
    )
