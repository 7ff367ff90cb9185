"""GPT-1's fine-tuning recipe: input transforms, collator, the L2 + lambda*L1 objective checked by hand,
offline metrics, and hfgpt-finetune end to end on tiny CSV/JSON files, including its input errors."""

import csv
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from scipy.stats import pearsonr
from sklearn.metrics import accuracy_score, f1_score
from transformers import AutoModelForSequenceClassification

from hfgpt.modeling import GPTConfig, GPTDoubleHeadsModel, GPTForSequenceClassification
from hfgpt.modeling.finetune import (
    F1,
    Accuracy,
    FinetuneInputError,
    PearsonR,
    TaskCollator,
    TaskTokens,
    TrainingInputError,
    add_finetune_tokens,
    compute_metrics_fn,
    load_metric,
    longest_first,
    transform_example,
    transform_plain,
)
from hfgpt.scripts import finetune_classification
from hfgpt.scripts.demo import build_char_tokenizer
from hfgpt.scripts.finetune_classification import (
    FinetuneArguments,
    evaluation_requested,
    finetune,
    main,
    make_parser,
    match_checkpoint_labels,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


TOKENS = TaskTokens(start=100, delimiter=101, classify=102)
TINY = "n_embd=32,n_layer=2,n_head=2,n_positions=32"


# --- transforms ---------------------------------------------------------------------------------------


def test_classification_transform_wraps_text_in_start_and_classify():
    assert transform_example("classification", [[5, 6, 7]], TOKENS, n_ctx=16) == [100, 5, 6, 7, 102]


def test_entailment_transform_delimits_premise_and_hypothesis():
    out = transform_example("entailment", [[1, 2], [3]], TOKENS, n_ctx=16)
    assert out == [100, 1, 2, 101, 3, 102]


def test_similarity_transform_gives_both_orders():
    out = transform_example("similarity", [[1, 2], [3]], TOKENS, n_ctx=16)
    assert out == [[100, 1, 2, 101, 3, 102], [100, 3, 101, 1, 2, 102]]


def test_multiple_choice_transform_gives_one_sequence_per_choice():
    out = transform_example("multiple_choice", [[1, 2], [3], [4, 5]], TOKENS, n_ctx=16)
    assert out == [[100, 1, 2, 101, 3, 102], [100, 1, 2, 101, 4, 5, 102]]


def test_pair_truncation_follows_train_py_max_len():
    # train.py: max_len = n_ctx // 2 - 2 per segment; n_ctx 16 -> 6 tokens each, 15 in all.
    out = transform_example("entailment", [list(range(10)), list(range(20, 30))], TOKENS, n_ctx=16)
    assert out == [100, 0, 1, 2, 3, 4, 5, 101, 20, 21, 22, 23, 24, 25, 102]
    single = transform_example("classification", [list(range(40))], TOKENS, n_ctx=16)
    assert single == [100, *range(14), 102]
    assert len(transform_example("entailment", [list(range(10))] * 2, TOKENS, 16, truncate=False)) == 23


@pytest.mark.parametrize(
    ("first", "second", "budget"),
    [(40, 3, 31), (3, 40, 31), (10, 10, 15), (10, 11, 15), (11, 10, 15), (5, 5, 3), (4, 4, 8), (20, 9, 1)],
)
def test_longest_first_matches_the_fast_tokenizers_pair_truncation(first, second, budget):
    # Reference: the `tokenizers` library cutting a text pair to `budget` (truncation="longest_first");
    # one token per character, so the kept a's and b's are the kept lengths.
    tokenizer = build_char_tokenizer("ab")
    ids = tokenizer(
        "a" * first, "b" * second, truncation="longest_first", max_length=budget, add_special_tokens=False
    )["input_ids"]
    kept = tokenizer.convert_ids_to_tokens(ids)
    assert longest_first((first, second), budget) == (kept.count("a"), kept.count("b"))


def test_plain_transform_keeps_the_hypothesis_of_a_long_premise():
    # n_ctx 32, one EOS (9) between: 31 tokens for the texts; the 3-token hypothesis stays whole.
    out = transform_plain([list(range(100, 140)), [1, 2, 3]], [9], n_ctx=32)
    assert out == [*range(100, 128), 9, 1, 2, 3]
    assert transform_plain([list(range(40))], [9], n_ctx=32) == list(range(32))
    assert len(transform_plain([list(range(40)), [1, 2, 3]], [9], n_ctx=32, truncate=False)) == 44


def test_add_finetune_tokens_appends_three_special_tokens_once():
    tokenizer = build_char_tokenizer("abc")
    n = len(tokenizer)
    tokens = add_finetune_tokens(tokenizer)
    assert (tokens.start, tokens.delimiter, tokens.classify) == (n, n + 1, n + 2)
    assert add_finetune_tokens(tokenizer) == tokens and len(tokenizer) == n + 3
    # Special: never split, and dropped by skip_special_tokens.
    ids = tokenizer("_start_ab_classify_", add_special_tokens=False)["input_ids"]
    assert ids[0] == tokens.start and ids[-1] == tokens.classify and len(ids) == 4


def test_collator_pads_two_and_three_dimensional_batches():
    collate = TaskCollator(pad_token_id=0)
    batch = collate([{"input_ids": [5, 6, 7], "labels": 1}, {"input_ids": [8], "labels": 0}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [1, 0]
    batch = collate(
        [{"input_ids": [[5, 6], [7]], "mc_labels": 1}, {"input_ids": [[8], [9, 9, 9]], "mc_labels": 0}]
    )
    assert batch["input_ids"].shape == (2, 2, 3)
    assert batch["attention_mask"][1].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert batch["mc_labels"].tolist() == [1, 0]
    with pytest.raises(FinetuneInputError, match="number of choices"):
        collate([{"input_ids": [[1], [2]]}, {"input_ids": [[1], [2], [3]]}])


# --- the objective L3 = L2 + lambda * L1, by hand -----------------------------------------------------


def _tiny_config(**kw) -> GPTConfig:
    return GPTConfig(vocab_size=20, n_positions=16, n_embd=32, n_layer=2, n_head=2, pad_token_id=0, **kw)


def _hand_lm_loss(
    hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, wte: torch.Tensor
) -> torch.Tensor:
    """train.py: per-sequence mean over real next-token positions (mask M[:, 1:]), then the batch mean."""
    hidden, ids, mask = (
        hidden.reshape(-1, *hidden.shape[-2:]),
        ids.reshape(-1, ids.shape[-1]),
        mask.reshape(-1, mask.shape[-1]),
    )
    per_seq = []
    for h, x, m in zip(hidden, ids, mask, strict=True):
        logits = h[:-1] @ wte.T
        losses = -torch.log_softmax(logits, -1).gather(-1, x[1:, None]).squeeze(-1)
        per_seq.append((losses * m[1:]).sum() / m[1:].sum())
    return torch.stack(per_seq).mean()


def _batch(shape: tuple[int, ...], classify: int = 19) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 18, shape, generator=gen)
    mask = torch.ones(shape, dtype=torch.long)
    # Variable lengths: the classify token ends each row, padding (0) after it.
    lengths = torch.randint(4, shape[-1] + 1, shape[:-1], generator=gen)
    for idx in np.ndindex(*shape[:-1]):
        n = int(lengths[idx])
        ids[idx][n - 1] = classify
        ids[idx][n:] = 0
        mask[idx][n:] = 0
    return ids, mask


@pytest.mark.parametrize("shape", [(3, 10), (3, 2, 10)], ids=["single", "similarity-both-orders"])
@pytest.mark.parametrize("lam", [0.5, 0.0])
def test_sequence_classification_loss_is_l2_plus_lambda_l1(shape, lam):
    torch.manual_seed(0)
    model = GPTForSequenceClassification(
        _tiny_config(num_labels=3, classify_token_id=19, lm_loss_weight=lam)
    ).eval()
    ids, mask = _batch(shape)
    labels = torch.tensor([0, 2, 1])
    out = model(input_ids=ids, attention_mask=mask, labels=labels)

    hidden = model.transformer(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, [K,] T, E)
    clf_pos = (ids == 19).long().argmax(-1)  # train.py pools at the clf token
    pooled = hidden.gather(-2, clf_pos[..., None, None].expand(*clf_pos.shape, 1, 32)).squeeze(-2)
    if len(shape) == 3:
        pooled = pooled.sum(1)  # §3.3: the two orderings' representations added
    l2 = F.cross_entropy(model.score(pooled), labels)
    l1 = _hand_lm_loss(hidden, ids, mask, model.transformer.wte.weight)

    torch.testing.assert_close(out.classification_loss, l2)
    torch.testing.assert_close(out.loss, l2 + lam * l1)
    if lam:
        torch.testing.assert_close(out.lm_loss, l1)
    else:
        assert out.lm_loss is None
    # The gradients agree too (the model's fused head-and-loss backward against autograd of the hand sum).
    params = [model.transformer.wte.weight, model.transformer.h[0].attn.c_attn.weight, model.score.weight]
    got = torch.autograd.grad(out.loss, params)
    expected = torch.autograd.grad(l2 + lam * l1, params)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)


def test_double_heads_loss_is_mc_loss_plus_lambda_l1():
    torch.manual_seed(0)
    model = GPTDoubleHeadsModel(_tiny_config(classify_token_id=19, lm_loss_weight=0.5)).eval()
    ids, mask = _batch((2, 3, 10))
    mc_labels = torch.tensor([2, 0])
    out = model(input_ids=ids, attention_mask=mask, mc_labels=mc_labels)

    hidden = model.transformer(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, C, T, E)
    clf_pos = (ids == 19).long().argmax(-1)
    pooled = hidden.gather(-2, clf_pos[..., None, None].expand(*clf_pos.shape, 1, 32)).squeeze(-2)
    mc_logits = model.multiple_choice_head.summary(pooled).squeeze(-1)  # (B, C)
    l2 = F.cross_entropy(mc_logits, mc_labels)
    l1 = _hand_lm_loss(hidden, ids, mask, model.transformer.wte.weight)
    torch.testing.assert_close(out.mc_logits, mc_logits)
    torch.testing.assert_close(out.loss, l2 + 0.5 * l1)
    torch.testing.assert_close(out.logits, hidden @ model.lm_head.weight.T)  # every position's LM logits
    got = torch.autograd.grad(out.loss, [model.transformer.wte.weight])
    expected = torch.autograd.grad(l2 + 0.5 * l1, [model.transformer.wte.weight])
    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=1e-5)


def test_int8_double_heads_copy_computes_the_auxiliary_lm_loss_from_its_own_logits():
    """An int8 decoding copy has no float LM-head weight: L1 comes from the logits its head computes."""
    from hfgpt.cpu.quantization import quantize_for_decoding

    torch.manual_seed(0)
    model = GPTDoubleHeadsModel(_tiny_config(classify_token_id=19, lm_loss_weight=0.5)).eval()
    quantized = quantize_for_decoding(model)
    ids, mask = _batch((2, 3, 10))
    mc_labels = torch.tensor([2, 0])
    with torch.no_grad():
        out = quantized(input_ids=ids, attention_mask=mask, mc_labels=mc_labels)
        reference = model(input_ids=ids, attention_mask=mask, mc_labels=mc_labels)
    logits, flat_ids, flat_mask = out.logits.reshape(6, 10, -1), ids.reshape(6, 10), mask.reshape(6, 10)
    losses = -torch.log_softmax(logits[:, :-1], -1).gather(-1, flat_ids[:, 1:, None]).squeeze(-1)
    l1 = ((losses * flat_mask[:, 1:]).sum(-1) / flat_mask[:, 1:].sum(-1)).mean()
    torch.testing.assert_close(out.lm_loss, l1)
    torch.testing.assert_close(out.loss, out.mc_loss + 0.5 * l1)
    assert 0 < abs(out.loss - reference.loss) < 0.02 * reference.loss  # int8 moves it, a little


# --- metrics ------------------------------------------------------------------------------------------


def test_local_metrics_match_hand_values(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pred, ref = [1, 0, 1, 1, 0, 1], [1, 0, 0, 1, 1, 1]
    assert Accuracy().compute(predictions=pred, references=ref) == {"accuracy": 4 / 6}
    # positive class: tp 3, fp 1, fn 1 -> 6 / 8; class 0: tp 1, fp 1, fn 1 -> 2 / 4
    assert F1().compute(predictions=pred, references=ref)["f1"] == pytest.approx(0.75)
    assert F1().compute(predictions=pred, references=ref, average="macro")["f1"] == pytest.approx(0.625)
    x, y = [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 5.0, 9.0]
    r = PearsonR().compute(predictions=x, references=y)["pearsonr"]
    # (x - 2.5) . (y - 5) = 4.5 + 0.5 + 0 + 6 = 11; |x - 2.5|^2 = 5; |y - 5|^2 = 26
    assert r == pytest.approx(11 / math.sqrt(5 * 26))
    metric = load_metric("accuracy")
    metric.add_batch(predictions=[1, 1], references=[1, 0])
    metric.add_batch(predictions=[0], references=[0])
    assert metric.compute() == {"accuracy": pytest.approx(2 / 3)}


@pytest.mark.parametrize("metric", [Accuracy, F1], ids=["accuracy", "f1"])
def test_class_metrics_refuse_scores_as_sklearn_does(metric, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    scores, references = [0.9, 1.2], [0.1, 1.9]
    sklearn_metric = accuracy_score if metric is Accuracy else f1_score
    with pytest.raises(ValueError, match="continuous"):  # the reference refuses them
        sklearn_metric(references, scores)
    with pytest.raises(ValueError, match=r"predictions hold 0\.9, not a class id"):
        metric().compute(predictions=scores, references=[0, 1])
    with pytest.raises(ValueError, match=r"references hold 0\.1, not a class id"):
        metric().compute(predictions=[0, 1], references=references)
    with pytest.raises(ValueError, match="not a class id"):
        metric().add(prediction=0.5, reference=1)
    # Whole-number floats are classes to scikit-learn too.
    name = "accuracy" if metric is Accuracy else "f1"
    assert metric().compute(predictions=[1.0, 0.0, 1.0], references=[1, 1, 1])[name] == pytest.approx(
        sklearn_metric([1, 1, 1], [1, 0, 1])
    )


def test_pearsonr_of_a_constant_input_is_nan_as_scipy(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    x, y = [1.0, 1.0, 1.0], [1.0, 2.0, 3.0]
    with pytest.warns(Warning):  # scipy's ConstantInputWarning
        reference = pearsonr(x, y)[0]
    assert math.isnan(reference)
    assert math.isnan(PearsonR().compute(predictions=x, references=y)["pearsonr"])


def test_regression_refuses_class_metrics():
    with pytest.raises(FinetuneInputError, match="metric 'accuracy' compares classes"):
        compute_metrics_fn(["accuracy"], regression=True, num_labels=1)
    with pytest.raises(FinetuneInputError, match="metric 'f1' compares classes"):
        compute_metrics_fn(["pearsonr", "f1"], regression=True, num_labels=1)


def test_unknown_metric_offline_is_a_clean_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FinetuneInputError, match="metric 'no_such_metric' is not one of the offline metrics"):
        load_metric("no_such_metric")


def test_compute_metrics_fn_takes_argmax_of_logits():
    class EvalPred:
        predictions = np.array([[0.1, 0.9], [2.0, -1.0], [0.0, 3.0]])
        label_ids = np.array([1, 1, 1])

    # Three classes: F1 is the macro average (class 0: 0 / 1 -> 0; class 1: tp 2, fn 1 -> 4 / 5).
    three = compute_metrics_fn(["f1"], num_labels=3)(EvalPred())
    assert three == {"f1": pytest.approx((0.0 + 0.8) / 2)}
    assert compute_metrics_fn(["accuracy", "f1"])(EvalPred()) == {
        "accuracy": pytest.approx(2 / 3),
        "f1": pytest.approx(0.8),
    }


# --- hfgpt-finetune end to end -----------------------------------------------------------------------


def _write_pairs(path: Path, n: int, seed: int = 0, label=lambda a, b: int(a == b)) -> Path:
    rng = random.Random(seed)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["premise", "hypothesis", "label"])
        for _ in range(n):
            a = "".join(rng.choice("abc") for _ in range(5))
            b = a if rng.random() < 0.5 else "".join(rng.choice("abc") for _ in range(5))
            writer.writerow([a, b, label(a, b)])
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok")
    build_char_tokenizer("abc ").save_pretrained(path)
    return str(path)


def _run(tmp_path: Path, tokenizer_dir: str, *extra: str) -> tuple[FinetuneArguments, object]:
    argv = [
        "--preset", "gpt2", "--config_overrides", TINY, "--tokenizer_name", tokenizer_dir,
        "--output_dir", str(tmp_path / "out"), "--max_steps", "3", "--per_device_train_batch_size", "8",
        "--use_cpu", "true", "--disable_tqdm", "true", "--save_strategy", "no", *extra,
    ]  # fmt: skip
    return make_parser().parse_args_into_dataclasses(args=argv)


def test_paper_defaults_are_the_parser_defaults():
    _, training_args = make_parser().parse_args_into_dataclasses(args=["--use_cpu", "true"])
    assert training_args.learning_rate == 6.25e-5
    assert training_args.per_device_train_batch_size == 32
    assert training_args.num_train_epochs == 3
    assert training_args.warmup_steps == 0.002
    assert str(training_args.lr_scheduler_type.value) == "linear"
    assert str(training_args.optim.value) == "adamw_torch_fused"
    assert FinetuneArguments().lm_loss_weight == 0.5


def test_finetune_push_problems_stop_before_training(tmp_path, tokenizer_dir):
    """A repo id the Hub would refuse is an input error before the model is built or trained."""
    data = _write_pairs(tmp_path / "train.csv", 8)
    args, training_args = _run(
        tmp_path, tokenizer_dir, "--task", "entailment", "--text_columns", "premise,hypothesis",
        "--train_file", str(data), "--push_to_hub", "true", "--hub_model_id", "me/not a name",
    )  # fmt: skip
    with pytest.raises(TrainingInputError, match="not a valid repo id"):
        finetune(args, training_args)
    assert not (tmp_path / "out").exists()


def test_finetune_entailment_reports_metrics_and_saves_a_loadable_checkpoint(tmp_path, tokenizer_dir):
    data = _write_pairs(tmp_path / "train.csv", 24)
    args, training_args = _run(
        tmp_path, tokenizer_dir, "--task", "entailment", "--text_columns", "premise,hypothesis",
        "--train_file", str(data), "--validation_file", str(data), "--metrics", "accuracy,f1",
    )  # fmt: skip
    metrics = finetune(args, training_args)
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and 0.0 <= metrics["eval_f1"] <= 1.0
    assert math.isfinite(metrics["eval_loss"])
    out = tmp_path / "out"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md", "all_results.json"):
        assert (out / name).is_file(), name
    assert not (out / ".hfgpt-final.tmp").exists()
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert isinstance(model, GPTForSequenceClassification)
    assert model.config.lm_loss_weight == 0.5 and model.config.num_labels == 2
    assert model.config.classify_token_id == len(build_char_tokenizer("abc ")) + 2  # _classify_ appended
    # train.py's classifier: dropout clf_pdrop = 0.1 on the pooled state, then `x @ w + b`.
    assert model.config.score_bias and model.config.score_dropout == 0.1
    assert load_file(out / "model.safetensors")["score.bias"].shape == (2,)


def test_finetune_multiple_choice_uses_double_heads(tmp_path, tokenizer_dir):
    rng = random.Random(1)
    path = tmp_path / "mc.jsonl"
    with path.open("w") as f:
        for _ in range(16):
            ctx = "".join(rng.choice("abc") for _ in range(4))
            f.write(
                json.dumps({"ctx": ctx, "e0": ctx[::-1], "e1": "ccc", "e2": "ab", "label": rng.randrange(3)})
                + "\n"
            )
    args, training_args = _run(
        tmp_path, tokenizer_dir, "--task", "multiple_choice", "--text_columns", "ctx,e0,e1,e2",
        "--train_file", str(path), "--validation_file", str(path),
    )  # fmt: skip
    metrics = finetune(args, training_args)
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    model = GPTDoubleHeadsModel.from_pretrained(tmp_path / "out")
    assert model.config.lm_loss_weight == 0.5
    # train.py drops the choices' pooled states with noise shape [B, 1, E]: one mask for all of them.
    assert model.config.summary_dropout_shared and not model.config.score_bias


def test_plain_recipe_regression_reports_pearson(tmp_path, tokenizer_dir):
    rng = random.Random(2)
    path = tmp_path / "reg.json"
    path.write_text(
        "\n".join(json.dumps({"text": "a" * (n := rng.randrange(1, 8)), "score": n / 3}) for _ in range(16))
    )
    # No --metrics: regression defaults to pearsonr (accuracy would compare scores cast to classes).
    args, training_args = _run(
        tmp_path, tokenizer_dir, "--recipe", "plain", "--label_column", "score",
        "--train_file", str(path), "--validation_file", str(path),
    )  # fmt: skip
    metrics = finetune(args, training_args)
    assert -1.0 <= metrics["eval_pearsonr"] <= 1.0 and "eval_accuracy" not in metrics
    model = GPTForSequenceClassification.from_pretrained(tmp_path / "out")
    assert model.config.num_labels == 1 and model.config.lm_loss_weight == 0.0
    assert model.config.problem_type == "regression"
    # GPT-2 style: transformers' GPT2ForSequenceClassification head, no bias and no dropout.
    assert not model.config.score_bias and model.config.score_dropout == 0.0


def _spy_on_trainer(monkeypatch) -> dict:
    """Records the Trainer hfgpt-finetune builds and its model's weights before training."""
    seen: dict = {}
    real = finetune_classification.Trainer

    def spy(**kwargs):
        trainer = real(**kwargs)
        seen["trainer"] = trainer
        seen["initial"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        return trainer

    monkeypatch.setattr(finetune_classification, "Trainer", spy)
    return seen


NO_DROPOUT = TINY + ",resid_pdrop=0,embd_pdrop=0,attn_pdrop=0,score_dropout=0"


def test_gradient_accumulation_gives_the_update_of_one_batch(tmp_path, tokenizer_dir, monkeypatch):
    """Batch 8 in one step and 4 x 2 accumulated steps see the same 8 rows, so plain SGD must make the same
    update: Trainer divides each micro-batch's mean loss by the steps unless the model claims to handle
    num_items_in_batch (GPTForSequenceClassification's **kwargs did: 4 x 2 took twice the step)."""
    data = _write_pairs(tmp_path / "train.csv", 8)
    seen = _spy_on_trainer(monkeypatch)
    updates = {}
    for batch, steps in ((8, 1), (4, 2)):
        out = tmp_path / f"bs{batch}"
        args, training_args = _run(
            tmp_path, tokenizer_dir, "--task", "entailment", "--text_columns", "premise,hypothesis",
            "--train_file", str(data), "--max_steps", "1", "--per_device_train_batch_size", str(batch),
            "--gradient_accumulation_steps", str(steps), "--optim", "sgd", "--learning_rate", "1.0",
            "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--weight_decay", "0",
            "--max_grad_norm", "0", "--output_dir", str(out), "--config_overrides", NO_DROPOUT,
        )  # fmt: skip
        finetune(args, training_args)
        after = load_file(out / "model.safetensors")
        updates[batch] = {k: after[k] - seen["initial"][k] for k in after}
    assert updates[8]["score.weight"].abs().max() > 1e-4  # a real step was taken
    for key in updates[8]:
        torch.testing.assert_close(updates[4][key], updates[8][key], atol=1e-6, rtol=1e-4, msg=key)


class _Captured(Exception):
    pass


def _encoded_inputs(monkeypatch, argv: list[str]) -> dict:
    """The datasets hfgpt-finetune hands to Trainer (Trainer replaced by a stub that stops there)."""
    captured = {}

    def stop(**kwargs):
        captured.update(kwargs)
        raise _Captured

    monkeypatch.setattr(finetune_classification, "Trainer", stop)
    with pytest.raises(_Captured):
        finetune(*make_parser().parse_args_into_dataclasses(args=argv))
    return captured


def test_plain_recipe_keeps_the_hypothesis_of_a_long_premise(tmp_path, tokenizer_dir, monkeypatch):
    data = tmp_path / "long.csv"
    data.write_text("premise,hypothesis,label\n" + "a" * 40 + ",bcb,1\nab,ab,0\n")
    argv = [
        "--preset", "gpt2", "--config_overrides", TINY, "--tokenizer_name", tokenizer_dir,
        "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--recipe", "plain",
        "--task", "entailment", "--text_columns", "premise,hypothesis", "--train_file", str(data),
    ]  # fmt: skip
    captured = _encoded_inputs(monkeypatch, argv)
    tokenizer = captured["processing_class"]
    # 32 positions: 28 premise tokens, EOS, the whole 3-token hypothesis.
    row = captured["train_dataset"][0]["input_ids"]
    assert tokenizer.decode(row) == "a" * 28 + "</s>" + "bcb"


@pytest.mark.parametrize("tokenizer_name", ["gpt2", "openai-gpt"])
def test_control_token_text_in_the_data_stays_text(tmp_path, monkeypatch, tokenizer_name):
    """OpenAI's TextEncoder maps text through its BPE vocabulary only, so "_classify_" written in the data
    never becomes the id of the added `_classify_` token: only the recipe's transform places them."""
    data = tmp_path / "train.jsonl"
    rows = [{"text": "see my_classify_ function and _start_ here", "label": 1}, {"text": "ok", "label": 0}]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    argv = [
        "--preset", "gpt2", "--config_overrides", TINY, "--tokenizer_name", tokenizer_name,
        "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--train_file", str(data),
    ]  # fmt: skip
    captured = _encoded_inputs(monkeypatch, argv)
    tokenizer = captured["processing_class"]
    start, delimiter, classify = tokenizer.convert_tokens_to_ids(["_start_", "_delimiter_", "_classify_"])
    row = captured["train_dataset"][0]["input_ids"]
    assert row[0] == start and row[-1] == classify
    assert not {start, delimiter, classify} & set(row[1:-1])
    assert "classify" in tokenizer.decode(row[1:-1])


def test_refinetuning_a_checkpoint_with_other_labels(tmp_path, tokenizer_dir):
    names = _write_pairs(tmp_path / "names.csv", 16, label=lambda a, b: "same" if a == b else "diff")
    args, training_args = _run(
        tmp_path, tokenizer_dir, "--task", "entailment", "--text_columns", "premise,hypothesis",
        "--train_file", str(names), "--max_steps", "1", "--output_dir", str(tmp_path / "first"),
    )  # fmt: skip
    finetune(args, training_args)
    reuse = ["--model_name_or_path", str(tmp_path / "first"), "--max_steps", "1", "--use_cpu", "true"]
    scores = tmp_path / "scores.jsonl"
    scores.write_text("\n".join(json.dumps({"text": "ab" * i, "score": i / 3}) for i in range(1, 9)))

    # Two-label head -> one regression score: refused with the way out, then done with it.
    regression = [*reuse, "--train_file", str(scores), "--label_column", "score", "--save_strategy", "no"]
    args, training_args = make_parser().parse_args_into_dataclasses(
        args=[*regression, "--output_dir", str(tmp_path / "reg")]
    )
    with pytest.raises(
        FinetuneInputError, match=r"head for 2 labels \(diff, same\).*--ignore_mismatched_sizes"
    ):
        finetune(args, training_args)
    args, training_args = make_parser().parse_args_into_dataclasses(
        args=[*regression, "--output_dir", str(tmp_path / "reg"), "--ignore_mismatched_sizes", "true"]
    )
    finetune(args, training_args)
    model = GPTForSequenceClassification.from_pretrained(tmp_path / "reg")
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"

    # Same number of labels, but numbers: the old names must not survive.
    numbers = _write_pairs(tmp_path / "numbers.csv", 16)
    args, training_args = make_parser().parse_args_into_dataclasses(
        args=[*reuse, "--task", "entailment", "--text_columns", "premise,hypothesis", "--train_file",
              str(numbers), "--output_dir", str(tmp_path / "ints"), "--save_strategy", "no"]
    )  # fmt: skip
    finetune(args, training_args)
    config = GPTForSequenceClassification.from_pretrained(tmp_path / "ints").config
    assert config.id2label == {0: "LABEL_0", 1: "LABEL_1"}


def test_a_checkpoint_keeps_the_ids_of_its_label_names():
    # run_glue.py: when the data's label names are the head's, the head's label2id is used as it is.
    base = GPTConfig(
        architectures=["GPTForSequenceClassification"], id2label={0: "same", 1: "diff"}, num_labels=2
    )
    args = FinetuneArguments(model_name_or_path="ckpt", task="entailment")
    assert match_checkpoint_labels(args, base, 2, {"diff": 0, "same": 1}) == {"same": 0, "diff": 1}
    assert match_checkpoint_labels(args, base, 2, {"no": 0, "yes": 1}) == {"no": 0, "yes": 1}
    assert match_checkpoint_labels(args, GPTConfig(architectures=["GPTForCausalLM"]), 3, None) is None


def test_evaluation_asked_for_without_validation_data_is_an_error(tmp_path, tokenizer_dir, capsys):
    assert not evaluation_requested(["--output_dir", "x"])  # the default per-epoch evaluation
    assert not evaluation_requested(["--output_dir", "x", "--eval_strategy", "no"])
    data = _write_pairs(tmp_path / "train.csv", 8)
    for flags in (["--do_eval"], ["--eval_strategy", "steps"]):
        argv = [
            "--preset", "gpt2", "--config_overrides", TINY, "--tokenizer_name", tokenizer_dir,
            "--task", "entailment", "--text_columns", "premise,hypothesis", "--train_file", str(data),
            "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", *flags,
        ]  # fmt: skip
        assert evaluation_requested(argv)
        assert main(argv) == 2
        assert "there is no validation data" in capsys.readouterr().err
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], r"drop the auxiliary LM loss \(lambda 0.5\)"),
        (["--task", "multiple_choice", "--text_columns", "premise,hypothesis,other"], "the multiple-choice"),
        (["--label_column", "score"], "a regression score has no classes"),
    ],
    ids=["gpt1-recipe", "multiple-choice", "regression"],
)
def test_label_smoothing_is_refused_where_trainer_would_get_the_loss_wrong(
    tmp_path, tokenizer_dir, extra, message
):
    data = tmp_path / "train.jsonl"
    row = {"premise": "ab", "hypothesis": "ba", "other": "c"}
    data.write_text("\n".join(json.dumps({**row, "label": i % 2, "score": i / 3}) for i in range(8)))
    base = ["--task", "entailment", "--text_columns", "premise,hypothesis", "--train_file", str(data)]
    args, training_args = _run(tmp_path, tokenizer_dir, *base, *extra, "--label_smoothing_factor", "0.1")
    with pytest.raises(
        FinetuneInputError, match=r"--label_smoothing_factor 0.1 cannot be used here: .*" + message
    ):
        finetune(args, training_args)


def test_label_smoothing_of_plain_classification_is_smoothed_cross_entropy(
    tmp_path, tokenizer_dir, monkeypatch
):
    """Without the auxiliary loss, Trainer's label smoother is the whole loss, and allowed: the loss of
    one step on all 8 rows equals F.cross_entropy(label_smoothing=0.1) of the initial model's logits."""
    data = _write_pairs(tmp_path / "train.csv", 8)
    args, training_args = _run(
        tmp_path, tokenizer_dir, "--task", "entailment", "--text_columns", "premise,hypothesis",
        "--train_file", str(data), "--lm_loss_weight", "0", "--label_smoothing_factor", "0.1",
        "--max_steps", "1", "--config_overrides", NO_DROPOUT,
    )  # fmt: skip
    seen = _spy_on_trainer(monkeypatch)
    metrics = finetune(args, training_args)
    trainer = seen["trainer"]
    trainer.model.load_state_dict(seen["initial"])
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = F.cross_entropy(logits, batch["labels"], label_smoothing=0.1)
    assert metrics["train_loss"] == pytest.approx(expected.item(), rel=1e-4)


# --- bad input: a clear message before training ------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", r"train_file '.*nope\.csv' does not exist"),
        ("empty", r"train_file '.*empty\.csv' is empty"),
        ("column", r"train data has no column 'hypothesis' \(columns: premise, label\)"),
        ("label", r"train data row \d+: label 7 is outside \[0, 2\) \(num_labels\)"),
        ("no-label", r"train data row 1: label None is not a number or a name"),
        ("too-long", r"row \d+: the transformed input has \d+ tokens, more than the model's context of 32"),
        ("mixed-formats", r"train_file '.*train\.csv' is csv but validation_file '.*dev\.jsonl' is json"),
        (
            "validation-names",
            r"validation data row 1: label 'diff' is a name, but the train data's labels are numbers",
        ),
        ("missing-text", r"train data row 1: column 'hypothesis' has no text \(missing or null\)"),
        (
            "mixed-labels",
            r"train data row 1: the label column mixes names and numbers \(row 0: 'same', row 1: 1\)",
        ),
        (
            "regression-accuracy",
            r"metric 'accuracy' compares classes, but a regression model predicts scores",
        ),
    ],
)
def test_bad_input_is_refused_before_training(tmp_path, tokenizer_dir, case, message, capsys):
    data = tmp_path / "train.csv"
    extra: list[str] = []
    if case == "missing":
        data = tmp_path / "nope.csv"
    elif case == "empty":
        data = tmp_path / "empty.csv"
        data.write_text("")
    elif case == "column":
        data.write_text("premise,label\nabc,1\n")
    elif case == "no-label":
        data.write_text("premise,hypothesis,label\nab,ab,1\nab,cb,\n")
    elif case == "label":
        _write_pairs(data, 8, label=lambda a, b: 7 if a == b else 0)
        extra = ["--num_labels", "2"]
    elif case in ("mixed-formats", "validation-names"):
        _write_pairs(data, 8)
        dev = tmp_path / ("dev.jsonl" if case == "mixed-formats" else "dev.csv")
        if case == "mixed-formats":
            dev.write_text(json.dumps({"premise": "ab", "hypothesis": "ab", "label": 1}))
        else:  # loaded as one dataset with the train file, it failed inside datasets on the column type
            dev.write_text("premise,hypothesis,label\nab,ab,1\nab,cb,diff\n")
        extra = ["--validation_file", str(dev)]
    elif case in ("missing-text", "mixed-labels", "regression-accuracy"):
        data = tmp_path / "train.jsonl"
        first = {"premise": "ab", "hypothesis": "ab"}
        rows = {
            "missing-text": [{**first, "label": "same"}, {"premise": "ab", "label": "diff"}],
            "mixed-labels": [{**first, "label": "same"}, {**first, "label": 1}],
            "regression-accuracy": [{**first, "label": 0.5}, {**first, "label": 2.25}],
        }[case]
        data.write_text("\n".join(json.dumps(row) for row in rows))
        extra = ["--metrics", "accuracy"] if case == "regression-accuracy" else []
    else:
        data.write_text("premise,hypothesis,label\n" + "a" * 30 + ",bbb,1\nab,ab,0\n")
        extra = ["--truncate", "false"]
    argv = [
        "--preset", "gpt2", "--config_overrides", TINY, "--tokenizer_name", tokenizer_dir,
        "--task", "entailment", "--text_columns", "premise,hypothesis", "--train_file", str(data),
        "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", *extra,
    ]  # fmt: skip
    args, training_args = make_parser().parse_args_into_dataclasses(args=argv)
    with pytest.raises(TrainingInputError, match=message):  # FinetuneInputError is one
        finetune(args, training_args)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("checkpoint-*"))
    # The command prints one clean line and exits non-zero.
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in err
