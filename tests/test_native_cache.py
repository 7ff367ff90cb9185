"""The C kernels' build cache (cpu/native.py) loads only what this user built: a library that another user
could have put under the expected name (in a folder that others can write to or own, or as a file they
own or can write) is never loaded; the process warns once and builds into a private temporary folder
instead. The cache path is made absolute once, so it never follows the working folder. A library's name
tells apart the compiler commands (`CC` with its arguments) and the extra flags (`HFGPT_CFLAGS`) that
built it; `.ci/as-avx2` builds and runs them as on a CPU with AVX2 but no AVX-512.

"Another user" is uid 12345 where the tests run as root (chown); elsewhere the tests that need chown are
skipped, and the others use a folder that others can write to, which is refused whoever owns it."""

import json
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from kernel_testing import cpu_flags  # tests/ is on sys.path

from hfgpt.cpu import native

needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler to build the kernels with"
)
needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another user needs root"
)
pytestmark = needs_cc

OTHER_UID = 12345

# The kernel cache as this module saw it when pytest imported it, before any fixture ran: test modules
# build kernels at import (`kernels.available()` in their skip conditions), so the session's cache
# (tests/conftest.py) must be set by then, or those land in ~/.cache/hfgpt.
CACHE_DIR_AT_IMPORT = os.environ.get("HFGPT_CACHE_DIR")

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>

__attribute__((constructor)) static void planted(void)
{
    const char *marker = getenv("HFGPT_PLANTED_MARKER");
    if (marker != NULL) {
        FILE *f = fopen(marker, "w");
        if (f != NULL) {
            fputs("the planted library ran\n", f);
            fclose(f);
        }
    }
}
"""


def _clear_caches() -> None:
    native.kernel.cache_clear()
    native._absolute_cache_dir.cache_clear()
    native._private_folder.cache_clear()
    native._instead_of.cache_clear()


@pytest.fixture(autouse=True)
def fresh_native_state(monkeypatch, tmp_path):
    """Each test resolves the cache path, picks its private folder and loads its kernels afresh, with a
    marker path that the planted library's constructor would write."""
    _clear_caches()
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HFGPT_NATIVE", raising=False)
    monkeypatch.setenv("HFGPT_PLANTED_MARKER", str(tmp_path / "planted-library-ran"))
    yield tmp_path / "planted-library-ran"
    _clear_caches()


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory) -> Path:
    """A shared library whose constructor writes the file named by $HFGPT_PLANTED_MARKER."""
    folder = tmp_path_factory.mktemp("planted")
    (folder / "planted.c").write_text(PLANTED_C)
    compiler = [*(os.environ.get("CC") or "cc").split(), "-shared", "-fPIC"]
    subprocess.run([*compiler, "-o", str(folder / "planted.so"), str(folder / "planted.c")], check=True)
    return folder / "planted.so"


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory) -> str:
    """The file name `build("row_product")` looks for in any cache folder (it does not depend on the
    folder)."""
    return native.build("row_product", directory=tmp_path_factory.mktemp("reference-cache")).name


def _plant(planted_library: Path, folder: Path, name: str, owner: int | None = OTHER_UID) -> Path:
    """The planted library copied into `folder` under `name`, owned by `owner` where the tests run as root."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    shutil.copy(planted_library, target)
    if owner is not None and os.geteuid() == 0:
        os.chown(target, owner, owner)
    return target


def _shared_folder(path: Path, mode: int = 0o1777, owner: int | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def _assert_genuine_kernel(library, not_in: Path) -> None:
    """`library` is the row_product kernel built from csrc (it answers its own entry point), not from
    `not_in`."""
    assert library is not None
    assert not Path(library._name).is_relative_to(not_in)
    x, weight = torch.tensor([[1.0, 2.0, -3.0]]), torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 1.0]])
    y = torch.full((1, 2), float("nan"))
    assert library.hfgpt_row_product(x.data_ptr(), weight.data_ptr(), 1, 2, 3, None, y.data_ptr(), 1) == 0
    torch.testing.assert_close(y, x @ weight.T)


def test_a_library_planted_in_a_folder_writable_by_others_is_not_loaded(
    monkeypatch, tmp_path, planted_library, kernel_name, fresh_native_state
):
    """A shared cache folder (1777, as /tmp) holding a library under the expected name: the kernel is built
    into a private temporary folder instead, with one warning naming the folder and the reason."""
    shared = _shared_folder(tmp_path / "shared")
    planted = _plant(planted_library, shared, kernel_name)
    monkeypatch.setenv("HFGPT_CACHE_DIR", str(shared))
    with pytest.warns(
        RuntimeWarning, match=r"does not load C kernels from .*shared: .*writable by others \(mode 1777\)"
    ):
        library = native.kernel("row_product")
    assert not fresh_native_state.exists(), "the planted library's constructor ran"
    _assert_genuine_kernel(library, not_in=shared)
    private = Path(library._name).parent
    assert private == native._private_folder()
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and private.stat().st_uid == os.geteuid()
    assert planted.read_bytes() == planted_library.read_bytes()  # left alone, not loaded
    with pytest.raises(native.NativeBuildError, match=r"refusing to load .*shared.* writable by others"):
        native.load(planted, "row_product")
    assert not fresh_native_state.exists()


def test_the_warning_comes_once_for_all_kernels(monkeypatch, tmp_path):
    shared = _shared_folder(tmp_path / "shared", 0o777)
    monkeypatch.setenv("HFGPT_CACHE_DIR", str(shared))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.kernel("row_product") is not None and native.kernel("int8_linear") is not None
    assert [str(w.message).split(":")[0] for w in caught] == [f"hfgpt does not load C kernels from {shared}"]
    assert list(shared.iterdir()) == []  # nothing was built there either


def test_a_library_replaced_in_a_world_writable_folder_is_not_loaded(
    monkeypatch, tmp_path, planted_library, fresh_native_state
):
    """A cache folder of this user's with mode 0777: the library it built there is replaced by another
    user's, which this process does not load."""
    cache = _shared_folder(tmp_path / "cache", 0o777)
    monkeypatch.setenv("HFGPT_CACHE_DIR", str(cache))
    built = native.build("row_product", directory=native._private_folder())
    _plant(planted_library, cache, built.name)
    with pytest.warns(RuntimeWarning, match=r"writable by others \(mode 777\)"):
        library = native.kernel("row_product")
    assert not fresh_native_state.exists()
    _assert_genuine_kernel(library, not_in=cache)


def test_xdg_cache_home_in_a_shared_folder_gets_a_private_hfgpt_folder(monkeypatch, tmp_path):
    """XDG_CACHE_HOME pointing at a shared sticky folder: hfgpt/ is made there 0700 and used (the sticky
    bit keeps others from renaming or removing it)."""
    shared = _shared_folder(tmp_path / "shared")
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))
    monkeypatch.delenv("HFGPT_CACHE_DIR")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        library = native.kernel("row_product")
    assert Path(library._name).parent == shared / "hfgpt"
    assert stat.S_IMODE((shared / "hfgpt").stat().st_mode) == 0o700


@needs_root
def test_xdg_cache_home_with_another_users_hfgpt_folder_is_not_loaded_from(
    monkeypatch, tmp_path, planted_library, kernel_name, fresh_native_state
):
    """XDG_CACHE_HOME in a shared sticky folder where another user made hfgpt/ first (0755, theirs) and put
    a library in it."""
    shared = _shared_folder(tmp_path / "shared")
    theirs = _shared_folder(shared / "hfgpt", 0o755, owner=OTHER_UID)
    _plant(planted_library, theirs, kernel_name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))
    monkeypatch.delenv("HFGPT_CACHE_DIR")
    with pytest.warns(RuntimeWarning, match=rf"{theirs} is owned by another user \(uid {OTHER_UID}\)"):
        library = native.kernel("row_product")
    assert not fresh_native_state.exists()
    _assert_genuine_kernel(library, not_in=shared)


@needs_root
def test_a_folder_above_the_cache_owned_by_another_user_is_refused(
    monkeypatch, tmp_path, planted_library, kernel_name, fresh_native_state
):
    """A cache folder of this user's (0700) inside another user's folder: they could rename it and put
    their own in its place."""
    theirs = _shared_folder(tmp_path / "alice", 0o755, owner=OTHER_UID)
    cache = _shared_folder(theirs / "cache", 0o700)
    _plant(planted_library, cache, kernel_name, owner=None)
    monkeypatch.setenv("HFGPT_CACHE_DIR", str(cache))
    with pytest.warns(RuntimeWarning, match=rf"{theirs} is owned by another user \(uid {OTHER_UID}\)"):
        library = native.kernel("row_product")
    assert not fresh_native_state.exists()
    _assert_genuine_kernel(library, not_in=theirs)


@needs_root
@pytest.mark.parametrize("problem", ["owner", "mode"])
def test_a_library_file_of_another_user_or_writable_by_others_is_rebuilt(
    monkeypatch, tmp_path, planted_library, kernel_name, fresh_native_state, problem
):
    """A trusted cache folder (this user's, 0700) holding a library file that another user owns, or that
    others can write: it is not loaded but built afresh in its place."""
    cache = _shared_folder(tmp_path / "cache", 0o700)
    planted = _plant(planted_library, cache, kernel_name, owner=OTHER_UID if problem == "owner" else None)
    if problem == "mode":
        os.chmod(planted, 0o757)
    monkeypatch.setenv("HFGPT_CACHE_DIR", str(cache))
    reason = rf"owned by another user \(uid {OTHER_UID}\)" if problem == "owner" else r"writable by others"
    with pytest.warns(RuntimeWarning, match=rf"does not load the C kernel {planted}: it is {reason}"):
        library = native.kernel("row_product")
    assert not fresh_native_state.exists()
    assert library is not None and Path(library._name) == planted
    info = planted.stat()
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o755
    assert planted.read_bytes() != planted_library.read_bytes()


def test_the_folders_it_makes_are_private(monkeypatch, tmp_path):
    """Every missing folder on the way to the cache is made 0700, whatever the umask."""
    monkeypatch.setenv("HFGPT_CACHE_DIR", str(tmp_path / "a" / "b" / "cache"))
    before = os.umask(0o002)
    try:
        library = native.kernel("row_product")
    finally:
        os.umask(before)
    assert Path(library._name).parent == tmp_path / "a" / "b" / "cache"
    for folder in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "cache"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert stat.S_IMODE(Path(library._name).stat().st_mode) == 0o755  # not 0775 under umask 002


def test_a_relative_cache_path_is_made_absolute_once(
    monkeypatch, tmp_path, planted_library, kernel_name, fresh_native_state
):
    """A relative HFGPT_CACHE_DIR is resolved against the working folder of its first use; a later chdir
    (into a folder holding a planted library under that relative path) does not move it."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    _plant(planted_library, second / "kernels", kernel_name, owner=None)
    monkeypatch.setenv("HFGPT_CACHE_DIR", "kernels")
    monkeypatch.chdir(first)
    assert native.cache_dir() == first / "kernels"
    monkeypatch.chdir(second)
    assert native.cache_dir() == first / "kernels"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        library = native.kernel("row_product")
    assert Path(library._name) == first / "kernels" / kernel_name
    assert not fresh_native_state.exists()


def test_a_relative_xdg_cache_home_is_ignored(
    monkeypatch, tmp_path, planted_library, kernel_name, fresh_native_state
):
    """The XDG spec: a relative XDG_CACHE_HOME is invalid and ignored, so ~/.cache/hfgpt is used, not a
    folder below wherever the process runs."""
    _plant(planted_library, tmp_path / "work" / "cache" / "hfgpt", kernel_name, owner=None)
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "cache")
    monkeypatch.delenv("HFGPT_CACHE_DIR")
    assert native.cache_dir() == tmp_path / "home" / ".cache" / "hfgpt"
    library = native.kernel("row_product")
    assert Path(library._name).parent == tmp_path / "home" / ".cache" / "hfgpt"
    assert not fresh_native_state.exists()


def test_without_a_trusted_private_folder_the_kernel_steps_aside(monkeypatch, tmp_path):
    """A refused cache and a TMPDIR that others can write to (not sticky): nothing is built or loaded, and
    callers run torch after one warning."""
    monkeypatch.setenv("HFGPT_CACHE_DIR", str(_shared_folder(tmp_path / "shared", 0o777)))
    monkeypatch.setattr("tempfile.tempdir", str(_shared_folder(tmp_path / "tmp", 0o777)))
    with pytest.warns(
        RuntimeWarning, match=r"(?s)not available.*nor is a private temporary folder .*tmp is writable"
    ):
        assert native.kernel("row_product") is None


def test_kernels_built_while_pytest_imports_the_test_modules_go_to_the_sessions_cache():
    """test_kernel_ops.py builds kernels in its skip conditions, as pytest imports it: the session's
    HFGPT_CACHE_DIR is set before that (pytest_configure), not by a fixture."""
    assert CACHE_DIR_AT_IMPORT is not None, "HFGPT_CACHE_DIR was not set when pytest imported this module"
    assert os.environ["HFGPT_CACHE_DIR"] == CACHE_DIR_AT_IMPORT


def _recording_compiler(folder: Path) -> tuple[Path, Path]:
    """A compiler that runs the real one after appending its arguments to a log, one call a line, each
    argument in brackets; and that log."""
    folder.mkdir(parents=True, exist_ok=True)
    script, log = folder / "recording-cc", folder / "calls.log"
    script.write_text(
        f"#!/bin/sh\nprintf '[%s]' \"$@\" >> {shlex.quote(str(log))}\necho >> {shlex.quote(str(log))}\n"
        f'exec {shlex.join(native._compiler())} "$@"\n'
    )
    os.chmod(script, 0o755)
    return script, log


def test_the_compilers_arguments_are_part_of_the_librarys_name(monkeypatch, tmp_path):
    """`CC="cc -mno-avx512f"` and `CC=cc` are the same compiler (one `--version`) building different code."""
    compiler = shlex.join(native._compiler())
    monkeypatch.setenv("CC", compiler)
    plain = native.build("row_product", directory=tmp_path)
    monkeypatch.setenv("CC", f"{compiler} -DHFGPT_UNUSED_MACRO=1")
    with_argument = native.build("row_product", directory=tmp_path)
    assert with_argument != plain and plain.exists() and with_argument.exists()
    assert native.build("row_product", directory=tmp_path) == with_argument  # (and found again)


def test_hfgpt_cflags_follow_hfgpts_flags_and_name_the_library(monkeypatch, tmp_path):
    """HFGPT_CFLAGS is split as a shell would and placed after FLAGS, in `build(name)` only: a caller's
    explicit flags (tests/kernel_testing.py's narrow builds) are compiled as given."""
    monkeypatch.delenv("HFGPT_CFLAGS", raising=False)
    script, log = _recording_compiler(tmp_path / "bin")
    monkeypatch.setenv("CC", str(script))
    plain = native.build("row_product", directory=tmp_path / "cache")
    monkeypatch.setenv("HFGPT_CFLAGS", "-DHFGPT_UNUSED_MACRO='two words' -O2")
    extra = native.build("row_product", directory=tmp_path / "cache")
    explicit = native.build("row_product", native.FLAGS, directory=tmp_path / "cache")
    assert extra != plain and explicit == plain
    compiles = [line for line in log.read_text().splitlines() if "[-o]" in line]
    flags = "".join(f"[{flag}]" for flag in native.FLAGS)
    assert len(compiles) == 2  # the explicit build found the plain one's library
    assert compiles[0].startswith(f"{flags}[-o]")
    assert compiles[1].startswith(f"{flags}[-DHFGPT_UNUSED_MACRO=two words][-O2][-o]")


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= cpu_flags(),
    reason="-march=x86-64-v3 needs an x86-64 CPU with AVX2 and FMA to run",
)
def test_hfgpt_cflags_march_builds_the_kernels_for_a_narrower_cpu(monkeypatch, tmp_path):
    """`HFGPT_CFLAGS=-march=x86-64-v3` overrides FLAGS' -march=native (the last -march wins): the int8
    kernel that `kernel()` loads has the AVX2 path (1), whatever this CPU has beyond it (AVX-VNNI: 2,
    AVX-512 VNNI: 3; x86-64-v3 has neither)."""
    monkeypatch.setenv("HFGPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HFGPT_CFLAGS", "-march=x86-64-v3")
    library = native.kernel("int8_linear")
    assert library is not None
    assert library.hfgpt_int8_vectorized() == 1


def test_a_bad_hfgpt_cflag_is_reported_with_the_command(monkeypatch, tmp_path):
    monkeypatch.setenv("HFGPT_CFLAGS", "--no-such-hfgpt-flag")
    with pytest.raises(
        native.NativeBuildError,
        match=r"(?s)^`.* -fPIC --no-such-hfgpt-flag -o .*row_product\.c` failed \(exit \d+\):.*",
    ):
        native.build("row_product", directory=tmp_path)
    monkeypatch.setenv("HFGPT_CACHE_DIR", str(tmp_path))
    with pytest.warns(RuntimeWarning, match=r"C kernel row_product is not available.*--no-such-hfgpt-flag"):
        assert native.kernel("row_product") is None
    monkeypatch.setenv("HFGPT_CFLAGS", "-DX='unclosed")
    with pytest.raises(native.NativeBuildError, match=r"HFGPT_CFLAGS=.*unclosed.* cannot be split"):
        native.build("row_product", directory=tmp_path)


AS_AVX2 = Path(__file__).resolve().parent.parent / ".ci" / "as-avx2"


def hidden_by_as_avx2(flag: str) -> bool:
    """Whether .ci/as-avx2 takes `flag` out of /proc/cpuinfo (what no AVX2-only x86-64 CPU has)."""
    return flag.startswith(("avx512", "amx", "avx_vnni")) or flag in ("avx_ifma", "avx_ne_convert")


AS_AVX2_PROBE = textwrap.dedent(
    """
    import json, os, torch
    from hfgpt.cpu import native

    library = native.kernel("int8_linear")
    print(json.dumps({
        "capability": torch.backends.cpu.get_cpu_capability(),
        "cpuinfo": open("/proc/cpuinfo").read(),
        "cflags": os.environ.get("HFGPT_CFLAGS"),
        "int8_path": None if library is None else library.hfgpt_int8_vectorized(),
    }))
    """
)


def _mount_namespace_refusal() -> str | None:
    """Why this process may not enter a private mount namespace as .ci/as-avx2 does, or None."""
    if shutil.which("unshare") is None:
        return "no unshare (util-linux) on PATH"
    command = ["unshare", "--mount", *([] if os.geteuid() == 0 else ["--map-root-user"]), "true"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if run.returncode != 0:
        return f"`{shlex.join(command)}` is not permitted here: {run.stderr.strip()}"
    return None


@pytest.mark.slow
@pytest.mark.skipif(
    platform.machine() != "x86_64" or not {"avx2", "fma"} <= cpu_flags(),
    reason=".ci/as-avx2 needs an x86-64 CPU with AVX2 and FMA",
)
def test_as_avx2_runs_a_command_as_on_a_cpu_without_avx512(tmp_path):
    """Under .ci/as-avx2, torch dispatches to its AVX2 kernels, /proc/cpuinfo lists no AVX-512, AMX or
    AVX-VNNI flag (its other lines are the real file's), and hfgpt builds its int8 kernel's AVX2 path
    (where the tests run as root: as another user, the namespace shows root's folders as nobody's, which
    the kernel cache refuses)."""
    refusal = _mount_namespace_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    run = subprocess.run(
        [str(AS_AVX2), sys.executable, "-c", AS_AVX2_PROBE],
        env={**os.environ, "HFGPT_CACHE_DIR": str(tmp_path), "HFGPT_CFLAGS": "-g"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    inside = json.loads(run.stdout.splitlines()[-1])
    assert inside["capability"] == "AVX2"
    assert inside["cflags"] == "-march=x86-64-v3 -g"  # the caller's flags after the script's

    def flags_and_rest(cpuinfo: str) -> tuple[list[set[str]], list[str]]:
        lines = cpuinfo.splitlines()
        flags = [set(line.partition(":")[2].split()) for line in lines if line.startswith("flags")]
        return flags, [line for line in lines if not line.startswith(("flags", "cpu MHz"))]

    flags, rest = flags_and_rest(inside["cpuinfo"])
    real_flags, real_rest = flags_and_rest(Path("/proc/cpuinfo").read_text())
    assert rest == real_rest and len(flags) == len(real_flags) > 0
    for processor, real in zip(flags, real_flags, strict=True):
        dropped = {flag for flag in real if hidden_by_as_avx2(flag)}
        assert {"avx2", "fma"} <= processor and not processor & dropped
        assert real - processor <= dropped
    if os.geteuid() == 0:
        assert inside["int8_path"] == 1
