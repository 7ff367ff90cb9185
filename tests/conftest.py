"""Shared test settings. The fixtures under tests/fixtures are copies of ../shared/fixtures so the suite
runs from a lone clone of the project."""

import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from filelock import FileLock

FIXTURES = Path(__file__).parent / "fixtures"
GPT2_FIXTURE = FIXTURES / "openai-gpt2-tiny"
GPT1_FIXTURE = FIXTURES / "openai-gpt1-tiny"

# --- the Hub environment of the test session ---------------------------------------------------------------
# huggingface_hub, transformers and datasets read their settings from the environment once, when imported
# (offline switch, endpoint, HF_HOME and the caches and token file under it), and every subprocess a test
# starts inherits the environment. So before any test module is imported, the session replaces whatever the
# user has set (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, HF_TOKEN, HF_HOME, HF_ENDPOINT, progress bars, ...)
# with one fixed environment: no token, a private HF_HOME in a temporary folder (the user's cache, saved
# login and token are never read or written), and offline (no test reaches the real Hub). The tests that
# talk to the stand-in Hub of tests/hub_server.py go online to it through the `use_test_hub` fixture.
HUB_ENV_PREFIXES = ("HF_", "HUGGINGFACE_", "HUGGING_FACE_", "TRANSFORMERS_")
_session_env = pytest.MonkeyPatch()
_session_hf_home: Path | None = None
_session_kernel_cache: Path | None = None


def session_hub_env(hf_home: Path) -> dict[str, str | None]:
    """The Hub variables of the test session: `None` for every one the user had set, then our own."""
    env: dict[str, str | None] = {name: None for name in os.environ if name.startswith(HUB_ENV_PREFIXES)}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    return env


def _sync_imported_hub_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where huggingface_hub was imported before this conftest (by a plugin), its constants hold the user's
    environment: they are set to what a fresh import in the session's environment gives."""
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is None:
        return
    spec = importlib.util.spec_from_file_location("_hfgpt_fresh_hub_constants", constants.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    for name, value in vars(fresh).items():
        if name.isupper() and getattr(constants, name, None) != value:
            monkeypatch.setattr(constants, name, value)
    transformers_hub = sys.modules.get("transformers.utils.hub")
    if transformers_hub is not None:
        monkeypatch.setattr(transformers_hub, "HF_MODULES_CACHE", os.path.join(fresh.HF_HOME, "modules"))


def pytest_configure(config: pytest.Config) -> None:
    global _session_hf_home, _session_kernel_cache
    _session_hf_home = Path(tempfile.mkdtemp(prefix="hfgpt-tests-hf-home-"))
    for name, value in session_hub_env(_session_hf_home).items():
        if value is None:
            _session_env.delenv(name)
        else:
            _session_env.setenv(name, value)
    _sync_imported_hub_constants(_session_env)
    # hfgpt's C kernels are built into a folder of the test session (not ~/.cache), unless HFGPT_CACHE_DIR
    # is set already (by the user, or by the pytest-xdist controller for its workers, which then share
    # its folder). Set here, before collection: test modules build kernels as pytest imports them (the
    # `kernels.available()` of their skip conditions), before any fixture runs.
    if "HFGPT_CACHE_DIR" not in os.environ:
        _session_kernel_cache = Path(tempfile.mkdtemp(prefix="hfgpt-tests-kernels-"))
        _session_env.setenv("HFGPT_CACHE_DIR", str(_session_kernel_cache))
    # pytest-xdist's workers share the CPUs: each worker, and the processes its tests start, runs torch on
    # its share of them. Two workers on 2 cores with torch's default of 2 threads each spend much of their
    # time in OpenMP barrier waits. The tests of threaded paths set their thread counts themselves
    # (`intra_op_threads`).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        share = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(share)
        _session_env.setenv("OMP_NUM_THREADS", str(share))
    _share_the_long_tests(config)


def _share_the_long_tests(config: pytest.Config) -> None:
    """Where pytest-xdist runs the tests (`-n`) with the distribution it picks itself, `load`, its
    `worksteal` instead: a worker that runs out of tests takes some of those queued for another, where
    `load` leaves it waiting while the other works through its queue (`pytest_collection_modifyitems`
    puts the long tests first). A `--dist` the command line names is kept."""
    named = " ".join([*config.invocation_params.args, os.environ.get("PYTEST_ADDOPTS", "")])
    if getattr(config.option, "dist", "no") == "load" and "--dist" not in named:
        config.option.dist = "worksteal"


def pytest_unconfigure(config: pytest.Config) -> None:
    _session_env.undo()
    for folder in (_session_hf_home, _session_kernel_cache):
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def point_at_test_hub(monkeypatch: pytest.MonkeyPatch, url: str, token: str | None = None) -> None:
    """Points this process's Hub clients (huggingface_hub, transformers) and the subprocesses that inherit
    its environment at the stand-in Hub at `url`: online, `url` as the endpoint, uploads through LFS (the
    stand-in speaks no Xet), and `token` as HF_TOKEN (none when None); `monkeypatch` undoes it all."""
    import huggingface_hub.constants as constants

    url = url.rstrip("/")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    if token is not None:
        monkeypatch.setenv("HF_TOKEN", token)
    # What huggingface_hub would have read from that environment at import; it reads these per call.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)


@pytest.fixture
def use_test_hub(monkeypatch: pytest.MonkeyPatch):
    """`use_test_hub(url, token=None)`: `point_at_test_hub` for this test; the session's offline
    environment is back after it."""

    def point(url: str, token: str | None = None) -> None:
        point_at_test_hub(monkeypatch, url, token)

    return point


@pytest.fixture
def gpt2_fixture_dir() -> Path:
    return GPT2_FIXTURE


@pytest.fixture
def gpt1_fixture_dir() -> Path:
    return GPT1_FIXTURE


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `name`, filled by `make(folder)` once in this run for all of pytest-xdist's workers: the
    first to get there makes it, the others wait on a file lock and read it (xdist's recipe for a fixture
    that should run once). Module fixtures that take tens of seconds are then not paid once a worker. The
    tests that use the folder only read it, or write files of their own names."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        folder = tmp_path_factory.mktemp(name)
        make(folder)
        return folder
    shared = tmp_path_factory.getbasetemp().parent  # this run's, above each worker's own
    folder = shared / name
    with FileLock(str(shared / f"{name}.lock")):
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed half way left
            folder.mkdir()
            make(folder)
            (folder / ".made").touch()
    return folder


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[int]:
    """torch's intra-op threads set to `count` inside, set back after (an exception too)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models train several times faster on one torch thread: a busy 2-core machine otherwise spends
    their time in OpenMP barrier waits."""
    with intra_op_threads(1):
        yield


@pytest.fixture
def torch_threads(request):
    """Runs a test on `request.param` intra-op threads (parametrize it with `indirect=True`): the row
    products split their work by the thread count."""
    with intra_op_threads(request.param) as count:
        yield count


@pytest.fixture(autouse=True)
def keep_freed_memory_calls(monkeypatch) -> list[bool]:
    """The training command lines' `keep_freed_memory()` (a process-wide allocator setting) recorded,
    not applied, in the test processes: one entry per call."""
    import hfgpt.scripts.train_lm as train_script

    calls: list[bool] = []
    monkeypatch.setattr(train_script, "keep_freed_memory", lambda: calls.append(True) or True)
    return calls


# The test modules of hfgpt.cpu itself: their models run the backend even where the environment switches its
# default off (HFGPT_CPU_BACKEND=0), so that the whole suite runs either way: the other modules then test
# the plain model, these the backend.
BACKEND_TEST_MODULES = {
    "test_backend",
    "test_benchmarks",
    "test_fidelity",
    "test_float_step",
    "test_huge_pages",
    "test_int8_block",
    "test_int8_kernel",
    "test_int8_step",
    "test_kernel_misuse",
    "test_native_cache",
    "test_quantization",
    "test_row_product_kernel",
}


@pytest.fixture(autouse=True)
def backend_for_backend_tests(request, monkeypatch):
    from hfgpt.cpu import backend

    module = request.module.__name__.rpartition(".")[2]
    if module in BACKEND_TEST_MODULES:
        backend.install()
        monkeypatch.setattr(backend, "_DEFAULT", True)
    yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Where pytest-xdist's workers take turns (`worksteal`, which `_share_the_long_tests` sets), the tests
    marked `slow` run first, each group in its own order: the workers share out the long tests at the start
    and the short ones at the end, rather than one worker running a long test at the end while the other
    waits. (xdist's `load` hands each worker a run of consecutive tests at the start: the first would get
    every long test.)"""
    if getattr(config.option, "dist", "no") == "worksteal":
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
