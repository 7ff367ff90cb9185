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
(`--metrics accuracy,f1`; `pearsonr`, the default, for regression) are computed offline with hfgpt's
evaluate metrics.

Exit status: 0 after training; 2 for bad input, before training starts: a usage error from the argument
parser, or a data / model / `--push_to_hub` problem printed as one `error: ...` line naming the file,
column or value at fault; also 2 for a `--push_to_hub` upload that fails after training, whose message
says the checkpoint is saved.
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
    transform_plain,
)
from hfgpt.scripts.train_lm import (
    KEEP_FREED_MEMORY_FIELD,
    _check_file,
    _parse_overrides,
    hub_target,
    keep_freed_memory_on_cpu,
    load_local_files,
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
    metrics: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated: accuracy, f1, pearsonr; default accuracy (pearsonr for regression)."
        },
    )
    train_file: str | None = field(default=None, metadata={"help": "Training data: .json/.jsonl or .csv."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation data, same format."})
    dataset_name: str | None = field(
        default=None, metadata={"help": "A dataset on the Hub (instead of files)."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's config."})
    validation_split_name: str = field(
        default="validation", metadata={"help": "The Hub dataset's eval split."}
    )
    ignore_mismatched_sizes: bool = field(
        default=False,
        metadata={
            "help": "Start a new classification head when the checkpoint's has another number of labels "
            "(as transformers' run_glue.py)."
        },
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
        if _check_file(args.train_file, "train_file") == "text":
            raise FinetuneInputError(
                f"train_file {args.train_file!r}: use a .csv or .json file with label columns"
            )
        raw = load_local_files({"train": args.train_file, "validation": args.validation_file})
        splits = {name: name for name in raw}
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


def _is_missing(value: Any) -> bool:
    # A JSON row without the key, a null, or an empty CSV cell (None, or NaN in a numeric column).
    return value is None or (isinstance(value, float) and math.isnan(value))


def _check_columns(raw: datasets.DatasetDict, text_columns: list[str], label_column: str) -> None:
    """Every column present, and every text there: a missing text would silently train on ""."""
    for name, split in raw.items():
        missing = [c for c in [*text_columns, label_column] if c not in split.column_names]
        if missing:
            raise FinetuneInputError(
                f"{name} data has no column {missing[0]!r} (columns: {', '.join(split.column_names)})"
            )
        for column in text_columns:
            for row, value in enumerate(split[column]):
                if _is_missing(value):
                    raise FinetuneInputError(
                        f"{name} data row {row}: column {column!r} has no text (missing or null)"
                    )


def _label_kind(value: Any) -> str | None:
    """A label's kind: "name" (a string), "number", or None for anything else (missing, NaN, a list)."""
    if isinstance(value, str):
        return "name"
    if isinstance(value, (int, float)) and not _is_missing(value):
        return "number"
    return None


def _is_number_text(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def resolve_labels(
    raw: datasets.DatasetDict, args: FinetuneArguments, n_choices: int
) -> tuple[int, dict[Any, int] | None]:
    """Number of labels and, for text labels, the label -> id table; every label checked before training.

    A label column holds names (strings, each a class) or numbers (class ids, or scores when one is not
    a whole number: regression), the same kind in every split."""
    column = args.label_column
    train_kinds: dict[str, tuple[int, Any]] = {}  # kind -> (first row, value) in the train data
    for name, split in raw.items():
        for row, value in enumerate(split[column]):
            kind = _label_kind(value)
            if kind is None:
                raise FinetuneInputError(f"{name} data row {row}: label {value!r} is not a number or a name")
            if name == "train":
                train_kinds.setdefault(kind, (row, value))
    if len(train_kinds) > 1:
        (name_row, a_name), (number_row, a_number) = train_kinds["name"], train_kinds["number"]
        raise FinetuneInputError(
            f"train data row {max(name_row, number_row)}: the label column mixes names and numbers "
            f"(row {name_row}: {a_name!r}, row {number_row}: {a_number!r}); use one kind"
        )
    (train_kind,) = train_kinds
    if args.task == "multiple_choice" and train_kind == "name":
        row, value = train_kinds["name"]
        raise FinetuneInputError(
            f"train data row {row}: label {value!r} is a name; multiple choice labels are choice numbers"
        )
    for name, split in raw.items():
        values = list(split[column])
        odd = [row for row, value in enumerate(values) if _label_kind(value) != train_kind]
        if odd:
            # A CSV column holding one word reads every label as text ('1' too): name the word.
            words = [row for row in odd if not _is_number_text(values[row])]
            row = (words or odd)[0]
            raise FinetuneInputError(
                f"{name} data row {row}: label {values[row]!r} is a {_label_kind(values[row])}, but the "
                f"train data's labels are {train_kind}s"
            )

    train_labels = raw["train"][column]
    if args.task == "multiple_choice":
        num_labels, table = n_choices, None
    elif train_kind == "name":
        names = sorted(set(train_labels))
        num_labels, table = len(names), {name: i for i, name in enumerate(names)}
    else:
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
            elif float(value) != int(value) or not 0 <= int(value) < num_labels:
                what = "choices" if args.task == "multiple_choice" else "num_labels"
                raise FinetuneInputError(
                    f"{name} data row {row}: label {value!r} is outside [0, {num_labels}) ({what})"
                )
    return num_labels, table


def _encode(tokenizer: PreTrainedTokenizerBase, text: Any) -> list[int]:
    # User text never becomes a control token: a literal "_classify_" (or "<|endoftext|>") in the data is
    # encoded as ordinary text, as OpenAI's TextEncoder / encoder.py encode it; only the recipe's
    # transforms insert the added tokens' ids.
    return tokenizer(str(text), add_special_tokens=False, split_special_tokens=True)["input_ids"]


def checkpoint_config(args: FinetuneArguments) -> GPTConfig | None:
    """The config of `--model_name_or_path` (None for a new model from `--preset`)."""
    if (args.model_name_or_path is None) == (args.preset is None):
        raise FinetuneInputError("give exactly one of --model_name_or_path, --preset")
    if args.model_name_or_path is None:
        return None
    if not Path(args.model_name_or_path).is_dir():
        raise FinetuneInputError(f"checkpoint folder {args.model_name_or_path!r} does not exist")
    return GPTConfig.from_pretrained(args.model_name_or_path)


def _has_classification_head(config: GPTConfig) -> bool:
    # Saved by a sequence-classification class (hfgpt's, GPT2's or OpenAIGPT's: all name the head `score`).
    return any(name.endswith("ForSequenceClassification") for name in config.architectures or ())


def match_checkpoint_labels(
    args: FinetuneArguments, base: GPTConfig | None, num_labels: int, label_table: dict[Any, int] | None
) -> dict[Any, int] | None:
    """Check the labels against a checkpoint's classification head; returns the label table to use.

    A head for another number of labels cannot be loaded: refused unless `--ignore_mismatched_sizes`
    (then the head starts anew). A head trained on the same label names keeps its ids, so each row of
    `score.weight` goes on scoring the label it learned (as run_glue.py reuses `model.config.label2id`)."""
    if base is None or args.task == "multiple_choice" or not _has_classification_head(base):
        return label_table
    if base.num_labels != num_labels:
        if args.ignore_mismatched_sizes:
            return label_table
        names = ", ".join(str(base.id2label[i]) for i in sorted(base.id2label))
        data = "1 (a regression score)" if num_labels == 1 else str(num_labels)
        raise FinetuneInputError(
            f"checkpoint {args.model_name_or_path!r} has a classification head for {base.num_labels} "
            f"labels ({names}), but the data has {data}; pass --ignore_mismatched_sizes true to train a new "
            "head"
        )
    by_text = {str(name): name for name in label_table or ()}
    if label_table is not None and {str(name) for name in base.id2label.values()} == set(by_text):
        return {by_text[str(name)]: int(i) for i, name in base.id2label.items()}
    return label_table


def build_model(
    args: FinetuneArguments,
    tokenizer: PreTrainedTokenizerBase,
    num_labels: int,
    classify_id: int | None,
    label_table: dict[Any, int] | None = None,
) -> GPTForSequenceClassification | GPTDoubleHeadsModel:
    model_class = GPTDoubleHeadsModel if args.task == "multiple_choice" else GPTForSequenceClassification
    settings: dict[str, Any] = dict(
        lm_loss_weight=args.lm_loss_weight if args.recipe == "gpt1" else 0.0,
        classify_token_id=classify_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    if args.task != "multiple_choice":
        # Written in full every time: a checkpoint's own names (or problem type) would otherwise survive
        # re-fine-tuning on other labels. The config's num_labels is len(id2label).
        id2label = (
            {i: str(name) for name, i in label_table.items()}
            if label_table
            else {i: f"LABEL_{i}" for i in range(num_labels)}
        )
        settings.update(
            id2label=id2label,
            label2id={name: i for i, name in id2label.items()},
            problem_type="regression" if num_labels == 1 else "single_label_classification",
        )
    # GPT-1's classifier (train.py `model` / `clf`): dropout `clf_pdrop` = 0.1 on the pooled state, then
    # `x @ w + b` with b initialised to 0; §4.1: "We add dropout to the classifier with a rate of 0.1".
    # Defaults of the recipe: --config_overrides may change them for a new model.
    # For multiple choice, train.py's dropout on the pooled states has noise shape [B, 1, E]: one mask for
    # all the choices of an example (summary_first_dropout, 0.1 by default, is that rate).
    head = {}
    if args.recipe == "gpt1":
        head = (
            {"summary_dropout_shared": True}
            if args.task == "multiple_choice"
            else {"score_bias": True, "score_dropout": 0.1}
        )
    if args.model_name_or_path is not None:  # checked by finetune's checkpoint_config call
        model = model_class.from_pretrained(
            args.model_name_or_path,
            ignore_mismatched_sizes=args.ignore_mismatched_sizes,
            **head,
            **settings,
        )
    else:
        if args.preset not in PRESETS:
            raise FinetuneInputError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
        overrides = {
            **head,
            **_parse_overrides(args.config_overrides),
            **settings,
            "vocab_size": len(tokenizer),
        }
        try:
            config = GPTConfig.from_preset(args.preset, **overrides)
        except (ValueError, TypeError, StrictDataclassError) as err:
            raise FinetuneInputError(
                f"invalid model config: {str(err).strip().splitlines()[-1].strip()}"
            ) from err
        model = model_class(config)
    # The recipe's added tokens get fresh N(0, 0.02) rows, as train.py draws them.
    return resize_embeddings_to_tokenizer(model, tokenizer)


def check_label_smoothing(args: FinetuneArguments, training_args: TrainingArguments, num_labels: int) -> None:
    """Trainer's `label_smoothing_factor` is right only for plain classification: it pops `labels`, calls
    the model without them and smooths the cross-entropy of `logits` alone. That drops the gpt1 recipe's
    auxiliary LM loss (L3 = L2 + lambda * L1 would become a smoothed L2), means nothing for one regression
    score, and never reaches the multiple-choice loss, whose labels are `mc_labels`."""
    factor = training_args.label_smoothing_factor
    if not factor:
        return
    if args.task == "multiple_choice":
        reason = "Trainer smooths only a `labels` column, so the multiple-choice loss would stay unsmoothed"
    elif num_labels == 1:
        reason = "a regression score has no classes to smooth"
    elif args.recipe == "gpt1" and args.lm_loss_weight > 0:
        reason = (
            f"Trainer would compute the loss from the class logits alone and drop the auxiliary LM loss "
            f"(lambda {args.lm_loss_weight}); add --lm_loss_weight 0 to smooth plain L2"
        )
    else:
        return
    raise FinetuneInputError(f"--label_smoothing_factor {factor} cannot be used here: {reason}")


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
    target = hub_target(training_args)
    set_seed(training_args.seed)

    columns = _columns(args)
    raw = load_splits(args)
    _check_columns(raw, columns, args.label_column)
    num_labels, label_table = resolve_labels(raw, args, n_choices=len(columns) - 1)
    regression = num_labels == 1
    check_label_smoothing(args, training_args, num_labels)
    metric_names = [m.strip() for m in (args.metrics or "").split(",") if m.strip()]
    metric_names = metric_names or (["pearsonr"] if regression else ["accuracy"])
    compute_metrics = compute_metrics_fn(metric_names, regression=regression, num_labels=num_labels)
    label_table = match_checkpoint_labels(args, checkpoint_config(args), num_labels, label_table)

    tokenizer = load_tokenizer(args.tokenizer_name or args.model_name_or_path or "gpt2")
    tokens = add_finetune_tokens(tokenizer) if args.recipe == "gpt1" else None
    model = build_model(args, tokenizer, num_labels, tokens.classify if tokens else None, label_table)
    n_ctx = model.config.n_positions
    label_key = "mc_labels" if args.task == "multiple_choice" else "labels"

    def transform(row: dict[str, Any], index: int) -> dict[str, Any]:
        texts = [_encode(tokenizer, row[c]) for c in columns]
        if tokens is not None:
            ids = transform_example(args.task, texts, tokens, n_ctx, truncate=args.truncate)
        else:
            # Plain GPT-2: the texts joined by EOS, pooled at the last token.
            sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
            ids = transform_plain(texts, sep, n_ctx, truncate=args.truncate)
        check_length(ids, n_ctx, f"row {index}")
        label = row[args.label_column]
        label = label_table[label] if label_table else (float(label) if regression else int(label))
        return {"input_ids": ids, label_key: label}

    encoded = datasets.DatasetDict(
        {
            name: split.map(
                transform, with_indices=True, remove_columns=split.column_names, desc=f"transform {name}"
            )
            for name, split in raw.items()
        }
    )
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
        compute_metrics=compute_metrics,
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
    if target is not None and trainer.is_world_process_zero():
        metrics["commit_url"] = push_checkpoint(training_args, target)
    return metrics


def make_parser() -> HfArgumentParser:
    parser = HfArgumentParser((FinetuneArguments, TrainingArguments))
    parser.set_defaults(**GPT1_FINETUNE_DEFAULTS)
    return parser


def evaluation_requested(argv: list[str] | None) -> bool:
    """Whether the command line itself asks for evaluation (`--do_eval`, or an `--eval_strategy` other
    than "no"), not just the default per-epoch evaluation, which applies only where there is data for it."""
    probe = make_parser()
    probe.set_defaults(do_eval=False, eval_strategy=None)
    namespace, _ = probe.parse_known_args(argv)
    strategy = getattr(namespace.eval_strategy, "value", namespace.eval_strategy)
    return bool(namespace.do_eval) or strategy not in (None, "no")


def main(argv: list[str] | None = None) -> int:
    args, training_args = make_parser().parse_args_into_dataclasses(args=argv)
    transformers.utils.logging.set_verbosity_warning()
    keep_freed_memory_on_cpu(args.keep_freed_memory, training_args)
    try:
        if not (args.validation_file or args.dataset_name) and evaluation_requested(argv):
            raise FinetuneInputError(
                "--do_eval / --eval_strategy ask for evaluation, but there is no validation data; "
                "give --validation_file"
            )
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
