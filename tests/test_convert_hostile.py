"""Hand-made hostile and careless release folders: each is refused with its documented exit code and one
`error: ...` line naming what is wrong, quickly, without a traceback and without leaving output behind."""

import hashlib
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

import hfgpt.modeling.openai_release as release_module
from hfgpt.modeling.openai_release import SIZE_LIMITS, CheckpointError, check_source_file, open_release
from hfgpt.modeling.tf_bundle import (
    BundleEntry,
    TensorBundleReader,
    _serialize_header,
    read_regular_file,
    write_table,
)
from hfgpt.scripts.convert_openai_checkpoint import main

GPT2 = Path(__file__).parent / "fixtures" / "openai-gpt2-tiny"
GPT1 = Path(__file__).parent / "fixtures" / "openai-gpt1-tiny"
GPT1_ARGS = ("--n-head", "4")  # the GPT-1 release does not record n_head; the fixture README gives it
DEADLINE = 30.0  # seconds: no case may take longer (before these fixes, some never finished)


def copy_release(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.name not in skip and not path.name.startswith("expected"):
            shutil.copyfile(path, dst / path.name)  # copyfile: writable copies of the read-only fixture
    return dst


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """main(argv) in a worker thread, bounded in time: a hang fails the test instead of stalling it."""
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(main([str(a) for a in argv])), daemon=True)
    start = time.monotonic()
    worker.start()
    worker.join(DEADLINE)
    assert not worker.is_alive(), f"hfgpt-convert {' '.join(map(str, argv))} ran past {DEADLINE} s"
    assert time.monotonic() - start < DEADLINE
    captured = capsys.readouterr()
    return result[0], captured.out, captured.err


def refused(capsys, src: Path, out: Path, code: int, message: str, *extra: str) -> str:
    """Convert ``src`` into ``out``: must exit ``code`` with one `error:` line matching ``message``."""
    got, _, err = run(capsys, src, out, *extra)
    assert got == code, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(message, err), err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]
    return err


# --- files that are not regular files ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("release", "name"),
    [
        ("gpt2", "hparams.json"),
        ("gpt2", "checkpoint"),
        ("gpt2", "encoder.json"),
        ("gpt2", "model.ckpt.index"),
        ("gpt2", "model.ckpt.data-00000-of-00001"),
        ("gpt1", "params_shapes.json"),
        ("gpt1", "params_3.npy"),
        ("gpt1", "vocab_40000.bpe"),
    ],
)
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path, capsys, release, name):
    src = copy_release(GPT2 if release == "gpt2" else GPT1, tmp_path / "src")
    (src / name).unlink()
    os.mkfifo(src / name)  # opening it for reading would block until someone writes
    extra = GPT1_ARGS if release == "gpt1" else ()
    refused(
        capsys,
        src,
        tmp_path / "out",
        3,
        f"{re.escape(name)} is a FIFO \\(named pipe\\), not a regular",
        *extra,
    )


@pytest.mark.parametrize("name", ["checkpoint", "hparams.json", "encoder.json", "vocab.bpe"])
def test_a_link_to_dev_zero_is_refused(tmp_path, capsys, name):
    src = copy_release(GPT2, tmp_path / "src")
    (src / name).unlink()
    (src / name).symlink_to("/dev/zero")  # an endless file: an unbounded read would never finish
    refused(capsys, src, tmp_path / "out", 3, f"{re.escape(name)} is a symbolic link to /dev/zero, outside")


def test_devices_and_oversized_files_are_refused_by_the_reader(tmp_path):
    with pytest.raises(CheckpointError, match="/dev/zero is a character device, not a regular file"):
        read_regular_file("/dev/zero", 1 << 20)
    sparse = tmp_path / "hparams.json"
    with open(sparse, "wb") as f:
        f.truncate(3 << 20)  # 3 MiB of holes: nothing to read, much to allocate
    with pytest.raises(CheckpointError, match=r"holds 3145728 bytes or more; .* at most 1048576"):
        read_regular_file(sparse, 1 << 20)


def test_an_oversized_hparams_file_is_refused_before_it_is_read(tmp_path, capsys):
    src = copy_release(GPT2, tmp_path / "src")
    with open(src / "hparams.json", "ab") as f:
        f.truncate(64 << 20)
    refused(capsys, src, tmp_path / "out", 3, r"hparams.json holds 67108864 bytes or more")


# --- links out of the release folder -----------------------------------------------------------------------


def test_a_vocabulary_linked_to_a_secret_is_neither_read_nor_copied(tmp_path, capsys):
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$salt$hash:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n")
    src = copy_release(GPT1, tmp_path / "src")
    (src / "vocab_40000.bpe").unlink()
    (src / "vocab_40000.bpe").symlink_to(secret)
    err = refused(
        capsys,
        src,
        tmp_path / "out",
        3,
        "vocab_40000.bpe is a symbolic link to .*shadow, outside the release",
        *GPT1_ARGS,
    )
    assert "root:" not in err


def test_a_vocabulary_of_another_format_is_refused_even_inside_the_folder(tmp_path, capsys):
    src = copy_release(GPT1, tmp_path / "src")
    (src / "vocab_40000.bpe").write_text("root:$6$salt$hash:19000:0:99999:7:::\n" * 40001)
    refused(
        capsys, src, tmp_path / "out", 3, "first line of vocab_40000.bpe must be its '#version", *GPT1_ARGS
    )


def test_an_encoder_linked_to_another_folder_is_refused_and_named(tmp_path, capsys):
    elsewhere = tmp_path / "other-model"
    elsewhere.mkdir()
    shutil.copyfile(GPT2 / "encoder.json", elsewhere / "encoder.json")  # the very same file, elsewhere
    src = copy_release(GPT2, tmp_path / "src", skip=("encoder.json",))
    (src / "encoder.json").symlink_to(Path("..") / "other-model" / "encoder.json")
    refused(
        capsys, src, tmp_path / "out", 3, r"encoder.json is a symbolic link to .*other-model/encoder.json"
    )


def test_links_inside_the_folder_and_into_a_hub_cache_blobs_folder_are_followed(tmp_path, capsys):
    # Inside the release folder: fine.
    src = copy_release(GPT2, tmp_path / "src")
    (src / "vocabulary").mkdir()
    (src / "encoder.json").rename(src / "vocabulary" / "encoder.json")
    (src / "encoder.json").symlink_to(Path("vocabulary") / "encoder.json")
    assert run(capsys, src, tmp_path / "out")[0] == 0
    # The Hub cache: snapshots/<revision>/<file> -> ../../blobs/<sha256>, as huggingface_hub lays it out.
    repo = tmp_path / "hub" / "models--openai--gpt2-tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in GPT2.iterdir():
        if not path.name.startswith("expected"):
            blob = hashlib.sha256(path.read_bytes()).hexdigest()
            shutil.copyfile(path, repo / "blobs" / blob)
            (snapshot / path.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    assert run(capsys, snapshot, tmp_path / "from-cache")[0] == 0
    assert (tmp_path / "from-cache" / "model.safetensors").read_bytes() == (
        tmp_path / "out" / "model.safetensors"
    ).read_bytes()
    # A link from that snapshot into another cached repo's blobs is a link out of the folder.
    other = tmp_path / "hub" / "models--someone--else" / "blobs"
    other.mkdir(parents=True)
    shutil.copyfile(GPT2 / "vocab.bpe", other / "vocab")
    (snapshot / "vocab.bpe").unlink()
    (snapshot / "vocab.bpe").symlink_to(other / "vocab")
    refused(
        capsys, snapshot, tmp_path / "out2", 3, r"vocab.bpe is a symbolic link to .*models--someone--else"
    )


def test_the_link_policy_itself(tmp_path):
    root = tmp_path / "release"
    root.mkdir()
    (root / "file").write_text("x")
    (root / "inside").symlink_to("file")
    (root / "dangling").symlink_to("nowhere")
    (root / "folder").mkdir()
    check_source_file(root, root / "file")
    check_source_file(root, root / "inside")
    with pytest.raises(CheckpointError, match="dangling is a broken symbolic link"):
        check_source_file(root, root / "dangling")
    with pytest.raises(CheckpointError, match="folder is a folder, not a regular file"):
        check_source_file(root, root / "folder")
    with pytest.raises(CheckpointError, match="missing release file"):
        check_source_file(root, root / "absent")


# --- sizes that overflow, and JSON nested without end --------------------------------------------------------


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value))


def test_a_dimension_of_2_63_or_more(tmp_path, capsys):
    src = copy_release(GPT1, tmp_path / "src")
    shapes = json.loads((src / "params_shapes.json").read_text())
    write_json(src / "params_shapes.json", [[2**63, 32], *shapes[1:]])
    refused(
        capsys,
        src,
        tmp_path / "out",
        3,
        r"params_shapes.json: expected a list of shapes .*below 2\*\*63",
        *GPT1_ARGS,
    )
    # Below 2**63 each, but their product overflows int64: the sizes are Python integers, and too large.
    write_json(src / "params_shapes.json", [shapes[0], [2**40, 2**40], *shapes[2:]])
    refused(capsys, src, tmp_path / "out", 3, r"n_vocab is 1099511627776, more than the 16777216", *GPT1_ARGS)
    write_json(src / "params_shapes.json", [*shapes[:2], [2**62, 2**62, 4], *shapes[3:]])
    refused(capsys, src, tmp_path / "out", 3, r"hold 1322752 values in all, but .* needs \d{30,}", *GPT1_ARGS)
    # The same shape from --inspect, which reads params_shapes.json alone.
    refused(
        capsys,
        src,
        tmp_path / "out",
        3,
        r"'model/h0/attn/c_attn/w' has shape \[4611686018427387904, ",
        "--inspect",
        *GPT1_ARGS,
    )


def test_a_npy_header_of_2_63_elements_or_of_garbage(tmp_path, capsys):
    src = copy_release(GPT1, tmp_path / "src")
    path = src / "params_2.npy"
    raw = path.read_bytes()
    header = raw[10:128].decode("latin1")
    huge = re.sub(r"\(\d+,\)", f"({2**63},)", header)[: len(header) - 1] + "\n"  # the same header length
    assert huge != header and len(huge) == len(header)
    path.write_bytes(raw[:10] + huge.encode("latin1") + raw[128:])
    refused(
        capsys,
        src,
        tmp_path / "out",
        3,
        r"params_2.npy: its header's length 9223372036854775808 is not",
        *GPT1_ARGS,
    )
    damaged = bytearray(raw)
    # An unclosed brace: numpy's header tokenizer raises tokenize.TokenError (EOF in multi-line statement).
    damaged[73] = ord("{")
    path.write_bytes(bytes(damaged))
    refused(
        capsys, src, tmp_path / "out", 3, r"params_2.npy is not a valid .npy file: TokenError", *GPT1_ARGS
    )


def test_a_dimension_of_2_63_in_the_index(tmp_path, capsys):
    src = copy_release(GPT2, tmp_path / "src")
    with TensorBundleReader(src / "model.ckpt") as reader:
        entries = dict(reader.entries)
    e = entries["model/ln_f/b"]
    # A varint of 2**63, which TensorShapeProto's int64 reads as -2**63.
    entries[e.name] = BundleEntry(e.name, e.dtype, (2**63, 2), e.shard_id, e.offset, e.size, e.crc32c)
    rows = [(n.encode(), entry.serialize()) for n, entry in sorted(entries.items())]
    write_table(src / "model.ckpt.index", [(b"", _serialize_header(1)), *rows])
    refused(capsys, src, tmp_path / "out", 3, r"tensor 'model/ln_f/b' has an unknown shape")


def test_n_embd_of_2_40(tmp_path, capsys):
    src = copy_release(GPT2, tmp_path / "src")
    hparams = json.loads((src / "hparams.json").read_text())
    write_json(src / "hparams.json", {**hparams, "n_embd": 2**40})
    refused(capsys, src, tmp_path / "out", 3, r"hparams.json: n_embd is 1099511627776, more than the 65536")
    write_json(src / "hparams.json", {**hparams, "n_embd": True})  # a bool is no size
    refused(capsys, src, tmp_path / "out", 3, r"hparams.json: n_embd must be a positive integer")


@pytest.mark.parametrize(
    ("release", "name"),
    [
        ("gpt2", "hparams.json"),
        ("gpt2", "encoder.json"),
        ("gpt1", "params_shapes.json"),
        ("gpt1", "encoder_bpe_40000.json"),
    ],
)
def test_deeply_nested_json(tmp_path, capsys, release, name):
    src = copy_release(GPT2 if release == "gpt2" else GPT1, tmp_path / "src")
    (src / name).write_text("[" * 200_000 + "]" * 200_000)
    extra = GPT1_ARGS if release == "gpt1" else ()
    refused(
        capsys, src, tmp_path / "out", 3, f"cannot read .*{re.escape(name)}: JSON nested too deeply", *extra
    )


def test_an_encoder_with_sparse_ids(tmp_path, capsys):
    src = copy_release(GPT2, tmp_path / "src")
    encoder = json.loads((src / "encoder.json").read_text())
    for i, token in enumerate(list(encoder)[:1000]):
        encoder[token] = 10**9 - i  # 50257 tokens still, with ids up to a billion
    write_json(src / "encoder.json", encoder)
    refused(capsys, src, tmp_path / "out", 3, r"encoder.json has 50257 tokens \(ids 1000..1000000000\), but")


def test_n_layer_of_a_million_is_refused_before_any_model_is_built(tmp_path, capsys, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was built for hyper-parameters the release does not hold")

    monkeypatch.setattr(release_module, "_expected_shapes", no_model)
    src = copy_release(GPT2, tmp_path / "src")
    hparams = json.loads((src / "hparams.json").read_text())
    write_json(src / "hparams.json", {**hparams, "n_layer": 10**6})
    start = time.monotonic()
    refused(capsys, src, tmp_path / "out", 3, r"hparams.json: n_layer is 1000000, more than the 256 ")
    assert time.monotonic() - start < 5
    # Within the bounds but not what the index holds: refused from the shapes alone, as before.
    write_json(src / "hparams.json", {**hparams, "n_layer": SIZE_LIMITS["n_layer"]})
    refused(
        capsys,
        src,
        tmp_path / "out",
        3,
        r"parameter 'transformer.h.10.attn.c_attn.bias' has no source tensor in the release \(and 3047 more\)",
    )
    write_json(src / "hparams.json", {**hparams, "n_embd": 4096})
    refused(
        capsys,
        src,
        tmp_path / "out",
        3,
        r"'model/h0/attn/c_attn/b' has shape \[96\], but hparams.json implies \[12288\]",
    )


# --- vocabularies that are not the release's ----------------------------------------------------------------


def merges_lines(src: Path, name: str) -> list[str]:
    return (src / name).read_text(encoding="utf-8").split("\n")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            "truncated",
            r"vocab_40000.bpe has 20000 merges; .*encoder_bpe_40000.json's 40478 tokens need 40000",
        ),
        ("truncated mid-line", r"vocab_40000.bpe has 39999 merges; .* need 40000"),
        ("a line deleted", r"vocab_40000.bpe has 39999 merges"),
        (
            "a line deleted, another added",
            r"line 1001 of vocab_40000.bpe joins .* but merge 1000 makes the token of id 1476",
        ),
        ("two lines swapped", r"line 11 of vocab_40000.bpe joins .* but merge 10 makes"),
        ("a split moved", r"line 6 of vocab_40000.bpe joins 'he</w>', which is neither a symbol"),
        ("no header", r"first line of vocab_40000.bpe must be its '#version: ...' header"),
        ("CRLF line ends", r"line 2 of vocab_40000.bpe joins 't h\\r' into 'th\\r'"),
        ("a blank line", r"line 3 of vocab_40000.bpe is '', not a merge"),
        (
            "a character of the encoder",
            r"encoder_bpe_40000.json gives id 239 to '\u4e00</w>'; the release has '.</w>'",
        ),
    ],
)
def test_gpt1_vocabulary_that_differs_from_the_release(tmp_path, capsys, damage, message):
    src = copy_release(GPT1, tmp_path / "src")
    lines = merges_lines(src, "vocab_40000.bpe")
    text = None
    if damage == "truncated":
        text = "\n".join(lines[:20001]) + "\n"
    elif damage == "truncated mid-line":
        text = "\n".join(lines)[:-3]
    elif damage == "a line deleted":
        del lines[500]
    elif damage == "a line deleted, another added":
        del lines[1000]
        lines.insert(-1, "a b")
    elif damage == "two lines swapped":
        lines[10], lines[11] = lines[11], lines[10]
    elif damage == "a split moved":
        assert lines[5] == "th e</w>"
        lines[5] = "t he</w>"  # the same token, joined from a symbol no earlier merge makes
    elif damage == "no header":
        lines = lines[1:]
        lines.insert(-1, "x y")
    elif damage == "CRLF line ends":
        text = "\r\n".join(lines)
    elif damage == "a blank line":
        lines[2] = ""
    if damage == "a character of the encoder":
        encoder = json.loads((src / "encoder_bpe_40000.json").read_text())
        del encoder[".</w>"]
        encoder["\u4e00</w>"] = 239  # a character the encoder does not have
        write_json(src / "encoder_bpe_40000.json", encoder)
    elif text is None:
        text = "\n".join(lines)
    if text is not None:
        (src / "vocab_40000.bpe").write_bytes(text.encode("utf-8"))
    refused(capsys, src, tmp_path / "out", 3, message, *GPT1_ARGS)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("two lines swapped", r"line 101 of vocab.bpe joins .* but merge 100 makes the token of id 355"),
        ("a byte symbol renamed", r"ids 0..255 of encoder.json are not the 256 byte symbols"),
        ("no <|endoftext|>", r"encoder.json gives id 50256 to '<\|endoftext\|\|>'"),
    ],
)
def test_gpt2_vocabulary_that_differs_from_the_release(tmp_path, capsys, damage, message):
    src = copy_release(GPT2, tmp_path / "src")
    if damage == "two lines swapped":
        lines = merges_lines(src, "vocab.bpe")
        lines[100], lines[101] = lines[101], lines[100]
        (src / "vocab.bpe").write_text("\n".join(lines), encoding="utf-8")
    else:
        encoder = json.loads((src / "encoder.json").read_text())
        old, new = (
            ("!", "\u4e00") if damage == "a byte symbol renamed" else ("<|endoftext|>", "<|endoftext||>")
        )
        encoder[new] = encoder.pop(old)
        write_json(src / "encoder.json", encoder)
    refused(capsys, src, tmp_path / "out", 3, message)


# --- GPT-1 shards: the size must match the header exactly ---------------------------------------------------


def test_bytes_inserted_into_a_gpt1_shard(tmp_path, capsys):
    src = copy_release(GPT1, tmp_path / "src")
    path = src / "params_4.npy"
    raw = path.read_bytes()
    path.write_bytes(raw[:1000] + b"\0\0\0\0" + raw[1000:])  # every later value would shift by one
    refused(
        capsys,
        src,
        tmp_path / "out",
        4,
        r"params_4.npy has 529232 bytes, 4 more than its header promises",
        *GPT1_ARGS,
    )


# --- --inspect from the index alone ----------------------------------------------------------------------------


def test_inspect_a_gpt2_release_from_its_index_and_hparams_alone(tmp_path, capsys):
    src = tmp_path / "1558M-before-download"
    src.mkdir()
    for name in ("model.ckpt.index", "hparams.json"):
        shutil.copyfile(GPT2 / name, src / name)
    code, out, err = run(capsys, "--inspect", src)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1 + 28 and lines[0].split()[:3] == ["source", "tensor", "dtype"]
    assert any(line.split()[0] == "model/wte" and "transformer.wte.weight" in line for line in lines)
    # Converting still needs every file.
    refused(capsys, src, tmp_path / "out", 3, "looks like a GPT2 release but has no checkpoint")
    # The index alone is not enough: the sizes come from hparams.json.
    (src / "hparams.json").unlink()
    code, _, err = run(capsys, "--inspect", src)
    assert code == 3 and "looks like a GPT2 release but has no hparams.json" in err


def test_inspect_a_gpt1_release_from_params_shapes_alone(tmp_path, capsys):
    src = tmp_path / "model"
    src.mkdir()
    shutil.copyfile(GPT1 / "params_shapes.json", src / "params_shapes.json")
    code, out, err = run(capsys, "--inspect", src, *GPT1_ARGS)
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1 + 26 and "model/we[tokens]" in out
    release = open_release(src, n_head=4, weights=False)
    with pytest.raises(CheckpointError, match="opened without its shards"):
        release.get("model/we[tokens]")


# --- SHA-256 of the files read -----------------------------------------------------------------------------


def test_sha256_report_and_check_name_the_changed_tensors(tmp_path, capsys):
    src = copy_release(GPT1, tmp_path / "src")
    code, out, err = run(capsys, src, tmp_path / "a", "--sha256", *GPT1_ARGS)
    assert code == 0, err
    listed = dict(reversed(line.split("  ")) for line in out.splitlines()[1:])
    names = [
        "params_shapes.json",
        *(f"params_{i}.npy" for i in range(10)),
        "encoder_bpe_40000.json",
        "vocab_40000.bpe",
    ]
    assert list(listed) == names
    assert all(listed[name] == hashlib.sha256((GPT1 / name).read_bytes()).hexdigest() for name in names)
    sums = tmp_path / "SHA256SUMS"
    sums.write_text("".join(f"{digest}  model/{name}\n" for name, digest in listed.items()))
    assert run(capsys, src, tmp_path / "b", "--check-sha256", sums, *GPT1_ARGS)[0] == 0
    # The last value of params_9.npy changed: it still converts (the shards carry no checksum), and only its
    # digest tells; against the list, it is refused with the tensors that shard holds.
    path = src / "params_9.npy"
    raw = bytearray(path.read_bytes())
    raw[-2] ^= 0x40
    path.write_bytes(bytes(raw))
    code, out, _ = run(capsys, src, tmp_path / "c", "--sha256", *GPT1_ARGS)
    changed = dict(reversed(line.split("  ")) for line in out.splitlines()[1:])
    assert code == 0 and [name for name in names if changed[name] != listed[name]] == ["params_9.npy"]
    err = refused(
        capsys,
        src,
        tmp_path / "d",
        4,
        r"params_9.npy has SHA-256 [0-9a-f]{64}, but the list gives [0-9a-f]{64}: the file differs",
        "--check-sha256",
        sums,
        *GPT1_ARGS,
    )
    # The token embedding spans shards 0..9; shard 9 also holds both layers.
    assert "it holds 25 tensor(s): model/we[tokens], model/h0/attn/c_attn/w, " in err
    assert err.rstrip().endswith(", model/h1/ln_2/g, model/h1/ln_2/b")
    sums.write_text("not a digest  params_3.npy\n")
    refused(
        capsys,
        src,
        tmp_path / "e",
        2,
        r"SHA256SUMS, line 1: expected '<sha256>  <file name>'",
        "--check-sha256",
        sums,
        *GPT1_ARGS,
    )


def test_sha256_check_of_a_gpt2_release(tmp_path, capsys):
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{'0' * 64}  models/124M/model.ckpt.data-00000-of-00001\n{'1' * 64}  model.ckpt.meta\n")
    err = refused(
        capsys,
        GPT2,
        tmp_path / "out",
        4,
        r"model.ckpt.data-00000-of-00001 has SHA-256",
        "--check-sha256",
        sums,
    )
    assert "it holds 28 tensor(s): model/h0/attn/c_attn/b" in err
    sums.write_text(f"{'1' * 64}  model.ckpt.meta\n")  # a file the conversion does not read
    refused(
        capsys, GPT2, tmp_path / "out", 2, r"the SHA-256 list names none of the files", "--check-sha256", sums
    )
