"""Model cards: content and metadata of each template, and the Hub's validation of the result (through
huggingface_hub's own `ModelCard.validate`, answered by the loopback Hub of tests/hub_server.py)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import EvalResult, HfApi, ModelCard

from hfgpt.model_cards import ModelCardError, count_parameters, render_model_card
from hfgpt.modeling import GPTConfig, GPTForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from hub_server import DEFAULT_TOKENS, HubServer  # noqa: E402

RELEASES = ["openai-gpt", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]
TINY = dict(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=4)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    with HubServer(tmp_path_factory.mktemp("hub")) as server:
        yield server


@pytest.fixture
def validating_hub(hub: HubServer, use_test_hub) -> HubServer:
    # ModelCard.validate posts to f"{constants.ENDPOINT}/api/validate-yaml", reading the constant per call;
    # use_test_hub sets it, and turns the session's offline switch off for the test.
    use_test_hub(hub.url)
    return hub


@pytest.mark.parametrize("kind", RELEASES)
def test_release_cards_carry_metadata_provenance_limitations_licence_and_citation(kind: str) -> None:
    card = render_model_card(kind, repo_id="someone/model", converter_version="9.8.7", source="/data/release")
    reparsed = ModelCard(str(card))  # what the Hub will read back from README.md
    assert reparsed.data.license == "mit"
    assert reparsed.data.library_name == "transformers"
    assert reparsed.data.pipeline_tag == "text-generation"
    assert "hfgpt" in reparsed.data.tags
    text = card.text
    assert "hfgpt 9.8.7" in text and "`/data/release`" in text  # converter version and source
    assert 'from_pretrained("someone/model", trust_remote_code=True)' in text
    assert "## Intended uses and limitations" in text and "bias" in text
    assert "## Licence\n\nMIT" in text
    if kind == "openai-gpt":
        assert reparsed.data.datasets == ["bookcorpus"]
        assert "@article{radford2018improving" in text and "BooksCorpus" in text
        assert "finetune-transformer-lm" in text
    else:
        assert "@article{radford2019language" in text and "WebText" in text
        assert "does not distinguish fact from fiction" in text


# GPT-2 paper, Table 3 (zero-shot): the values the cards must carry, typed from the paper.
PAPER_TABLE3 = {
    "gpt2": {
        "LAMBADA perplexity": 35.13,
        "WikiText-103 perplexity": 37.50,
        "One Billion Word perplexity": 75.20,
    },
    "gpt2-medium": {
        "LAMBADA perplexity": 15.60,
        "WikiText-103 perplexity": 26.37,
        "One Billion Word perplexity": 55.72,
    },
    "gpt2-large": {
        "LAMBADA perplexity": 10.87,
        "WikiText-103 perplexity": 22.05,
        "One Billion Word perplexity": 44.575,
    },
    "gpt2-xl": {
        "LAMBADA perplexity": 8.63,
        "WikiText-103 perplexity": 17.48,
        "One Billion Word perplexity": 42.16,
    },
}


@pytest.mark.parametrize("kind", sorted(PAPER_TABLE3))
def test_gpt2_cards_report_the_papers_zero_shot_results_in_model_index(kind: str) -> None:
    results = ModelCard(str(render_model_card(kind))).data.eval_results
    by_name = {f"{r.dataset_name} {r.metric_type}": r for r in results}
    for name, value in PAPER_TABLE3[kind].items():
        assert by_name[name].metric_value == value
        assert by_name[name].source_name == "Radford et al. 2019, Table 3"
    assert len(results) == 10


def test_gpt1_card_has_no_results_of_fine_tuned_models() -> None:
    card = ModelCard(str(render_model_card("openai-gpt")))
    assert card.data.eval_results is None
    assert "model-index" not in str(card)


def test_parameter_counts_match_the_models() -> None:
    for config in (GPTConfig(**TINY), GPTConfig(**TINY, layer_norm_position="post", n_inner=48)):
        model = GPTForCausalLM(config)
        assert count_parameters(config.to_dict()) == sum(p.numel() for p in model.parameters())
    with torch.device("meta"):
        for preset, shown in [("gpt2", "124M"), ("gpt2-medium", "355M"), ("gpt2-large", "774M")]:
            model = GPTForCausalLM(GPTConfig.from_preset(preset))
            assert count_parameters(model.config.to_dict()) == sum(p.numel() for p in model.parameters())
            assert f"| Parameters | {shown} |" in render_model_card(preset).text


def test_trained_card_records_base_model_data_training_and_measured_results() -> None:
    config = {**TINY, "architectures": ["GPTForSequenceClassification"]}
    result = EvalResult(
        task_type="text-classification",
        dataset_type="glue",
        dataset_name="SST-2",
        dataset_config="sst2",
        dataset_split="validation",
        metric_type="accuracy",
        metric_value=0.912,
    )
    card = render_model_card(
        "trained",
        config=config,
        repo_id="me/gpt2-sst2",
        base_model="openai-community/gpt2",
        datasets=["glue"],
        task="sentiment classification",
        training={"learning_rate": 6.25e-5, "epochs": 3},
        eval_results=[result],
    )
    data = ModelCard(str(card)).data
    assert data.base_model == "openai-community/gpt2" and data.datasets == ["glue"]
    assert data.pipeline_tag == "text-classification"
    assert data.model_name == "gpt2-sst2"
    assert [(r.dataset_name, r.dataset_split, r.metric_value) for r in data.eval_results] == [
        ("SST-2", "validation", 0.912)
    ]
    assert 'AutoModelForSequenceClassification.from_pretrained("me/gpt2-sst2"' in card.text
    assert "| learning_rate | 6.25e-05 |" in card.text
    assert "GPT-2 style, pre-norm" in card.text


def test_bad_requests_are_refused_with_the_fault_named() -> None:
    with pytest.raises(ModelCardError, match="unknown model card kind 'gpt3'"):
        render_model_card("gpt3")
    with pytest.raises(ModelCardError, match="unknown fact.*base_modle"):
        render_model_card("trained", config=TINY, base_modle="gpt2")
    with pytest.raises(ModelCardError, match="needs the checkpoint's config"):
        render_model_card("trained")
    with pytest.raises(ModelCardError, match="lacks n_head"):
        render_model_card("trained", config={k: v for k, v in TINY.items() if k != "n_head"})
    with pytest.raises(ModelCardError, match="EvalResult"):
        render_model_card("gpt2", eval_results=[{"accuracy": 1.0}])


@pytest.mark.parametrize("kind", [*RELEASES, "trained"])
def test_every_card_passes_the_hubs_validation(kind: str, validating_hub: HubServer) -> None:
    card = render_model_card(kind, **({"config": TINY} if kind == "trained" else {}))
    card.validate()
    assert ("POST", "/api/validate-yaml", 200) in validating_hub.log


def test_validation_rejects_unknown_licence_and_broken_yaml(validating_hub: HubServer) -> None:
    card = render_model_card("trained", config=TINY, license="my-own-licence")
    with pytest.raises(ValueError, match="my-own-licence"):
        card.validate()
    # A README that ModelCard itself cannot parse: huggingface_hub validates it before committing it.
    api = HfApi(endpoint=validating_hub.url, token=next(iter(DEFAULT_TOKENS)))
    api.create_repo("tester/broken-card", exist_ok=True)
    broken = b"---\nlicense: mit\ntags: [unclosed\n---\n\n# x\n"
    with pytest.raises(ValueError, match="Invalid YAML"):
        api.upload_file(path_or_fileobj=broken, path_in_repo="README.md", repo_id="tester/broken-card")


@pytest.mark.parametrize(
    ("facts", "body"),
    [
        ({}, "MIT."),
        ({"license": "apache-2.0"}, "Released under the licence `apache-2.0`"),
        ({"license": "apache-2.0", "license_text": "Apache 2.0, see LICENSE."}, "Apache 2.0, see LICENSE."),
    ],
)
def test_trained_card_licence_section_agrees_with_the_license_metadata(facts: dict, body: str) -> None:
    card = render_model_card("trained", config=TINY, **facts)
    licence = card.text.split("## Licence\n\n")[1].split("\n\n## ")[0]
    assert licence.startswith(body)
    assert ModelCard(str(card)).data.license == facts.get("license", "mit")
    if "license" in facts:
        assert "MIT" not in licence


def _heads_and_configs() -> list[tuple[type, dict]]:
    """Every head class hfgpt's cards describe, each with the config options that change its size."""
    import transformers

    from hfgpt.modeling import (
        GPTDoubleHeadsModel,
        GPTForQuestionAnswering,
        GPTForSequenceClassification,
        GPTForTokenClassification,
        GPTModel,
    )

    cases: list[tuple[type, dict]] = []
    for norm in ("pre", "post"):
        for tie in (True, False):
            cases.append((GPTForCausalLM, dict(layer_norm_position=norm, tie_word_embeddings=tie)))
            cases.append((GPTDoubleHeadsModel, dict(layer_norm_position=norm, tie_word_embeddings=tie)))
        cases += [
            (GPTModel, dict(layer_norm_position=norm)),
            (GPTForSequenceClassification, dict(layer_norm_position=norm, num_labels=3)),
            (GPTForSequenceClassification, dict(layer_norm_position=norm, num_labels=5, score_bias=True)),
            (GPTForTokenClassification, dict(layer_norm_position=norm, num_labels=7)),
            (GPTForQuestionAnswering, dict(layer_norm_position=norm)),
        ]
    cases.append((GPTDoubleHeadsModel, dict(summary_proj_to_labels=False)))
    for prefix in ("GPT2", "OpenAIGPT"):
        for name in ("Model", "LMHeadModel", "DoubleHeadsModel", "ForSequenceClassification"):
            cases.append((getattr(transformers, prefix + name), dict(num_labels=4)))
        cases.append((getattr(transformers, prefix + "LMHeadModel"), dict(tie_word_embeddings=False)))
    cases.append((transformers.GPT2DoubleHeadsModel, dict(summary_proj_to_labels=False)))
    cases += [(transformers.GPT2ForTokenClassification, dict(num_labels=6))]
    cases += [(transformers.GPT2ForQuestionAnswering, {})]
    return cases


def test_parameter_counts_match_every_head_tied_or_not() -> None:
    import transformers

    for cls, options in _heads_and_configs():
        if cls.__name__.startswith("GPT2"):
            config = transformers.GPT2Config(**TINY, **options)
        elif cls.__name__.startswith("OpenAIGPT"):
            config = transformers.OpenAIGPTConfig(**TINY, **options)
        else:
            config = GPTConfig(**TINY, **options)
        model = cls(config)
        saved = {**json.loads(config.to_json_string()), "architectures": [cls.__name__]}  # as config.json
        expected = sum(p.numel() for p in model.parameters())  # a tied head's weight once
        assert count_parameters(saved) == expected, (cls.__name__, options)


def _transformers_format_config(kind: str, architecture: str) -> dict:
    """config.json as `hfgpt-convert --format transformers` writes it (interop.to_transformers_config)."""
    from hfgpt.modeling.interop import to_transformers_config

    norm = "post" if kind == "openai-gpt" else "pre"
    config = to_transformers_config(GPTConfig(**TINY, layer_norm_position=norm))
    config.architectures = [architecture]
    return json.loads(config.to_json_string())


@pytest.mark.parametrize(
    ("kind", "architecture"),
    [
        ("openai-gpt", "OpenAIGPTLMHeadModel"),
        ("gpt2", "GPT2LMHeadModel"),
        ("trained", "OpenAIGPTLMHeadModel"),
        ("trained", "OpenAIGPTDoubleHeadsModel"),
        ("trained", "GPT2DoubleHeadsModel"),
        ("trained", "GPT2ForTokenClassification"),
    ],
)
def test_cards_of_transformers_format_checkpoints_describe_transformers_classes(
    kind: str, architecture: str
) -> None:
    config = _transformers_format_config(
        "openai-gpt" if "OpenAIGPT" in architecture else "gpt2", architecture
    )
    card = render_model_card(kind, config=config, repo_id="me/x")
    text = card.text
    data = ModelCard(str(card)).data
    token_classification = architecture.endswith("ForTokenClassification")
    assert data.pipeline_tag == ("token-classification" if token_classification else "text-generation")
    # Not hfgpt's format: no remote code, no hfgpt model_type.
    assert "model_type: hfgpt" not in text and "trust_remote_code" not in text
    assert "ships in this repository" not in text
    assert f"`model_type: {config['model_type']}`" in text
    if kind == "trained":
        style = "GPT-1 style, post-norm" if config["model_type"] == "openai-gpt" else "GPT-2 style, pre-norm"
        assert f"| Architecture | {architecture} ({style}) |" in text
    loader = "AutoModelForTokenClassification" if token_classification else "AutoModelForCausalLM"
    if "DoubleHeads" in architecture:  # no Auto class loads it: the card names the class
        loader = architecture
        assert "AutoModel." not in text
    assert f'model = {loader}.from_pretrained("me/x")' in text


@pytest.mark.slow
def test_double_heads_card_names_a_loader_that_loads_the_double_heads_model(tmp_path: Path) -> None:
    """The hfgpt-format card's two snippets, run as written against a saved GPTDoubleHeadsModel: with hfgpt,
    and in a process where hfgpt cannot be imported (remote code)."""
    import subprocess

    from hfgpt.modeling import GPTDoubleHeadsModel

    torch.manual_seed(0)
    GPTDoubleHeadsModel(GPTConfig(**TINY, bos_token_id=None, eos_token_id=None)).save_pretrained(
        tmp_path / "dh"
    )
    card = render_model_card(
        "trained",
        config=json.loads((tmp_path / "dh" / "config.json").read_text()),
        repo_id=str(tmp_path / "dh"),
    )
    assert ModelCard(str(card)).data.pipeline_tag == "text-generation"
    assert "AutoModel." not in card.text  # AutoModel would give the bare decoder
    code = card.text.split("```python\n")[1].split("```")[0]
    with_hfgpt, without_hfgpt = code.split("# Without hfgpt")
    namespace: dict = {}
    exec(with_hfgpt, namespace)  # noqa: S102 - the card's own snippet
    assert type(namespace["model"]) is GPTDoubleHeadsModel
    script = "import sys\nsys.modules['hfgpt'] = None\n# Without hfgpt" + without_hfgpt
    script += "\nprint(type(model).__name__, type(model).__module__.startswith('transformers_modules'))\n"
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["GPTDoubleHeadsModel", "True"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**TINY, "architectures": "GPTForCausalLM"}, "architectures must be a list of class names"),
        (
            {**TINY, "architectures": ["LlamaForCausalLM"]},
            "architectures.0. 'LlamaForCausalLM' is not a head",
        ),
        (
            {**TINY, "model_type": "gpt2", "architectures": ["GPTForCausalLM"]},
            "'GPTForCausalLM' is a hfgpt class, but model_type is 'gpt2'",
        ),
        ({**TINY, "model_type": "llama"}, "model_type 'llama' is not an hfgpt, gpt2 or openai-gpt model"),
    ],
)
def test_configs_the_cards_cannot_describe_are_refused_by_field(config: dict, message: str) -> None:
    with pytest.raises(ModelCardError, match=message):
        render_model_card("trained", config=config)


@pytest.mark.slow
def test_transformers_format_card_snippets_load_with_plain_transformers_and_with_hfgpt(
    tmp_path: Path,
) -> None:
    """The card of a GPT-1 double-heads model exported to transformers' own class, its snippets run as
    written: the first where hfgpt cannot be imported, the second with hfgpt."""
    import subprocess

    from hfgpt.modeling import GPTDoubleHeadsModel
    from hfgpt.modeling.interop import to_transformers

    torch.manual_seed(0)
    ours = GPTDoubleHeadsModel(
        GPTConfig(**TINY, layer_norm_position="post", bos_token_id=None, eos_token_id=None)
    )
    to_transformers(ours).save_pretrained(tmp_path / "exported")
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    card = render_model_card("trained", config=config, repo_id=str(tmp_path / "exported"))
    assert "| Architecture | OpenAIGPTDoubleHeadsModel (GPT-1 style, post-norm) |" in card.text
    code = card.text.split("```python\n")[1].split("```")[0]
    plain, with_hfgpt = code.split("# hfgpt reads")
    script = "import sys\nsys.modules['hfgpt'] = None\n" + plain + "\nprint(type(model).__name__)\n"
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "OpenAIGPTDoubleHeadsModel"
    namespace: dict = {}
    exec("# hfgpt reads" + with_hfgpt, namespace)  # noqa: S102 - the card's own snippet
    assert type(namespace["model"]) is GPTDoubleHeadsModel
    for name, tensor in ours.state_dict().items():
        assert torch.equal(namespace["model"].state_dict()[name], tensor), name


RELEASE_SECTIONS = [
    "Where the weights come from",
    "How to use",
    "Training data",
    "Intended uses and limitations",
    "Evaluation",
    "Licence",
    "Citation",
]
TRAINED_SECTIONS = [
    "How to use",
    "Intended uses and limitations",
    "Training procedure",
    "Evaluation",
    "Licence",
    "Citation",
]


def _readable_cards() -> dict[str, tuple[ModelCard, list[str]]]:
    """A card of every kind as the commands write them, with the sections each must have in order: the
    five releases, a GPT-2 release with a result measured on it, a model trained from scratch and a GPT-1
    fine-tuned with its hyper-parameters and results."""
    measured = EvalResult(
        task_type="text-generation",
        dataset_type="wikitext",
        dataset_name="WikiText-103",
        metric_type="perplexity",
        metric_value=37.4,
    )
    cards = {
        kind: (render_model_card(kind, repo_id=f"someone/{kind}", source="models/x"), RELEASE_SECTIONS)
        for kind in RELEASES
    }
    cards["gpt2, measured"] = (render_model_card("gpt2", eval_results=[measured]), RELEASE_SECTIONS)
    cards["trained"] = (render_model_card("trained", config=TINY), TRAINED_SECTIONS)
    accuracy = EvalResult(
        task_type="text-classification",
        dataset_type="glue",
        dataset_name="RTE",
        dataset_config="rte",
        dataset_split="validation",
        metric_type="accuracy",
        metric_value=0.56,
    )
    fine_tuned = render_model_card(
        "trained",
        config={**TINY, "layer_norm_position": "post", "architectures": ["GPTForSequenceClassification"]},
        repo_id="me/gpt1-rte",
        base_model="openai-community/openai-gpt",
        datasets=["glue"],
        task="entailment",
        training={"learning_rate": 6.25e-5, "epochs": 3},
        eval_results=[accuracy],
    )
    cards["trained, fine-tuned"] = (fine_tuned, TRAINED_SECTIONS)
    return cards


@pytest.mark.parametrize("name", list(_readable_cards()))
def test_cards_render_to_tidy_markdown_with_valid_metadata(name: str, validating_hub: HubServer) -> None:
    card, sections = _readable_cards()[name]
    text = card.text
    assert not any(mark in text for mark in ("{{", "}}", "{%", "%}")), "template syntax left in the card"
    assert "\n\n\n" not in text and not any(line != line.rstrip() for line in text.splitlines())
    assert text.count("```") % 2 == 0 and "None" not in text
    title, intro = text.lstrip("\n").split("\n\n", 2)[:2]
    assert title.startswith("# ") and intro and not intro.startswith(("#", "|", "`"))  # a title, then prose
    assert [line[3:] for line in text.splitlines() if line.startswith("## ")] == sections
    # Every table row has as many cells as its header.
    for table in re.findall(r"(?:^\|.*\|\n)+", text, flags=re.MULTILINE):
        widths = {row.count("|") for row in table.splitlines()}
        assert len(widths) == 1, table
    # The metadata reads back, and the Hub's validation accepts it.
    assert ModelCard(str(card)).data.license
    card.validate()
