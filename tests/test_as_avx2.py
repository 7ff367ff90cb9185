"""The kernel tests run again as on an x86-64 CPU with AVX2 but no AVX-512 (`.ci/as-avx2`).

The machines that run this suite have AVX-512 and AMX; many users' CPUs have AVX2 alone. There hfgpt's
kernels are built for 8-lane vectors, the int8 products take their AVX2 path, and torch, oneDNN and MKL
stop at AVX2. The narrower builds
are also compared with the native one inside each kernel module (`kernel_testing.narrow_build`); this
runs whole modules in that configuration, where every test passes and the only skips are the int8
paths whose instructions such a CPU lacks. On a CPU that has none of the flags the script hides (AVX2 is
its widest), the suite's own run of these modules is that run, and this one is skipped rather than repeated.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_testing import cpu_flags  # tests/ is on sys.path
from test_native_cache import AS_AVX2, _mount_namespace_refusal, hidden_by_as_avx2

ROOT = Path(__file__).resolve().parent.parent
MODULES = [
    "tests/test_row_product_kernel.py",
    "tests/test_int8_kernel.py",
    "tests/test_int8_block.py",
    "tests/test_int8_step.py",
    "tests/test_float_step.py",
    "tests/test_kernel_ops.py",
    "tests/test_quantization.py",
    "tests/test_backend.py",
    "tests/test_kv_cache.py",
]
# Tests of those modules that no ISA changes: the paged cache's loop (the backend's step declines it) and the
# environment switch (a setting read at import).
NOT_AGAIN = [
    "tests/test_kv_cache.py::test_continuous_batching_gives_the_tokens_of_generate",
    "tests/test_backend.py::test_the_environment_switch",
]
# The skips such a CPU is expected to give: the int8 paths that need AVX-512 VNNI or AVX-VNNI.
EXPECTED_SKIP = re.compile(r"the (avx512_vnni|avx_vnni) path needs a CPU with [a-z0-9_, ]+$")


def test_the_kernel_modules_pass_as_on_an_avx2_cpu(tmp_path):
    if not any(hidden_by_as_avx2(flag) for flag in cpu_flags()):
        pytest.skip(
            "this CPU has no flag that .ci/as-avx2 hides: the suite's own run of these modules is the AVX2 run"
        )
    refusal = _mount_namespace_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    if os.geteuid() != 0:
        pytest.skip("as a user other than root, .ci/as-avx2's namespace shows root's folders as nobody's")
    environment = {
        **{
            key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_", "HFGPT_CFLAGS"))
        },
        "HFGPT_CACHE_DIR": str(tmp_path / "kernels"),
    }
    run = subprocess.run(
        [
            str(AS_AVX2),
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            *MODULES,
            *(f"--deselect={test}" for test in NOT_AGAIN),
        ],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    skips = re.findall(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", output, flags=re.MULTILINE)
    assert all(EXPECTED_SKIP.match(reason) for _, reason in skips), skips
    assert sum(int(count) for count, _ in skips) <= 6
    assert re.search(r"\b\d+ passed\b", output.splitlines()[-1]), output[-2000:]
