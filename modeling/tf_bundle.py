"""TensorFlow V2 checkpoints ("tensor bundles") read and written in plain Python, without TensorFlow.

A bundle with prefix ``P`` is an index file ``P.index`` plus data shards ``P.data-00000-of-0000N``.

* The index is an immutable sorted table in LevelDB's SSTable format (TensorFlow keeps its own copy in
  ``tensorflow/core/lib/io/{table,block,format}.cc``; the layout is documented in LevelDB's
  ``doc/table_format.md``): data blocks, a metaindex block, an index block and a 48-byte footer ending in
  a magic number. Each block ends with a 5-byte trailer: a compression type (0 none, 1 Snappy) and the
  masked CRC-32C of the block contents plus that type byte.
* Entries map a tensor name to a serialized ``BundleEntryProto`` (``tensorflow/core/protobuf/
  tensor_bundle.proto``): dtype, shape, shard id, byte offset and size in that shard, and the masked
  CRC-32C of the tensor's bytes. The empty key holds the ``BundleHeaderProto`` (number of shards,
  endianness, format version).
* Data shards are the raw little-endian tensor bytes laid end to end (``tensor_bundle.cc``).

The few protobuf fields needed are decoded by hand, so there is no protobuf or TensorFlow dependency.
:class:`TensorBundleWriter` writes the same format; tests and benchmarks use it to build releases,
including corrupt, multi-shard and Snappy-compressed ones. Written with TensorFlow's defaults
(256 KiB blocks, a restart point every 16 keys, no compression, tensors in key order), it reproduces
the index and data files TensorFlow's own ``Saver`` wrote byte for byte.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import stat
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import crc32c as _crc32c
import numpy as np

__all__ = [
    "BundleEntry",
    "CheckpointError",
    "CorruptCheckpointError",
    "TensorBundleReader",
    "TensorBundleWriter",
    "data_file_name",
    "masked_crc32c",
    "open_regular_file",
    "read_regular_file",
    "snappy_decompress",
    "unmask_crc32c",
]


class CheckpointError(ValueError):
    """A source checkpoint is not what it should be. ``exit_code`` is what the CLI exits with."""

    exit_code = 3


class CorruptCheckpointError(CheckpointError):
    """The bytes on disk are damaged: a checksum mismatch, a truncated file, a broken table."""

    exit_code = 4


# --- reading files that may be hostile -------------------------------------------------------------------

_FILE_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
}


def open_regular_file(path: str | Path) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (after following links).

    Opened non-blocking, so a FIFO does not wait for a writer, and refused by what ``fstat`` says about
    the opened file itself: FIFOs, devices such as ``/dev/zero`` and sockets raise CheckpointError.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")
            raise CheckpointError(f"{path} is {what}, not a regular file; refusing to read it")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """All bytes of the regular file ``path``, refused when it holds more than ``limit`` bytes.

    Reads at most ``limit + 1`` bytes whatever the file claims, so a file that grows while it is read
    cannot make this read without end.
    """
    fd = open_regular_file(path)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise CheckpointError(
            f"{path} holds {max(size, len(data))} bytes or more; a file of this kind holds at most {limit}"
        )
    return data


# --- checksums ------------------------------------------------------------------------------------------

# LevelDB/TensorFlow store CRCs "masked" so that a CRC of data that itself contains CRCs stays well
# distributed (leveldb util/crc32c.h, tensorflow/core/lib/hash/crc32c.h: kMaskDelta).
_MASK_DELTA = 0xA282EAD8


def masked_crc32c(data: bytes | memoryview | np.ndarray, crc: int = 0) -> int:
    """Masked CRC-32C of ``data`` (optionally extending an unmasked running ``crc``)."""
    value = _crc32c.crc32c(data, crc)
    return ((((value >> 15) | (value << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def unmask_crc32c(masked: int) -> int:
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


# --- varints and the few protobuf fields we need ----------------------------------------------------------


def _read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise CorruptCheckpointError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise CorruptCheckpointError("varint longer than 64 bits")


def _varint(value: int) -> bytes:
    if value < 0:  # protobuf encodes negative int32/int64 as 10-byte two's complement
        value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _proto_fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """Yield ``(field_number, wire_type, value)``; value is an int (varint, fixed) or bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 1:
            (value,) = struct.unpack_from("<Q", buf, pos)
            pos += 8
        elif wire == 2:
            length, pos = _read_varint(buf, pos)
            value = bytes(buf[pos : pos + length])
            if len(value) != length:
                raise CorruptCheckpointError("truncated protobuf field")
            pos += length
        elif wire == 5:
            (value,) = struct.unpack_from("<I", buf, pos)
            pos += 4
        else:
            raise CorruptCheckpointError(f"unsupported protobuf wire type {wire}")
        yield field, wire, value


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _field(number: int, wire: int, payload: bytes | int) -> bytes:
    head = _varint(number << 3 | wire)
    if wire == 0:
        return head + _varint(int(payload))
    if wire == 5:
        return head + struct.pack("<I", payload)
    return head + _varint(len(payload)) + payload  # wire 2


# TensorFlow's DataType enum (tensorflow/core/framework/types.proto) for the numeric types a bundle of
# model weights can hold. bfloat16 has no numpy dtype: it is read as its raw uint16 bits.
_TF_DTYPES: dict[int, str] = {
    1: "float32",
    2: "float64",
    3: "int32",
    4: "uint8",
    5: "int16",
    6: "int8",
    9: "int64",
    10: "bool",
    14: "bfloat16",
    17: "uint16",
    19: "float16",
    22: "uint32",
    23: "uint64",
}
_TF_DTYPE_IDS = {name: number for number, name in _TF_DTYPES.items()}
_TF_DTYPE_NAMES = {7: "string", 8: "complex64", 18: "complex128", 20: "resource", 21: "variant"}


# TensorFlow's own limit on a tensor's rank (TensorShape kMaxRank); it also bounds the work of a shape's size.
MAX_RANK = 254


def _numpy_dtype(name: str) -> np.dtype:
    return np.dtype("<u2") if name == "bfloat16" else np.dtype(name).newbyteorder("<")


@dataclass(frozen=True)
class BundleEntry:
    """One tensor's ``BundleEntryProto``: where its bytes live and their checksum."""

    name: str
    dtype: str  # numpy name, or "bfloat16"
    shape: tuple[int, ...]
    shard_id: int
    offset: int
    size: int
    crc32c: int  # masked, as stored

    @property
    def numpy_dtype(self) -> np.dtype:
        return _numpy_dtype(self.dtype)

    @classmethod
    def parse(cls, name: str, data: bytes) -> BundleEntry:
        dtype_id, shape, shard_id, offset, size, crc, unknown_rank = 0, [], 0, 0, 0, 0, False
        for field, _, value in _proto_fields(data):
            if field == 1:
                dtype_id = value
            elif field == 2:  # TensorShapeProto: repeated Dim dim = 2 {int64 size = 1}; unknown_rank = 3
                for sfield, _, svalue in _proto_fields(value):
                    if sfield == 2:
                        dim = 0
                        for dfield, _, dvalue in _proto_fields(svalue):
                            if dfield == 1:
                                dim = _signed64(dvalue)
                        shape.append(dim)
                    elif sfield == 3:
                        unknown_rank = bool(svalue)
            elif field == 3:
                shard_id = value
            elif field == 4:
                offset = _signed64(value)
            elif field == 5:
                size = _signed64(value)
            elif field == 6:
                crc = value
            elif field == 7:  # TensorSliceProto: partitioned variables, which no OpenAI release has
                raise CheckpointError(f"tensor {name!r} is stored as slices, which are not supported")
        if dtype_id not in _TF_DTYPES:
            label = _TF_DTYPE_NAMES.get(dtype_id, f"enum value {dtype_id}")
            raise CheckpointError(f"tensor {name!r} has unsupported TensorFlow dtype {label}")
        if unknown_rank or any(d < 0 for d in shape):
            raise CheckpointError(f"tensor {name!r} has an unknown shape")
        if len(shape) > MAX_RANK:
            raise CheckpointError(
                f"tensor {name!r} has {len(shape)} dimensions; at most {MAX_RANK} are supported"
            )
        return cls(name, _TF_DTYPES[dtype_id], tuple(shape), shard_id, offset, size, crc)

    def serialize(self) -> bytes:
        # proto3 leaves out fields holding their default value, as TensorFlow's serializer does.
        dims = b"".join(_field(2, 2, _field(1, 0, d) if d else b"") for d in self.shape)
        out = _field(1, 0, _TF_DTYPE_IDS[self.dtype]) + _field(2, 2, dims)
        for number, value in ((3, self.shard_id), (4, self.offset), (5, self.size)):
            if value:
                out += _field(number, 0, value)
        return out + _field(6, 5, self.crc32c)


def _parse_header(data: bytes) -> tuple[int, int, int]:
    """BundleHeaderProto -> (num_shards, endianness (0 little, 1 big), version.producer)."""
    num_shards, endianness, producer = 0, 0, 0
    for field, _, value in _proto_fields(data):
        if field == 1:
            num_shards = value
        elif field == 2:
            endianness = value
        elif field == 3:
            for vfield, _, vvalue in _proto_fields(value):
                if vfield == 1:
                    producer = vvalue
    return num_shards, endianness, producer


def _serialize_header(num_shards: int) -> bytes:
    # endianness LITTLE is the enum default, so TensorFlow leaves it out; VersionDef{producer: 1}.
    return _field(1, 0, num_shards) + _field(3, 2, _field(1, 0, 1))


def data_file_name(prefix: str | Path, shard: int, num_shards: int) -> Path:
    """``{prefix}.data-00000-of-00001`` (tensor_bundle.cc: DataFilename)."""
    return Path(f"{prefix}.data-{shard:05d}-of-{num_shards:05d}")


# --- Snappy (raw block format, as TensorFlow's table blocks use it) ---------------------------------------


def snappy_decompress(data: bytes | memoryview) -> bytes:
    """Decompress a raw Snappy block (google/snappy ``format_description.txt``).

    The stream is a varint uncompressed length, then elements whose tag byte's low two bits say:
    00 a literal, 01/10/11 a copy of earlier output with a 1-, 2- or 4-byte offset. Copies may overlap
    their own output (offset < length), which repeats a pattern.
    """
    data = memoryview(data)
    length, pos = _read_varint(data, 0)
    # An element yields at most 64 bytes from at least 3 (a copy), so no valid stream expands more than
    # ~21x: a larger claimed length is damage, and the output never grows past the claimed length.
    if length > 22 * len(data):
        raise CorruptCheckpointError(f"snappy: {len(data)} bytes cannot decompress to the {length} claimed")
    out = bytearray()
    end = len(data)
    while pos < end:
        tag = data[pos]
        pos += 1
        kind = tag & 3
        if kind == 0:
            size = tag >> 2
            if size >= 60:  # 60..63: the length-1 follows in 1..4 little-endian bytes
                nbytes = size - 59
                size = int.from_bytes(data[pos : pos + nbytes], "little")
                pos += nbytes
            size += 1
            if pos + size > end:
                raise CorruptCheckpointError("snappy: literal runs past the end of the input")
            if len(out) + size > length:
                raise CorruptCheckpointError(f"snappy: decompresses past the {length} bytes its header says")
            out += data[pos : pos + size]
            pos += size
            continue
        if kind == 1:
            size = 4 + ((tag >> 2) & 7)
            offset = ((tag >> 5) << 8) | data[pos]
            pos += 1
        elif kind == 2:
            size = 1 + (tag >> 2)
            offset = int.from_bytes(data[pos : pos + 2], "little")
            pos += 2
        else:
            size = 1 + (tag >> 2)
            offset = int.from_bytes(data[pos : pos + 4], "little")
            pos += 4
        if pos > end or offset == 0 or offset > len(out):
            raise CorruptCheckpointError("snappy: copy offset outside the decompressed data")
        if len(out) + size > length:
            raise CorruptCheckpointError(f"snappy: decompresses past the {length} bytes its header says")
        start = len(out) - offset
        if offset >= size:
            out += out[start : start + size]
        else:  # overlapping copy: the last `offset` bytes repeat
            pattern = bytes(out[start:])
            out += (pattern * (size // offset + 1))[:size]
    if len(out) != length:
        raise CorruptCheckpointError(f"snappy: decompressed {len(out)} bytes, header says {length}")
    return bytes(out)


# --- the SSTable ----------------------------------------------------------------------------------------

_TABLE_MAGIC = 0xDB4775248B80FB57  # leveldb table/format.h kTableMagicNumber
_FOOTER_SIZE = 48  # two block handles padded to 40 bytes, then the 8-byte magic
_TRAILER_SIZE = 5
_NO_COMPRESSION, _SNAPPY = 0, 1


def _read_block(table: bytes, offset: int, size: int, path: Path) -> bytes:
    if offset + size + _TRAILER_SIZE > len(table):
        raise CorruptCheckpointError(f"{path}: block at {offset} runs past the end of the file (truncated?)")
    contents = table[offset : offset + size]
    kind = table[offset + size]
    (stored,) = struct.unpack_from("<I", table, offset + size + 1)
    if masked_crc32c(table[offset : offset + size + 1]) != stored:
        raise CorruptCheckpointError(f"{path}: checksum mismatch in the table block at offset {offset}")
    if kind == _SNAPPY:
        return snappy_decompress(contents)
    if kind != _NO_COMPRESSION:
        raise CorruptCheckpointError(f"{path}: unknown block compression type {kind}")
    return contents


def _block_entries(block: bytes, path: Path) -> Iterator[tuple[bytes, bytes]]:
    """Entries of one block: keys are stored as (shared prefix length, the rest), restarting every few."""
    if len(block) < 4:
        raise CorruptCheckpointError(f"{path}: table block too short")
    (num_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    limit = len(block) - 4 * (num_restarts + 1)
    if limit < 0:
        raise CorruptCheckpointError(f"{path}: bad restart array in a table block")
    pos, key = 0, b""
    while pos < limit:
        shared, pos = _read_varint(block, pos)
        non_shared, pos = _read_varint(block, pos)
        value_length, pos = _read_varint(block, pos)
        if shared > len(key) or pos + non_shared + value_length > limit:
            raise CorruptCheckpointError(f"{path}: corrupt entry in a table block")
        key = key[:shared] + block[pos : pos + non_shared]
        pos += non_shared
        yield key, block[pos : pos + value_length]
        pos += value_length


def _decode_handle(data: bytes, pos: int = 0) -> tuple[int, int, int]:
    offset, pos = _read_varint(data, pos)
    size, pos = _read_varint(data, pos)
    return offset, size, pos


# The largest index a bundle may have: OpenAI's are a few KiB (1558M: ~8 KiB); a bundle of a million
# tensors would need ~100 MB.
MAX_INDEX_SIZE = 1 << 28


def read_table(path: str | Path, limit: int = MAX_INDEX_SIZE) -> dict[bytes, bytes]:
    """All key/value pairs of an SSTable file, in key order (a file of more than ``limit`` bytes is refused)."""
    path = Path(path)
    table = read_regular_file(path, limit)
    try:
        return _read_table(table, path)
    except CorruptCheckpointError as exc:
        if str(path) in str(exc):
            raise
        raise CorruptCheckpointError(f"{path}: {exc}") from exc


def _read_table(table: bytes, path: Path) -> dict[bytes, bytes]:
    if len(table) < _FOOTER_SIZE:
        raise CorruptCheckpointError(f"{path}: too short to be a table ({len(table)} bytes; truncated?)")
    footer = table[-_FOOTER_SIZE:]
    (magic,) = struct.unpack_from("<Q", footer, 40)
    if magic != _TABLE_MAGIC:
        raise CorruptCheckpointError(f"{path}: not a TensorFlow checkpoint index (bad magic; truncated?)")
    _, _, pos = _decode_handle(footer)  # the metaindex holds filter blocks; bundles have none to read
    index_offset, index_size, _ = _decode_handle(footer, pos)
    entries: dict[bytes, bytes] = {}
    for _, handle in _block_entries(_read_block(table, index_offset, index_size, path), path):
        offset, size, _ = _decode_handle(handle)
        for key, value in _block_entries(_read_block(table, offset, size, path), path):
            entries[key] = value
    return entries


class _BlockBuilder:
    def __init__(self, restart_interval: int):
        self.restart_interval = restart_interval
        self.buffer = bytearray()
        self.restarts = [0]
        self.counter = 0
        self.last_key = b""

    def add(self, key: bytes, value: bytes) -> None:
        shared = 0
        if self.counter < self.restart_interval:
            limit = min(len(key), len(self.last_key))
            while shared < limit and key[shared] == self.last_key[shared]:
                shared += 1
        else:
            self.restarts.append(len(self.buffer))
            self.counter = 0
        self.buffer += _varint(shared) + _varint(len(key) - shared) + _varint(len(value))
        self.buffer += key[shared:] + value
        self.last_key = key
        self.counter += 1

    def size_estimate(self) -> int:
        return len(self.buffer) + 4 * len(self.restarts) + 4

    def finish(self) -> bytes:
        restarts = struct.pack(f"<{len(self.restarts)}I", *self.restarts)
        return bytes(self.buffer) + restarts + struct.pack("<I", len(self.restarts))

    @property
    def empty(self) -> bool:
        return not self.buffer


def _shortest_separator(start: bytes, limit: bytes) -> bytes:
    """A short key k with start <= k < limit (leveldb's BytewiseComparator::FindShortestSeparator)."""
    common = 0
    while common < min(len(start), len(limit)) and start[common] == limit[common]:
        common += 1
    if common < min(len(start), len(limit)):
        byte = start[common]
        if byte < 0xFF and byte + 1 < limit[common]:
            return start[:common] + bytes([byte + 1])
    return start


def _short_successor(key: bytes) -> bytes:
    """A short key >= key (leveldb's FindShortSuccessor): bump the first byte that can be bumped."""
    for i, byte in enumerate(key):
        if byte != 0xFF:
            return key[:i] + bytes([byte + 1])
    return key


def write_table(
    path: str | Path,
    items: Iterable[tuple[bytes, bytes]],
    *,
    block_size: int = 256 * 1024,
    restart_interval: int = 16,
    compress: Callable[[bytes], bytes] | None = None,
) -> None:
    """Write sorted key/value pairs as an SSTable, with TensorFlow's table defaults.

    ``compress`` is a raw-Snappy compressor (e.g. ``cramjam.snappy.compress_raw``); like leveldb, a block
    is stored compressed only when that saves at least 1/8 of its size.
    """
    out = bytearray()

    def emit(block: bytes) -> bytes:
        kind = _NO_COMPRESSION
        if compress is not None:
            packed = bytes(compress(block))
            if len(packed) < len(block) - len(block) // 8:
                block, kind = packed, _SNAPPY
        handle = _varint(len(out)) + _varint(len(block))
        out.extend(block)
        out.append(kind)
        out.extend(struct.pack("<I", masked_crc32c(block + bytes([kind]))))
        return handle

    data = _BlockBuilder(restart_interval)
    index = _BlockBuilder(1)  # leveldb indexes every block handle with its own restart point
    pending_handle: bytes | None = None
    last_key = None
    for key, value in items:
        if last_key is not None and key <= last_key:
            raise ValueError(f"table keys must be strictly increasing: {key!r} after {last_key!r}")
        if pending_handle is not None:
            index.add(_shortest_separator(last_key, key), pending_handle)
            pending_handle = None
        data.add(key, value)
        last_key = key
        if data.size_estimate() >= block_size:
            pending_handle = emit(data.finish())
            data = _BlockBuilder(restart_interval)
    if not data.empty:
        pending_handle = emit(data.finish())
    if pending_handle is not None:
        index.add(_short_successor(last_key), pending_handle)
    metaindex_handle = emit(_BlockBuilder(restart_interval).finish())
    index_handle = emit(index.finish())
    footer = (metaindex_handle + index_handle).ljust(40, b"\0") + struct.pack("<Q", _TABLE_MAGIC)
    out.extend(footer)
    Path(path).write_bytes(bytes(out))


# --- the bundle -----------------------------------------------------------------------------------------


class TensorBundleReader:
    """Read-only access to a TensorFlow V2 checkpoint, tensors served from memory maps.

    ``prefix`` is the checkpoint prefix (``.../model.ckpt``). Opening reads only the index; each data
    shard is checked to be long enough for the entries it holds. :meth:`get` returns a read-only array
    viewing the mapped file after checking the tensor's CRC-32C; :meth:`release` drops its pages from
    this process again, so converting a large checkpoint tensor by tensor keeps a small footprint.
    """

    def __init__(
        self,
        prefix: str | Path,
        *,
        data: bool = True,
        check_file: Callable[[Path], None] | None = None,
    ):
        """``data=False`` reads the index alone (shapes, dtypes, where each tensor lies): the data shards
        need not exist, and :meth:`get` is unavailable. ``check_file`` is called on each file's path
        before it is opened (a policy on links, say); it raises to refuse the file."""
        self.prefix = Path(prefix)
        self._check_file = check_file or (lambda path: None)
        index_path = Path(f"{self.prefix}.index")
        if not index_path.exists():
            raise CheckpointError(f"missing checkpoint index {index_path}")
        self._check_file(index_path)
        table = read_table(index_path)
        if b"" not in table:
            raise CorruptCheckpointError(f"{index_path}: no bundle header (empty key) in the index")
        self.num_shards, endianness, self.version = _parse_header(table.pop(b""))
        if endianness != 0:
            raise CheckpointError(f"{index_path}: big-endian bundles are not supported")
        if self.num_shards < 1:
            raise CorruptCheckpointError(f"{index_path}: header says {self.num_shards} data shards")
        self.entries: dict[str, BundleEntry] = {}
        for key, value in table.items():
            try:
                name = key.decode("utf-8")
                self.entries[name] = BundleEntry.parse(name, value)
            except (UnicodeDecodeError, CorruptCheckpointError) as exc:
                raise CorruptCheckpointError(f"{index_path}: entry {key!r}: {exc}") from exc
        self.has_data = data
        self.data_files: list[Path] = []
        sizes: dict[int, int] = {}
        for shard in range(self.num_shards if data else 0):  # stops at the first missing shard
            path = data_file_name(self.prefix, shard, self.num_shards)
            if not path.exists():
                raise CheckpointError(
                    f"missing checkpoint data shard {path} ({index_path} names {self.num_shards} shards)"
                )
            self._check_file(path)
            fd = open_regular_file(path)
            try:
                sizes[shard] = os.fstat(fd).st_size
            finally:
                os.close(fd)
            self.data_files.append(path)
        self._check_entries(sizes if data else None)
        self._maps: dict[int, mmap.mmap] = {}

    def _check_entries(self, sizes: dict[int, int] | None) -> None:
        for entry in self.entries.values():
            if not 0 <= entry.shard_id < self.num_shards:
                raise CorruptCheckpointError(f"tensor {entry.name!r}: shard {entry.shard_id} does not exist")
            expected = math.prod(entry.shape) * entry.numpy_dtype.itemsize  # Python ints: no overflow
            if entry.size != expected:
                raise CorruptCheckpointError(
                    f"tensor {entry.name!r}: {entry.size} bytes stored, but shape {list(entry.shape)} "
                    f"of {entry.dtype} needs {expected}"
                )
            if entry.offset < 0:
                raise CorruptCheckpointError(
                    f"tensor {entry.name!r} lies at a negative offset {entry.offset}"
                )
            if sizes is not None and entry.offset + entry.size > sizes[entry.shard_id]:
                path = self.data_files[entry.shard_id]
                raise CorruptCheckpointError(
                    f"tensor {entry.name!r} lies at bytes {entry.offset}..{entry.offset + entry.size} of "
                    f"{path.name}, which has only {sizes[entry.shard_id]} bytes (truncated?)"
                )

    def __enter__(self) -> TensorBundleReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for mapped in self._maps.values():
            # Arrays returned by get() may still view the map; then it unmaps when they are freed.
            with contextlib.suppress(BufferError):
                mapped.close()
        self._maps.clear()

    def keys(self) -> list[str]:
        return list(self.entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def _map(self, shard: int) -> mmap.mmap:
        if not self.has_data:
            raise CheckpointError(f"{self.prefix}: opened from its index alone (data=False); no tensor data")
        if shard not in self._maps:
            path = self.data_files[shard]
            self._check_file(path)
            fd = open_regular_file(path)
            try:
                self._maps[shard] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)  # the map keeps its own reference to the file
        return self._maps[shard]

    def get(self, name: str, verify: bool = True) -> np.ndarray:
        """The tensor ``name`` as a read-only array on the memory map (bfloat16 as raw uint16 bits)."""
        if name not in self.entries:
            raise KeyError(name)
        entry = self.entries[name]
        if entry.size == 0:  # nothing to map (and an empty shard file cannot be mapped at all)
            return np.empty(entry.shape, entry.numpy_dtype)
        view = memoryview(self._map(entry.shard_id))[entry.offset : entry.offset + entry.size]
        if verify and masked_crc32c(view) != entry.crc32c:
            raise CorruptCheckpointError(
                f"checksum mismatch for tensor {name!r} in {self.data_files[entry.shard_id].name}: "
                "the data file is corrupt"
            )
        return np.frombuffer(view, dtype=entry.numpy_dtype).reshape(entry.shape)

    def release(self, name: str) -> None:
        """Drop the pages of ``name`` from this process (the OS page cache keeps them)."""
        entry = self.entries[name]
        mapped = self._maps.get(entry.shard_id)
        if mapped is None or not hasattr(mmap, "MADV_DONTNEED") or entry.size == 0:
            return
        start = entry.offset - entry.offset % mmap.PAGESIZE
        mapped.madvise(mmap.MADV_DONTNEED, start, entry.offset + entry.size - start)


class TensorBundleWriter:
    """Write a TensorFlow V2 checkpoint from numpy arrays.

    ``shard_of`` picks each tensor's data shard (default: everything in shard 0). Tensors are laid out
    in key order, as TensorFlow's ``Saver`` does, so with the defaults the files match TensorFlow's.
    ``compress`` (a raw-Snappy compressor) stores index blocks Snappy-compressed.
    """

    def __init__(
        self,
        prefix: str | Path,
        *,
        num_shards: int = 1,
        shard_of: Callable[[str], int] | None = None,
        compress: Callable[[bytes], bytes] | None = None,
        block_size: int = 256 * 1024,
        restart_interval: int = 16,
    ):
        self.prefix = Path(prefix)
        self.num_shards = num_shards
        self.shard_of = shard_of or (lambda name: 0)
        self.compress = compress
        self.block_size = block_size
        self.restart_interval = restart_interval

    def write(
        self,
        tensors: Mapping[str, np.ndarray | Callable[[], np.ndarray]]
        | Iterable[tuple[str, np.ndarray | Callable[[], np.ndarray]]],
        *,
        bfloat16: Iterable[str] = (),
    ) -> dict[str, BundleEntry]:
        """Write all tensors and the index. Names in ``bfloat16`` hold raw bfloat16 bits as uint16.

        A value may also be a zero-argument callable returning the array: it is called when that tensor's
        turn comes, so a large checkpoint can be written holding one tensor at a time.
        """
        bfloat16 = set(bfloat16)
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        items = sorted(items, key=lambda kv: kv[0].encode("utf-8"))
        entries: dict[str, BundleEntry] = {}
        with ExitStack() as stack:
            files = [
                stack.enter_context(open(data_file_name(self.prefix, i, self.num_shards), "wb"))
                for i in range(self.num_shards)
            ]
            for name, value in items:
                array = np.asarray(value() if callable(value) else value)
                dtype = "bfloat16" if name in bfloat16 else array.dtype.name
                if dtype not in _TF_DTYPE_IDS:
                    raise ValueError(f"tensor {name!r}: dtype {array.dtype} has no TensorFlow equivalent")
                shard = self.shard_of(name)
                data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
                view = memoryview(data).cast("B") if data.size else b""
                f = files[shard]
                entries[name] = BundleEntry(
                    name, dtype, tuple(array.shape), shard, f.tell(), data.nbytes, masked_crc32c(view)
                )
                f.write(view)
        header = (b"", _serialize_header(self.num_shards))
        rows = [header] + [(name.encode("utf-8"), entries[name].serialize()) for name, _ in items]
        write_table(
            f"{self.prefix}.index",
            rows,
            block_size=self.block_size,
            restart_interval=self.restart_interval,
            compress=self.compress,
        )
        return entries
