"""The TensorFlow V2 bundle reader/writer against the checkpoint TensorFlow's own Saver wrote."""

import json
import os
import shutil
import struct
from pathlib import Path

import cramjam
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hfgpt.modeling.tf_bundle import (
    MAX_INDEX_SIZE,
    BundleEntry,
    CheckpointError,
    CorruptCheckpointError,
    TensorBundleReader,
    TensorBundleWriter,
    data_file_name,
    masked_crc32c,
    read_table,
    snappy_decompress,
    unmask_crc32c,
    write_table,
)

GPT2_FIXTURE = Path(__file__).parent / "fixtures" / "openai-gpt2-tiny"
PREFIX = GPT2_FIXTURE / "model.ckpt"
LAYER_TENSORS = [
    "attn/c_attn/b", "attn/c_attn/w", "attn/c_proj/b", "attn/c_proj/w", "ln_1/b", "ln_1/g", "ln_2/b",
    "ln_2/g", "mlp/c_fc/b", "mlp/c_fc/w", "mlp/c_proj/b", "mlp/c_proj/w",
]  # fmt: skip


def fixture_tensors() -> dict[str, np.ndarray]:
    with TensorBundleReader(PREFIX) as reader:
        return {name: reader.get(name).copy() for name in reader}


def test_reads_every_tensor_tensorflow_wrote_with_checksums_and_hparams_shapes():
    hparams = json.loads((GPT2_FIXTURE / "hparams.json").read_text())
    e, v, p = hparams["n_embd"], hparams["n_vocab"], hparams["n_ctx"]
    expected_shapes = {"model/wte": (v, e), "model/wpe": (p, e), "model/ln_f/g": (e,), "model/ln_f/b": (e,)}
    for i in range(hparams["n_layer"]):
        for name, shape in {
            "attn/c_attn/w": (1, e, 3 * e), "attn/c_attn/b": (3 * e,), "attn/c_proj/w": (1, e, e),
            "attn/c_proj/b": (e,), "mlp/c_fc/w": (1, e, 4 * e), "mlp/c_fc/b": (4 * e,),
            "mlp/c_proj/w": (1, 4 * e, e), "mlp/c_proj/b": (e,), "ln_1/g": (e,), "ln_1/b": (e,),
            "ln_2/g": (e,), "ln_2/b": (e,),
        }.items():  # fmt: skip
            expected_shapes[f"model/h{i}/{name}"] = shape
    with TensorBundleReader(PREFIX) as reader:
        assert reader.num_shards == 1
        assert {name: reader.entries[name].shape for name in reader} == expected_shapes
        total = 0
        for name in reader:
            array = reader.get(name)  # verifies the masked CRC-32C TensorFlow stored
            assert array.dtype == np.float32 and array.shape == expected_shapes[name]
            assert np.isfinite(array).all() and array.std() > 0
            total += array.nbytes
    # The entries tile the data file exactly: nothing unread, nothing overlapping.
    assert total == data_file_name(PREFIX, 0, 1).stat().st_size


def test_writer_reproduces_tensorflows_files_byte_for_byte(tmp_path):
    TensorBundleWriter(tmp_path / "model.ckpt").write(fixture_tensors())
    for suffix in (".index", ".data-00000-of-00001"):
        assert (tmp_path / f"model.ckpt{suffix}").read_bytes() == Path(f"{PREFIX}{suffix}").read_bytes()


def test_masked_crc_round_trips_and_matches_leveldb_check_value():
    # CRC-32C("123456789") is the standard check value 0xE3069283; masking is reversible.
    assert unmask_crc32c(masked_crc32c(b"123456789")) == 0xE3069283
    assert masked_crc32c(b"123456789") != 0xE3069283


@pytest.mark.parametrize("size", [0, 1, 59, 60, 61, 256, 70_000, 300_000])
@pytest.mark.parametrize("kind", ["random", "two-letter", "repeating"])
def test_snappy_decompress_matches_cramjam(size, kind):
    rng = np.random.default_rng(size)
    if kind == "random":
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    elif kind == "two-letter":
        data = rng.choice(np.frombuffer(b"ab", np.uint8), size).tobytes()
    else:
        data = (b"model/h11/attn/c_attn/w" * (size // 23 + 1))[:size]
    assert snappy_decompress(bytes(cramjam.snappy.compress_raw(data))) == data


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=40), max_size=30), st.integers(1, 50))
def test_snappy_decompress_matches_cramjam_on_generated_input(pieces, repeat):
    data = b"".join(piece * (1 + i % repeat) for i, piece in enumerate(pieces))
    assert snappy_decompress(bytes(cramjam.snappy.compress_raw(data))) == data


def test_snappy_rejects_corrupt_stream():
    packed = bytearray(cramjam.snappy.compress_raw(b"abcdabcdabcdabcdabcd" * 10))
    packed[0] += 1  # announced length no longer matches
    with pytest.raises(CorruptCheckpointError, match="snappy"):
        snappy_decompress(bytes(packed))


def test_snappy_compressed_index_blocks_are_read(tmp_path):
    tensors = {
        f"model/h{i}/{name}": np.full((2,), i, np.float32) for i in range(40) for name in LAYER_TENSORS
    }
    TensorBundleWriter(tmp_path / "plain").write(tensors)
    TensorBundleWriter(tmp_path / "snappy", compress=cramjam.snappy.compress_raw).write(tensors)
    snappy_index = (tmp_path / "snappy.index").read_bytes()
    assert len(snappy_index) < len((tmp_path / "plain.index").read_bytes())
    # One data block, then the metaindex block whose offset opens the footer: the byte 5 before it is the
    # data block's compression type, 1 = Snappy.
    footer = snappy_index[-48:]
    metaindex_offset, shift, pos = 0, 0, 0
    while True:
        metaindex_offset |= (footer[pos] & 0x7F) << shift
        shift, pos = shift + 7, pos + 1
        if not footer[pos - 1] & 0x80:
            break
    assert snappy_index[metaindex_offset - 5] == 1
    assert read_table(tmp_path / "snappy.index") == read_table(tmp_path / "plain.index")
    with TensorBundleReader(tmp_path / "snappy") as reader:
        assert sorted(reader.keys()) == sorted(tensors)
        np.testing.assert_array_equal(reader.get("model/h39/ln_2/g"), tensors["model/h39/ln_2/g"])


def test_many_blocks_and_restart_points(tmp_path):
    # Tiny blocks force many data blocks, each indexed by a shortest separator key.
    tensors = {f"t{i:04d}/{'x' * (i % 7)}": np.arange(i % 5, dtype=np.float64) for i in range(500)}
    TensorBundleWriter(tmp_path / "m", block_size=128, restart_interval=3).write(tensors)
    with TensorBundleReader(tmp_path / "m") as reader:
        assert reader.keys() == sorted(tensors)
        for name, array in tensors.items():
            np.testing.assert_array_equal(reader.get(name), array)


def test_multiple_data_shards_and_dtypes(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a/float32": rng.standard_normal((3, 4)).astype(np.float32),
        "b/float16": rng.standard_normal(7).astype(np.float16),
        "c/int64": np.arange(5, dtype=np.int64),
        "d/bfloat16": np.array([0x3F80, 0xC000], np.uint16),  # 1.0, -2.0
        "e/empty": np.zeros((0, 3), np.float32),
        "f/scalar": np.array(2.5, np.float64),
    }
    TensorBundleWriter(tmp_path / "m", num_shards=3, shard_of=lambda name: ord(name[0]) % 3).write(
        tensors, bfloat16=["d/bfloat16"]
    )
    assert sorted(p.name for p in tmp_path.glob("m.data-*")) == [f"m.data-0000{i}-of-00003" for i in range(3)]
    with TensorBundleReader(tmp_path / "m") as reader:
        assert reader.num_shards == 3
        assert {reader.entries[n].shard_id for n in tensors} == {0, 1, 2}
        assert reader.entries["d/bfloat16"].dtype == "bfloat16"
        for name, array in tensors.items():
            got = reader.get(name)
            assert got.shape == array.shape and got.dtype == array.dtype
            np.testing.assert_array_equal(got, array)


def copy_bundle(tmp_path: Path) -> Path:
    for path in GPT2_FIXTURE.glob("model.ckpt.*"):
        shutil.copyfile(path, tmp_path / path.name)  # copyfile: writable copies of the read-only fixture
    return tmp_path / "model.ckpt"


def test_flipped_byte_names_the_tensor(tmp_path):
    prefix = copy_bundle(tmp_path)
    with TensorBundleReader(prefix) as reader:
        entry = reader.entries["model/h1/mlp/c_fc/w"]
    data = bytearray(data_file_name(prefix, 0, 1).read_bytes())
    data[entry.offset + entry.size // 2] ^= 0x01
    data_file_name(prefix, 0, 1).write_bytes(bytes(data))
    with TensorBundleReader(prefix) as reader:
        reader.get("model/h1/mlp/c_fc/b")  # neighbours are intact
        with pytest.raises(
            CorruptCheckpointError, match=r"checksum mismatch for tensor 'model/h1/mlp/c_fc/w'"
        ):
            reader.get("model/h1/mlp/c_fc/w")


def test_truncated_data_file_is_reported_on_open(tmp_path):
    prefix = copy_bundle(tmp_path)
    path = data_file_name(prefix, 0, 1)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match=r"'model/wte'.*only \d+ bytes \(truncated\?\)"):
        TensorBundleReader(prefix)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_damaged_index(tmp_path, damage):
    prefix = copy_bundle(tmp_path)
    index = Path(f"{prefix}.index")
    raw = bytearray(index.read_bytes())
    if damage == "flip":
        raw[40] ^= 0xFF  # inside the data block
        match = "checksum mismatch in the table block"
    elif damage == "truncate":
        raw = raw[:-10]
        match = "bad magic"
    else:
        raw = raw[:0]
        match = "too short"
    index.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=match):
        TensorBundleReader(prefix)


def test_missing_shard_and_index(tmp_path):
    prefix = copy_bundle(tmp_path)
    data_file_name(prefix, 0, 1).unlink()
    with pytest.raises(CheckpointError, match="missing checkpoint data shard .*data-00000-of-00001"):
        TensorBundleReader(prefix)
    with pytest.raises(CheckpointError, match="missing checkpoint index"):
        TensorBundleReader(tmp_path / "other")


def test_unknown_dtype_is_named(tmp_path):
    header = b"\x08\x01\x1a\x02\x08\x01"  # num_shards 1, version {producer 1}
    string_entry = b"\x08\x07\x12\x00"  # dtype DT_STRING (7), scalar shape
    write_table(tmp_path / "m.index", [(b"", header), (b"model/names", string_entry)])
    data_file_name(tmp_path / "m", 0, 1).write_bytes(b"")
    with pytest.raises(CheckpointError, match="'model/names' has unsupported TensorFlow dtype string"):
        TensorBundleReader(tmp_path / "m")


def test_entry_size_must_agree_with_shape(tmp_path):
    entry = BundleEntry("w", "float32", (2, 3), 0, 0, 20, 0)  # 6 floats need 24 bytes
    write_table(tmp_path / "m.index", [(b"", b"\x08\x01"), (b"w", entry.serialize())])
    data_file_name(tmp_path / "m", 0, 1).write_bytes(bytes(24))
    with pytest.raises(CorruptCheckpointError, match=r"'w': 20 bytes stored, but shape \[2, 3\]"):
        TensorBundleReader(tmp_path / "m")


def test_entry_proto_round_trip():
    entry = BundleEntry("x", "float16", (1, 0, 70000), 2, 1 << 40, 0, 0xFFFFFFFF)
    assert BundleEntry.parse("x", entry.serialize()) == entry
    # The fixture's first entry, as TensorFlow serialized it: dtype 1, shape [96], size 384, crc.
    raw = bytes.fromhex("08011204120208602880033" + "5cd2a6160")
    assert BundleEntry.parse("b", raw) == BundleEntry(
        "b", "float32", (96,), 0, 0, 384, struct.unpack("<I", bytes.fromhex("cd2a6160"))[0]
    )


def test_bundle_of_empty_tensors_only(tmp_path):
    TensorBundleWriter(tmp_path / "m").write({"empty": np.zeros((0, 4), np.float32)})
    assert data_file_name(tmp_path / "m", 0, 1).stat().st_size == 0
    with TensorBundleReader(tmp_path / "m") as reader:
        assert reader.get("empty").shape == (0, 4)


# --- hostile files ------------------------------------------------------------------------------------------


def test_snappy_stream_claiming_more_than_it_can_hold():
    with pytest.raises(CorruptCheckpointError, match="cannot decompress to the"):
        snappy_decompress(b"\xff\xff\xff\xff\x0f" + b"\x00a")  # claims 4 GiB from 7 bytes
    with pytest.raises(CorruptCheckpointError, match="past the 3 bytes its header says"):
        snappy_decompress(b"\x03\x0cabcd")  # a literal of 4 bytes where 3 were promised


def test_an_index_entry_of_too_many_dimensions():
    entry = BundleEntry("w", "float32", (1,) * 300, 0, 0, 4, 0)
    with pytest.raises(CheckpointError, match="'w' has 300 dimensions; at most 254"):
        BundleEntry.parse("w", entry.serialize())


def test_the_index_alone(tmp_path):
    shutil.copyfile(PREFIX.with_suffix(".ckpt.index"), tmp_path / "model.ckpt.index")
    with TensorBundleReader(tmp_path / "model.ckpt", data=False) as reader:
        assert reader.entries == TensorBundleReader(PREFIX).entries
        with pytest.raises(CheckpointError, match="opened from its index alone"):
            reader.get("model/wte")
    with pytest.raises(CheckpointError, match="missing checkpoint data shard"):
        TensorBundleReader(tmp_path / "model.ckpt")


@pytest.mark.parametrize("kind", ["fifo", "device", "too large"])
def test_files_that_are_not_plain_or_small_are_refused(tmp_path, kind):
    prefix = copy_bundle(tmp_path)
    index = Path(f"{prefix}.index")
    if kind == "fifo":
        index.unlink()
        os.mkfifo(index)  # a plain open() would wait for a writer
        match = "model.ckpt.index is a FIFO \\(named pipe\\), not a regular file"
    elif kind == "device":
        data_file_name(prefix, 0, 1).unlink()
        data_file_name(prefix, 0, 1).symlink_to("/dev/zero")
        match = "data-00000-of-00001 is a character device, not a regular file"
    else:
        with open(index, "ab") as f:
            f.truncate(MAX_INDEX_SIZE + 1)
        match = f"holds {MAX_INDEX_SIZE + 1} bytes or more"
    with pytest.raises(CheckpointError, match=match):
        TensorBundleReader(prefix)
