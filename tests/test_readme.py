"""The README and docs/ stay true: short and for users, their links resolve, their tables agree with the
code and the figures they describe, and their code blocks run.

The code blocks run offline, in order, in a working folder laid out as a user's would be: OpenAI's
releases in `models/124M` and `finetune-transformer-lm/model` (the tiny fixture releases of
tests/fixtures), a small corpus and CSV files for the training examples, and a Hub on 127.0.0.1
(tests/hub_server.py) that holds `openai-community/gpt2` (the GPT-2 fixture converted to transformers'
layout) and accepts pushes to `you/...`. The only edits to the blocks are listed in `SUBSTITUTIONS`.
Each Python block, and each shell line that calls one of hfgpt's commands, runs in a forked copy of one
interpreter that imported torch and transformers (not hfgpt) in that environment (tests/preloaded_python.py):
as a fresh interpreter would run it, less the seconds of those imports; other shell lines run in bash.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import random
import re
import select
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import bench_model  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
import pytest
from huggingface_hub import HfApi

from hfgpt.modeling import PRESETS, GPTConfig
from hfgpt.modeling.openai_release import GPT1_EMBEDDING_MAP, GPT1_LAYER_MAP, GPT2_WEIGHT_MAP
from hfgpt.scripts.convert_openai_checkpoint import convert_openai_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from hub_server import HubServer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FIXTURES = Path(__file__).parent / "fixtures"

DEMO_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && "
    ".venv/bin/pip install -q -e '.[demo]' && .venv/bin/hfgpt-demo"
)
TEST_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && "
    ".venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pytest -n 2 -q"
)

# README blocks the test does not run, each with the reason; every other block runs.
NOT_RUN = {
    DEMO_COMMAND: "makes a virtual environment and installs from the network (tests/test_demo.py runs the demo)",
    TEST_COMMAND: "the test suite itself (.ci/run)",
}
# The fixture GPT-1 is tiny: 4 heads, where the released model has 12.
SUBSTITUTIONS = {"--n-head 12": "--n-head 4"}
# docs/ pages whose Python blocks run after the README's, in the same folder.
DOCS_RUN = ("config.md", "finetuning.md")


def code_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of a Markdown file, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), flags=re.MULTILINE | re.DOTALL)


def commands(code: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", "", code)
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


# --- short, for users, and true to the CI ----------------------------------------------------------------


def test_readme_is_short_and_free_of_development_history():
    text = README.read_text()
    # (250 until the GPU table: bench_cuda.py's "Speed on a GPU" takes about 20 lines once measured)
    assert len(text.splitlines()) <= 275
    # No commit hashes, run letters or session names: those belong to git history.
    hashes = [
        w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search("[a-f]", w)
    ]
    assert not hashes
    assert not re.search(r"\bsession", text, flags=re.IGNORECASE)
    assert not re.search(r"\b(run|runs) [A-Z]\b|\bS\d{1,2}b?\b", text)


def test_the_two_commands_are_unchanged_and_the_test_command_is_what_ci_runs():
    blocks = [code.strip() for language, code in code_blocks(README) if language == "bash"]
    assert blocks[:2] == [DEMO_COMMAND, TEST_COMMAND]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == TEST_COMMAND


@pytest.mark.parametrize("path", [README, *DOCS, ROOT / "benchmarks" / "RESULTS.md"], ids=lambda p: p.name)
def test_local_links_resolve(path):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if not re.match(r"[a-z]+://", target):
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_readme_links_every_docs_page():
    text = README.read_text()
    assert DOCS and all(f"(docs/{page.name})" in text for page in DOCS)


# --- tables that come from the code or the figures ------------------------------------------------------


def test_readme_performance_table_is_the_one_made_from_the_figures():
    text = README.read_text()
    first, last = bench_model.marked_region(text, bench_model.README_TABLE)
    expected = bench_model.summary_table(bench_model.load_figures())
    assert text[first:last].strip() == expected, (
        "stale table: run python benchmarks/bench_model.py --update-docs"
    )
    assert "![hfgpt against transformers](benchmarks/ratios-cpu.png)" in text


def test_conversion_doc_tables_are_the_converters_tables():
    text = (ROOT / "docs" / "conversion.md").read_text()

    def row(source: str, target: str, op: str) -> str:
        return f"| `{source.replace('{}', '{i}')}` | `{target.replace('{}', '{i}')}` | {op} |"

    rows = [row(source, target, op.name) for source, (target, op) in GPT2_WEIGHT_MAP.items()]
    rows += [row(source, target, op.name) for source, target, op in [*GPT1_EMBEDDING_MAP, *GPT1_LAYER_MAP]]
    for line in rows:
        assert line in text
    assert text.count("| `model/") == len(rows)  # and no row the converter lacks


def test_config_doc_names_every_field_and_the_presets():
    text = (ROOT / "docs" / "config.md").read_text()
    fields = [name for name in GPTConfig.__annotations__ if not name.startswith("_")]
    assert fields
    missing = [name for name in fields if f"`{name}`" not in text]
    assert not missing, f"docs/config.md lacks {missing}"
    for name in PRESETS:
        config = GPTConfig.from_preset(name)
        cells = (config.n_layer, config.n_embd, config.n_head, config.n_positions, config.vocab_size)
        assert f"| `{name}` | " + " | ".join(map(str, cells)) + " |" in text


def _help(command: str) -> str:
    """What `command --help` prints, from its entry point in this process (a subprocess costs an import)."""
    (entry,) = entry_points(group="console_scripts", name=command)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        entry.load()(["--help"])
    return out.getvalue()


@pytest.mark.slow
def test_cli_doc_names_only_options_the_commands_have():
    """Each option docs/cli.md shows under a command's heading is one that command accepts."""
    sections = re.split(r"^## ", (ROOT / "docs" / "cli.md").read_text(), flags=re.MULTILINE)[1:]
    checked = 0
    for section in sections:
        command = section.split("\n", 1)[0].strip()
        if not command.startswith("hfgpt-"):
            continue
        body = section.split("accelerate launch")[0]  # accelerate's own options follow there
        options = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", body))
        accepted = _help(command)
        unknown = sorted(o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}\b", accepted))
        assert not unknown, f"docs/cli.md names {unknown} under {command}"
        checked += 1
    assert checked == 5


# --- the code blocks run -------------------------------------------------------------------------------


def _corpus(folder: Path) -> None:
    rng = random.Random(0)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "wizards",
        "hex",
        "every",
        "bold",
        "zebra",
    ]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 20))) + "." for _ in range(600)]
    (folder / "corpus.txt").write_text("\n".join(lines) + "\n")
    subjects = ["a man", "the woman", "two children", "a dog", "the old farmer"]
    verbs = ["is sleeping", "plays football", "reads a book", "runs in the park", "cooks dinner"]
    for name, rows in (("train.csv", 48), ("dev.csv", 16)):
        with open(folder / name, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["premise", "hypothesis", "label"])
            for _ in range(rows):
                subject, verb = rng.choice(subjects), rng.choice(verbs)
                other = rng.choice(verbs)
                writer.writerow([f"{subject} {verb} today.", f"{subject} {other}.", int(other == verb)])


@pytest.fixture
def user_folder(tmp_path: Path, use_test_hub):
    """The working folder and environment of a user who downloaded OpenAI's releases, with a Hub."""
    work = tmp_path / "work"
    shutil.copytree(FIXTURES / "openai-gpt2-tiny", work / "models" / "124M")
    shutil.copytree(FIXTURES / "openai-gpt1-tiny", work / "finetune-transformer-lm" / "model")
    _corpus(work)
    # The Hub's copy of GPT-2 in transformers' own layout, as openai-community/gpt2 is.
    tokens = {"hf_readme_openai": "openai-community", "hf_readme_you": "you"}
    with HubServer(tmp_path / "hub", tokens=tokens) as hub:
        use_test_hub(hub.url)  # this process uploads the Hub's copy: online, through LFS
        hub_copy = convert_openai_checkpoint(
            FIXTURES / "openai-gpt2-tiny", tmp_path / "hub-gpt2", format="transformers"
        )
        api = HfApi(endpoint=hub.url, token="hf_readme_openai")
        api.create_repo("openai-community/gpt2")
        api.upload_folder(folder_path=str(hub_copy), repo_id="openai-community/gpt2")
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))
        }
        env.update(
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            HF_ENDPOINT=hub.url,
            HF_HOME=str(tmp_path / "hf-home"),
            HF_TOKEN="hf_readme_you",
            HF_HUB_DISABLE_XET="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            TRANSFORMERS_VERBOSITY="error",
        )
        yield work, env


def _run(argv: list[str], work: Path, env: dict[str, str], what: str) -> None:
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (
        f"{what} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )


class PreloadedPython:
    """tests/preloaded_python.py started in `work` with `env`: `run` runs a script, or a command of an
    installed console script, in a forked copy of it (as a fresh interpreter would, less the imports of
    torch and transformers that each of the blocks would repeat)."""

    def __init__(self, work: Path, env: dict[str, str]) -> None:
        self.work = work
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("preloaded_python.py"))],
            cwd=work,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.runs = 0

    def run(self, argv: list[str], what: str) -> None:
        output = self.work / f"output_{self.runs}.txt"
        self.runs += 1
        request = {"argv": argv, "cwd": str(self.work), "output": str(output)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        if not select.select([self.process.stdout], [], [], 900)[0]:
            raise TimeoutError(f"{what}: no exit status in 900 s")
        answer = self.process.stdout.readline()
        assert answer.strip() == "0", (
            f"{what} failed ({answer.strip() or 'the preloaded interpreter died'}):\n"
            + (output.read_text()[-8000:] if output.exists() else "")
        )

    def __enter__(self) -> PreloadedPython:
        return self

    def __exit__(self, *exc_info) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        finally:
            self.process.kill()


def _command_argv(command: str, env: dict[str, str]) -> list[str] | None:
    """A shell command's argv where it is a plain call of one of hfgpt's console scripts (no shell syntax)
    installed on the environment's PATH, else None (bash runs it)."""
    if set(command) & set("|&;<>()$`*?'\"\\"):
        return None
    argv = command.split()
    installed = shutil.which(argv[0], path=env["PATH"])
    is_hfgpt = any(e.value.startswith("hfgpt.") for e in entry_points(group="console_scripts", name=argv[0]))
    return argv if installed and is_hfgpt else None


def _substituted(code: str) -> str:
    for old, new in SUBSTITUTIONS.items():
        code = code.replace(old, new)
    return code


@pytest.mark.slow
def test_readme_and_docs_code_blocks_run_offline(user_folder):
    work, env = user_folder
    ran = 0
    blocks = [(README.name, *block) for block in code_blocks(README)]
    blocks += [
        (name, *block)
        for name in DOCS_RUN
        for block in code_blocks(ROOT / "docs" / name)
        if block[0] == "python"
    ]
    with PreloadedPython(work, env) as python:
        for where, language, code in blocks:
            if code.strip() in NOT_RUN:
                continue
            assert language in ("bash", "python"), (
                f"{where}: a {language or 'plain'} block the test cannot run"
            )
            if language == "bash":
                for command in commands(_substituted(code)):
                    argv = _command_argv(command, env)
                    if argv is None:
                        _run(["bash", "-c", command], work, env, f"{where}: {command}")
                    else:
                        python.run(argv, f"{where}: {command}")
            else:
                script = work / f"block_{ran}.py"
                script.write_text(_substituted(code))
                python.run([str(script)], f"{where} block:\n{code}")
            ran += 1
    assert ran == len(code_blocks(README)) - len(NOT_RUN) + sum(
        1 for name in DOCS_RUN for block in code_blocks(ROOT / "docs" / name) if block[0] == "python"
    )
    # What the README says the commands leave behind.
    assert (work / "out" / "gpt2" / "model.safetensors").is_file()
    assert (work / "out" / "lm" / "config.json").is_file()
    assert (work / "out" / "gpt1-entailment" / "config.json").is_file()
