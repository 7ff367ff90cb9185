"""What the tests of hfgpt's C kernels (tests/test_*_kernel.py) share: a fresh kernel cache around each
test, a record of a kernel's calls, and a training step compared with torch's ops."""

import platform

import pytest
import torch
from test_performance import seeded_step  # tests/ is on sys.path

from hfgpt.cpu import kernels, native
from hfgpt.modeling import GPTForCausalLM


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


def assert_step_equals_torchs(
    model: GPTForCausalLM, ids: torch.Tensor, step: tuple[torch.Tensor, dict], atol: float, rtol: float
) -> None:
    """`step` (`seeded_step(model, ids, seed=3)` on a kernel) equals the same step run again now that the
    caller has switched the kernel off: the loss to 1e-6, each gradient to `atol` / `rtol`."""
    loss, grads = step
    torch_loss, torch_grads = seeded_step(model, ids, seed=3)
    torch.testing.assert_close(loss, torch_loss, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, torch_grads[name], atol=atol, rtol=rtol, msg=name)
