"""Shared test settings. The fixtures under tests/fixtures are copies of ../shared/fixtures so the suite
runs from a lone clone of the project."""

import os
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"
GPT2_FIXTURE = FIXTURES / "openai-gpt2-tiny"
GPT1_FIXTURE = FIXTURES / "openai-gpt1-tiny"


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache_dir(tmp_path_factory):
    """hfgpt's C kernels are built into a folder of the test session (not ~/.cache), unless
    HFGPT_CACHE_DIR is set already."""
    if "HFGPT_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["HFGPT_CACHE_DIR"] = str(tmp_path_factory.mktemp("hfgpt-cache"))
    yield
    del os.environ["HFGPT_CACHE_DIR"]


@pytest.fixture
def gpt2_fixture_dir() -> Path:
    return GPT2_FIXTURE


@pytest.fixture
def gpt1_fixture_dir() -> Path:
    return GPT1_FIXTURE


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models train several times faster on one torch thread: a busy 2-core machine otherwise spends
    their time in OpenMP barrier waits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def torch_threads(request):
    """Runs a test on `request.param` intra-op threads (parametrize it with `indirect=True`): the one-row
    products split their work by the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def keep_freed_memory_calls(monkeypatch) -> list[bool]:
    """The training command lines' `keep_freed_memory()` (a process-wide allocator setting) recorded,
    not applied, in the test processes: one entry per call."""
    import hfgpt.scripts.train_lm as train_script

    calls: list[bool] = []
    monkeypatch.setattr(train_script, "keep_freed_memory", lambda: calls.append(True) or True)
    return calls


@pytest.fixture(autouse=True)
def cpu_products_setting_restored():
    """Every test leaves `use_onednn_products` as it found it: a leaked False would run every later test
    in the process on MKL alone (one did, until session 8)."""
    from hfgpt.cpu import ops as ops_hfgpt

    before = dict(ops_hfgpt._cpu_products)
    yield
    assert ops_hfgpt._cpu_products == before, "the test left use_onednn_products changed"


@pytest.fixture(params=["onednn", "mkl"])
def cpu_products(request):
    """Runs a test with hfgpt's float32 CPU products through oneDNN at every size
    (`use_onednn_products(True)`; the default runs them there only where oneDNN is the faster on the CPU)
    and through MKL's `addmm` (`use_onednn_products(False)`); the oneDNN case is skipped on a torch built
    without oneDNN."""
    from hfgpt.cpu import ops as ops_hfgpt

    if request.param == "onednn" and ops_hfgpt._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN")
    with ops_hfgpt.onednn_products(request.param == "onednn"):
        yield request.param


# The test modules of hfgpt.cpu itself: their models are built kernelized even where the environment
# switches the backend's default off (HFGPT_CPU_BACKEND=0), so that the whole suite runs either way:
# the other modules then test the plain model, these the backend through explicit kernelization.
BACKEND_TEST_MODULES = {
    "test_attention_kernel",
    "test_backend",
    "test_benchmarks",
    "test_dropout_kernel",
    "test_gelu_kernel",
    "test_huge_pages",
    "test_int8_block",
    "test_int8_kernel",
    "test_kernel_misuse",
    "test_loss_kernel",
    "test_onednn_products",
    "test_performance",
    "test_quantization",
    "test_row_product_kernel",
}


@pytest.fixture(autouse=True)
def backend_for_backend_tests(request):
    from hfgpt.cpu import layers
    from hfgpt.modeling import GPTPreTrainedModel

    hooks = GPTPreTrainedModel.post_init_hooks
    module = request.module.__name__.rpartition(".")[2]
    if module not in BACKEND_TEST_MODULES or layers._kernelize_new_model in hooks:
        yield
        return
    hooks.append(layers._kernelize_new_model)
    try:
        yield
    finally:
        hooks.remove(layers._kernelize_new_model)
