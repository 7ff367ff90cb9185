"""Converting OpenAI's releases reproduces OpenAI's own outputs; bad input fails cleanly."""

import json
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel, OpenAIGPTLMHeadModel

import hfgpt.modeling
from hfgpt.modeling import GPTDoubleHeadsModel, GPTForCausalLM
from hfgpt.modeling.openai_release import (
    FINETUNE_TOKENS,
    CheckpointError,
    ConversionError,
    CorruptCheckpointError,
    OutputExistsError,
    write_gpt1_release,
    write_gpt2_release,
)
from hfgpt.modeling.tf_bundle import (
    BundleEntry,
    TensorBundleReader,
    TensorBundleWriter,
    _serialize_header,
    write_table,
)
from hfgpt.scripts.convert_openai_checkpoint import convert_openai_checkpoint, main

ROOT = Path(__file__).parent.parent
GPT2 = Path(__file__).parent / "fixtures" / "openai-gpt2-tiny"
GPT1 = Path(__file__).parent / "fixtures" / "openai-gpt1-tiny"
GPT1_HEADS = 4  # the GPT-1 release does not record n_head; the fixture README gives it
TOL = dict(atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def gpt2_out(tmp_path_factory) -> Path:
    return convert_openai_checkpoint(GPT2, tmp_path_factory.mktemp("gpt2") / "out")


@pytest.fixture(scope="module")
def gpt1_out(tmp_path_factory) -> Path:
    return convert_openai_checkpoint(
        GPT1, tmp_path_factory.mktemp("gpt1") / "out", n_head=GPT1_HEADS, add_finetune_tokens=True, seed=0
    )


def expected(folder: Path) -> dict[str, np.ndarray]:
    return dict(np.load(folder / "expected.npz"))


def logits_of(model, ids: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0]


# --- GPT-2 ------------------------------------------------------------------------------------------------


def test_gpt2_reproduces_openai_logits_and_greedy_continuations(gpt2_out):
    assert {p.name for p in gpt2_out.iterdir()} >= {
        "model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json", "README.md",
    }  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(gpt2_out).eval()
    assert isinstance(model, GPTForCausalLM)
    assert model.config.layer_norm_position == "pre"
    hparams = json.loads((GPT2 / "hparams.json").read_text())
    assert (model.config.vocab_size, model.config.n_positions, model.config.n_embd) == (
        hparams["n_vocab"], hparams["n_ctx"], hparams["n_embd"],
    )  # fmt: skip
    ref = expected(GPT2)
    for k in range(3):
        ids = ref[f"ids_{k}"]
        torch.testing.assert_close(logits_of(model, ids), torch.tensor(ref[f"logits_{k}"]), **TOL)
        greedy = ref[f"greedy_{k}"]
        prompt = torch.tensor(ids)[None]
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=len(greedy) - len(ids),
            do_sample=False,
            use_cache=True,
        )
        assert out[0].tolist() == greedy.tolist()


def test_gpt2_tokenizer_reproduces_openai_encoder(gpt2_out):
    prompts = json.loads((GPT2 / "expected_prompts.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(gpt2_out)
    for text, ids in zip(prompts["prompts"], prompts["ids"], strict=True):
        assert tokenizer(text)["input_ids"] == ids


def test_model_card_and_generation_config(gpt2_out):
    card = (gpt2_out / "README.md").read_text()
    assert card.startswith("---") and "hfgpt" in card
    generation = json.loads((gpt2_out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 50256


def test_output_carries_remote_code_for_every_head(gpt2_out):
    from hfgpt.modeling.modeling_hfgpt import AUTO_MAP

    config = json.loads((gpt2_out / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP
    for name in ("modeling_hfgpt.py", "configuration_hfgpt.py"):
        assert (gpt2_out / name).read_text() == (ROOT / "modeling" / name).read_text()


@pytest.mark.slow
def test_cli_and_script_and_entry_point(gpt2_out, tmp_path):
    assert main([str(GPT2), str(tmp_path / "a"), "--dtype", "bfloat16"]) == 0
    with safe_open(tmp_path / "a" / "model.safetensors", "pt") as f:
        assert f.get_tensor("transformer.wte.weight").dtype == torch.bfloat16
    # The file runs as a script, and the `hfgpt-convert` console entry point is this same main().
    script = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "convert_openai_checkpoint.py"),
            str(GPT2),
            str(tmp_path / "b"),
        ],
        capture_output=True,
        text=True,
    )
    assert script.returncode == 0, script.stderr
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (
        gpt2_out / "model.safetensors"
    ).read_bytes()
    (entry,) = [e for e in entry_points(group="console_scripts") if e.name == "hfgpt-convert"]
    assert entry.load() is main


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_reduced_precision_equals_casting_the_float32_weights(gpt2_out, tmp_path, dtype):
    out = convert_openai_checkpoint(GPT2, tmp_path / "out", dtype=dtype)
    assert json.loads((out / "config.json").read_text())["dtype"] == dtype
    with (
        safe_open(gpt2_out / "model.safetensors", "pt") as full,
        safe_open(out / "model.safetensors", "pt") as half,
    ):
        assert sorted(full.keys()) == sorted(half.keys())
        for name in full.keys():  # noqa: SIM118 - safe_open has no __iter__
            torch.testing.assert_close(
                half.get_tensor(name), full.get_tensor(name).to(getattr(torch, dtype)), atol=0, rtol=0
            )


def test_sharded_output_loads_identically(gpt2_out, tmp_path):
    out = convert_openai_checkpoint(GPT2, tmp_path / "out", max_shard_size="30KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    with safe_open(gpt2_out / "model.safetensors", "pt") as f:
        assert sorted(index["weight_map"]) == sorted(f.keys())
        assert index["metadata"]["total_size"] == sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118
    ids = expected(GPT2)["ids_1"]
    torch.testing.assert_close(
        logits_of(AutoModelForCausalLM.from_pretrained(out), ids),
        logits_of(AutoModelForCausalLM.from_pretrained(gpt2_out), ids),
        atol=0,
        rtol=0,
    )


def test_transformers_format_gpt2_loads_in_plain_transformers(tmp_path):
    out = convert_openai_checkpoint(GPT2, tmp_path / "out", format="transformers")
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    model = GPT2LMHeadModel.from_pretrained(out).eval()
    ref = expected(GPT2)
    torch.testing.assert_close(logits_of(model, ref["ids_2"]), torch.tensor(ref["logits_2"]), **TOL)
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompts = json.loads((GPT2 / "expected_prompts.json").read_text())
    assert tokenizer(prompts["prompts"][1])["input_ids"] == prompts["ids"][1]


def test_multi_shard_snappy_release_written_from_a_state_dict(gpt2_out, tmp_path):
    # The reverse of the name table rebuilds a release; TensorFlow-style multi-shard + Snappy index.
    import cramjam

    state = {k: v.numpy() for k, v in GPTForCausalLM.from_pretrained(gpt2_out).state_dict().items()}
    hparams = json.loads((GPT2 / "hparams.json").read_text())
    src = write_gpt2_release(
        state,
        tmp_path / "release",
        hparams,
        vocab_dir=GPT2,
        num_shards=3,
        shard_of=lambda name: hash(name) % 3,
        compress=cramjam.snappy.compress_raw,
    )
    with (
        TensorBundleReader(src / "model.ckpt") as reader,
        TensorBundleReader(GPT2 / "model.ckpt") as original,
    ):
        assert sorted(reader) == sorted(original)
        for name in original:
            np.testing.assert_array_equal(reader.get(name), original.get(name))
    out = convert_openai_checkpoint(src, tmp_path / "out")
    with (
        safe_open(out / "model.safetensors", "pt") as got,
        safe_open(gpt2_out / "model.safetensors", "pt") as want,
    ):
        assert sorted(got.keys()) == sorted(want.keys())
        for name in want.keys():  # noqa: SIM118 - safe_open has no __iter__
            assert torch.equal(got.get_tensor(name), want.get_tensor(name)), name


# --- GPT-1 ------------------------------------------------------------------------------------------------


def test_gpt1_reproduces_openai_lm_logits(tmp_path):
    out = convert_openai_checkpoint(GPT1, tmp_path / "out", n_head=GPT1_HEADS)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.layer_norm_position == "post" and model.config.n_positions == 64
    assert model.config.vocab_size == 40478
    ref = expected(GPT1)
    for k in range(3):
        torch.testing.assert_close(logits_of(model, ref[f"ids_{k}"]), torch.tensor(ref[f"logits_{k}"]), **TOL)
    texts = json.loads((GPT1 / "expected_texts.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer(texts["texts"][0])["input_ids"] == texts["ids"][0]


def test_gpt1_multiple_choice_reproduces_openai_classifier(gpt1_out):
    ref = expected(GPT1)
    model = GPTDoubleHeadsModel.from_pretrained(gpt1_out).eval()
    assert model.config.classify_token_id == 40480 and model.config.summary_type == "cls_index"
    with torch.no_grad():
        # The fixture's fine-tuning embeddings and its `clf` head (train.py: clf_h @ w + b, w [n_embd, 1]).
        model.transformer.wte.weight[40478:] = torch.tensor(ref["special_embeddings"])
        model.multiple_choice_head.summary.weight.copy_(torch.tensor(ref["clf_w"]).T)
        model.multiple_choice_head.summary.bias.copy_(torch.tensor(ref["clf_b"]))
        choices = [ref["mc_ids_0"], ref["mc_ids_1"]]
        width = max(len(c) for c in choices)
        # Right padding cannot reach the `_classify_` position under causal attention, as in train.py.
        ids = torch.tensor(np.stack([np.pad(c, (0, width - len(c))) for c in choices]))[None]
        mc_logits = model(ids).mc_logits
    torch.testing.assert_close(mc_logits, torch.tensor(ref["mc_logits"]), **TOL)


def test_gpt1_finetune_tokens_and_seed(gpt1_out, tmp_path):
    with safe_open(gpt1_out / "model.safetensors", "pt") as f:
        wte = f.get_tensor("transformer.wte.weight")
    assert wte.shape == (40481, 32)
    # params_shapes.json: positions [64, 32] first, then the 40478 token rows.
    flat = np.concatenate([np.load(GPT1 / f"params_{i}.npy") for i in range(10)])
    np.testing.assert_array_equal(
        wte[:40478].numpy(), flat[64 * 32 : 64 * 32 + 40478 * 32].reshape(40478, 32)
    )
    new_rows = wte[40478:]
    assert 0.01 < new_rows.std().item() < 0.03 and abs(new_rows.mean().item()) < 0.01
    again = convert_openai_checkpoint(
        GPT1, tmp_path / "same", n_head=GPT1_HEADS, add_finetune_tokens=True, seed=0
    )
    other = convert_openai_checkpoint(
        GPT1, tmp_path / "other", n_head=GPT1_HEADS, add_finetune_tokens=True, seed=1
    )
    with safe_open(again / "model.safetensors", "pt") as a, safe_open(other / "model.safetensors", "pt") as b:
        torch.testing.assert_close(a.get_tensor("transformer.wte.weight")[40478:], new_rows, atol=0, rtol=0)
        assert not torch.equal(b.get_tensor("transformer.wte.weight")[40478:], new_rows)
    tokenizer = AutoTokenizer.from_pretrained(gpt1_out)
    assert tokenizer.convert_tokens_to_ids(list(FINETUNE_TOKENS)) == [40478, 40479, 40480]


def test_transformers_format_gpt1_loads_in_plain_transformers(tmp_path):
    out = convert_openai_checkpoint(
        GPT1, tmp_path / "out", n_head=GPT1_HEADS, format="transformers", add_finetune_tokens=True
    )
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"transformer.tokens_embed.weight", "transformer.positions_embed.weight"} <= names
    model = OpenAIGPTLMHeadModel.from_pretrained(out).eval()
    assert model.config.vocab_size == 40481
    ref = expected(GPT1)
    logits = logits_of(model, ref["ids_1"])[:, :40478]  # the BPE token columns, as the fixture keeps
    torch.testing.assert_close(logits, torch.tensor(ref["logits_1"]), **TOL)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.convert_tokens_to_ids(list(FINETUNE_TOKENS)) == [40478, 40479, 40480]


def test_gpt1_release_round_trips_through_the_reverse_table(tmp_path):
    out = convert_openai_checkpoint(GPT1, tmp_path / "out", n_head=GPT1_HEADS)
    state = {
        k: v.numpy()
        for k, v in GPTForCausalLM.from_pretrained(out).state_dict().items()
        if k != "lm_head.weight"
    }
    src = write_gpt1_release(state, tmp_path / "release", vocab_dir=GPT1)
    assert (src / "params_shapes.json").read_text().replace(" ", "") == (
        GPT1 / "params_shapes.json"
    ).read_text().replace(" ", "")
    for i in range(10):
        np.testing.assert_array_equal(np.load(src / f"params_{i}.npy"), np.load(GPT1 / f"params_{i}.npy"))


# --- inspect ----------------------------------------------------------------------------------------------


def test_inspect_reads_only_the_index(tmp_path, capsys):
    src = copy_release(GPT2, tmp_path / "src")
    data = src / "model.ckpt.data-00000-of-00001"
    data.write_bytes(bytes(len(data.read_bytes())))  # zero every weight: the checksums no longer match
    assert main(["--inspect", str(src)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + 28
    row = next(line.split() for line in lines if line.startswith("model/h1/attn/c_attn/w "))
    assert row == ["model/h1/attn/c_attn/w", "float32", "[1,", "32,", "96]", "squeeze(0)",
                   "transformer.h.1.attn.c_attn.weight", "[32,", "96]"]  # fmt: skip
    assert main([str(src), str(tmp_path / "out")]) == CorruptCheckpointError.exit_code
    assert main(["--inspect", str(GPT1), "--n-head", "4"]) == 0
    assert "model/we[tokens]" in capsys.readouterr().out


# --- bad input --------------------------------------------------------------------------------------------


def copy_release(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.name not in skip and not path.name.startswith("expected"):
            shutil.copyfile(path, dst / path.name)  # copyfile: writable copies of the read-only fixture
    return dst


def run_cli(capsys, src: Path, out: Path, *extra: str) -> tuple[int, str]:
    existed = out.exists()
    code = main([str(src), str(out), *extra])
    err = capsys.readouterr().err
    # Nothing half-written: neither the output folder nor a temporary sibling is left behind.
    if code != 0:
        assert existed or not out.exists()
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]
    return code, err


def flip_byte_of(prefix: Path, tensor: str) -> None:
    with TensorBundleReader(prefix) as reader:
        entry = reader.entries[tensor]
    path = Path(f"{prefix}.data-00000-of-00001")
    data = bytearray(path.read_bytes())
    data[entry.offset + 3] ^= 0x10
    path.write_bytes(bytes(data))


def test_flipped_byte_names_the_tensor_and_leaves_no_output(tmp_path, capsys):
    src = copy_release(GPT2, tmp_path / "src")
    flip_byte_of(src / "model.ckpt", "model/wte")  # last in file order: fails mid-conversion
    code, err = run_cli(capsys, src, tmp_path / "out")
    assert code == 4
    assert err.startswith("error: checksum mismatch for tensor 'model/wte'") and "Traceback" not in err


@pytest.mark.parametrize(
    ("release", "damage", "code", "message"),
    [
        ("gpt2", "missing vocab.bpe", 3, "looks like a GPT2 release but has no vocab.bpe"),
        ("gpt2", "missing data", 3, "missing checkpoint data shard .*model.ckpt.data-00000-of-00001"),
        ("gpt2", "extra data shard", 3, "extra file .*model.ckpt.data-00001-of-00002"),
        (
            "gpt2",
            "truncated data",
            4,
            "'model/wte' lies at bytes .* which has only .* bytes \\(truncated\\?\\)",
        ),
        ("gpt2", "hparams n_embd", 3, "tensor 'model/h0/attn/c_attn/b' has shape \\[96\\].* hparams.json"),
        ("gpt2", "hparams n_layer", 3, "parameter 'transformer.h.2.attn.c_attn.bias' has no source tensor"),
        ("gpt2", "hparams n_layer down", 3, "'model/h1/.*' maps to 'transformer.h.1.*', which the model"),
        ("gpt2", "hparams n_head", 3, "hyper-parameters from .*hparams.json are invalid: .*n_head"),
        ("gpt2", "unknown tensor", 3, "tensor 'model/h0/attn/extra' in .* has no parameter to map to"),
        ("gpt2", "integer weights", 3, "tensor 'model/wpe' has dtype int32"),
        ("gpt2", "both releases", 3, "holds files of both the GPT-1 and the GPT-2 release"),
        ("gpt2", "list in hparams.json", 3, "hparams.json: expected a JSON object"),
        ("gpt2", "binary checkpoint file", 3, "checkpoint is not a text file"),
        ("gpt2", "malformed encoder", 3, "cannot read .*encoder.json"),
        ("gpt2", "bad merge line", 3, "cannot build the tokenizer from .*encoder.json and .*vocab.bpe"),
        (
            "gpt2",
            "id past the embedding",
            3,
            r"encoder.json has 50257 tokens \(ids 1..50300\), but the embedding",
        ),
        ("gpt2", "no merges", 3, "vocab.bpe has 0 merges; .*encoder.json's 50257 tokens need 50000"),
        (
            "gpt2",
            "2-D conv weight",
            3,
            r"'model/h0/attn/c_attn/w' has shape \[32, 96\], but hparams.json implies \[1, 32, 96\]",
        ),
        (
            "gpt2",
            "a billion shards",
            3,
            "missing checkpoint data shard .*-00000-of-1000000000 .*names 1000000000",
        ),
        ("gpt2", "garbage footer", 4, "model.ckpt.index: "),
        (
            "gpt2",
            "overflowing shape",
            4,
            r"'model/ln_f/b': 128 bytes stored, but shape .* needs 3402823669\d+",
        ),
        ("gpt1", "missing shard", 3, "looks like a GPT1 release but has no params_7.npy"),
        ("gpt1", "extra shard", 3, "extra file .*params_10.npy"),
        ("gpt1", "truncated shard", 4, "params_3.npy is truncated"),
        ("gpt1", "wrong total", 3, r"hold (\d+) values in all, but .*params_shapes.json needs (?!\1)\d+"),
        (
            "gpt1",
            "shape swap",
            3,
            "tensor 'model/h0/attn/c_attn/w' has shape \\[1, 96, 32\\].* params_shapes.json",
        ),
        ("gpt1", "float64 shard", 3, "params_5.npy: unsupported dtype float64"),
        ("gpt1", "bad n_head", 3, "n_head 5 does not divide n_embd 32"),
        ("gpt1", "encoder a list", 3, "encoder_bpe_40000.json: expected a JSON object mapping each token"),
        ("gpt1", "small vocabulary", 3, "encoder_bpe_40000.json has 1000 tokens .* embedding has 40478 rows"),
        ("gpt1", "a row moved to positions", 3, "has 40478 tokens .* the embedding has 40477 rows"),
        ("none", "empty folder", 3, "is neither a GPT-2 release"),
        ("none", "a file", 3, "is a file, not a release folder"),
    ],
)
def test_bad_input(tmp_path, capsys, release, damage, code, message):
    src = tmp_path / "src"
    extra: list[str] = ["--n-head", "5" if damage == "bad n_head" else "4"] if release == "gpt1" else []
    if damage == "a file":
        src.write_text("not a release")
    elif release == "none":
        src.mkdir()
    elif release == "gpt2":
        copy_release(GPT2, src)
        _damage_gpt2(src, damage)
    else:
        copy_release(GPT1, src)
        _damage_gpt1(src, damage)
    got, err = run_cli(capsys, src, tmp_path / "out", *extra)
    assert got == code, err
    assert err.startswith("error: ") and "Traceback" not in err
    assert re.search(message, err), err


def _damage_gpt2(src: Path, damage: str) -> None:
    data = src / "model.ckpt.data-00000-of-00001"
    hparams = json.loads((src / "hparams.json").read_text())
    if damage == "missing vocab.bpe":
        (src / "vocab.bpe").unlink()
    elif damage == "missing data":
        data.unlink()
    elif damage == "extra data shard":
        (src / "model.ckpt.data-00001-of-00002").write_bytes(b"")
    elif damage == "truncated data":
        data.write_bytes(data.read_bytes()[:-1000])
    elif damage.startswith("hparams"):
        key = "n_embd" if damage == "hparams n_embd" else "n_layer"
        key = "n_head" if damage == "hparams n_head" else key
        hparams[key] = {
            "hparams n_embd": 64,
            "hparams n_layer": 3,
            "hparams n_layer down": 1,
            "hparams n_head": 5,
        }[damage]
        (src / "hparams.json").write_text(json.dumps(hparams))
    elif damage in ("unknown tensor", "integer weights"):
        with TensorBundleReader(src / "model.ckpt") as reader:
            tensors = {name: reader.get(name).copy() for name in reader}
        if damage == "unknown tensor":
            tensors["model/h0/attn/extra"] = np.zeros(3, np.float32)
        else:
            tensors["model/wpe"] = tensors["model/wpe"].astype(np.int32)
        TensorBundleWriter(src / "model.ckpt").write(tensors)
    elif damage == "both releases":
        (src / "params_shapes.json").write_text("[]")
    elif damage == "list in hparams.json":
        (src / "hparams.json").write_text("[1]")
    elif damage == "binary checkpoint file":
        (src / "checkpoint").write_bytes(b"\xff\xfe model_checkpoint_path")
    elif damage == "malformed encoder":
        (src / "encoder.json").write_text('{"a": 0,')
    elif damage == "bad merge line":
        lines = (src / "vocab.bpe").read_text(encoding="utf-8").splitlines()
        lines[5] = "onlyonetoken"
        (src / "vocab.bpe").write_text("\n".join(lines) + "\n", encoding="utf-8")
    elif damage == "id past the embedding":
        encoder = json.loads((src / "encoder.json").read_text())
        encoder["!"] = 50300  # was 0: 50257 tokens still, one id the 50257-row embedding lacks
        (src / "encoder.json").write_text(json.dumps(encoder))
    elif damage == "no merges":
        (src / "vocab.bpe").write_text("#version: 0.2\n")
    elif damage == "2-D conv weight":
        with TensorBundleReader(src / "model.ckpt") as reader:
            tensors = {name: reader.get(name).copy() for name in reader}
        tensors["model/h0/attn/c_attn/w"] = tensors["model/h0/attn/c_attn/w"][0]
        TensorBundleWriter(src / "model.ckpt").write(tensors)
    elif damage in ("a billion shards", "overflowing shape"):
        with TensorBundleReader(src / "model.ckpt") as reader:
            entries = dict(reader.entries)
        shards = 1
        if damage == "a billion shards":  # a valid index whose header claims 10**9 data files
            shards = 10**9
        else:
            e = entries["model/ln_f/b"]
            entries[e.name] = BundleEntry(
                e.name, e.dtype, (2**62, 2**62, 4), e.shard_id, e.offset, e.size, e.crc32c
            )
        rows = [(name.encode(), entry.serialize()) for name, entry in sorted(entries.items())]
        write_table(src / "model.ckpt.index", [(b"", _serialize_header(shards)), *rows])
    elif damage == "garbage footer":
        index = bytearray((src / "model.ckpt.index").read_bytes())
        index[-48:-8] = b"\xff" * 40  # the block handles: varints that never end
        (src / "model.ckpt.index").write_bytes(bytes(index))


def _damage_gpt1(src: Path, damage: str) -> None:
    if damage == "missing shard":
        (src / "params_7.npy").unlink()
    elif damage == "extra shard":
        np.save(src / "params_10.npy", np.zeros(3, np.float32))
    elif damage == "truncated shard":
        path = src / "params_3.npy"
        path.write_bytes(path.read_bytes()[:-16])
    elif damage == "wrong total":
        np.save(src / "params_9.npy", np.load(src / "params_9.npy")[:-6])
    elif damage == "shape swap":
        shapes = json.loads((src / "params_shapes.json").read_text())
        shapes[2] = [1, 96, 32]  # same number of values, wrong layout
        (src / "params_shapes.json").write_text(json.dumps(shapes))
    elif damage == "float64 shard":
        np.save(src / "params_5.npy", np.load(src / "params_5.npy").astype(np.float64))
    elif damage == "encoder a list":
        (src / "encoder_bpe_40000.json").write_text("[1, 2]")
    elif damage == "small vocabulary":
        encoder = json.loads((src / "encoder_bpe_40000.json").read_text())
        (src / "encoder_bpe_40000.json").write_text(json.dumps(dict(list(encoder.items())[:1000])))
    elif damage == "a row moved to positions":  # same number of values: only the vocabulary tells
        shapes = json.loads((src / "params_shapes.json").read_text())
        shapes[0][0] += 1
        shapes[1][0] -= 1
        (src / "params_shapes.json").write_text(json.dumps(shapes))


def test_output_that_already_holds_a_model_is_kept(gpt2_out, tmp_path, capsys):
    before = {p.name: p.read_bytes() for p in gpt2_out.iterdir()}
    code, err = run_cli(capsys, GPT1, gpt2_out, "--n-head", "4")
    assert code == OutputExistsError.exit_code == 5
    assert "already holds a model" in err
    assert {p.name: p.read_bytes() for p in gpt2_out.iterdir()} == before
    # An existing empty folder is fine.
    (tmp_path / "empty").mkdir()
    assert main([str(GPT2), str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "model.safetensors").exists()


def test_errors_are_one_family_with_exit_codes():
    assert issubclass(ConversionError, CheckpointError) and issubclass(
        CorruptCheckpointError, CheckpointError
    )
    with pytest.raises(ConversionError, match="--add-finetune-tokens applies to GPT-1 releases only"):
        convert_openai_checkpoint(GPT2, Path("/nonexistent/never-written"), add_finetune_tokens=True)
    with pytest.raises(ConversionError, match="n_head comes from hparams.json"):
        convert_openai_checkpoint(GPT2, Path("/nonexistent/never-written"), n_head=4)


def test_hfgpt_modeling_import_is_enough_for_auto_classes():
    # `import hfgpt.modeling` (done above) registers the "hfgpt" model type with the Auto classes.
    assert hfgpt.modeling.GPTForCausalLM is GPTForCausalLM


def test_benchmark_smoke_at_tiny_size():
    import bench_convert as bench  # benchmarks/ is on pytest's pythonpath (pyproject.toml)

    # "tiny" has the fixture's shapes, so its release is exactly as large as the one TensorFlow wrote.
    assert bench.release_shapes(bench.SIZES["tiny"]) == {
        name: entry.shape for name, entry in TensorBundleReader(GPT2 / "model.ckpt").entries.items()
    }
    results = bench.run_benchmark("tiny", isolate=False)
    assert results["weights_bytes_float32"] == (GPT2 / "model.ckpt.data-00000-of-00001").stat().st_size
    for label in ("hfgpt", "peer"):
        assert results[label]["seconds"] > 0 and results[label]["peak_rss"] >= results[label]["baseline_rss"]


def test_push_to_hub_gets_the_finished_folder(tmp_path, monkeypatch):
    import hfgpt.scripts.push_to_hub as push_module

    calls = []

    def fake_push(model_dir, repo_id):
        calls.append((Path(model_dir), repo_id, sorted(p.name for p in Path(model_dir).iterdir())))

    monkeypatch.setattr(push_module, "push_to_hub", fake_push)
    assert main([str(GPT2), str(tmp_path / "out"), "--push-to-hub", "someone/gpt2-tiny"]) == 0
    ((folder, repo_id, files),) = calls
    assert folder == tmp_path / "out" and repo_id == "someone/gpt2-tiny"
    assert {"model.safetensors", "config.json", "tokenizer_config.json", "README.md"} <= set(files)


def test_unwritable_destination_is_a_clean_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main([str(GPT2), str(blocker / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(blocker) in err and "Traceback" not in err


@pytest.mark.parametrize(
    "option",
    [
        ["--seed", "-1", "--add-finetune-tokens"],
        ["--seed", str(2**33), "--add-finetune-tokens"],
        ["--n-head", "0"],
        ["--max-shard-size", "abc"],
    ],
)
def test_option_out_of_range_is_a_usage_error(tmp_path, capsys, option):
    with pytest.raises(SystemExit) as stop:
        main([str(GPT1), str(tmp_path / "out"), *option])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option[0]}" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_bad_repo_id_is_refused_before_converting(tmp_path, capsys):
    code, err = run_cli(capsys, GPT2, tmp_path / "out", "--push-to-hub", "no namespace")
    assert code == 2 and "'no namespace' is not a valid repo id" in err
    code, err = run_cli(capsys, GPT2, tmp_path / "out", "--push-to-hub", "gpt2-mine")
    assert code == 2 and "needs a namespace: write your-name/gpt2-mine" in err
    assert not (tmp_path / "out").exists()


def test_failed_push_keeps_the_conversion_and_says_how_to_retry(tmp_path, capsys, monkeypatch):
    import hfgpt.scripts.push_to_hub as push_module

    def refused(model_dir, repo_id):
        raise push_module.PushError("the Hub refused the token")

    monkeypatch.setattr(push_module, "push_to_hub", refused)
    code = main([str(GPT2), str(tmp_path / "out"), "--push-to-hub", "someone/gpt2-tiny"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "error: the Hub refused the token" in err
    assert f"hfgpt-push {tmp_path / 'out'} someone/gpt2-tiny" in err
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_output_folder_has_the_permissions_of_a_plain_mkdir(gpt2_out):
    sibling = gpt2_out.parent / "plain"
    sibling.mkdir()
    assert gpt2_out.stat().st_mode == sibling.stat().st_mode


def test_output_that_is_a_link_to_an_empty_folder_is_written_through(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert main([str(GPT2), str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink()
    assert (tmp_path / "target" / "model.safetensors").is_file()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "link").config.n_layer == 2


def test_sigterm_mid_conversion_removes_the_temporary_folder(tmp_path, capsys, monkeypatch):
    import os
    import signal

    import hfgpt.modeling.openai_release as release_module

    fetched = []
    source_array = release_module._source_array

    def terminated_on_the_third_tensor(release, item):
        fetched.append(item.source)
        if len(fetched) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` would
        return source_array(release, item)

    monkeypatch.setattr(release_module, "_source_array", terminated_on_the_third_tensor)
    before = signal.getsignal(signal.SIGTERM)
    code, err = run_cli(capsys, GPT2, tmp_path / "out")  # checks nothing is left behind
    assert code == 130 and "interrupted" in err and len(fetched) == 3
    assert signal.getsignal(signal.SIGTERM) == before  # the CLI puts the old handler back


def test_model_card_names_the_release_folder_not_the_local_path(gpt2_out):
    card = (gpt2_out / "README.md").read_text()
    assert f"(source: `{GPT2.name}`)" in card
    assert str(GPT2.parent) not in card


HFGPT_COMMANDS = sorted(e.name for e in entry_points(group="console_scripts") if e.value.startswith("hfgpt."))


@pytest.mark.parametrize("command", HFGPT_COMMANDS)
def test_every_command_prints_its_help(command, capsys):
    (entry,) = entry_points(group="console_scripts", name=command)
    with pytest.raises(SystemExit) as stop:
        entry.load()(["--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")


def test_the_commands_are_all_there():
    assert HFGPT_COMMANDS == ["hfgpt-convert", "hfgpt-demo", "hfgpt-finetune", "hfgpt-push", "hfgpt-train"]


def test_main_runs_from_a_worker_thread(tmp_path):
    # Only the main thread may install the SIGTERM handler; elsewhere the conversion runs without it.
    import threading

    codes = []
    worker = threading.Thread(target=lambda: codes.append(main([str(GPT2), str(tmp_path / "out")])))
    worker.start()
    worker.join()
    assert codes == [0] and (tmp_path / "out" / "model.safetensors").is_file()


def test_interrupted_push_says_the_conversion_is_complete(tmp_path, capsys, monkeypatch):
    import hfgpt.scripts.push_to_hub as push_module

    def interrupted(model_dir, repo_id):
        raise KeyboardInterrupt

    monkeypatch.setattr(push_module, "push_to_hub", interrupted)
    assert main([str(GPT2), str(tmp_path / "out"), "--push-to-hub", "someone/gpt2-tiny"]) == 130
    assert (
        f"interrupted while pushing: {tmp_path / 'out'} is converted and complete" in capsys.readouterr().err
    )
