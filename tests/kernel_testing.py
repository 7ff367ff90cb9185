"""What the tests of hfgpt's C kernels (tests/test_*_kernel.py) share: a fresh kernel cache around each
test, a record of a kernel's calls, and a training step compared with torch's ops."""

import pytest
import torch
from test_performance import seeded_step  # tests/ is on sys.path

from hfgpt.cpu import native
from hfgpt.cpu import ops as ops_hfgpt
from hfgpt.modeling import GPTForCausalLM


@pytest.fixture(autouse=True)
def fresh_kernel_cache():
    """`native.kernel`'s libraries loaded afresh for the test, and forgotten after it (a test may build
    or refuse one: `HFGPT_NATIVE=0`, a portable build). Autouse in every module that imports it."""
    native.kernel.cache_clear()
    yield
    native.kernel.cache_clear()


def record_kernel_calls(monkeypatch, getter: str) -> list[str]:
    """The names of the entry points called (and still run) on the library that `ops_hfgpt.<getter>`
    returns, whatever arguments the getter takes; the getter still returns None where it did."""
    calls, choose = [], getattr(ops_hfgpt, getter)

    class Spy:
        def __init__(self, library):
            self.library = library

        def __getattr__(self, name):
            def call(*args):
                calls.append(name)
                return getattr(self.library, name)(*args)

            return call

    def spied(*args):
        library = choose(*args)
        return None if library is None else Spy(library)

    monkeypatch.setattr(ops_hfgpt, getter, spied)
    return calls


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
