"""`keep_freed_memory` (hfgpt.cpu.runtime) and the training command lines that apply it."""

import platform
import subprocess
import sys
import textwrap

import pytest

from hfgpt.cpu import runtime as cpu_runtime
from hfgpt.scripts import finetune_classification, train_lm

# Allocates, fills and frees a 64 MB tensor 40 times and prints the page faults of each round. With freed
# memory kept, the first rounds still fault: small allocations made in between can land in the freed block,
# so the heap grows until a free block large enough stays (after at most 8 rounds in 100 runs here). The
# last ten rounds are the steady state a training loop lives in. (The module is loaded from its file: the
# package's import, transformers' included, would add 10 seconds a process and nothing to what is measured.)
SCRIPT = textwrap.dedent(
    """
    import importlib.util, resource, sys, torch
    spec = importlib.util.spec_from_file_location("runtime", sys.argv[2])
    runtime = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runtime)
    applied = runtime.keep_freed_memory() if sys.argv[1] == "keep" else None
    def faults_of_a_fresh_64_mb_tensor():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(16 << 20)  # filled, then freed at once
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(applied, *(faults_of_a_fresh_64_mb_tensor() for _ in range(40)))
    """
)


def faults_in_a_fresh_process(mode: str) -> tuple[str, list[int]]:
    argv = [sys.executable, "-c", SCRIPT, mode, cpu_runtime.__file__]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    applied, *faults = out.stdout.split()
    return applied, [int(f) for f in faults]


@pytest.mark.slow
@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"),
    reason="mallopt is glibc's: elsewhere keep_freed_memory returns False (tested below)",
)
def test_keep_freed_memory_reuses_freed_blocks_without_page_faults():
    _, default_faults = faults_in_a_fresh_process("default")
    applied, kept_faults = faults_in_a_fresh_process("keep")
    assert applied == "True"
    assert all(f >= 8000 for f in default_faults[-10:])  # 64 MB of 4 KB pages mapped afresh: ~16,000
    assert sum(kept_faults[-10:]) < 1000


def test_keep_freed_memory_is_false_without_glibc(monkeypatch):
    monkeypatch.setattr(cpu_runtime.sys, "platform", "darwin")
    assert cpu_runtime.keep_freed_memory() is False


@pytest.mark.parametrize("script", [train_lm, finetune_classification])
@pytest.mark.parametrize("flag", [[], ["--keep_freed_memory", "false"]])
def test_training_command_lines_keep_freed_memory_on_the_cpu_unless_told_not_to(
    script, flag, keep_freed_memory_calls, tmp_path, capsys
):
    # A missing data file: main() refuses it (exit 2) after applying the setting, before any training.
    data = ["--train_file", str(tmp_path / "missing.txt")]
    if script is finetune_classification:
        data += ["--task", "classification"]
    argv = ["--output_dir", str(tmp_path / "out"), "--use_cpu", "true", *data, *flag]
    assert script.main(argv) == 2
    assert keep_freed_memory_calls == ([] if flag else [True])
