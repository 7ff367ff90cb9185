"""transformers' own common model tests on hfgpt's classes, with the CPU backend on as users get it.

transformers' wheel carries no tests; its source distribution carries tests/test_modeling_common.py, whose
`ModelTesterMixin` is what every model of its repository must pass (save and load, attention dispatch
between sdpa and eager, `attn_implementation` as asked, gradient checkpointing, resizing embeddings, the
cache's argument name, ...). This test fetches the source distribution of the installed transformers from
the package index (pip download), runs that file's tests on hfgpt's six heads in both block orders
(tests/transformers_common_tester.py) and checks that none fails.

The source distribution lacks the mixins that test_modeling_common.py imports from tests/generation and
tests/exporters (generate() and torch.export tests): they are stood in for by empty classes, so those
tests are not among the ones run here (hfgpt's generation is tested in test_modeling, test_kv_cache and
test_compiled_decoding). Without a reachable package index the test is skipped, naming what it could not
fetch; CI reaches one.
"""

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

TESTER = Path(__file__).with_name("transformers_common_tester.py")
VERSION = importlib.metadata.version("transformers")
# Tests of the mixin that each block order must pass (not skip), where the installed version has them.
MUST_PASS = (
    "test_sdpa_can_dispatch_non_composite_models",
    "test_bc_cache_name_forward",
    "test_save_load",
    "test_training",
    "test_training_gradient_checkpointing",
    "test_resize_tokens_embeddings",
    "test_attention_outputs",
    "test_hidden_states_output",
    "test_model_is_small",
)


def fetch_source_distribution(folder: Path, project: str = "transformers", version: str = VERSION) -> Path:
    """`project`==`version`'s source distribution (by default the installed transformers'), downloaded into
    `folder`; skips the test, naming what it could not fetch, where the package index cannot be reached.
    tests/test_ecosystem.py fetches llama-cpp-python's this way too."""
    # `--no-binary` names the project alone: `:all:` would make pip build the tools that read the archive's
    # metadata (scikit-build-core, setuptools, ...) from their sources too, minutes on a machine without
    # pip's cache.
    what = f"{project}=={version}'s source distribution"
    pip_or_skip(
        ["download", "--no-deps", "--no-binary", project, "--dest", str(folder), f"{project}=={version}"],
        what,
    )
    # The archive's name is the project's, normalised (llama-cpp-python -> llama_cpp_python-0.3.36.tar.gz).
    archives = list(folder.glob(f"{re.sub(r'[-_.]+', '_', project)}-{version}.tar.gz"))
    archives += list(folder.glob(f"{project}-{version}.tar.gz"))
    if not archives:
        pytest.skip(f"{what} not fetched: no archive")
    return archives[0]


def pip_or_skip(arguments: list[str], what: str) -> None:
    """`pip <arguments>` against the package index; skips the test, naming `what` and pip's last line, where
    it fails (an unreachable index fails within minutes)."""
    command = [sys.executable, "-m", "pip", *arguments, "--quiet", "--retries", "2", "--timeout", "30"]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no reason given"])[-1]
        pytest.skip(f"{what} not fetched: {reason}")


def stub_missing_mixins(tests: Path) -> list[str]:
    """For each module that test_modeling_common.py imports from its own tests folder and the source
    distribution lacks, a stand-in defining each imported name as an empty class; returns their names."""
    tree = ast.parse((tests / "test_modeling_common.py").read_text())
    stubbed = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level != 1 or node.module is None:
            continue
        path = tests.joinpath(*node.module.split(".")).with_suffix(".py")
        if path.exists():
            continue
        for parent in [p for p in path.relative_to(tests).parents if p != Path(".")]:
            (tests / parent).mkdir(exist_ok=True)
            (tests / parent / "__init__.py").touch()
        path.write_text("".join(f"class {alias.name}:\n    pass\n\n\n" for alias in node.names))
        stubbed.append(node.module)
    return stubbed


@pytest.fixture(scope="module")
def transformers_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A package holding transformers' top-level test modules, the stand-ins, and hfgpt's tester as a
    test module of its own."""
    root = tmp_path_factory.mktemp("transformers-common")
    archive = fetch_source_distribution(root)
    tests = root / "package" / "tests"
    tests.mkdir(parents=True)
    prefix = f"transformers-{VERSION}/tests/"
    with tarfile.open(archive) as sdist:
        for member in sdist.getmembers():
            name = member.name.removeprefix(prefix)
            if (
                member.isfile()
                and member.name.startswith(prefix)
                and "/" not in name
                and name.endswith(".py")
            ):
                (tests / name).write_bytes(sdist.extractfile(member).read())
    assert (tests / "test_modeling_common.py").exists(), (
        f"{archive.name} has no tests/test_modeling_common.py"
    )
    (tests / "__init__.py").touch()
    stubbed = stub_missing_mixins(tests)
    assert set(stubbed) <= {"generation.test_utils", "exporters.test_export"}, (
        f"transformers {VERSION}'s test_modeling_common.py imports test modules its source lacks: {stubbed}"
    )
    shutil.copy(TESTER, tests / "test_hfgpt_common.py")
    return tests


@pytest.mark.slow
def test_hfgpt_passes_transformers_common_model_tests(transformers_tests: Path) -> None:
    # (-rA: a line per test with its outcome; a test whose subtests partly skip, one per head, still passes)
    command = [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "tests/test_hfgpt_common.py"]
    done = subprocess.run(
        command, cwd=transformers_tests.parent, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, f"transformers {VERSION}'s common tests failed:\n{done.stdout[-6000:]}"
    passed = set(re.findall(r"^PASSED tests/test_hfgpt_common\.py::(\w+)::(\w+)", done.stdout, flags=re.M))
    assert len(passed) >= 100, (
        f"only {len(passed)} of transformers' common tests passed:\n{done.stdout[-3000:]}"
    )
    source = (transformers_tests / "test_modeling_common.py").read_text()
    for name in (name for name in MUST_PASS if f"def {name}(" in source):
        for block_order in ("GPT2CommonTest", "GPT1CommonTest"):
            assert (block_order, name) in passed, f"{block_order}.{name} did not pass"
