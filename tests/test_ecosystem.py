"""docs/ecosystem.md's recipes run, one test per section, and show what the page says they show.

Each section's Python blocks run as one script in a fresh interpreter (as a user runs them), in a folder
laid out as the page's first block writes it: `out/gpt2`, `out/gpt1` and `out/gpt2-transformers`,
converted from the tiny fixture releases of tests/fixtures (GPT-1's with its 4 heads). The test then reads
the variables the recipe computed. A recipe skips where its tool is not installed; the `test` extra
installs them all (llama-cpp-python compiles llama.cpp on install; its converter comes from its source
distribution, fetched from the package index). Shell blocks run too, except those in `NOT_RUN`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import tomllib
import torch
from test_remote_code import (  # tests/ is on sys.path
    ATTENTION_MASK,
    INIT,
    INPUT_IDS,
    TINY,
    check_code_files,
    run_without_hfgpt,
)
from test_transformers_common import fetch_source_distribution

from hfgpt.modeling import GPTConfig, GPTForCausalLM
from hfgpt.modeling.modeling_hfgpt import AUTO_MAP, REMOTE_CODE_FILES
from hfgpt.scripts.convert_openai_checkpoint import convert_openai_checkpoint

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "ecosystem.md"
FIXTURES = Path(__file__).parent / "fixtures"
BIN = Path(sys.executable).parent

# Shell blocks the suite does not run (by their first words), each with the reason; every other shell block
# runs in its test.
NOT_RUN = {
    "hfgpt-convert models/124M": "the page's starting point: `user_folder` converts the fixture releases",
    "transformers serve": "a server: its test starts it in the background on a free port, then stops it",
    "vllm serve": "vLLM and TGI do not install here; the test checks the folder they read",
    "pip download --no-deps --no-binary llama-cpp-python": (
        "the test fetches the same archive with test_transformers_common's helper (which skips, naming it, "
        "without a package index) and unpacks the converter's files from it"
    ),
    "accelerate launch --use_fsdp": "needs GPUs: on the CPU accelerate runs DDP instead",
}
# The first words of the shell blocks the tests run.
RUN = ("lm_eval run", "torchrun", "PYTHONPATH=llama_cpp_python")

# Runs a recipe's code, then writes the variables the test asks for as JSON (tensors as lists).
RUNNER = textwrap.dedent(
    """
    import json, sys
    script, names, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    namespace = {"__name__": "__main__"}
    exec(compile(open(script).read(), script, "exec"), namespace)
    plain = lambda value: value.tolist() if hasattr(value, "tolist") else value
    with open(out, "w") as handle:
        json.dump({name: plain(namespace[name]) for name in names}, handle)
    """
)


def sections() -> dict[str, list[tuple[str, str]]]:
    """The page's fenced blocks, (language, code), under each `## ` heading."""
    found: dict[str, list[tuple[str, str]]] = {}
    for part in re.split(r"^## ", PAGE.read_text(), flags=re.MULTILINE)[1:]:
        title = part.splitlines()[0].strip()
        found[title] = re.findall(r"^```(\w*)\n(.*?)^```", part, flags=re.MULTILINE | re.DOTALL)
    return found


def blocks(title: str, language: str) -> list[str]:
    matching = [title_ for title_ in sections() if title_.startswith(title)]
    assert len(matching) == 1, f"docs/ecosystem.md has no single section {title!r}: {list(sections())}"
    return [code for lang, code in sections()[matching[0]] if lang == language]


def environment() -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        # The recipes' servers listen on 127.0.0.1: their clients must reach it directly, never a proxy.
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


def run_recipe(folder: Path, title: str, names: list[str], replace: dict[str, str] | None = None) -> dict:
    """Run the Python blocks of section `title` in `folder` (each key of `replace` in them replaced by its
    value); the values of `names` after they ran."""
    script = folder / f"recipe-{re.sub(r'[^a-z0-9]+', '-', title.lower())}.py"
    code = "\n".join(blocks(title, "python"))
    for old, new in (replace or {}).items():
        assert old in code, f"{title}: no {old!r} to replace"
        code = code.replace(old, new)
    script.write_text(code)
    out = script.with_suffix(".json")
    result = checked_run(
        [sys.executable, "-c", RUNNER, str(script), json.dumps(names), str(out)], folder, title
    )
    (folder / f"{script.stem}.stderr").write_text(result.stderr)  # what the user saw, for tests to read
    return json.loads(out.read_text())


def checked_run(argv: list[str], folder: Path, what: str) -> subprocess.CompletedProcess:
    """`argv` run in `folder` with the recipes' environment; a failure shows the end of its stderr."""
    result = subprocess.run(argv, cwd=folder, env=environment(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{what}: {result.stderr[-6000:]}"
    return result


def run_shell(folder: Path, command: str) -> subprocess.CompletedProcess:
    return checked_run(["bash", "-c", command], folder, command)


def needs(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)}")


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    """The folders of the page's first block, from the fixture releases."""
    folder = tmp_path_factory.mktemp("ecosystem")
    convert_openai_checkpoint(FIXTURES / "openai-gpt2-tiny", folder / "out" / "gpt2")
    convert_openai_checkpoint(FIXTURES / "openai-gpt1-tiny", folder / "out" / "gpt1", n_head=4)
    convert_openai_checkpoint(
        FIXTURES / "openai-gpt2-tiny", folder / "out" / "gpt2-transformers", format="transformers"
    )
    return folder


def test_every_shell_block_runs_or_says_why_not():
    for title, found in sections().items():
        for language, code in found:
            if language == "bash" and not code.startswith(tuple(NOT_RUN)):
                assert code.startswith(RUN) and len(code.strip().splitlines()) == 1, f"{title}: {code!r}"


def test_the_readme_links_the_page():
    assert "(docs/ecosystem.md)" in (ROOT / "README.md").read_text()


# --- lm-evaluation-harness ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_lm_evaluation_harness_recipe(user_folder):
    needs("lm_eval")
    results = run_recipe(user_folder, "lm-evaluation-harness", ["results"])["results"]
    ours, theirs, gpt1 = results["out/gpt2"], results["out/gpt2-transformers"], results["out/gpt1"]
    # GPT-2 through hfgpt's code (trust_remote_code) and through transformers' GPT2LMHeadModel.
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours[metric] == pytest.approx(theirs[metric], rel=1e-6), metric
        assert 1.0 < gpt1[metric] < float("inf"), (metric, gpt1[metric])
    assert gpt1["byte_perplexity,none"] != ours["byte_perplexity,none"]


@pytest.mark.slow
def test_lm_evaluation_harness_command_line_runs_gpt1_without_extra_arguments(user_folder):
    needs("lm_eval")
    (user_folder / "my_tasks").exists() or run_recipe(user_folder, "lm-evaluation-harness", [])
    (command,) = (c for c in blocks("lm-evaluation-harness", "bash"))
    assert "out/gpt1,trust_remote_code=True " in command  # no prefix_token_id or other argument
    out = run_shell(user_folder, command)
    assert re.search(r"my_perplexity.*byte_perplexity", out.stdout, flags=re.DOTALL), out.stdout[-3000:]


def test_gpt1_tokenizer_names_a_bos_and_eos_inside_the_released_vocabulary(user_folder):
    pytest.importorskip("spacy")
    from transformers import AutoTokenizer

    from hfgpt.tokenization import GPT1Tokenizer

    tokenizer = AutoTokenizer.from_pretrained(user_folder / "out" / "gpt1")
    assert isinstance(tokenizer, GPT1Tokenizer)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<unk>", "<unk>")
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == 0 == tokenizer.unk_token_id
    assert len(tokenizer) == 40478  # nothing added: the model's embedding has 40478 rows
    text = "isn't it <unk> nice? A BOS in the text stays text."
    plain = GPT1Tokenizer(bos_token=None, eos_token=None)
    expected = plain.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text) == tokenizer.encode(text, add_special_tokens=False) == expected
    assert 0 not in expected


@pytest.mark.parametrize("name", ["gpt1", "gpt2"])
def test_text_generation_pipeline_gives_the_prompt_then_the_continuation(user_folder, name):
    if name == "gpt1":
        pytest.importorskip("spacy")
    from transformers import AutoTokenizer, pipeline

    folder = user_folder / "out" / name
    generator = pipeline("text-generation", model=str(folder), device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = GPTForCausalLM.from_pretrained(folder).eval()
    for prompt in ("The quick brown fox", "Isn't it odd, she asked"):
        text = generator(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
        ids = tokenizer(prompt)["input_ids"]
        sequence = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0].tolist()
        # The continuation as the whole sequence, decoded at once, reads after the prompt's own decoding.
        whole, start = tokenizer.decode(sequence, skip_special_tokens=True), tokenizer.decode(ids)
        assert len(sequence) > len(ids) and whole.startswith(start), (whole, start)
        continuation = whole[len(start) :]
        assert continuation.strip() and text == prompt + continuation, (text, continuation)


# --- TransformerLens --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_transformerlens_recipe(user_folder):
    needs("transformer_lens")
    out = run_recipe(user_folder, "TransformerLens", ["difference", "difference_from_memory", "hooked"])
    assert out["difference"] < 1e-4
    assert out["difference_from_memory"] < 1e-5
    assert out["hooked"] > 10 * 2  # hooks in each of the 2 blocks and around them


# --- CTranslate2 and the serving engines --------------------------------------------------------------------


@pytest.mark.slow
def test_ctranslate2_recipe(user_folder):
    needs("ctranslate2")
    assert run_recipe(user_folder, "CTranslate2", ["same"])["same"] == [True, True, True]


def test_serving_engines_read_the_transformers_format(user_folder):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from hfgpt.tokenization import GPT2Tokenizer

    folder = user_folder / "out" / "gpt2-transformers"
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert config["n_ctx"] == config["n_positions"] == 64  # llama.cpp's GPT-2 converter reads n_ctx
    assert "auto_map" not in config and not list(folder.glob("*.py"))
    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as weights:
            names |= set(weights.keys())
    n_layer = config["n_layer"]
    assert all(name.startswith("transformer.") for name in names), names  # vLLM's and TGI's prefix
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # the head is tied
    assert config.get("tie_word_embeddings", True)
    if importlib.util.find_spec("gguf") is not None:  # llama.cpp's converter maps names with this table
        import gguf

        table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, n_layer)
        unmapped = [n for n in names if table.get_name(n, try_suffixes=(".weight", ".bias")) is None]
        assert not unmapped, unmapped
    assert (folder / "tokenizer.json").is_file()
    text = "Serving engines read tokenizer.json: <|endoftext|> and ids as OpenAI's."
    assert AutoTokenizer.from_pretrained(folder).encode(text) == GPT2Tokenizer().encode(text)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_exports_write_the_context_length_as_n_ctx_too(tmp_path, norm):
    from hfgpt.modeling.interop import to_transformers

    model = GPTForCausalLM(GPTConfig(**TINY, **INIT, layer_norm_position=norm))
    to_transformers(model).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == {"pre": "gpt2", "post": "openai-gpt"}[norm]
    assert written["n_ctx"] == written["n_positions"] == TINY["n_positions"]
    # Read back into hfgpt, the old name is dropped: n_positions alone sets the context length.
    back = GPTForCausalLM.from_pretrained(tmp_path)
    assert back.config.n_positions == TINY["n_positions"] and "n_ctx" not in back.config.to_dict()


# --- llama.cpp ----------------------------------------------------------------------------------------------


def llama_cpp_release() -> str:
    """The llama-cpp-python release whose converter docs/ecosystem.md runs."""
    (fetch,) = (c for c in blocks("llama.cpp", "bash") if c.startswith("pip download"))
    found = re.search(r"llama-cpp-python==([\w.]+) && tar xzf (llama_cpp_python-\1)\.tar\.gz", fetch)
    assert found, fetch
    return found[1]


def unpack_llama_cpp_converter(archive: Path, folder: Path) -> None:
    """The converter, its `conversion` package and its `gguf-py` from the source distribution, at the paths
    the page's `tar xzf` gives them (the rest of the archive, llama.cpp's C++ sources, is not needed)."""
    top = archive.name.removesuffix(".tar.gz")
    wanted = tuple(
        f"{top}/vendor/llama.cpp/{p}" for p in ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    )
    with tarfile.open(archive) as sdist:
        members = [m for m in sdist.getmembers() if m.isfile() and m.name.startswith(wanted)]
        for member in members:
            target = folder / member.name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(sdist.extractfile(member).read())
    assert any(m.name.endswith("convert_hf_to_gguf.py") for m in members), f"{archive.name}: no converter"


# llama.cpp's names of GPT-2's tensors (its src/llama-arch.cpp, LLM_ARCH_GPT2) -> the transformers tensor each
# holds, and whether the converter transposes it: Conv1D weights are stored (in, out), GGUF's (out, in).
LLAMA_CPP_GPT2_NAMES = {
    "token_embd.weight": ("transformer.wte.weight", False),
    "position_embd.weight": ("transformer.wpe.weight", False),
    "output_norm.weight": ("transformer.ln_f.weight", False),
    "output_norm.bias": ("transformer.ln_f.bias", False),
}
LLAMA_CPP_GPT2_BLOCK_NAMES = {
    "attn_norm": ("ln_1", False),
    "attn_qkv": ("attn.c_attn", True),
    "attn_output": ("attn.c_proj", True),
    "ffn_norm": ("ln_2", False),
    "ffn_up": ("mlp.c_fc", True),
    "ffn_down": ("mlp.c_proj", True),
}


@pytest.fixture(scope="module")
def gguf_file(user_folder) -> Path:
    """gpt2.gguf, written by the page's converter command from out/gpt2-transformers."""
    archive = fetch_source_distribution(user_folder, "llama-cpp-python", llama_cpp_release())
    unpack_llama_cpp_converter(archive, user_folder)
    (command,) = (c.strip() for c in blocks("llama.cpp", "bash") if "convert_hf_to_gguf.py" in c)
    assert "out/gpt2-transformers --outfile gpt2.gguf" in command
    run_shell(user_folder, command)
    return user_folder / "gpt2.gguf"


@pytest.mark.slow
def test_llama_cpp_converter_reads_the_transformers_format(user_folder, gguf_file):
    import gguf
    from safetensors.torch import load_file

    folder = user_folder / "out" / "gpt2-transformers"
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    expected = {
        name: (weights[source], transpose) for name, (source, transpose) in LLAMA_CPP_GPT2_NAMES.items()
    }
    for i in range(config["n_layer"]):
        for name, (source, transpose) in LLAMA_CPP_GPT2_BLOCK_NAMES.items():
            for kind in ("weight", "bias"):
                tensor = weights[f"transformer.h.{i}.{source}.{kind}"]
                expected[f"blk.{i}.{name}.{kind}"] = (tensor, transpose and kind == "weight")
    reader = gguf.GGUFReader(gguf_file)
    found = {tensor.name: tensor for tensor in reader.tensors}
    assert sorted(found) == sorted(expected)  # no output.weight: the head is tied to token_embd
    for name, (tensor, transpose) in expected.items():
        value = (tensor.T if transpose else tensor).numpy()
        # GGUF lists a tensor's dimensions innermost first, numpy's shape outermost first.
        assert [int(n) for n in reversed(found[name].shape)] == list(value.shape), name
        assert found[name].tensor_type == gguf.GGMLQuantizationType.F32, name
        assert (found[name].data == value).all(), name
    header = {name: field.contents() for name, field in reader.fields.items()}
    assert header["general.architecture"] == "gpt2"
    assert header["gpt2.context_length"] == config["n_positions"] == 64
    assert header["gpt2.block_count"] == config["n_layer"]
    assert header["gpt2.embedding_length"] == config["n_embd"]
    assert header["gpt2.attention.head_count"] == config["n_head"]
    assert header["tokenizer.ggml.model"] == "gpt2"


def test_the_test_extra_installs_the_llama_cpp_python_whose_converter_the_page_runs():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"llama-cpp-python=={llama_cpp_release()}" in extras["test"]


@pytest.mark.slow
def test_llama_cpp_recipe(user_folder, request):
    needs("llama_cpp")
    request.getfixturevalue("gguf_file")
    out = run_recipe(user_folder, "llama.cpp", ["same_ids", "llama_tokens", "hfgpt_tokens"])
    assert out["same_ids"] is True
    assert len(out["hfgpt_tokens"]) == 16 and out["llama_tokens"] == out["hfgpt_tokens"]


# --- transformers serve -------------------------------------------------------------------------------------


def free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_serving(url: str, server: subprocess.Popen, log: Path, seconds: float) -> None:
    """Poll `url` (on 127.0.0.1, without any proxy) until it answers, the server exits, or time is up."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server stopped ({server.returncode}):\n{log.read_text()[-6000:]}"
        try:
            with direct.open(url, timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"nothing served at {url} after {seconds:.0f} s:\n{log.read_text()[-6000:]}")


def stop(server: subprocess.Popen) -> None:
    """The server and the model process it started (its own process group), within seconds."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


@pytest.mark.slow
def test_transformers_serve_recipe(user_folder):
    needs("fastapi", "uvicorn", "openai")
    (command,) = (c.strip() for c in blocks("transformers serve", "bash"))
    assert command.startswith("transformers serve out/gpt2-transformers --host 127.0.0.1 --port 8000 ")
    port = free_local_port()
    log = user_folder / "serve.log"
    with log.open("w") as sink:
        server = subprocess.Popen(
            ["bash", "-c", "exec " + command.replace("--port 8000", f"--port {port}")],
            cwd=user_folder,
            env=environment(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: `stop` ends it and its model process
        )
    try:
        wait_until_serving(f"http://127.0.0.1:{port}/v1/models", server, log, seconds=240)
        names = ["served", "local", "chat_status", "generated", "ids"]
        out = run_recipe(user_folder, "transformers serve", names, {"127.0.0.1:8000": f"127.0.0.1:{port}"})
    finally:
        stop(server)
    assert server.returncode is not None
    assert len(out["generated"][0]) > len(out["ids"][0])  # generate() added tokens
    assert out["served"] and out["served"] == out["local"], (out["served"], out["local"])
    assert out["chat_status"] == 400
    assert f"127.0.0.1:{port}" in log.read_text()  # where it listened: on the loopback address only


@pytest.mark.slow
def test_transformers_serve_refuses_an_hfgpt_folder_as_the_page_says(user_folder):
    # The page tells users to serve the export because this fails: were a version of transformers to serve
    # hfgpt's classes, this test would say so, and the page should then show that route.
    needs("fastapi", "uvicorn", "openai")
    command = f"transformers serve out/gpt2 --trust-remote-code --host 127.0.0.1 --port {free_local_port()}"
    result = subprocess.run(
        ["bash", "-c", f"exec {command} --device cpu"],
        cwd=user_folder,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert result.returncode != 0
    assert "module transformers has no attribute GPTForCausalLM" in result.stderr + result.stdout
    assert "`module transformers has no attribute GPTForCausalLM`" in PAGE.read_text()


# --- TRL ----------------------------------------------------------------------------------------------------

# Lines that would alarm a user for nothing: transformers' model-type warning, torchao's failed loads and the
# deprecation lines its import makes torch print, transformers' FutureWarning for TRL's
# `gradient_checkpointing` default.
ALARMS = ("You are using a model of type", "Failed to load", "_pytree", "FutureWarning", "Traceback")


@pytest.mark.slow
def test_trl_recipe(user_folder):
    needs("trl")
    out = run_recipe(user_folder, "TRL", ["losses", "trained_classes"])
    assert set(out["losses"]) == {"out/gpt2", "out/gpt1"}
    for folder, losses in out["losses"].items():
        assert len(losses) == 8 and losses[-1] < 0.9 * losses[0], (folder, losses)
    # hfgpt's installed classes (with the CPU backend), not the copies of their code in the folders.
    assert out["trained_classes"] == ["hfgpt.modeling.modeling_hfgpt.GPTForCausalLM"] * 2
    stderr = (user_folder / "recipe-trl.stderr").read_text()
    assert not [line for line in stderr.splitlines() if any(alarm in line for alarm in ALARMS)], stderr[
        -3000:
    ]
    # The fine-tuned checkpoints load as any other and hold the trained weights.
    for name in ("gpt2", "gpt1"):
        trained = GPTForCausalLM.from_pretrained(user_folder / "out" / f"{name}-sft")
        before = GPTForCausalLM.from_pretrained(user_folder / "out" / name)
        assert not torch.equal(trained.transformer.wte.weight, before.transformer.wte.weight)


@pytest.mark.slow
def test_trl_trains_gpt1_without_hfgpt_imported_with_sft_config_trust_remote_code(user_folder, tmp_path):
    needs("trl")
    script = tmp_path / "sft_gpt1.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, sys

            from datasets import Dataset
            from trl import SFTConfig, SFTTrainer

            dataset = Dataset.from_dict({"text": ["The quick brown fox jumps over the lazy dog."] * 8})
            config = SFTConfig(
                output_dir=sys.argv[2], trust_remote_code=True, use_cpu=True, activation_checkpointing=False,
                max_steps=4, learning_rate=1e-2, per_device_train_batch_size=4, logging_steps=1,
                save_strategy="no", report_to="none",
            )
            trainer = SFTTrainer(model=sys.argv[1], args=config, train_dataset=dataset)
            trainer.train()
            losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
            print(json.dumps({"losses": losses, "model": type(trainer.model).__module__,
                              "tokenizer": type(trainer.processing_class).__module__}))
            """
        )
    )
    result = checked_run(
        [sys.executable, str(script), "out/gpt1", str(tmp_path / "sft")], user_folder, "SFT on GPT-1"
    )
    out = json.loads(result.stdout.strip().splitlines()[-1])
    # The folder's own copies of hfgpt's code, as where hfgpt is not installed.
    assert out["model"].startswith("transformers_modules.") and out["model"].endswith(".modeling_hfgpt")
    assert out["tokenizer"].endswith(".tokenization_gpt1")
    assert out["losses"][-1] < out["losses"][0], out["losses"]
    assert not [line for line in result.stderr.splitlines() if any(a in line for a in ALARMS)], result.stderr


# --- PEFT, ONNX ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_peft_lora_recipe(user_folder):
    needs("peft")
    out = run_recipe(user_folder, "PEFT", ["losses", "reloaded_difference", "merged_difference"])
    assert out["losses"][-1] < 0.9 * out["losses"][0], out["losses"]
    assert out["reloaded_difference"] < 1e-5
    assert out["merged_difference"] < 1e-4


@pytest.mark.slow
def test_onnx_recipe(user_folder):
    needs("onnx", "onnxscript", "onnxruntime")
    assert run_recipe(user_folder, "ONNX", ["difference"])["difference"] < 1e-4


# --- FSDP2 --------------------------------------------------------------------------------------------------


def check_clean_checkpoint(folder: Path) -> None:
    """What a single process's save writes: hfgpt's classes in auto_map, hfgpt's two code files only."""
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP, config["auto_map"]
    assert config["architectures"] == ["GPTForCausalLM"]
    assert sorted(p.name for p in folder.glob("*.py")) == sorted(REMOTE_CODE_FILES)
    check_code_files(folder)


@pytest.fixture
def one_process_group():
    """A gloo process group of this process alone (a store in memory: no port)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_wrapped_model_saves_a_checkpoint_that_loads_without_hfgpt(tmp_path, one_process_group):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.manual_seed(0)
    model = GPTForCausalLM(GPTConfig(**TINY, **INIT))
    mesh = init_device_mesh("cpu", (1,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model, FSDPModule) and type(model).__name__ == "FSDPGPTForCausalLM"
    ids, mask = torch.tensor(INPUT_IDS), torch.tensor(ATTENTION_MASK)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    optimizer.step()
    with torch.no_grad():
        expected = model.eval()(ids, attention_mask=mask).logits
    model.reshard()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    ckpt = tmp_path / "fsdp2"
    model.save_pretrained(ckpt, state_dict=state)
    check_clean_checkpoint(ckpt)
    assert not list(ckpt.glob("_fsdp*"))
    # The class is torch's again after the save.
    assert type(model).__name__ == "FSDPGPTForCausalLM" and type(model).__module__.startswith("torch.")
    out = run_without_hfgpt(tmp_path, "causal-lm-logits", ckpt)
    assert out["class"] == "GPTForCausalLM"
    torch.testing.assert_close(torch.tensor(out["result"]), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_fsdp2_recipe_trains_on_two_cpu_processes(user_folder, tmp_path):
    (script,) = blocks("Several GPUs", "python")
    assert script.startswith("# train_fsdp2.py\n")
    (user_folder / "train_fsdp2.py").write_text(script)
    (command,) = (c.strip() for c in blocks("Several GPUs", "bash") if c.startswith("torchrun"))
    out = run_shell(user_folder, command)
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", out.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], out.stdout
    ckpt = user_folder / "out" / "gpt2-fsdp2"
    check_clean_checkpoint(ckpt)
    # The trained weights, loaded by plain transformers from the checkpoint's own code, generate what hfgpt
    # generates from them.
    model = GPTForCausalLM.from_pretrained(ckpt).eval()
    before = GPTForCausalLM.from_pretrained(user_folder / "out" / "gpt2")
    assert not torch.equal(model.transformer.wte.weight, before.transformer.wte.weight)
    ids, mask = torch.tensor(INPUT_IDS), torch.tensor(ATTENTION_MASK)
    with torch.no_grad():
        expected = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0
        )
    assert run_without_hfgpt(tmp_path, "causal-lm", ckpt)["result"] == expected.tolist()
