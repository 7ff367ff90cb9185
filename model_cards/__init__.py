"""Model cards (README.md) for hfgpt checkpoints on the Hugging Face Hub.

`render_model_card(kind, config=..., **facts)` fills one of the Jinja templates next to this file and
returns a `huggingface_hub.ModelCard` whose YAML metadata is built with `ModelCardData` / `EvalResult`:

- "openai-gpt", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl": OpenAI's original releases converted by
  `hfgpt-convert`;
- "trained": any checkpoint trained or fine-tuned with hfgpt (used by the training scripts).

Templates extend each other (the GPT-2 sizes share `_gpt2_base.md`), so they are rendered with a Jinja
environment loading from this folder, then parsed back by `ModelCard`, exactly as `ModelCard.from_template`
does with a single file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import jinja2
from huggingface_hub import EvalResult, ModelCard, ModelCardData

TEMPLATES_DIR = Path(__file__).parent

GPT2_PAPER = (
    "https://cdn.openai.com/better-language-models/language_models_are_unsupervised_multitask_learners.pdf"
)
GPT2_PAPER_SOURCE = "Radford et al. 2019, Table 3"

# Zero-shot results of the GPT-2 paper, Table 3 (model sizes as the paper names them: 117M, 345M, 762M,
# 1542M; the released checkpoints are 124M, 355M, 774M, 1558M). Columns: Hub dataset id, display name,
# dataset config, metric id, metric display name.
GPT2_TABLE3_COLUMNS: list[tuple[str, str, str | None, str, str]] = [
    ("lambada", "LAMBADA", None, "perplexity", "Perplexity"),
    ("lambada", "LAMBADA", None, "accuracy", "Accuracy"),
    ("cbt", "Children's Book Test (common nouns)", "CN", "accuracy", "Accuracy"),
    ("cbt", "Children's Book Test (named entities)", "NE", "accuracy", "Accuracy"),
    ("wikitext", "WikiText-2", "wikitext-2-raw-v1", "perplexity", "Perplexity"),
    ("ptb_text_only", "Penn Treebank", None, "perplexity", "Perplexity"),
    ("enwik8", "enwik8", None, "bpb", "Bits per byte"),
    ("text8", "text8", None, "bpc", "Bits per character"),
    ("wikitext", "WikiText-103", "wikitext-103-raw-v1", "perplexity", "Perplexity"),
    ("lm1b", "One Billion Word", None, "perplexity", "Perplexity"),
]
GPT2_TABLE3: dict[str, list[float]] = {
    "gpt2": [35.13, 45.99, 87.65, 83.4, 29.41, 65.85, 1.16, 1.17, 37.50, 75.20],
    "gpt2-medium": [15.60, 55.48, 92.35, 87.1, 22.76, 47.33, 1.01, 1.06, 26.37, 55.72],
    "gpt2-large": [10.87, 60.12, 93.45, 88.0, 19.93, 40.31, 0.97, 1.02, 22.05, 44.575],
    "gpt2-xl": [8.63, 63.24, 93.30, 89.05, 18.34, 35.76, 0.93, 0.98, 17.48, 42.16],
}


@dataclass(frozen=True)
class CardKind:
    """One row of the card table: which template, and the metadata every card of that kind carries."""

    template: str
    title: str
    release_name: str | None = None  # folder name of OpenAI's GPT-2 release
    datasets: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    extra_facts: frozenset[str] = field(default_factory=frozenset)


_RELEASE_FACTS = frozenset({"source"})
CARD_KINDS: dict[str, CardKind] = {
    # GPT-1 was trained on BooksCorpus (paper §4.1).
    "openai-gpt": CardKind("openai-gpt.md", "OpenAI GPT-1", None, ("bookcorpus",), ("gpt1",), _RELEASE_FACTS),
    # GPT-2's WebText was never released, so no dataset id.
    "gpt2": CardKind("gpt2.md", "GPT-2 (124M)", "124M", (), ("gpt2",), _RELEASE_FACTS),
    "gpt2-medium": CardKind("gpt2-medium.md", "GPT-2 Medium (355M)", "355M", (), ("gpt2",), _RELEASE_FACTS),
    "gpt2-large": CardKind("gpt2-large.md", "GPT-2 Large (774M)", "774M", (), ("gpt2",), _RELEASE_FACTS),
    "gpt2-xl": CardKind("gpt2-xl.md", "GPT-2 XL (1558M)", "1558M", (), ("gpt2",), _RELEASE_FACTS),
    "trained": CardKind(
        "trained.md",
        "hfgpt model",
        extra_facts=frozenset(
            {
                "title",
                "description",
                "base_model",
                "datasets",
                "task",
                "training",
                "intended_uses",
                "license",
                "license_text",
                "language",
                "tags",
            }
        ),  # fmt: skip
    ),
}
COMMON_FACTS = frozenset({"repo_id", "converter_version", "eval_results"})

# What a checkpoint's head computes -> (the Auto class that loads it, its Hub pipeline tag). No Auto class
# loads a double-heads model (AutoModelForMultipleChoice expects no LM head; AutoModel gives the bare
# decoder), so its card names the class itself.
HEADS: dict[str, tuple[str | None, str]] = {
    "causal-lm": ("AutoModelForCausalLM", "text-generation"),
    "double-heads": (None, "text-generation"),
    "sequence-classification": ("AutoModelForSequenceClassification", "text-classification"),
    "token-classification": ("AutoModelForTokenClassification", "token-classification"),
    "question-answering": ("AutoModelForQuestionAnswering", "question-answering"),
    "base": ("AutoModel", "feature-extraction"),
}

# config.json's `architectures[0]` -> (its `model_type`, its head). hfgpt's own classes (model_type
# "hfgpt"), and transformers' GPT2* / OpenAIGPT* classes, which `hfgpt-convert --format transformers` and
# `hfgpt.modeling.interop.to_transformers` write (transformers has no OpenAIGPT token-classification or
# question-answering class).
HEAD_CLASSES: dict[str, tuple[str, str]] = {
    "GPTForCausalLM": ("hfgpt", "causal-lm"),
    "GPTDoubleHeadsModel": ("hfgpt", "double-heads"),
    "GPTForSequenceClassification": ("hfgpt", "sequence-classification"),
    "GPTForTokenClassification": ("hfgpt", "token-classification"),
    "GPTForQuestionAnswering": ("hfgpt", "question-answering"),
    "GPTModel": ("hfgpt", "base"),
    "GPT2LMHeadModel": ("gpt2", "causal-lm"),
    "GPT2DoubleHeadsModel": ("gpt2", "double-heads"),
    "GPT2ForSequenceClassification": ("gpt2", "sequence-classification"),
    "GPT2ForTokenClassification": ("gpt2", "token-classification"),
    "GPT2ForQuestionAnswering": ("gpt2", "question-answering"),
    "GPT2Model": ("gpt2", "base"),
    "OpenAIGPTLMHeadModel": ("openai-gpt", "causal-lm"),
    "OpenAIGPTDoubleHeadsModel": ("openai-gpt", "double-heads"),
    "OpenAIGPTForSequenceClassification": ("openai-gpt", "sequence-classification"),
    "OpenAIGPTModel": ("openai-gpt", "base"),
}

# model_type -> the class a config without `architectures` stands for (save_pretrained records it).
_DEFAULT_ARCHITECTURE = {
    "hfgpt": "GPTForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "openai-gpt": "OpenAIGPTLMHeadModel",
}


class ModelCardError(ValueError):
    """A card cannot be rendered from the facts given; the message names the kind or fact at fault."""


def hfgpt_version() -> str:
    try:
        return version("hfgpt")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown"


def model_type_of(config: Mapping[str, Any]) -> str:
    """The checkpoint format of `config`: "hfgpt" (also for a dict without `model_type`, such as hfgpt's
    presets), or transformers' own "gpt2" / "openai-gpt"."""
    model_type = config.get("model_type") or "hfgpt"
    if model_type not in _DEFAULT_ARCHITECTURE:
        raise ModelCardError(
            f"config model_type {model_type!r} is not an hfgpt, gpt2 or openai-gpt model; hfgpt's cards "
            "describe those only"
        )
    return model_type


def architecture_of(config: Mapping[str, Any]) -> str:
    """`config`'s head class (`architectures[0]`, else the causal LM of its format), checked against the
    known heads and the config's `model_type`."""
    model_type = model_type_of(config)
    architectures = config.get("architectures") or [_DEFAULT_ARCHITECTURE[model_type]]
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ModelCardError(f"config architectures must be a list of class names, got {architectures!r}")
    name = architectures[0]
    if name not in HEAD_CLASSES:
        raise ModelCardError(
            f"config architectures[0] {name!r} is not a head hfgpt's cards know ({', '.join(HEAD_CLASSES)})"
        )
    if HEAD_CLASSES[name][0] != model_type:
        raise ModelCardError(
            f"config architectures[0] {name!r} is a {HEAD_CLASSES[name][0]} class, but model_type is "
            f"{model_type!r}"
        )
    return name


def layer_norm_position_of(config: Mapping[str, Any]) -> str:
    """Where `config`'s layer norms sit: "post" (GPT-1: transformers' OpenAIGPT, or hfgpt's field) or
    "pre" (GPT-2)."""
    model_type = model_type_of(config)
    if model_type == "hfgpt":
        return config.get("layer_norm_position", "pre")
    return "post" if model_type == "openai-gpt" else "pre"


def _num_labels(config: Mapping[str, Any]) -> int:
    # PretrainedConfig's num_labels is len(id2label); config.json may carry either, or neither (2 labels).
    if config.get("num_labels") is not None:
        return int(config["num_labels"])
    return len(config["id2label"]) if config.get("id2label") else 2


def count_parameters(config: Mapping[str, Any]) -> int:
    """Parameters of the model described by `config` (its `architectures[0]`, default the causal LM), as
    the checkpoint stores them: embeddings V*E + P*E; per block two layer norms (4E), attention 4E^2 + 4E,
    MLP 2*E*I + I + E; the final layer norm of GPT-2 (pre-norm); then the head: an LM head V*E unless tied
    to the embeddings (counted once then), the double-heads' summary projection (one output, or E without
    `summary_proj_to_labels`: transformers sets num_labels to 1 there, hfgpt asks for one), the sequence
    classifier E*L (+L with hfgpt's `score_bias`), the token classifier E*L + L, the span head 2E + 2."""
    e, n_layer, inner = config["n_embd"], config["n_layer"], config.get("n_inner") or 4 * config["n_embd"]
    vocab = config["vocab_size"]
    block = 4 * e + (4 * e * e + 4 * e) + (2 * e * inner + inner + e)
    final_norm = 2 * e if layer_norm_position_of(config) == "pre" else 0
    total = (vocab + config["n_positions"]) * e + n_layer * block + final_norm
    head = HEAD_CLASSES[architecture_of(config)][1]
    if head in ("causal-lm", "double-heads") and not config.get("tie_word_embeddings", True):
        total += vocab * e
    if head == "double-heads" and config.get("summary_use_proj", True):
        outputs = 1 if config.get("summary_proj_to_labels", True) else e
        total += e * outputs + outputs
    labels = _num_labels(config)
    if head == "sequence-classification":
        total += e * labels + (labels if config.get("score_bias", False) else 0)
    elif head == "token-classification":
        total += e * labels + labels
    elif head == "question-answering":
        total += 2 * e + 2
    return total


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def gpt2_reported_results(kind: str) -> list[EvalResult]:
    """The GPT-2 paper's Table 3 row for `kind` as EvalResults."""
    return [
        EvalResult(
            task_type="text-generation",
            task_name="Zero-shot language modelling",
            dataset_type=dataset,
            dataset_name=name,
            dataset_config=config,
            metric_type=metric,
            metric_name=metric_name,
            metric_value=value,
            source_name=GPT2_PAPER_SOURCE,
            source_url=GPT2_PAPER,
        )
        for (dataset, name, config, metric, metric_name), value in zip(
            GPT2_TABLE3_COLUMNS, GPT2_TABLE3[kind], strict=True
        )
    ]


def _config_dict(kind: str, config: Any) -> dict[str, Any]:
    if config is None:
        if kind == "trained":
            raise ModelCardError("a 'trained' card needs the checkpoint's config (config=...)")
        # Lazy: the presets live with the model, which pulls in transformers.
        from hfgpt.modeling.configuration_hfgpt import GPTConfig

        config = GPTConfig.from_preset(kind)
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ModelCardError(f"config must be a mapping or a PretrainedConfig, got {type(config).__name__}")
    missing = [k for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head") if k not in config]
    if missing:
        raise ModelCardError(f"config lacks {', '.join(missing)}: is it an hfgpt config?")
    return dict(config)


def render_model_card(kind: str, config: Any = None, **facts: Any) -> ModelCard:
    """Render the model card for a checkpoint.

    Args:
        kind: "openai-gpt", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl" (a converted OpenAI release)
            or "trained" (a checkpoint trained or fine-tuned with hfgpt).
        config: the checkpoint's `GPTConfig` or its `config.json` as a dict; defaults to the preset of a
            release kind.
        **facts: `repo_id` (used in the loading snippet), `converter_version` (defaults to the installed
            hfgpt), `eval_results` (EvalResults measured on this checkpoint; release cards add the paper's
            reported ones); release kinds also take `source` (where the original files were read from);
            "trained" takes `title`, `description`, `base_model`, `datasets`, `task`, `training` (a dict of
            hyperparameters), `intended_uses`, `license`, `license_text`, `language`, `tags`.

    Returns:
        A `huggingface_hub.ModelCard`; `card.save(path)` writes README.md, `card.validate()` asks the Hub.
    """
    if kind not in CARD_KINDS:
        raise ModelCardError(f"unknown model card kind {kind!r}; expected one of {', '.join(CARD_KINDS)}")
    spec = CARD_KINDS[kind]
    unknown = set(facts) - COMMON_FACTS - spec.extra_facts
    if unknown:
        raise ModelCardError(f"unknown fact(s) for a {kind!r} card: {', '.join(sorted(unknown))}")
    cfg = _config_dict(kind, config)

    measured = list(facts.get("eval_results") or [])
    for result in measured:
        if not isinstance(result, EvalResult):
            raise ModelCardError(
                f"eval_results must be huggingface_hub.EvalResult, got {type(result).__name__}"
            )
    reported = gpt2_reported_results(kind) if kind in GPT2_TABLE3 else []
    results = reported + measured

    model_type = model_type_of(cfg)
    architecture = architecture_of(cfg)
    head = HEAD_CLASSES[architecture][1]
    auto_class, pipeline_tag = HEADS[head]
    license_id = facts.get("license", "mit")
    repo_id = facts.get("repo_id") or "path/to/this/model"
    title = facts.get("title") or (
        repo_id.split("/")[-1] if kind == "trained" and facts.get("repo_id") else spec.title
    )
    datasets = list(facts.get("datasets") or spec.datasets)
    base_model = facts.get("base_model")

    card_data = ModelCardData(
        language=facts.get("language", "en"),
        license=license_id,
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=sorted({"hfgpt", *spec.tags, *(facts.get("tags") or ())}),
        datasets=datasets or None,
        base_model=base_model,
        model_name=title if results else None,
        eval_results=results or None,
    )

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        undefined=jinja2.StrictUndefined,  # a template naming a fact nobody passes is a bug, not a blank
        keep_trailing_newline=True,
    )
    values = {
        "description": None,
        "task": None,
        "training": None,
        "intended_uses": None,
        "license_text": None,
        "source": None,
        **facts,
        "card_data": card_data.to_yaml(),
        "title": title,
        "repo_id": repo_id,
        "converter_version": facts.get("converter_version") or hfgpt_version(),
        "release_name": spec.release_name,
        "parameters": _human(count_parameters(cfg)),
        "results": results,
        "measured": bool(measured),
        "datasets": datasets,
        "base_model": base_model,
        "base_model_url": f"https://huggingface.co/{base_model}" if base_model else None,
        "license": license_id,
        "architecture": architecture,
        "head": head,
        "auto_class": auto_class,
        "model_type": model_type,
        # The checkpoint needs hfgpt's code (shipped beside it for trust_remote_code) only in hfgpt format;
        # gpt2 / openai-gpt checkpoints are transformers' own classes.
        "remote_code": model_type == "hfgpt",
        "hfgpt_class": next(n for n, (t, h) in HEAD_CLASSES.items() if t == "hfgpt" and h == head),
        # AutoTokenizer loads GPT-2's tokenizer and transformers' OpenAIGPTTokenizer as they are; hfgpt's
        # GPT-1 tokenizer needs ftfy and spaCy, so the GPT-1 release card explains it instead.
        "with_tokenizer": kind != "trained" and (kind != "openai-gpt" or model_type != "hfgpt"),
        "layer_norm_position": layer_norm_position_of(cfg),
        **{k: cfg[k] for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")},
    }
    content = env.get_template(spec.template).render(**values)
    return ModelCard(content)


__all__ = [
    "CARD_KINDS",
    "HEADS",
    "HEAD_CLASSES",
    "GPT2_TABLE3",
    "ModelCardError",
    "architecture_of",
    "count_parameters",
    "gpt2_reported_results",
    "layer_norm_position_of",
    "model_type_of",
    "render_model_card",
]
