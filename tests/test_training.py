"""hfgpt-train: causal-LM training through Trainer on local files, a complete reloadable checkpoint, exact
resumption after an interruption, data-parallel runs under `accelerate launch`, and clear input errors."""

import functools
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from hfgpt.modeling import GPTForCausalLM, GPTPreTrainedModel
from hfgpt.modeling.finetune import TrainingInputError
from hfgpt.scripts.demo import build_char_tokenizer
from hfgpt.scripts.train_lm import (
    DataArguments,
    TrainingInterrupted,
    load_raw_splits,
    main,
    make_parser,
    pack_blocks,
    train_lm,
)

REPO = Path(__file__).resolve().parents[1]
TINY = "n_embd=32,n_layer=2,n_head=2,n_positions=32"
WORDS = ["the cat", "a dog", "sat on", "the mat", "ran far", "and then"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, str]:
    """A character tokenizer and the same small corpus as .txt, .jsonl and .csv."""
    root = tmp_path_factory.mktemp("corpus")
    build_char_tokenizer("abcdefghijklmnopqrstuvwxyz .,").save_pretrained(root / "tok")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(6)) + "." for _ in range(120)]
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    (root / "train.jsonl").write_text(
        "\n".join(json.dumps({"body": line, "id": i}) for i, line in enumerate(lines))
    )
    (root / "train.csv").write_text("id,body\n" + "\n".join(f"{i},{line}" for i, line in enumerate(lines)))
    return {
        "root": str(root),
        "tok": str(root / "tok"),
        **{ext: str(root / f"train.{ext}") for ext in ("txt", "jsonl", "csv")},
    }


def _argv(corpus: dict, out: Path, *extra: str) -> list[str]:
    return [
        "--preset", "gpt2", "--config_overrides", TINY, "--tokenizer_name", corpus["tok"],
        "--train_file", corpus["txt"], "--output_dir", str(out), "--per_device_train_batch_size", "4",
        "--use_cpu", "true", "--disable_tqdm", "true", "--seed", "7", *extra,
    ]  # fmt: skip


def _parse(argv: list[str]):
    return make_parser().parse_args_into_dataclasses(args=argv)


def test_cpu_defaults():
    _, _, training_args = _parse(["--output_dir", "x"])
    assert str(training_args.optim.value) == "adamw_torch_fused"
    assert (
        training_args.report_to == []
        or training_args.report_to == ["none"]
        or training_args.report_to == "none"
    )
    assert training_args.dataloader_num_workers == 0


def test_pack_blocks_concatenates_rows_with_eos_and_cuts_full_blocks(corpus):
    tokenizer = AutoTokenizer.from_pretrained(corpus["tok"])
    raw = load_raw_splits(DataArguments(train_file=corpus["txt"]), seed=0)
    blocks = pack_blocks(raw, tokenizer, "text", block_size=16)
    expected: list[int] = []
    for text in raw["train"]["text"]:
        expected += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    got = [t for row in blocks["train"]["input_ids"] for t in row]
    assert got == expected[: len(expected) // 16 * 16]
    assert all(len(row) == 16 for row in blocks["train"]["input_ids"])
    assert blocks["train"]["labels"] == blocks["train"]["input_ids"]
    assert raw["validation"].num_rows == 6  # 5 % of 120 held out when there is no validation file


def test_train_saves_a_complete_checkpoint_that_loads(tmp_path, corpus):
    model_args, data_args, training_args = _parse(_argv(corpus, tmp_path / "out", "--max_steps", "4"))
    metrics = train_lm(model_args, data_args, training_args)
    assert metrics["train_steps"] == 4
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    out = tmp_path / "out"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"):
        assert (out / name).is_file(), name
    assert not (out / ".hfgpt-final.tmp").exists()
    assert "causal language modelling" in (out / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert isinstance(model, GPTForCausalLM) and model.config.vocab_size == len(tokenizer)
    ids = tokenizer("the cat", return_tensors="pt")["input_ids"]
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)


def test_bf16_on_the_cpu_trains_inside_autocast_and_saves_float32(tmp_path, corpus, monkeypatch):
    """`--bf16 --use_cpu true` (README): Trainer runs each forward inside CPU autocast to bfloat16, the
    fused training loss forms no logits (float32 loss), the weights stay float32."""
    seen = []
    post_init = GPTPreTrainedModel.post_init

    def add_recorder(model):  # around the forward of the model train_lm builds, as it is built
        post_init(model)
        if not isinstance(model, GPTForCausalLM):
            return
        forward = model.forward

        @functools.wraps(forward)  # Trainer keeps the dataset columns that the signature names
        def recording_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            logits_dtype = None if out.logits is None else out.logits.dtype
            seen.append((torch.is_autocast_enabled("cpu"), logits_dtype, out.loss.dtype))
            return out

        model.forward = recording_forward

    monkeypatch.setattr(GPTPreTrainedModel, "post_init", add_recorder)
    argv = _argv(corpus, tmp_path / "out", "--max_steps", "2", "--bf16", "true")
    metrics = train_lm(*_parse(argv))
    assert metrics["train_steps"] == 2 and math.isfinite(metrics["train_loss"])
    # Training runs the model file's forward, whose fused loss forms no logits, with the backend or without.
    assert seen and set(seen[:2]) == {(True, None, torch.float32)}
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}


@pytest.mark.parametrize("ext", ["jsonl", "csv"])
def test_json_and_csv_files_with_a_text_column(tmp_path, corpus, ext):
    argv = _argv(
        corpus, tmp_path / "out", "--max_steps", "1", "--text_column", "body", "--eval_strategy", "no"
    )
    argv[argv.index(corpus["txt"])] = corpus[ext]
    metrics = train_lm(*_parse(argv))
    assert metrics["train_steps"] == 1 and math.isfinite(metrics["eval_loss"])


def test_continue_training_from_a_checkpoint(tmp_path, corpus):
    train_lm(*_parse(_argv(corpus, tmp_path / "a", "--max_steps", "2", "--eval_strategy", "no")))
    argv = _argv(corpus, tmp_path / "b", "--max_steps", "2", "--eval_strategy", "no")
    start = argv.index("--preset")
    argv[start : start + 4] = ["--model_name_or_path", str(tmp_path / "a")]
    train_lm(*_parse(argv))
    before, after = (
        load_file(tmp_path / "a" / "model.safetensors"),
        load_file(tmp_path / "b" / "model.safetensors"),
    )
    assert before.keys() == after.keys()
    assert not torch.equal(
        before["transformer.h.0.attn.c_attn.weight"], after["transformer.h.0.attn.c_attn.weight"]
    )


class StopAt(TrainerCallback):
    """Simulates an interruption: stop after `step` (the checkpoint of that step is saved first)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True
        return control


def test_resumed_training_gives_the_same_weights_as_straight_training(tmp_path, corpus):
    # Dropout stays on (GPT-2's 0.1): resumption must also restore the RNG states and the data order.
    common = ("--max_steps", "6", "--eval_strategy", "no", "--save_strategy", "steps", "--save_steps", "100")
    train_lm(*_parse(_argv(corpus, tmp_path / "straight", *common)))

    train_lm(*_parse(_argv(corpus, tmp_path / "resumed", *common)), callbacks=[StopAt(3)])
    assert (tmp_path / "resumed" / "checkpoint-3").is_dir()
    interrupted = load_file(tmp_path / "resumed" / "model.safetensors")
    checkpoint = str(tmp_path / "resumed" / "checkpoint-3")
    metrics = train_lm(
        *_parse(_argv(corpus, tmp_path / "resumed", *common, "--resume_from_checkpoint", checkpoint))
    )
    assert metrics["train_steps"] == 6

    straight = load_file(tmp_path / "straight" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0, msg=key)
    assert not torch.equal(interrupted["transformer.wte.weight"], straight["transformer.wte.weight"])


def _free_port() -> int:
    # torchrun's default port (29500) may be taken by a concurrent run (pytest-xdist, another suite).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_accelerate_launch_two_processes(tmp_path, corpus):
    out = tmp_path / "ddp"
    argv = _argv(corpus, out, "--max_steps", "3", "--save_strategy", "no", "--eval_strategy", "no")
    # accelerate's torchrun launcher (`--multi_gpu`) with TrainingArguments.use_cpu runs DDP over gloo on
    # CPU; `accelerate launch --cpu` would start a single process (multi-CPU there means MPI).
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        str(REPO / "scripts" / "train_lm.py"), *argv,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Both processes trained, one wrote the checkpoint.
    assert "[process 0/2] trained 3 steps" in proc.stdout and "[process 1/2] trained 3 steps" in proc.stdout
    assert proc.stdout.count("checkpoint: ") == 1
    # Each step consumed one batch per process: an epoch is ceil(blocks / (4 per device * 2 processes)) steps.
    tokenizer = AutoTokenizer.from_pretrained(corpus["tok"])
    n_blocks = pack_blocks(
        load_raw_splits(DataArguments(train_file=corpus["txt"]), seed=7), tokenizer, "text", 32
    )["train"].num_rows
    epoch = json.loads((out / "all_results.json").read_text())["epoch"]
    assert epoch == pytest.approx(3 / math.ceil(n_blocks / 8))
    assert isinstance(AutoModelForCausalLM.from_pretrained(out), GPTForCausalLM)


# --- bad input: a clear message before training -------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", r"train_file '.*nope\.txt' does not exist"),
        ("empty", r"train_file '.*empty\.txt' is empty"),
        ("column", r"train data has no column 'body' \(columns: text\)"),
        ("block", r"--block_size 64 must be in \[2, 32\]"),
        ("too-little", r"the train data has 12 tokens, fewer than one block of 32"),
        ("small-validation", r"the validation data has 6 tokens, fewer than one block of 32"),
        ("preset", r"unknown preset 'gpt5'"),
        ("config", r"invalid model config: .*n_embd \(32\) must be divisible by GPTConfig.n_head \(3\)"),
        ("one-row", r"the train data has 1 row\(s\), too few to hold out 5% for validation"),
        ("number-column", r"train data column 'id' holds int64 values, not text; choose a text column"),
        ("mixed-formats", r"train_file '.*train\.txt' is text but validation_file '.*train\.jsonl' is json"),
        ("malformed", r"train_file '.*bad\.jsonl' could not be read as json: .*row 1"),
        ("header-only", r"train_file '.*header\.csv' holds no rows"),
    ],
)
def test_bad_input_is_refused_before_training(tmp_path, corpus, case, message, capsys):
    argv = _argv(corpus, tmp_path / "out")
    data = argv.index(corpus["txt"])
    if case == "missing":
        argv[data] = str(tmp_path / "nope.txt")
    elif case == "empty":
        (tmp_path / "empty.txt").write_text("")
        argv[data] = str(tmp_path / "empty.txt")
    elif case == "column":
        argv += ["--text_column", "body"]
    elif case == "block":
        argv += ["--block_size", "64"]
    elif case in ("too-little", "small-validation"):
        # 5 % held out for validation: 3 rows -> 2 train rows; 20 rows -> 1 validation row (6 tokens).
        (tmp_path / "short.txt").write_text("a cat\n" * (3 if case == "too-little" else 20))
        argv[data] = str(tmp_path / "short.txt")
    elif case == "config":
        argv[argv.index(TINY)] = TINY.replace("n_head=2", "n_head=3")
    elif case == "one-row":  # datasets' train_test_split would leave no training row
        (tmp_path / "one.txt").write_text("the cat sat on the mat\n")
        argv[data] = str(tmp_path / "one.txt")
    elif case == "number-column":
        argv[data] = corpus["jsonl"]
        argv += ["--text_column", "id"]
    elif case == "mixed-formats":
        argv += ["--validation_file", corpus["jsonl"]]
    elif case == "malformed":
        (tmp_path / "bad.jsonl").write_text('{"text": "a cat"}\n{"text": oops\n')
        argv[data] = str(tmp_path / "bad.jsonl")
    elif case == "header-only":
        (tmp_path / "header.csv").write_text("text\n")
        argv[data] = str(tmp_path / "header.csv")
    else:
        argv[argv.index("gpt2")] = "gpt5"
    with pytest.raises(TrainingInputError, match=message):
        train_lm(*_parse(argv))
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: ")


def test_validation_file_is_read_with_its_own_column_types(tmp_path):
    """The validation file is loaded on its own: read together with the train file, its `id` column (text
    here, numbers there) made `datasets` fail casting it to the train file's int64."""
    (tmp_path / "train.csv").write_text("id,body\n" + "".join(f"{i},a cat sat\n" for i in range(10)))
    (tmp_path / "dev.csv").write_text("id,body\nx1,a dog ran\n")
    data_args = DataArguments(
        train_file=str(tmp_path / "train.csv"), validation_file=str(tmp_path / "dev.csv"), text_column="body"
    )
    raw = load_raw_splits(data_args, seed=0)
    assert raw["validation"]["body"] == ["a dog ran"] and raw["train"].num_rows == 10


def test_push_to_hub_uploads_the_finished_checkpoint(tmp_path, corpus, use_test_hub):
    """--push_to_hub goes through hfgpt-push to a Hub (here the loopback test Hub) after the final save."""
    import huggingface_hub

    sys.path.insert(0, str(Path(__file__).parent))
    from hub_server import DEFAULT_TOKENS, HubServer

    token = next(iter(DEFAULT_TOKENS))
    with HubServer(tmp_path / "hub") as hub:
        use_test_hub(hub.url)  # online, the test Hub as the endpoint, LFS uploads (it speaks no Xet)
        argv = _argv(corpus, tmp_path / "out", "--max_steps", "1", "--eval_strategy", "no")
        argv += [
            "--push_to_hub",
            "true",
            "--hub_model_id",
            f"{DEFAULT_TOKENS[token]}/tiny",
            "--hub_token",
            token,
        ]
        metrics = train_lm(*_parse(argv))
        assert "tiny" in metrics["commit_url"]
        # The token reaches the push, not the disk: Trainer pickles its arguments into training_args.bin.
        written = [path for path in (tmp_path / "out").rglob("*") if path.is_file()]
        assert any(path.name == "training_args.bin" for path in written)
        assert not [path for path in written if token.encode() in path.read_bytes()]
        files = set(
            huggingface_hub.HfApi(endpoint=hub.url, token=token).list_repo_files(
                f"{DEFAULT_TOKENS[token]}/tiny"
            )
        )
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "README.md",
        "generation_config.json",
    } <= files
    assert not any(name.startswith("checkpoint-") for name in files)


def test_push_to_hub_without_hub_model_id_goes_to_the_users_output_dir_name(tmp_path, corpus, use_test_hub):
    """As with Trainer, `--push_to_hub` alone pushes to `<token's user>/<output_dir's name>` (TrainingArguments:
    hub_model_id "will default to user_name/output_dir_name"); a name without a namespace was refused after
    training."""
    import huggingface_hub

    sys.path.insert(0, str(Path(__file__).parent))
    from hub_server import DEFAULT_TOKENS, HubServer

    token = next(iter(DEFAULT_TOKENS))
    with HubServer(tmp_path / "hub") as hub:
        use_test_hub(hub.url)
        argv = _argv(corpus, tmp_path / "my-run", "--max_steps", "1", "--eval_strategy", "no")
        argv += ["--push_to_hub", "true", "--hub_token", token]
        metrics = train_lm(*_parse(argv))
        repo_id = f"{DEFAULT_TOKENS[token]}/my-run"
        assert repo_id in metrics["commit_url"]
        files = huggingface_hub.HfApi(endpoint=hub.url, token=token).list_repo_files(repo_id)
    assert {"config.json", "model.safetensors"} <= set(files)


@pytest.mark.parametrize(
    ("hub_args", "message"),
    [
        (["--hub_model_id", "me/not a name"], "not a valid repo id"),
        (["--hub_token", "hf_refused"], "refused the token"),  # a bare name asks the Hub whose token it is
        (
            ["--hub_model_id", "me/tiny", "--hub_token", "hf_refused"],
            "refused the token",
        ),  # so does a full id
    ],
)
def test_push_to_hub_problems_stop_before_training(tmp_path, corpus, use_test_hub, hub_args, message):
    """A repo id the Hub would refuse, or a token it refuses, is an input error before any training step,
    not after the whole run."""
    sys.path.insert(0, str(Path(__file__).parent))
    from hub_server import HubServer

    with HubServer(tmp_path / "hub") as hub:
        use_test_hub(hub.url)
        argv = _argv(corpus, tmp_path / "run", "--max_steps", "1", "--eval_strategy", "no")
        with pytest.raises(TrainingInputError, match=message):
            train_lm(*_parse([*argv, "--push_to_hub", "true", *hub_args]))
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


def test_dataset_name_loads_through_datasets(tmp_path, corpus):
    """--dataset_name goes to `datasets.load_dataset`; a local dataset folder stands in for a Hub id (the
    same call, no network), and its own validation split is used instead of a held-out share."""
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    lines = Path(corpus["txt"]).read_text().splitlines()
    (folder / "train.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in lines[:100]))
    (folder / "validation.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in lines[100:]))
    argv = _argv(corpus, tmp_path / "out", "--max_steps", "1", "--eval_strategy", "no")
    argv[argv.index("--train_file") : argv.index("--train_file") + 2] = ["--dataset_name", str(folder)]
    model_args, data_args, training_args = _parse(argv)
    raw = load_raw_splits(data_args, seed=0)
    assert (raw["train"].num_rows, raw["validation"].num_rows) == (100, 20)
    assert train_lm(model_args, data_args, training_args)["train_steps"] == 1


# --- SIGTERM: a checkpoint at the next step boundary, then a documented exit ---------------------------


class SigtermDuring(TrainerCallback):
    """Sends this process a SIGTERM while step `step` runs, and records the evaluations."""

    def __init__(self, step: int):
        self.step, self.evaluations = step, 0

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
        return control

    def on_evaluate(self, args, state, control, **kwargs):
        self.evaluations += 1
        return control


def test_sigterm_saves_a_checkpoint_at_the_step_boundary_and_stops(tmp_path, corpus):
    """In-process (`train_lm(stop_on_sigterm=True)`, as hfgpt-train runs it): the step under way finishes,
    its checkpoint is saved although --save_strategy would not save it, the evaluation due at that step
    and the final export are skipped, and the previous SIGTERM handler is back afterwards."""
    noted: list[int] = []

    def guard(signum, frame):  # in place around the run: a SIGTERM that reached it would not kill pytest
        noted.append(signum)

    original = signal.signal(signal.SIGTERM, guard)
    try:
        stopper = SigtermDuring(3)
        argv = _argv(corpus, tmp_path / "out", "--max_steps", "50", "--eval_strategy", "steps")
        argv += ["--eval_steps", "3", "--save_strategy", "steps", "--save_steps", "100"]
        with pytest.raises(TrainingInterrupted, match=r"stopped after step 3 of 50") as interrupted:
            train_lm(*_parse(argv), callbacks=[stopper], stop_on_sigterm=True)
        handler_after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, original)
    assert noted == [] and handler_after is guard  # train_lm's handler took the signal, then gave way
    checkpoint = tmp_path / "out" / "checkpoint-3"
    assert interrupted.value.checkpoint == checkpoint and interrupted.value.step == 3
    assert f"--resume_from_checkpoint {checkpoint}" in str(interrupted.value)
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth"):
        assert (checkpoint / name).is_file(), name
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 3
    assert stopper.evaluations == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-3"]  # no final export


@pytest.mark.slow
def test_hfgpt_train_on_sigterm_exits_143_naming_a_checkpoint_that_resumes_exactly(tmp_path, corpus):
    """The command line in a subprocess, sent SIGTERM once it logs its first loss: exit status 143 and a
    message naming the checkpoint; resuming from it to step N gives the weights of a straight run of N
    steps (a constant learning rate, so that the interrupted run's step budget does not matter)."""
    common = ("--eval_strategy", "no", "--lr_scheduler_type", "constant", "--logging_steps", "1")
    out = tmp_path / "run"
    argv = _argv(corpus, out, "--max_steps", "100000", "--save_strategy", "no", *common)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "hfgpt.scripts.train_lm", *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    watchdog = threading.Timer(240, proc.kill)  # (reading stdout has no timeout of its own)
    watchdog.start()
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "'loss'" in line:
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
    output = "".join(seen) + rest
    assert proc.returncode == 143, output[-3000:]
    match = re.search(
        r"interrupted: SIGTERM during training: .* --resume_from_checkpoint (\S+)$", output, re.M
    )
    assert match, output[-3000:]
    checkpoint = Path(match.group(1))
    assert checkpoint.parent == out and checkpoint.name.startswith("checkpoint-")
    step = int(checkpoint.name.removeprefix("checkpoint-"))
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "optimizer.pt").is_file()
    assert not (out / "model.safetensors").exists()  # the final export is skipped

    steps = str(step + 2)
    resume = ("--resume_from_checkpoint", str(checkpoint))
    metrics = train_lm(
        *_parse(_argv(corpus, out, "--max_steps", steps, "--save_strategy", "no", *common, *resume))
    )
    assert metrics["train_steps"] == step + 2
    train_lm(
        *_parse(_argv(corpus, tmp_path / "straight", "--max_steps", steps, "--save_strategy", "no", *common))
    )
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    resumed = load_file(out / "model.safetensors")
    assert straight.keys() == resumed.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0, msg=key)
