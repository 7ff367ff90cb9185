"""hfgpt's C kernels built for arm64 Linux (aarch64, NEON) on any host, by Zig's Clang as a cross compiler
(the `ziglang` package, which `hfgpt[test]` installs).

The suite runs the kernels on this host's x86-64 builds (native, x86-64-v3 and the SSE2 baseline). An arm64
user is the first to compile them for arm64, with that CPU's `-march=native`: these tests make that build
here, with hfgpt's own flags (`native.FLAGS`) and the arm64 baseline (`-mcpu=generic`, NEON), and check that
every source compiles without a warning, exports every entry point that `hfgpt.cpu.native` loads, and
turns its float loops into NEON vector instructions. No arm64 CPU runs them here: the values are tested
on the x86-64 builds of the same portable source (4-lane vectors in the baseline build, as NEON's)."""

import functools
import re
import subprocess
import sys

import pytest

from hfgpt.cpu import native

pytest.importorskip("ziglang")

# The kernels whose float arithmetic runs on `vector_math.h`'s vectors.
FLOAT_KERNELS = ("row_product", "int8_linear")

# csrc/row_product.c includes <omp.h> for its two thread-number queries; Zig ships no OpenMP header, so the
# build gets these declarations (OpenMP's own) in its place.
OMP_DECLARATIONS = "int omp_get_thread_num(void);\nint omp_get_num_threads(void);\n"


@pytest.fixture(scope="module")
def arm64_assembly(tmp_path_factory):
    """csrc/{name}.c compiled for aarch64 Linux with hfgpt's flags (-march=native made the arm64
    baseline; assembly instead of a library: the cross build has no arm64 OpenMP runtime to link), once per
    kernel for the module, or a failure naming the compiler's messages, warnings included."""
    directory = tmp_path_factory.mktemp("arm64")
    (directory / "omp.h").write_text(OMP_DECLARATIONS)
    flags = [f for f in native.FLAGS if f not in ("-march=native", "-shared")]

    @functools.cache
    def build(name: str) -> str:
        out = directory / f"{name}.s"
        command = [
            sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-gnu", "-mcpu=generic",
            *flags, "-Wall", "-Wextra", "-Wno-unused-command-line-argument", "-I", str(directory), "-S",
            str(native.SOURCE_DIR / f"{name}.c"), "-o", str(out),
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0 and not result.stderr.strip(), (
            f"csrc/{name}.c for aarch64: {' '.join(command)}\n{result.stderr}"
        )
        return out.read_text()

    return build


@pytest.mark.parametrize("name", sorted(native.SIGNATURES))
def test_kernel_compiles_for_arm64_with_its_entry_points(name, arm64_assembly):
    assembly = arm64_assembly(name)
    exported = set(re.findall(r"^\s*\.globl\s+(\w+)", assembly, flags=re.MULTILINE))
    missing = set(native.SIGNATURES[name]) - exported
    assert not missing, f"csrc/{name}.c built for aarch64 lacks {sorted(missing)}"


@pytest.mark.parametrize("name", FLOAT_KERNELS)
def test_float_kernel_is_neon_vector_code_on_arm64(name, arm64_assembly):
    assembly = arm64_assembly(name)
    # NEON's fused multiply-adds and products on four float lanes (v0.4s ...), as vector_math.h's `vf`.
    vector_arithmetic = re.findall(r"^\s*(fmla|fmul|fadd|fmax)\s+v\d+\.4s", assembly, flags=re.MULTILINE)
    assert len(vector_arithmetic) >= 8, f"csrc/{name}.c: {len(vector_arithmetic)} NEON float vector ops"
