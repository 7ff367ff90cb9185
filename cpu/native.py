"""hfgpt's C kernels (`cpu/csrc/`), built on first use with the machine's C compiler and loaded with ctypes:
no build step at install time and no torch headers (docs/cpu-backend.md, "The C kernels"); `hfgpt.cpu.kernels`
makes their entry points torch operators.

A library's name hashes its source, csrc's headers (a changed header rebuilds every kernel), the flags, the
compiler command and version and the CPU's flags, so another source, compiler, setting or machine sharing the
cache folder builds its own copy. It is written under a temporary name and renamed into place, so that two
processes building at once (pytest-xdist) never load a half-written file. `HFGPT_CFLAGS` (split as a shell
would) follows hfgpt's flags so that it wins where they conflict (GCC and Clang take the last `-march`): e.g.
`-march=x86-64-v3` for the oldest CPU of a fleet sharing one cache, or `.ci/as-avx2`.

Loading a library runs its code, so the cache is trusted only as a careful build cache would be (OpenSSH's
StrictModes): folders made 0700, owned by this user or root and writable by no one else (`_refusal` has the
exceptions). Otherwise one warning names the path and the reason, and this process builds into a private
temporary folder (mkdtemp, removed at exit).

OpenMP calls use torch's runtime where both are GNU's (`libgomp.so.1`): one pool of threads; clang's libomp
works, with a second pool. Without a compiler, `kernel()` returns None after one warning and callers run
torch; `HFGPT_NATIVE=0` (read at the first call) does the same without a warning.
"""

import atexit
import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch  # noqa: F401  (loaded first: its OpenMP runtime is the one the libraries share)

SOURCE_DIR = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LAYOUT_VERSION = 2  # hfgpt_int8_layout_version() of csrc/int8_linear.c

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# A whole decoding step (csrc/decode_step.h), int8 or float32: ids, positions, wte, wpe, rows, n, heads, inner,
# layers, pre_norm, eps, scalings, layer pointers, key buffers, value buffers, capacities, past, mask, mask
# stride, ln_f weight, bias, eps, y, threads
_DECODE_STEP = (
    _INT,
    [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT, _F32, _P, _P, _P, _P, _P]
    + [_I64, _P, _I64, _P, _P, _F32, _P, _INT],
)
# name -> (restype, argtypes) of every function a library must export
SIGNATURES = {
    "int8_linear": {
        "hfgpt_int8_layout_version": (_INT, []),
        "hfgpt_int8_vectorized": (_INT, []),
        # x, rows, ldx, in, inp, xq, sx, qsum
        "hfgpt_int8_quantize_rows": (None, [_P, _I64, _I64, _I64, _I64, _P, _P, _P]),
        # x, rows, ldx, in, packed w, out, inp, scale, bias, y, ldy, threads
        "hfgpt_int8_linear": (_INT, [_P, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _P, _I64, _INT]),
        "hfgpt_int8_fused_available": (_INT, []),
        # x, rows, in, ln weight, ln bias, eps, packed w, out, inp, scale, bias, y, threads
        "hfgpt_int8_norm_linear": (_INT, [_P, _I64, _I64, _P, _P, _F32, _P, _I64, _I64, _P, _P, _P, _INT]),
        # attn, h, y, rows, n, pre_norm, ln_1 weight, bias, ln_2 weight, bias, eps,
        # c_proj (w, inp, scale, bias), c_fc (w, out, inp, scale, bias), mlp c_proj (w, inp, scale, bias), threads
        "hfgpt_int8_block_tail": (
            _INT,
            [_P, _P, _P, _I64, _I64, _INT, _P, _P, _P, _P, _F32]
            + [_P, _I64, _P, _P, _P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _INT],
        ),
        "hfgpt_int8_decode_step": _DECODE_STEP,
    },
    "row_product": {
        # x, w, out, in, bias, y, threads (bfloat16 x, w, bias and y)
        "hfgpt_row_product_bf16": (_INT, [_P, _P, _I64, _I64, _P, _P, _INT]),
        # x, w, rows, out, in, bias, y, threads
        "hfgpt_row_product": (_INT, [_P, _P, _I64, _I64, _I64, _P, _P, _INT]),
        "hfgpt_float_decode_step": _DECODE_STEP,
    },
}


class NativeBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    """Where the compiled libraries go: `$HFGPT_CACHE_DIR`, else `$XDG_CACHE_HOME/hfgpt` (an absolute one
    only, as the XDG spec asks), else `~/.cache/hfgpt`. Made absolute once per setting, against the working
    folder of its first use, so that a later chdir never moves the cache."""
    return _absolute_cache_dir(
        os.environ.get("HFGPT_CACHE_DIR", ""), os.environ.get("XDG_CACHE_HOME", ""), os.path.expanduser("~")
    )


@functools.cache
def _absolute_cache_dir(configured: str, xdg_cache_home: str, home: str) -> Path:
    if configured:
        return Path(os.path.abspath(os.path.expanduser(configured)))
    if os.path.isabs(xdg_cache_home):
        return Path(os.path.abspath(xdg_cache_home)) / "hfgpt"
    return Path(os.path.abspath(os.path.join(home, ".cache", "hfgpt")))


class _Untrusted(Exception):
    """A path this process must not load a library from: `path`, and `reason` (a phrase)."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path} {reason}")
        self.path, self.reason = path, reason


# Ownership and modes are POSIX's; elsewhere (Windows) the checks below pass everything.
_POSIX = hasattr(os, "geteuid")


@functools.cache
def _private_group(gid: int) -> bool:
    """Whether `gid` is this user's private group (Debian's, Ubuntu's, Fedora's, which a umask of 002 leaves
    writable): the user's primary group, named as the user, with no other listed member."""
    import grp
    import pwd

    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == os.getegid() and group.gr_name == user and set(group.gr_mem) <= {user}


def _refusal(info: os.stat_result, holds_libraries: bool) -> str | None:
    """Why a folder (or, with `holds_libraries`, the cache folder or a library in it) is not to be trusted,
    or None: another user than this one and root owns it, or others can write to it. A folder above the
    cache may be so where it is sticky (/tmp: no one else may rename or remove what this user made in it);
    the cache folder may not: anyone could put a library there under the name `build` looks for."""
    if info.st_uid not in (os.geteuid(), 0):
        return f"is owned by another user (uid {info.st_uid})"
    mode = info.st_mode
    writable = bool(mode & stat.S_IWOTH) or bool(mode & stat.S_IWGRP and not _private_group(info.st_gid))
    if writable and (holds_libraries or not mode & stat.S_ISVTX):
        who = "others" if mode & stat.S_IWOTH else f"group {info.st_gid}"
        return f"is writable by {who} (mode {stat.S_IMODE(mode):o})"
    return None


def _trusted_folder(directory: Path, create: bool) -> Path:
    """`directory` with its symbolic links resolved, checked from the root down (and, with `create`, its
    missing folders made 0700 on the way). Raises `_Untrusted` for the first folder that fails `_refusal`,
    `NativeBuildError` where a folder cannot be made."""
    path = Path(os.path.realpath(directory))
    if not _POSIX:
        if create:
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise NativeBuildError(f"cannot write the compiled kernel into {path}: {error}") from error
        return path
    folders = [*reversed(path.parents), path]
    for folder in folders:
        try:
            info = os.lstat(folder)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:  # made by someone else in between: checked below as any other
                pass
            except OSError as error:
                raise NativeBuildError(f"cannot write the compiled kernel into {path}: {error}") from error
            info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode):  # (a symbolic link here appeared after realpath)
            raise _Untrusted(folder, "is not a folder")
        reason = _refusal(info, holds_libraries=folder == path)
        if reason is not None:
            raise _Untrusted(folder, reason)
    return path


def _library_refusal(path: Path) -> str | None:
    """Why the library file `path` (in a trusted folder) is not to be loaded, or None."""
    if not _POSIX:
        return None
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    return _refusal(info, holds_libraries=True)


@functools.cache
def _private_folder() -> Path:
    """This process's own build folder (mkdtemp: 0700, a name no one can predict), removed at exit; raises
    `_Untrusted` where even it fails the checks (a TMPDIR that another user controls)."""
    path = Path(tempfile.mkdtemp(prefix="hfgpt-kernels-"))
    atexit.register(shutil.rmtree, path, True)
    return _trusted_folder(path, create=False)


@functools.cache
def _instead_of(directory: Path, refusal: str) -> Path:
    """The private folder to build into instead of the refused cache `directory`, with one warning per
    cache folder and reason."""
    try:
        private = _private_folder()
    except _Untrusted as error:
        raise NativeBuildError(
            f"the kernel cache {directory} is not safe to load from ({refusal}), nor is a private temporary "
            f"folder ({error})"
        ) from error
    warnings.warn(
        f"hfgpt does not load C kernels from {directory}: {refusal}, so another user could put code there "
        f"that this process would run. This process builds them into the private folder {private} "
        "instead (make the cache folder this user's and writable by it alone, e.g. `chmod 700`, or set "
        "HFGPT_CACHE_DIR to such a folder)", RuntimeWarning, stacklevel=4,
    )  # fmt: skip
    return private


def _build_folder(directory: Path) -> Path:
    """`directory` made and checked (`_trusted_folder`), or the private folder where it fails."""
    try:
        return _trusted_folder(directory, create=True)
    except _Untrusted as error:
        return _instead_of(Path(os.path.abspath(directory)), str(error))


def _split(variable: str) -> list[str]:
    """The environment variable `variable` split as a shell would; `NativeBuildError` where it cannot be
    (an unclosed quote)."""
    try:
        return shlex.split(os.environ.get(variable, ""))
    except ValueError as error:
        raise NativeBuildError(
            f"{variable}={os.environ[variable]!r} cannot be split into words: {error}"
        ) from error


def _compiler() -> list[str]:
    return _split("CC") or ["cc"]


def _extra_flags() -> tuple[str, ...]:
    """`$HFGPT_CFLAGS`: compiler flags after `FLAGS`, in the builds that `kernel()` makes."""
    return tuple(_split("HFGPT_CFLAGS"))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build(name: str, flags: tuple[str, ...] | None = None, directory: Path | None = None) -> Path:
    """Compile `csrc/{name}.c` (once per source, flags, compiler and CPU) and return the library's path.
    `flags` None: `FLAGS` followed by `$HFGPT_CFLAGS`; otherwise exactly `flags`. Raises
    `NativeBuildError` naming the command and the compiler's message."""
    source = SOURCE_DIR / f"{name}.c"
    compiler = _compiler()
    flags = (*FLAGS, *_extra_flags()) if flags is None else tuple(flags)
    if shutil.which(compiler[0]) is None:
        raise NativeBuildError(f"no C compiler: {compiler[0]!r} is not on PATH (set CC to use another one)")
    try:
        version = subprocess.run(
            [*compiler, "--version"], capture_output=True, text=True, errors="replace", timeout=60
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeBuildError(f"{' '.join(compiler)} --version failed: {error}") from error
    key = hashlib.sha256()
    for part in (
        source.read_bytes(),
        *(header.read_bytes() for header in sorted(SOURCE_DIR.glob("*.h"))),
        shlex.join(flags).encode(),
        shlex.join(compiler).encode(),
        "".join(version).encode(),
        _cpu_flags().encode(),
    ):
        key.update(part)
        key.update(b"\0")
    directory = _build_folder(cache_dir() if directory is None else directory)
    target = directory / f"{name}-{platform.machine()}-{key.hexdigest()[:16]}.so"
    if os.path.lexists(target):
        refusal = _library_refusal(target)
        if refusal is None:
            return target
        warnings.warn(
            f"hfgpt does not load the C kernel {target}: it {refusal}; building it afresh in its place",
            RuntimeWarning, stacklevel=3,
        )  # fmt: skip
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=directory)
        os.close(fd)
    except OSError as error:
        raise NativeBuildError(f"cannot write the compiled kernel into {directory}: {error}") from error
    command = [*compiler, *flags, "-o", tmp, str(source)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=300)
        if result.returncode != 0:
            message = "\n".join((result.stderr or result.stdout).strip().splitlines()[-12:])
            raise NativeBuildError(f"`{' '.join(command)}` failed (exit {result.returncode}):\n{message}")
        os.chmod(tmp, 0o755)  # (the linker makes its output with the umask's mode: 0775 under umask 002)
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeBuildError(f"`{' '.join(command)}` failed: {error}") from error
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(path: Path, name: str) -> ctypes.CDLL:
    """Load a library built by `build(name)` and declare its functions; checks the int8 weight layout.
    Raises `NativeBuildError` where the file or a folder above it fails the cache's checks."""
    path = Path(os.path.realpath(path))
    try:
        _trusted_folder(path.parent, create=False)
        refusal = _library_refusal(path)
    except _Untrusted as error:
        raise NativeBuildError(f"refusing to load {path}: {error}") from error
    if refusal is not None:
        raise NativeBuildError(f"refusing to load {path}: it {refusal}")
    library = ctypes.CDLL(str(path))  # (after torch: its OpenMP runtime is loaded, for the library to share)
    for function, (restype, argtypes) in SIGNATURES[name].items():
        getattr(library, function).restype = restype
        getattr(library, function).argtypes = argtypes
    if name == "int8_linear" and library.hfgpt_int8_layout_version() != LAYOUT_VERSION:
        raise NativeBuildError(
            f"{path} packs weights in layout {library.hfgpt_int8_layout_version()}, not {LAYOUT_VERSION}"
        )
    return library


@functools.cache
def kernel(name: str) -> ctypes.CDLL | None:
    """The library `csrc/{name}.c`, built if needed; None (with one warning) where it cannot be built or
    `HFGPT_NATIVE=0`."""
    if os.environ.get("HFGPT_NATIVE", "1") == "0":
        return None
    try:
        return load(build(name), name)
    except (NativeBuildError, OSError, AttributeError) as error:
        warnings.warn(
            f"hfgpt's C kernel {name} is not available, so the slower torch implementation of the same "
            f"arithmetic runs instead: {error}", RuntimeWarning, stacklevel=2,
        )  # fmt: skip
        return None


__all__ = ["NativeBuildError", "build", "cache_dir", "kernel", "load"]
