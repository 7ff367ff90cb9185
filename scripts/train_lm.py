"""Train an hfgpt causal LM with transformers' `Trainer`: from scratch (a preset or a config file) or
continuing from a checkpoint, on local text/JSON/CSV files or a Hub dataset.

    hfgpt-train --preset gpt2 --config_overrides n_embd=256,n_layer=4,n_head=4 \
        --tokenizer_name gpt2 --train_file corpus.txt --output_dir out --num_train_epochs 1

Every `TrainingArguments` flag works as usual (`--learning_rate`, `--max_steps`, `--resume_from_checkpoint`,
`--push_to_hub --hub_model_id user/name`, ...). The text is tokenized, packed into blocks of the context
length, and the validation loss is reported with its perplexity. The output folder receives a complete
checkpoint: weights, config, generation config, tokenizer, model card (README.md) and the metrics.

Data-parallel: `accelerate launch --multi_gpu --num_processes N -m hfgpt.scripts.train_lm ...` (see the README).

SIGTERM (a scheduler's preemption, `kill`, `docker stop`) during training is not fatal: the run finishes the
step it is in, saves a Trainer checkpoint (`<output_dir>/checkpoint-<step>`, whatever `--save_strategy`
says), skips the final evaluation and export, and exits with status 143 (128 + SIGTERM), printing the
checkpoint to resume from with `--resume_from_checkpoint` (resumption is exact: the same weights as an
uninterrupted run). Under `accelerate launch` the processes agree at each step whether any of them got
the signal, so all stop after the same step, each exits with 143 once all have saved, and the launcher
reports their 143 (its own exit status is 1). Before training starts and after its last step, SIGTERM
ends the process as usual.

Exit status: 0 after training; 2 for bad input, before training starts: a usage error from the argument
parser, or a data / model / `--push_to_hub` problem printed as one `error: ...` line naming the file,
column or value at fault; also 2 for a `--push_to_hub` upload that fails after training, whose message
says the checkpoint is saved; 143 after a SIGTERM during training, once its checkpoint is saved.
"""

import ast
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import hfgpt.modeling  # noqa: F401  (registers hfgpt with the Auto classes)
from hfgpt.cpu.runtime import keep_freed_memory
from hfgpt.modeling import PRESETS, GPTConfig, GPTForCausalLM
from hfgpt.modeling.finetune import TrainingInputError

# `--keep_freed_memory`, a flag of both training command lines (this one and hfgpt-finetune).
KEEP_FREED_MEMORY_FIELD: dict[str, Any] = {
    "default": True,
    "metadata": {
        "help": "On the CPU with glibc (Linux): keep freed memory in the process for reuse, instead of "
        "mapping the large buffers of every step afresh, whose pages are then faulted in again each step; "
        "false leaves the allocator alone."
    },
}


def keep_freed_memory_on_cpu(enabled: bool, training_args: TrainingArguments) -> None:
    """Apply `keep_freed_memory()` (process-wide) when asked to and training runs on the CPU."""
    if enabled and training_args.device.type == "cpu":
        keep_freed_memory()


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Checkpoint folder to continue training from (instead of a preset)."}
    )
    preset: str | None = field(
        default=None, metadata={"help": f"Train from scratch with a preset config: {', '.join(PRESETS)}."}
    )
    config_file: str | None = field(
        default=None, metadata={"help": "Train from scratch with this config.json (a GPTConfig)."}
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated config fields for a new model, e.g. n_embd=256,n_layer=4,n_head=4."
        },
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={
            "help": "Tokenizer folder, or 'gpt2' / 'openai-gpt' for hfgpt's bundled tokenizers. Defaults "
            "to the checkpoint's own tokenizer, or GPT-2's for a new model."
        },
    )
    keep_freed_memory: bool = field(**KEEP_FREED_MEMORY_FIELD)


@dataclass
class DataArguments:
    train_file: str | None = field(
        default=None, metadata={"help": "Training data: .txt, .json/.jsonl or .csv."}
    )
    validation_file: str | None = field(default=None, metadata={"help": "Validation data, same formats."})
    dataset_name: str | None = field(
        default=None, metadata={"help": "A dataset on the Hub (instead of files)."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's config."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text (JSON/CSV/Hub)."})
    block_size: int | None = field(
        default=None, metadata={"help": "Tokens per training block; defaults to the context length."}
    )
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Share of the training data held out when there is no validation split."}
    )


# `load_dataset` builder for each local file extension.
FILE_BUILDERS: dict[str, str] = {
    ".txt": "text",
    ".text": "text",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
}

# Defaults that differ from TrainingArguments' own, chosen for CPU runs (flags still override them):
# no experiment trackers, no worker processes, and the fused AdamW kernel (one kernel over all the
# parameters per step: several times faster on the CPU than the foreach and for-loop implementations).
CPU_DEFAULTS: dict[str, Any] = {
    "report_to": "none",
    "optim": "adamw_torch_fused",
    "dataloader_num_workers": 0,
    "output_dir": "hfgpt-train-output",
    "eval_strategy": "epoch",
    "logging_steps": 10,
}


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """'gpt2' / 'openai-gpt' build hfgpt's bundled tokenizers offline; anything else is a folder."""
    if name_or_path in ("gpt2", "openai-gpt"):
        from hfgpt.tokenization import GPT1Tokenizer, GPT2Tokenizer

        return GPT2Tokenizer() if name_or_path == "gpt2" else GPT1Tokenizer()
    if not Path(name_or_path).is_dir():
        raise TrainingInputError(
            f"tokenizer {name_or_path!r} is neither 'gpt2', 'openai-gpt' nor an existing folder"
        )
    return AutoTokenizer.from_pretrained(name_or_path)


def _parse_overrides(text: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise TrainingInputError(f"--config_overrides: {item!r} is not key=value")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def build_model(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase) -> GPTForCausalLM:
    """A checkpoint to continue from, or a new model from a preset / config file (+ overrides) whose
    vocabulary is sized to the tokenizer."""
    sources = [model_args.model_name_or_path, model_args.preset, model_args.config_file]
    if sum(s is not None for s in sources) != 1:
        raise TrainingInputError("give exactly one of --model_name_or_path, --preset, --config_file")
    if model_args.model_name_or_path:
        if not Path(model_args.model_name_or_path).is_dir():
            raise TrainingInputError(f"checkpoint folder {model_args.model_name_or_path!r} does not exist")
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
        if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
        return model
    overrides = _parse_overrides(model_args.config_overrides)
    # The vocabulary and special ids come from the tokenizer the model will be trained with.
    from_tokenizer = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if model_args.preset and model_args.preset not in PRESETS:
        raise TrainingInputError(f"unknown preset {model_args.preset!r}; choose one of {', '.join(PRESETS)}")
    if model_args.config_file and not Path(model_args.config_file).is_file():
        raise TrainingInputError(f"config file {model_args.config_file!r} does not exist")
    try:
        if model_args.preset:
            config = GPTConfig.from_preset(model_args.preset, **overrides, **from_tokenizer)
        else:
            base = json.loads(Path(model_args.config_file).read_text())
            config = GPTConfig.from_dict({**base, **overrides, **from_tokenizer})
    except (ValueError, TypeError, StrictDataclassError) as err:
        # GPTConfig validates every field; the last line of its message names the one at fault.
        raise TrainingInputError(
            f"invalid model config: {str(err).strip().splitlines()[-1].strip()}"
        ) from err
    return GPTForCausalLM(config)


def _check_file(path: str, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise TrainingInputError(f"{what} {path!r} does not exist")
    if p.suffix.lower() not in FILE_BUILDERS:
        raise TrainingInputError(
            f"{what} {path!r}: unsupported extension; use one of {', '.join(FILE_BUILDERS)}"
        )
    if p.stat().st_size == 0:
        raise TrainingInputError(f"{what} {path!r} is empty")
    return FILE_BUILDERS[p.suffix.lower()]


def load_local_files(files: dict[str, str | None]) -> datasets.DatasetDict:
    """Local data files by split (`{"train": path, "validation": path or None}`), each checked, then loaded
    on its own: one `load_dataset` call over both would make the validation file follow the train file's
    schema and fail inside `datasets` on a column or a type the two do not share."""
    paths = {split: path for split, path in files.items() if path is not None}
    builders = {split: _check_file(path, f"{split}_file") for split, path in paths.items()}
    if len(set(builders.values())) > 1:
        described = " but ".join(f"{split}_file {paths[split]!r} is {b}" for split, b in builders.items())
        raise TrainingInputError(f"{described}; give every data file in the same format")
    out = {}
    for split, builder in builders.items():
        try:
            out[split] = datasets.load_dataset(builder, data_files={split: paths[split]}, split=split)
        except datasets.exceptions.DatasetGenerationError as err:
            cause = str(err.__cause__ or err).strip().splitlines()[-1]
            raise TrainingInputError(
                f"{split}_file {paths[split]!r} could not be read as {builder}: {cause}"
            ) from err
        except ValueError as err:  # datasets' answer to a file with no rows ("corresponds to no data")
            if "no data" not in str(err):
                raise
            raise TrainingInputError(f"{split}_file {paths[split]!r} holds no rows") from err
    return datasets.DatasetDict(out)


def _check_text_column(split: datasets.Dataset, name: str, column: str) -> None:
    if column not in split.column_names:
        raise TrainingInputError(
            f"{name} data has no column {column!r} (columns: "
            f"{', '.join(split.column_names)}); choose one with --text_column"
        )
    feature = split.features[column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        kind = feature.dtype if isinstance(feature, datasets.Value) else f"{type(feature).__name__} (mixed)"
        raise TrainingInputError(
            f"{name} data column {column!r} holds {kind} values, not text; "
            "choose a text column with --text_column"
        )


def load_raw_splits(data_args: DataArguments, seed: int) -> datasets.DatasetDict:
    """The train and validation splits as `datasets`, checked for the text column."""
    if data_args.dataset_name:
        raw = datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name)
    elif data_args.train_file:
        raw = load_local_files({"train": data_args.train_file, "validation": data_args.validation_file})
    else:
        raise TrainingInputError("give --train_file (a local file) or --dataset_name (a Hub dataset)")
    if "train" not in raw:
        raise TrainingInputError(f"the dataset has no 'train' split (splits: {', '.join(raw)})")
    if raw["train"].num_rows == 0:
        raise TrainingInputError("the train data has no rows")
    if "validation" not in raw:
        percentage = data_args.validation_split_percentage
        if not 0 < percentage < 100:
            raise TrainingInputError(
                "--validation_split_percentage must be in (0, 100) without a validation split"
            )
        n_rows = raw["train"].num_rows
        # train_test_split holds out ceil(share * rows) and needs at least one row left to train on.
        if n_rows - math.ceil(percentage / 100 * n_rows) < 1:
            raise TrainingInputError(
                f"the train data has {n_rows} row(s), too few to hold out {percentage}% for validation and "
                "keep a row to train on; give --validation_file or more rows"
            )
        split = raw["train"].train_test_split(test_size=percentage / 100, seed=seed)
        raw = datasets.DatasetDict(train=split["train"], validation=split["test"])
    for name in ("train", "validation"):
        _check_text_column(raw[name], name, data_args.text_column)
        if raw[name].num_rows == 0:
            raise TrainingInputError(f"the {name} data has no rows")
    return datasets.DatasetDict(train=raw["train"], validation=raw["validation"])


def pack_blocks(
    raw: datasets.DatasetDict, tokenizer: PreTrainedTokenizerBase, text_column: str, block_size: int
) -> datasets.DatasetDict:
    """Tokenize every row, end it with the EOS token (so packed documents stay separated, as GPT-2's
    `<|endoftext|>` did in WebText), concatenate, and cut into `block_size` blocks (labels = inputs)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        ids = tokenizer([t or "" for t in batch[text_column]], add_special_tokens=False)["input_ids"]
        return {"input_ids": [row + eos for row in ids if row]}

    def group(batch: dict[str, list]) -> dict[str, list]:
        flat = [token for row in batch["input_ids"] for token in row]
        n = len(flat) // block_size * block_size
        blocks = [flat[i : i + block_size] for i in range(0, n, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    out = {}
    for name, split in raw.items():
        tokens = split.map(tokenize, batched=True, remove_columns=split.column_names, desc=f"tokenize {name}")
        n_tokens = sum(len(r) for r in tokens["input_ids"])
        if n_tokens < block_size:
            raise TrainingInputError(
                f"the {name} data has {n_tokens} tokens, fewer than one block of {block_size}; "
                "add text or lower --block_size"
            )
        # One batch for the whole split: blocks span row boundaries, as in the original packed training.
        out[name] = tokens.map(group, batched=True, batch_size=None, desc=f"pack {name}")
    return datasets.DatasetDict(out)


def write_model_card(model: Any, directory: Path, **facts: Any) -> None:
    """README.md through hfgpt.model_cards."""
    from hfgpt.model_cards import render_model_card

    render_model_card("trained", config=model.config, **facts).save(directory / "README.md")


def save_complete_checkpoint(
    trainer: Trainer, tokenizer: PreTrainedTokenizerBase, output_dir: str, card_facts: dict[str, Any]
) -> None:
    """Model, generation config, tokenizer, model card and metrics into `output_dir`.

    Everything is written to a temporary folder inside `output_dir` first and moved into place only when
    complete, `config.json` last, so a reader never sees weights without their config. `save_model` runs
    on every process (FSDP gathers the weights collectively); only the main process writes."""
    final, tmp = Path(output_dir), Path(output_dir) / ".hfgpt-final.tmp"
    trainer.save_model(str(tmp))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(tmp)
        write_model_card(trainer.model, tmp, **card_facts)
        names = sorted((p.name for p in tmp.iterdir()), key=lambda n: n == "config.json")
        for name in names:
            target = final / name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(tmp / name, target)
        shutil.rmtree(tmp)
    trainer.accelerator.wait_for_everyone()


@dataclass(frozen=True)
class HubTarget:
    """Where `--push_to_hub` uploads the finished checkpoint, and with which token."""

    repo_id: str
    token: str | None


def hub_target(training_args: TrainingArguments) -> HubTarget | None:
    """Where `--push_to_hub` uploads (None without it), resolved and checked before any work: as Trainer,
    `--hub_model_id` defaulting to the output folder's name, and a name without a namespace under the
    token's user. The token is checked with the Hub whatever the name, so a missing or refused one fails
    here, not after training. Both are then taken out of `training_args`: `push_to_hub`, since hfgpt-push
    uploads the complete checkpoint after training rather than Trainer at each save, and `hub_token`,
    since Trainer pickles its arguments into `training_args.bin` beside every checkpoint."""
    if not training_args.push_to_hub:
        return None
    from hfgpt.scripts.push_to_hub import PushError, check_repo_id, token_user

    name = training_args.hub_model_id or Path(training_args.output_dir).absolute().name
    token = training_args.hub_token
    try:
        if "/" in name:
            check_repo_id(name)  # a malformed id is refused before any network call
            token_user(name, token)
            repo_id = name
        else:
            repo_id = f"{token_user(name, token)}/{name}"
            check_repo_id(repo_id)
    except PushError as err:
        raise TrainingInputError(f"--push_to_hub: {err}") from err
    training_args.push_to_hub, training_args.hub_token = False, None
    return HubTarget(repo_id, token)


def push_checkpoint(training_args: TrainingArguments, target: HubTarget) -> str:
    """Upload the finished checkpoint in `output_dir` to `target` (`hub_target`) with hfgpt-push
    (`--hub_private_repo` as in Trainer). Imported lazily: only pushes need it."""
    from hfgpt.scripts.push_to_hub import PushError, push_to_hub

    try:
        info = push_to_hub(
            training_args.output_dir,
            target.repo_id,
            private=bool(training_args.hub_private_repo),
            token=target.token,
        )
    except PushError as err:
        raise TrainingInputError(
            f"the checkpoint is saved in {training_args.output_dir}, but pushing it to {target.repo_id} "
            f"failed: {err}"
        ) from err
    return info.commit_url


# hfgpt-train's exit status after a SIGTERM during training, once its checkpoint is saved (128 + SIGTERM,
# as a shell reports a process that SIGTERM ended).
EXIT_INTERRUPTED = 128 + signal.SIGTERM


class TrainingInterrupted(Exception):
    """Training stopped at a step boundary on SIGTERM, after saving `checkpoint` (a Trainer checkpoint
    folder to pass to `--resume_from_checkpoint`)."""

    def __init__(self, checkpoint: Path, step: int, max_steps: int):
        super().__init__(
            f"SIGTERM during training: stopped after step {step} of {max_steps} and saved the checkpoint "
            f"{checkpoint}; resume with the same arguments and --resume_from_checkpoint {checkpoint}"
        )
        self.checkpoint, self.step = checkpoint, step


class StopOnSigterm(TrainerCallback):
    """Turns a SIGTERM during `trainer.train()` into a clean stop: `handling_sigterm()` installs a handler
    that only notes the signal; at the next step end, the callback asks Trainer to save a checkpoint and
    stop (no evaluation on the way out), and records the folder in `checkpoint`.

    Under data parallelism every process takes part in the same decision at every step end (a one-number
    all-reduce, on the CPU through gloo where it can), so they all stop after the same step: one process
    stopping alone would leave the others waiting in their next gradient all-reduce."""

    def __init__(self) -> None:
        self.requested = False  # a SIGTERM arrived (in this process)
        self.stopping = False  # the checkpoint of this step is being saved, then training stops
        self.checkpoint: Path | None = None
        self._group: Any = None

    @contextlib.contextmanager
    def handling_sigterm(self) -> Iterator[None]:
        """The SIGTERM handler, in place for the block (the main thread's only: elsewhere Python cannot
        set one, and the signal keeps its usual effect); the previous one is restored after it."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGTERM, self._note_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _note_sigterm(self, signum: int, frame: object) -> None:
        self.requested = True  # (nothing more in a signal handler: Trainer acts at the step's end)

    def on_train_begin(self, args, state, control, **kwargs):
        if args.world_size > 1 and torch.distributed.is_initialized():
            # A CPU group, so that the per-step vote never waits for a GPU's queued work.
            if torch.distributed.get_backend() == "gloo":
                self._group = torch.distributed.group.WORLD
            else:
                try:
                    self._group = torch.distributed.new_group(backend="gloo")
                except (RuntimeError, ValueError):  # a torch without gloo: vote on the training device
                    self._group = None

    def _any_process_requested(self, args) -> bool:
        if not (args.world_size > 1 and torch.distributed.is_initialized()):
            return self.requested
        on_cpu = self._group is not None
        vote = torch.tensor([int(self.requested)], device="cpu" if on_cpu else args.device)
        group = self._group if on_cpu else None
        torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MAX, group=group)
        return bool(vote.item())

    def on_step_end(self, args, state, control, **kwargs):
        if not self.stopping and self._any_process_requested(args):
            self.stopping = True
            control.should_save = True
            control.should_training_stop = True
            control.should_evaluate = False
        return control

    def on_save(self, args, state, control, **kwargs):
        if self.stopping and self.checkpoint is None:
            self.checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.stopping:  # the step's checkpoint is saved: no end-of-epoch evaluation or second save
            control.should_save = False
            control.should_evaluate = False
        return control


def train_lm(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: TrainingArguments,
    callbacks: list[TrainerCallback] | None = None,
    stop_on_sigterm: bool = False,
) -> dict[str, Any]:
    """Train, evaluate, save a complete checkpoint to `training_args.output_dir`, optionally push it.
    Returns the metrics (train_loss, eval_loss, perplexity, ...).

    With `stop_on_sigterm` (hfgpt-train's), a SIGTERM during training saves a Trainer checkpoint at the
    next step boundary and raises `TrainingInterrupted` naming it (see the module's docstring)."""
    target = hub_target(training_args)
    set_seed(training_args.seed)

    if model_args.tokenizer_name:
        tokenizer = load_tokenizer(model_args.tokenizer_name)
    elif model_args.model_name_or_path:
        tokenizer = load_tokenizer(model_args.model_name_or_path)
    else:
        tokenizer = load_tokenizer("gpt2")
    model = build_model(model_args, tokenizer)
    n_ctx = model.config.n_positions
    block_size = data_args.block_size or n_ctx
    if not 1 < block_size <= n_ctx:
        raise TrainingInputError(f"--block_size {block_size} must be in [2, {n_ctx}] (the model's context)")

    with training_args.main_process_first(desc="dataset preparation"):
        raw = load_raw_splits(data_args, training_args.seed)
        lm_data = pack_blocks(raw, tokenizer, data_args.text_column, block_size)

    sigterm = StopOnSigterm() if stop_on_sigterm else None
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=lm_data["train"],
        eval_dataset=lm_data["validation"],
        data_collator=default_data_collator,
        processing_class=tokenizer,
        callbacks=[*(callbacks or []), sigterm] if sigterm is not None else callbacks,
    )
    with sigterm.handling_sigterm() if sigterm is not None else contextlib.nullcontext():
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if sigterm is not None and sigterm.checkpoint is not None:
        # Every process has written its part of the checkpoint (its RNG state) before any exits: a launcher
        # ends the others as soon as one process exits with an error status.
        trainer.accelerator.wait_for_everyone()
        raise TrainingInterrupted(sigterm.checkpoint, trainer.state.global_step, trainer.state.max_steps)
    metrics = {**result.metrics, "train_steps": trainer.state.global_step}
    eval_metrics = trainer.evaluate()
    eval_metrics["perplexity"] = math.exp(min(eval_metrics["eval_loss"], 700.0))
    metrics.update(eval_metrics)
    trainer.log_metrics("eval", eval_metrics)
    trainer.save_metrics("all", metrics)

    data_name = data_args.dataset_name or Path(data_args.train_file).name
    card_facts = {
        "datasets": [data_args.dataset_name] if data_args.dataset_name else None,
        "description": f"A causal language model trained with hfgpt-train on {data_name}.",
        "base_model": None,
        "task": "causal language modelling",
        "training": {
            "steps": trainer.state.global_step,
            "learning_rate": training_args.learning_rate,
            "batch size per device": training_args.per_device_train_batch_size,
            "block size": block_size,
            "validation loss": round(eval_metrics["eval_loss"], 4),
            "validation perplexity": round(eval_metrics["perplexity"], 3),
        },
    }
    save_complete_checkpoint(trainer, tokenizer, training_args.output_dir, card_facts)
    if target is not None and trainer.is_world_process_zero():
        metrics["commit_url"] = push_checkpoint(training_args, target)
    return metrics


def make_parser() -> HfArgumentParser:
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    parser.set_defaults(**CPU_DEFAULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    transformers.utils.logging.set_verbosity_warning()
    keep_freed_memory_on_cpu(model_args.keep_freed_memory, training_args)
    try:
        metrics = train_lm(model_args, data_args, training_args, stop_on_sigterm=True)
    except TrainingInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except TrainingInterrupted as err:
        if training_args.process_index == 0:
            print(f"interrupted: {err}", file=sys.stderr)
        return EXIT_INTERRUPTED
    # One line per process, so a data-parallel run shows that every process trained.
    print(
        f"[process {training_args.process_index}/{training_args.world_size}] trained "
        f"{metrics['train_steps']} steps"
    )
    if training_args.process_index == 0:
        summary = {k: metrics[k] for k in ("train_loss", "eval_loss", "perplexity") if k in metrics}
        print(json.dumps(summary, indent=2))
        print(f"checkpoint: {training_args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
