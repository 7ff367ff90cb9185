"""Fine-tune an hfgpt checkpoint on a classification task with transformers' `Trainer`: GPT-1's recipe
(Radford et al. 2018, §3.3) or plain GPT-2 sequence classification.

    # GPT-1 recipe, entailment on local CSV files (columns premise, hypothesis, label):
    hfgpt-finetune --model_name_or_path ./openai-gpt --tokenizer_name openai-gpt --task entailment \
        --text_columns premise,hypothesis --train_file train.csv --validation_file dev.csv --output_dir out

    # Multiple choice (ROCStories-style: a context and one column per ending, label = right ending):
    hfgpt-finetune --model_name_or_path ./openai-gpt --task multiple_choice \
        --text_columns story,ending1,ending2 --train_file train.jsonl --output_dir out

The defaults are the paper's fine-tuning hyper-parameters (§4.1 / train.py): learning rate 6.25e-5,
batch 32, 3 epochs, linear decay with 0.2% warm-up, weight decay 0.01, gradient clipping 1, and the
auxiliary LM objective with lambda 0.5 (`--lm_loss_weight 0` gives plain L2). `--recipe plain` skips the
added tokens and pools at the last token, as transformers' GPT2ForSequenceClassification does. Metrics
(`--metrics accuracy,f1` or `pearsonr` for regression) are computed offline with hfgpt's evaluate metrics.
"""

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import transformers
from huggingface_hub.errors import StrictDataclassError
from transformers import (
    HfArgumentParser,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

import hfgpt.modeling  # noqa: F401  (registers hfgpt with the Auto classes)
from hfgpt.modeling import PRESETS, GPTConfig, GPTDoubleHeadsModel, GPTForSequenceClassification
from hfgpt.modeling.finetune import (
    TASK_TEXT_COLUMNS,
    TASKS,
    FinetuneInputError,
    TaskCollator,
    TrainingInputError,
    add_finetune_tokens,
    check_length,
    compute_metrics_fn,
    pick_classification_logits,
    transform_example,
)
from hfgpt.scripts.train_lm import (
    KEEP_FREED_MEMORY_FIELD,
    _check_file,
    _parse_overrides,
    keep_freed_memory_on_cpu,
    load_tokenizer,
    push_checkpoint,
    save_complete_checkpoint,
)
from hfgpt.tokenization import resize_embeddings_to_tokenizer


@dataclass
class FinetuneArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "Pre-trained checkpoint folder."})
    preset: str | None = field(
        default=None, metadata={"help": f"Start from an untrained preset instead: {', '.join(PRESETS)}."}
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": "e.g. n_embd=32,n_layer=2 (with --preset)."}
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={"help": "Tokenizer folder or 'gpt2' / 'openai-gpt'; default: the checkpoint's."},
    )
    task: str = field(default="classification", metadata={"help": f"One of {', '.join(TASKS)}."})
    recipe: str = field(
        default="gpt1",
        metadata={"help": "'gpt1': the paper's input transforms and L2 + lambda*L1; 'plain': GPT-2 style."},
    )
    text_columns: str = field(
        default="text",
        metadata={"help": "Comma-separated text columns (multiple choice: context, then choices)."},
    )
    label_column: str = field(default="label", metadata={"help": "Column holding the label."})
    num_labels: int | None = field(
        default=None, metadata={"help": "Classes (1 = regression); default: inferred."}
    )
    lm_loss_weight: float = field(
        default=0.5, metadata={"help": "lambda of L3 = L2 + lambda*L1 (0 = plain L2)."}
    )
    truncate: bool = field(
        default=True,
        metadata={"help": "Cut segments as train.py does; with --truncate false, refuse long inputs."},
    )
    metrics: str = field(default="accuracy", metadata={"help": "Comma-separated: accuracy, f1, pearsonr."})
    train_file: str | None = field(default=None, metadata={"help": "Training data: .json/.jsonl or .csv."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation data, same format."})
    dataset_name: str | None = field(
        default=None, metadata={"help": "A dataset on the Hub (instead of files)."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's config."})
    validation_split_name: str = field(
        default="validation", metadata={"help": "The Hub dataset's eval split."}
    )
    keep_freed_memory: bool = field(**KEEP_FREED_MEMORY_FIELD)


# The paper's fine-tuning hyper-parameters (§4.1 "Fine-tuning details"; train.py's argparse defaults), plus
# the CPU-friendly settings of hfgpt-train. Every one can be overridden on the command line.
GPT1_FINETUNE_DEFAULTS: dict[str, Any] = {
    "learning_rate": 6.25e-5,
    "per_device_train_batch_size": 32,
    "num_train_epochs": 3,
    "lr_scheduler_type": "linear",
    "warmup_steps": 0.002,  # a float in [0, 1) is a ratio of the total steps: 0.2% warm-up
    "weight_decay": 0.01,
    "max_grad_norm": 1.0,
    "report_to": "none",
    "optim": "adamw_torch_fused",
    "dataloader_num_workers": 0,
    "eval_strategy": "epoch",
    "save_strategy": "epoch",
    "logging_steps": 10,
    "output_dir": "hfgpt-finetune-output",
}


def load_splits(args: FinetuneArguments) -> datasets.DatasetDict:
    if args.dataset_name:
        raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        splits = {"train": "train", "validation": args.validation_split_name}
    elif args.train_file:
        files = {"train": args.train_file}
        builder = _check_file(args.train_file, "train_file")
        if builder == "text":
            raise FinetuneInputError(
                f"train_file {args.train_file!r}: use a .csv or .json file with label columns"
            )
        if args.validation_file:
            _check_file(args.validation_file, "validation_file")
            files["validation"] = args.validation_file
        raw = datasets.load_dataset(builder, data_files=files)
        splits = {name: name for name in files}
    else:
        raise FinetuneInputError("give --train_file (a local file) or --dataset_name (a Hub dataset)")
    out = {}
    for ours, theirs in splits.items():
        if theirs not in raw:
            raise FinetuneInputError(f"the dataset has no {theirs!r} split (splits: {', '.join(raw)})")
        if raw[theirs].num_rows == 0:
            raise FinetuneInputError(f"the {ours} data has no rows")
        out[ours] = raw[theirs]
    return datasets.DatasetDict(out)


def _columns(args: FinetuneArguments) -> list[str]:
    columns = [c.strip() for c in args.text_columns.split(",") if c.strip()]
    low, high = TASK_TEXT_COLUMNS[args.task]
    if len(columns) < low or (high is not None and len(columns) > high):
        expected = f"{low}" if low == high else f"at least {low}"
        raise FinetuneInputError(
            f"task {args.task!r} reads {expected} text column(s), got --text_columns {args.text_columns!r}"
        )
    return columns


def _check_columns(raw: datasets.DatasetDict, needed: list[str]) -> None:
    for name, split in raw.items():
        missing = [c for c in needed if c not in split.column_names]
        if missing:
            raise FinetuneInputError(
                f"{name} data has no column {missing[0]!r} (columns: {', '.join(split.column_names)})"
            )


def resolve_labels(
    raw: datasets.DatasetDict, args: FinetuneArguments, n_choices: int
) -> tuple[int, dict[Any, int] | None]:
    """Number of labels and, for text labels, the label -> id table; every label checked before training."""
    column = args.label_column
    if args.task == "multiple_choice":
        num_labels, table = n_choices, None
    elif all(isinstance(v, str) for v in raw["train"][column]):
        names = sorted(set(raw["train"][column]))
        num_labels, table = len(names), {name: i for i, name in enumerate(names)}
    else:
        train_labels = raw["train"][column]
        for name, split in raw.items():
            for row, value in enumerate(split[column]):
                if not isinstance(value, (int, float)) or (isinstance(value, float) and math.isnan(value)):
                    raise FinetuneInputError(
                        f"{name} data row {row}: label {value!r} is not a number or a name"
                    )
        is_float = any(isinstance(v, float) and not float(v).is_integer() for v in train_labels)
        num_labels = args.num_labels or (1 if is_float else int(max(train_labels)) + 1)
        table = None
    if args.num_labels is not None and table is not None and args.num_labels != num_labels:
        raise FinetuneInputError(
            f"--num_labels {args.num_labels} but the train data has {num_labels} label names"
        )
    if num_labels == 1:
        return num_labels, None  # regression: any number
    for name, split in raw.items():
        for row, value in enumerate(split[column]):
            if table is not None:
                if value not in table:
                    raise FinetuneInputError(
                        f"{name} data row {row}: label {value!r} does not occur in the train data"
                    )
            elif value is None or float(value) != int(value) or not 0 <= int(value) < num_labels:
                what = "choices" if args.task == "multiple_choice" else "num_labels"
                raise FinetuneInputError(
                    f"{name} data row {row}: label {value!r} is outside [0, {num_labels}) ({what})"
                )
    return num_labels, table


def _encode(tokenizer: PreTrainedTokenizerBase, text: Any) -> list[int]:
    return tokenizer(str(text if text is not None else ""), add_special_tokens=False)["input_ids"]


def build_model(
    args: FinetuneArguments, tokenizer: PreTrainedTokenizerBase, num_labels: int, classify_id: int | None
) -> GPTForSequenceClassification | GPTDoubleHeadsModel:
    model_class = GPTDoubleHeadsModel if args.task == "multiple_choice" else GPTForSequenceClassification
    settings = dict(
        lm_loss_weight=args.lm_loss_weight if args.recipe == "gpt1" else 0.0,
        classify_token_id=classify_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    if args.task != "multiple_choice":
        settings["num_labels"] = num_labels
    if (args.model_name_or_path is None) == (args.preset is None):
        raise FinetuneInputError("give exactly one of --model_name_or_path, --preset")
    if args.model_name_or_path:
        if not Path(args.model_name_or_path).is_dir():
            raise FinetuneInputError(f"checkpoint folder {args.model_name_or_path!r} does not exist")
        model = model_class.from_pretrained(args.model_name_or_path, **settings)
    else:
        if args.preset not in PRESETS:
            raise FinetuneInputError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
        overrides = {**_parse_overrides(args.config_overrides), **settings, "vocab_size": len(tokenizer)}
        try:
            config = GPTConfig.from_preset(args.preset, **overrides)
        except (ValueError, TypeError, StrictDataclassError) as err:
            raise FinetuneInputError(
                f"invalid model config: {str(err).strip().splitlines()[-1].strip()}"
            ) from err
        model = model_class(config)
    # The recipe's added tokens get fresh N(0, 0.02) rows, as train.py draws them.
    return resize_embeddings_to_tokenizer(model, tokenizer)


def finetune(
    args: FinetuneArguments, training_args: TrainingArguments, callbacks: list[TrainerCallback] | None = None
) -> dict[str, Any]:
    """Prepare and check the data (every error before training starts), fine-tune, evaluate, save."""
    if args.task not in TASKS:
        raise FinetuneInputError(f"unknown task {args.task!r}; choose one of {', '.join(TASKS)}")
    if args.recipe not in ("gpt1", "plain"):
        raise FinetuneInputError(f"unknown recipe {args.recipe!r}; choose 'gpt1' or 'plain'")
    if args.recipe == "plain" and args.task not in ("classification", "entailment"):
        raise FinetuneInputError(f"--recipe plain supports classification and entailment, not {args.task!r}")
    push, training_args.push_to_hub = training_args.push_to_hub, False
    set_seed(training_args.seed)

    columns = _columns(args)
    raw = load_splits(args)
    _check_columns(raw, [*columns, args.label_column])
    num_labels, label_table = resolve_labels(raw, args, n_choices=len(columns) - 1)

    tokenizer = load_tokenizer(args.tokenizer_name or args.model_name_or_path or "gpt2")
    tokens = add_finetune_tokens(tokenizer) if args.recipe == "gpt1" else None
    model = build_model(args, tokenizer, num_labels, tokens.classify if tokens else None)
    n_ctx = model.config.n_positions
    label_key = "mc_labels" if args.task == "multiple_choice" else "labels"

    def transform(row: dict[str, Any], index: int) -> dict[str, Any]:
        texts = [_encode(tokenizer, row[c]) for c in columns]
        if tokens is not None:
            ids = transform_example(args.task, texts, tokens, n_ctx, truncate=args.truncate)
        else:
            # Plain GPT-2: the texts joined by EOS, pooled at the last token.
            sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
            ids = texts[0] + [t for text in texts[1:] for t in sep + text]
            ids = ids[:n_ctx] if args.truncate else ids
        check_length(ids, n_ctx, f"row {index}")
        label = row[args.label_column]
        label = label_table[label] if label_table else (float(label) if num_labels == 1 else int(label))
        return {"input_ids": ids, label_key: label}

    encoded = datasets.DatasetDict(
        {
            name: split.map(
                transform, with_indices=True, remove_columns=split.column_names, desc=f"transform {name}"
            )
            for name, split in raw.items()
        }
    )
    if label_table:
        model.config.id2label = {i: str(name) for name, i in label_table.items()}
        model.config.label2id = {str(name): i for name, i in label_table.items()}

    metric_names = [m.strip() for m in args.metrics.split(",") if m.strip()]
    training_args.label_names = [label_key]
    has_eval = "validation" in encoded
    if not has_eval:
        training_args.eval_strategy = "no"
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=encoded["train"],
        eval_dataset=encoded.get("validation"),
        data_collator=TaskCollator(pad_token_id=model.config.pad_token_id or 0),
        processing_class=tokenizer,
        compute_metrics=compute_metrics_fn(metric_names, regression=num_labels == 1, num_labels=num_labels),
        preprocess_logits_for_metrics=pick_classification_logits,
        callbacks=callbacks,
    )
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = dict(result.metrics)
    if has_eval:
        metrics.update(trainer.evaluate())
        trainer.log_metrics("eval", {k: v for k, v in metrics.items() if k.startswith("eval_")})
    trainer.save_metrics("all", metrics)

    card_facts = {
        "description": f"Fine-tuned with hfgpt-finetune ({args.recipe} recipe, task {args.task}).",
        "base_model": None,
        "datasets": [args.dataset_name] if args.dataset_name else None,
        "task": args.task.replace("_", " "),
        "training": {
            "steps": trainer.state.global_step,
            "learning_rate": training_args.learning_rate,
            "batch size per device": training_args.per_device_train_batch_size,
            "lambda (auxiliary LM loss)": model.config.lm_loss_weight,
            **{k: round(v, 4) for k, v in metrics.items() if k.startswith("eval_") and isinstance(v, float)},
        },
    }
    save_complete_checkpoint(trainer, tokenizer, training_args.output_dir, card_facts)
    if push and trainer.is_world_process_zero():
        metrics["commit_url"] = push_checkpoint(training_args)
    return metrics


def make_parser() -> HfArgumentParser:
    parser = HfArgumentParser((FinetuneArguments, TrainingArguments))
    parser.set_defaults(**GPT1_FINETUNE_DEFAULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, training_args = make_parser().parse_args_into_dataclasses(args=argv)
    transformers.utils.logging.set_verbosity_warning()
    keep_freed_memory_on_cpu(args.keep_freed_memory, training_args)
    try:
        metrics = finetune(args, training_args)
    except TrainingInputError as err:  # FinetuneInputError included
        print(f"error: {err}", file=sys.stderr)
        return 2
    if training_args.process_index == 0:
        shown = {k: v for k, v in metrics.items() if k.startswith("eval_") or k == "train_loss"}
        print(json.dumps({k: float(np.round(v, 6)) for k, v in shown.items()}, indent=2))
        print(f"checkpoint: {training_args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
