"""GPT-1's fine-tuning recipe as library pieces: task input transforms, a collator and offline metrics.

Radford et al. (2018), "Improving Language Understanding by Generative Pre-Training", §3.3 turns every
task into token sequences the pre-trained decoder can read, with three added tokens (`_start_`,
`_delimiter_`, `_classify_`) and a linear head on the hidden state at `_classify_`:

| task            | sequences per example                                         | head                           |
|-----------------|---------------------------------------------------------------|--------------------------------|
| classification  | `[_start_] text [_classify_]`                                 | GPTForSequenceClassification   |
| entailment      | `[_start_] premise [_delimiter_] hypothesis [_classify_]`     | GPTForSequenceClassification   |
| similarity      | both orders of the two texts; representations added          | GPTForSequenceClassification   |
| multiple_choice | one `[_start_] context [_delimiter_] answer_k [_classify_]`   | GPTDoubleHeadsModel            |
|                 | per choice, softmax over the choices                          |                                |

Truncation follows openai/finetune-transformer-lm `train.py` (`transform_roc`): every segment of a
two-segment input is cut to `max_len = n_ctx // 2 - 2` tokens, so the whole never exceeds the context.
The plain (GPT-2 style) inputs, texts joined by EOS, are cut longest text first, as transformers' fast
tokenizers cut a text pair (`truncation="longest_first"`): a long first text never pushes out the second.

The metrics are `evaluate.Metric` subclasses defined here, because `evaluate.load("accuracy")` downloads
its script from the Hub and fails offline; they have the same `compute` / `add_batch` interface.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import datasets
import evaluate
import numpy as np
import torch

from hfgpt.tokenization import FINETUNE_TOKENS

Task = Literal["classification", "entailment", "similarity", "multiple_choice"]
TASKS: tuple[str, ...] = ("classification", "entailment", "similarity", "multiple_choice")


# How many text columns each task reads (multiple choice: a context, then two or more choices).
TASK_TEXT_COLUMNS: dict[str, tuple[int, int | None]] = {
    "classification": (1, 1),
    "entailment": (2, 2),
    "similarity": (2, 2),
    "multiple_choice": (3, None),
}


class TrainingInputError(ValueError):
    """Bad training input (a file, a column, a size); the message names the value at fault."""


class FinetuneInputError(TrainingInputError):
    """Bad fine-tuning input (a column, a label, a length); the message names the value at fault."""


@dataclass(frozen=True)
class TaskTokens:
    """Ids of the recipe's three added tokens."""

    start: int
    delimiter: int
    classify: int


def add_finetune_tokens(tokenizer: Any) -> TaskTokens:
    """Add `_start_`, `_delimiter_`, `_classify_` to `tokenizer` as special tokens where missing (GPT-1's
    tokenizer may already have them; GPT-2's gets them appended) and return their ids. The caller must
    `model.resize_token_embeddings(len(tokenizer))` when the vocabulary grew."""
    vocab = tokenizer.get_vocab()
    missing = [token for token in FINETUNE_TOKENS if token not in vocab]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    ids = tokenizer.convert_tokens_to_ids(list(FINETUNE_TOKENS))
    return TaskTokens(*ids)


def _segment_length(n_ctx: int) -> int:
    # train.py: `max_len = n_ctx//2-2`, applied to each of the two segments.
    return n_ctx // 2 - 2


def transform_single(text: Sequence[int], tokens: TaskTokens, n_ctx: int, truncate: bool = True) -> list[int]:
    """Classification: `[_start_] text [_classify_]`, the text cut to `n_ctx - 2` tokens."""
    text = list(text[: n_ctx - 2]) if truncate else list(text)
    return [tokens.start, *text, tokens.classify]


def transform_pair(
    first: Sequence[int], second: Sequence[int], tokens: TaskTokens, n_ctx: int, truncate: bool = True
) -> list[int]:
    """Entailment and one choice of multiple choice: `[_start_] first [_delimiter_] second [_classify_]`,
    each segment cut to `n_ctx // 2 - 2` tokens as train.py's `transform_roc` does."""
    if truncate:
        max_len = _segment_length(n_ctx)
        first, second = first[:max_len], second[:max_len]
    return [tokens.start, *first, tokens.delimiter, *second, tokens.classify]


def longest_first(lengths: tuple[int, int], budget: int) -> tuple[int, int]:
    """How many tokens of each of two texts to keep so that together they fit in `budget`: the longer text
    is cut first; when both must be cut, the shorter keeps `budget // 2` and the longer the rest (of two
    equal texts, the second counts as the longer). The `tokenizers` library's rule for a pair
    (`TruncationStrategy::LongestFirst`), which transformers' fast tokenizers apply."""
    first, second = lengths
    if first + second <= budget:
        return first, second
    short_keep = min(first, second, budget // 2)
    long_keep = budget - short_keep
    return (short_keep, long_keep) if first <= second else (long_keep, short_keep)


def transform_plain(
    texts: Sequence[Sequence[int]], separator: Sequence[int], n_ctx: int, truncate: bool = True
) -> list[int]:
    """`--recipe plain` (GPT-2 sequence classification, pooled at the last token): one text, or two joined
    by `separator` (EOS). With `truncate`, a text is cut to `n_ctx` tokens and a pair is cut with
    `longest_first`, so the hypothesis of an entailment pair survives a long premise."""
    if len(texts) == 1:
        return list(texts[0][:n_ctx]) if truncate else list(texts[0])
    if len(texts) != 2:
        raise FinetuneInputError(f"--recipe plain joins one or two texts, got {len(texts)}")
    first, second = texts
    if truncate:
        keep_first, keep_second = longest_first((len(first), len(second)), max(n_ctx - len(separator), 0))
        first, second = first[:keep_first], second[:keep_second]
    return [*first, *separator, *second]


def transform_example(
    task: Task,
    texts: Sequence[Sequence[int]],
    tokens: TaskTokens,
    n_ctx: int,
    truncate: bool = True,
) -> list[int] | list[list[int]]:
    """Token ids of one example's texts -> the model input of `task`: one sequence (classification,
    entailment) or a list of sequences (similarity: both orders; multiple choice: one per choice)."""
    if task == "classification":
        return transform_single(texts[0], tokens, n_ctx, truncate)
    if task == "entailment":
        return transform_pair(texts[0], texts[1], tokens, n_ctx, truncate)
    if task == "similarity":
        # §3.3: "no inherent ordering of the two sentences": both orderings, representations added
        # (GPTForSequenceClassification sums the pooled states of a (B, 2, T) input).
        return [
            transform_pair(texts[0], texts[1], tokens, n_ctx, truncate),
            transform_pair(texts[1], texts[0], tokens, n_ctx, truncate),
        ]
    if task == "multiple_choice":
        return [transform_pair(texts[0], choice, tokens, n_ctx, truncate) for choice in texts[1:]]
    raise FinetuneInputError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")


def check_length(ids: list[int] | list[list[int]], n_ctx: int, where: str) -> None:
    """Refuse an input longer than the context (possible only without truncation)."""
    rows = ids if ids and isinstance(ids[0], list) else [ids]
    longest = max(len(row) for row in rows)
    if longest > n_ctx:
        raise FinetuneInputError(
            f"{where}: the transformed input has {longest} tokens, more than the model's context of "
            f"{n_ctx} (config.n_positions); shorten the text or allow truncation"
        )


@dataclass
class TaskCollator:
    """Pads a batch of transformed examples into tensors.

    `input_ids` of each feature is a list of ids (B, T) or a list of sequences (B, K, T); every row is
    right-padded with `pad_token_id` to the longest in the batch and `attention_mask` marks real tokens
    (train.py's mask `M`, which also limits the auxiliary LM loss to real tokens). Label keys pass through.
    """

    pad_token_id: int = 0
    label_keys: tuple[str, ...] = ("labels", "mc_labels")

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [f["input_ids"] for f in features]
        nested = bool(rows) and isinstance(rows[0][0], (list, tuple))
        if not nested:
            rows = [[r] for r in rows]
        n_seq = max(len(r) for r in rows)
        if any(len(r) != n_seq for r in rows):
            raise FinetuneInputError(
                f"examples in one batch have different numbers of sequences ({sorted({len(r) for r in rows})}); "
                "every multiple-choice example needs the same number of choices"
            )
        length = max(len(seq) for r in rows for seq in r)
        input_ids = torch.full((len(rows), n_seq, length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), n_seq, length), dtype=torch.long)
        for i, r in enumerate(rows):
            for k, seq in enumerate(r):
                input_ids[i, k, : len(seq)] = torch.tensor(seq, dtype=torch.long)
                attention_mask[i, k, : len(seq)] = 1
        if not nested:
            input_ids, attention_mask = input_ids[:, 0], attention_mask[:, 0]
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        for key in self.label_keys:
            if key in features[0]:
                batch[key] = torch.tensor([f[key] for f in features])
        return batch


# --- Metrics ----------------------------------------------------------------------------------------
# Definitions as in scikit-learn / scipy (and the Hub's `accuracy`, `f1`, `pearsonr` scripts), computed
# with numpy so they need neither a download nor an extra dependency.


def _features(dtype: str) -> datasets.Features:
    return datasets.Features({"predictions": datasets.Value(dtype), "references": datasets.Value(dtype)})


def _check_class_ids(metric: str, name: str, values: Any) -> None:
    """Refuse values that are not class ids (a float with a fraction, NaN, a string): scikit-learn's
    `accuracy_score` / `f1_score` raise on such "continuous" targets, where a cast to int64 would silently
    turn regression scores into classes."""
    if values is None:
        return
    for value in np.asarray(values, dtype=object).reshape(-1):
        if isinstance(value, (bool, int, np.bool_, np.integer)):
            continue
        if isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
            continue
        raise ValueError(
            f"{metric}: {name} hold {value!r}, not a class id; classification metrics take integer "
            "classes (scikit-learn refuses continuous values too); use pearsonr for regression scores"
        )


class _ClassMetric(evaluate.Metric):
    """An evaluate metric over class ids: every batch is checked before evaluate casts it to int64
    (`compute` adds its inputs through `add_batch`)."""

    # Each needs a docstring: evaluate.EvaluationModule.__init__ appends the inputs' description to it.
    def add_batch(self, *, predictions: Any = None, references: Any = None, **kwargs: Any) -> None:
        """`evaluate.Metric.add_batch`, refusing values that are not class ids."""
        _check_class_ids(self.name, "predictions", predictions)
        _check_class_ids(self.name, "references", references)
        super().add_batch(predictions=predictions, references=references, **kwargs)

    def add(self, *, prediction: Any = None, reference: Any = None, **kwargs: Any) -> None:
        """`evaluate.Metric.add`, refusing a value that is not a class id."""
        _check_class_ids(self.name, "predictions", [prediction] if prediction is not None else None)
        _check_class_ids(self.name, "references", [reference] if reference is not None else None)
        super().add(prediction=prediction, reference=reference, **kwargs)


class Accuracy(_ClassMetric):
    """Fraction of predictions equal to the references."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=self.__doc__, citation="", inputs_description="", features=_features("int64")
        )

    def _compute(self, predictions: Sequence[int], references: Sequence[int]) -> dict[str, float]:
        return {"accuracy": float(np.mean(np.asarray(predictions) == np.asarray(references)))}


class F1(_ClassMetric):
    """F1 of the positive class (`average="binary"`, `pos_label=1`) or the macro average over classes."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=self.__doc__, citation="", inputs_description="", features=_features("int64")
        )

    def _compute(
        self,
        predictions: Sequence[int],
        references: Sequence[int],
        average: str = "binary",
        pos_label: int = 1,
    ) -> dict[str, float]:
        pred, ref = np.asarray(predictions), np.asarray(references)

        def f1_of(label: int) -> float:
            tp = np.sum((pred == label) & (ref == label))
            fp = np.sum((pred == label) & (ref != label))
            fn = np.sum((pred != label) & (ref == label))
            return float(2 * tp / (2 * tp + fp + fn)) if tp + fp + fn else 0.0

        if average == "binary":
            return {"f1": f1_of(pos_label)}
        if average == "macro":
            return {"f1": float(np.mean([f1_of(c) for c in np.union1d(pred, ref)]))}
        raise ValueError(f"F1: average must be 'binary' or 'macro', got {average!r}")


class PearsonR(evaluate.Metric):
    """Pearson correlation between predicted and reference scores (the STS-B metric of GPT-1's Table 4)."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=self.__doc__, citation="", inputs_description="", features=_features("float64")
        )

    def _compute(self, predictions: Sequence[float], references: Sequence[float]) -> dict[str, float]:
        pred, ref = np.asarray(predictions, dtype=np.float64), np.asarray(references, dtype=np.float64)
        pred, ref = pred - pred.mean(), ref - ref.mean()
        denom = np.sqrt(np.sum(pred**2) * np.sum(ref**2))
        # A constant input has no correlation: NaN, as scipy.stats.pearsonr (the Hub metric) returns.
        return {"pearsonr": float(np.sum(pred * ref) / denom) if denom else float("nan")}


LOCAL_METRICS: dict[str, type[evaluate.Metric]] = {"accuracy": Accuracy, "f1": F1, "pearsonr": PearsonR}


def load_metric(name: str) -> evaluate.EvaluationModule:
    """A metric by name: the in-package one for accuracy / f1 / pearsonr (offline), else `evaluate.load`."""
    if name in LOCAL_METRICS:
        return LOCAL_METRICS[name]()
    try:
        return evaluate.load(name)
    except Exception as err:  # offline, or no such metric: evaluate raises several unrelated types
        raise FinetuneInputError(
            f"metric {name!r} is not one of the offline metrics ({', '.join(LOCAL_METRICS)}) and "
            f"evaluate.load could not fetch it: {err}"
        ) from err


def pick_classification_logits(logits: Any, labels: Any = None) -> torch.Tensor:
    """`preprocess_logits_for_metrics` for Trainer: keep only the classification scores.

    Trainer hands over every non-loss output; the scores are the one 2-D tensor among them
    (`logits` (B, num_labels) of GPTForSequenceClassification, `mc_logits` (B, C) of GPTDoubleHeadsModel;
    the LM logits are 3-D or 4-D and the separate loss terms 0-D)."""
    if isinstance(logits, torch.Tensor):
        return logits
    candidates = [t for t in logits if isinstance(t, torch.Tensor) and t.ndim == 2]
    if len(candidates) != 1:
        raise ValueError(f"expected one 2-D logits tensor, got shapes {[tuple(t.shape) for t in logits]}")
    return candidates[0]


def compute_metrics_fn(
    metric_names: Sequence[str], regression: bool = False, num_labels: int = 2
) -> Callable[[Any], dict]:
    """`compute_metrics` for Trainer from metric names (argmax of the logits, or the score for regression).
    F1 is the positive class's for two labels and the macro average for more. Accuracy and F1 compare
    classes, so they are refused for regression (their inputs would be scores)."""
    metrics = [load_metric(name) for name in metric_names]
    if regression:
        for name, metric in zip(metric_names, metrics, strict=True):
            if isinstance(metric, _ClassMetric):
                raise FinetuneInputError(
                    f"metric {name!r} compares classes, but a regression model predicts scores; use pearsonr"
                )

    def compute(eval_pred: Any) -> dict[str, float]:
        logits, labels = eval_pred.predictions, eval_pred.label_ids
        predictions = np.squeeze(logits, -1) if regression else np.argmax(logits, axis=-1)
        out: dict[str, float] = {}
        for metric in metrics:
            extra = {"average": "binary" if num_labels == 2 else "macro"} if isinstance(metric, F1) else {}
            out.update(metric.compute(predictions=predictions, references=labels, **extra))
        return out

    return compute


__all__ = [
    "FINETUNE_TOKENS",
    "LOCAL_METRICS",
    "TASKS",
    "TASK_TEXT_COLUMNS",
    "Accuracy",
    "F1",
    "FinetuneInputError",
    "PearsonR",
    "TaskCollator",
    "TaskTokens",
    "TrainingInputError",
    "add_finetune_tokens",
    "check_length",
    "compute_metrics_fn",
    "load_metric",
    "longest_first",
    "pick_classification_logits",
    "transform_example",
    "transform_pair",
    "transform_plain",
    "transform_single",
]
