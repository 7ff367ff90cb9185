"""OpenAI's original GPT-1 and GPT-2 releases: recognise them, read them, and convert them.

* GPT-2 (github.com/openai/gpt-2, ``download_model.py``): a TensorFlow V2 checkpoint ``model.ckpt`` plus
  ``hparams.json`` and the byte-level BPE files ``encoder.json`` / ``vocab.bpe``. Read with
  :mod:`hfgpt.modeling.tf_bundle`, so no TensorFlow is needed.
* GPT-1 (github.com/openai/finetune-transformer-lm, ``model/``): every parameter flattened, concatenated
  in the order of ``params_shapes.json`` and cut into ``params_0.npy`` … ``params_9.npy``; ``train.py``
  glues the shards together and splits them again by those shapes. We do the same lazily, reading each
  parameter's byte range straight from memory-mapped shards.

The name mapping is data: one table per release, each row ``(source name, parameter name, operation)``
with ``{}`` for the layer index. The reverse direction (a state dict back to a release, used by the
test-only writers) is derived from the same tables.

Conversion streams tensor by tensor into safetensors shards written by hand (header JSON, then raw
bytes), so peak memory stays near the largest single tensor rather than the whole model.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import mmap
import os
import re
import secrets
import shutil
import stat
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from huggingface_hub.errors import StrictDataclassError

from hfgpt.tokenization import FINETUNE_TOKENS

from .tf_bundle import (
    MAX_RANK,
    CheckpointError,
    CorruptCheckpointError,
    TensorBundleReader,
    TensorBundleWriter,
    open_regular_file,
    read_regular_file,
)

__all__ = [
    "CONVERSION_ERRORS",
    "CheckpointError",
    "ConversionError",
    "CorruptCheckpointError",
    "FINETUNE_TOKENS",
    "InvalidOptionError",
    "GPT1_EMBEDDING_MAP",
    "GPT1_LAYER_MAP",
    "GPT2_WEIGHT_MAP",
    "MappedTensor",
    "OutputExistsError",
    "Release",
    "convert_release",
    "detect_release",
    "inspect_release",
    "open_release",
    "parse_sha256_list",
    "write_gpt1_release",
    "write_gpt2_release",
]


class ConversionError(CheckpointError):
    """The source is not a release we can convert (missing/extra files, wrong shapes, bad options)."""

    exit_code = 3


class InvalidOptionError(ConversionError):
    """An option out of its range (dtype, format, seed, n_head, shard size, repo id): the CLI's usage error."""

    exit_code = 2


class OutputExistsError(ConversionError):
    """The output folder already holds files; we never overwrite a model."""

    exit_code = 5


# Every error a conversion raises on bad input; the CLI turns these into `error: ...` and exit_code.
CONVERSION_ERRORS = (CheckpointError,)

ReleaseKind = Literal["gpt2", "gpt1"]
DType = Literal["float32", "float16", "bfloat16"]


# --- operations between a source tensor and a parameter ---------------------------------------------------


@dataclass(frozen=True)
class Op:
    """A shape-changing operation from a release tensor to a parameter, with its inverse."""

    name: str
    forward: Callable[[np.ndarray], np.ndarray]
    reverse: Callable[[np.ndarray], np.ndarray]
    forward_shape: Callable[[tuple[int, ...]], tuple[int, ...] | None]  # None: shape not allowed
    reverse_shape: Callable[[tuple[int, ...]], tuple[int, ...]]


IDENTITY = Op("identity", lambda a: a, lambda a: a, lambda s: s, lambda s: s)
# OpenAI's conv1d weights are [1, n_in, n_out] (model.py: `w = tf.get_variable('w', [1, nx, nf])`);
# the Conv1D parameter is [n_in, n_out].
SQUEEZE0 = Op(
    "squeeze(0)",
    lambda a: a.reshape(a.shape[1:]),
    lambda a: a.reshape((1, *a.shape)),
    lambda s: s[1:] if len(s) == 3 and s[0] == 1 else None,
    lambda s: (1, *s),
)

# GPT-2 TensorFlow names (openai/gpt-2 src/model.py) -> parameter names (transformers' GPT2LMHeadModel).
GPT2_WEIGHT_MAP: dict[str, tuple[str, Op]] = {
    "model/wte": ("transformer.wte.weight", IDENTITY),
    "model/wpe": ("transformer.wpe.weight", IDENTITY),
    "model/h{}/ln_1/g": ("transformer.h.{}.ln_1.weight", IDENTITY),
    "model/h{}/ln_1/b": ("transformer.h.{}.ln_1.bias", IDENTITY),
    "model/h{}/attn/c_attn/w": ("transformer.h.{}.attn.c_attn.weight", SQUEEZE0),
    "model/h{}/attn/c_attn/b": ("transformer.h.{}.attn.c_attn.bias", IDENTITY),
    "model/h{}/attn/c_proj/w": ("transformer.h.{}.attn.c_proj.weight", SQUEEZE0),
    "model/h{}/attn/c_proj/b": ("transformer.h.{}.attn.c_proj.bias", IDENTITY),
    "model/h{}/ln_2/g": ("transformer.h.{}.ln_2.weight", IDENTITY),
    "model/h{}/ln_2/b": ("transformer.h.{}.ln_2.bias", IDENTITY),
    "model/h{}/mlp/c_fc/w": ("transformer.h.{}.mlp.c_fc.weight", SQUEEZE0),
    "model/h{}/mlp/c_fc/b": ("transformer.h.{}.mlp.c_fc.bias", IDENTITY),
    "model/h{}/mlp/c_proj/w": ("transformer.h.{}.mlp.c_proj.weight", SQUEEZE0),
    "model/h{}/mlp/c_proj/b": ("transformer.h.{}.mlp.c_proj.bias", IDENTITY),
    "model/ln_f/g": ("transformer.ln_f.weight", IDENTITY),
    "model/ln_f/b": ("transformer.ln_f.bias", IDENTITY),
}

# GPT-1 has no names on disk, only an order (params_shapes.json). train.py's single embedding `we` is
# stored as two entries: positions first, then tokens (the fine-tuning rows are added at load time).
# The names on the left are the variables of finetune-transformer-lm's train.py `model` scope.
GPT1_EMBEDDING_MAP: list[tuple[str, str, Op]] = [
    ("model/we[positions]", "transformer.wpe.weight", IDENTITY),
    ("model/we[tokens]", "transformer.wte.weight", IDENTITY),
]
# Then, for each layer in turn, these twelve (train.py `block`: attn, ln_1, mlp, ln_2 variable order).
GPT1_LAYER_MAP: list[tuple[str, str, Op]] = [
    ("model/h{}/attn/c_attn/w", "transformer.h.{}.attn.c_attn.weight", SQUEEZE0),
    ("model/h{}/attn/c_attn/b", "transformer.h.{}.attn.c_attn.bias", IDENTITY),
    ("model/h{}/attn/c_proj/w", "transformer.h.{}.attn.c_proj.weight", SQUEEZE0),
    ("model/h{}/attn/c_proj/b", "transformer.h.{}.attn.c_proj.bias", IDENTITY),
    ("model/h{}/ln_1/g", "transformer.h.{}.ln_1.weight", IDENTITY),
    ("model/h{}/ln_1/b", "transformer.h.{}.ln_1.bias", IDENTITY),
    ("model/h{}/mlp/c_fc/w", "transformer.h.{}.mlp.c_fc.weight", SQUEEZE0),
    ("model/h{}/mlp/c_fc/b", "transformer.h.{}.mlp.c_fc.bias", IDENTITY),
    ("model/h{}/mlp/c_proj/w", "transformer.h.{}.mlp.c_proj.weight", SQUEEZE0),
    ("model/h{}/mlp/c_proj/b", "transformer.h.{}.mlp.c_proj.bias", IDENTITY),
    ("model/h{}/ln_2/g", "transformer.h.{}.ln_2.weight", IDENTITY),
    ("model/h{}/ln_2/b", "transformer.h.{}.ln_2.bias", IDENTITY),
]

GPT2_FILES = ("checkpoint", "model.ckpt.index", "hparams.json", "encoder.json", "vocab.bpe")
GPT1_FILES = (
    "params_shapes.json",
    *(f"params_{i}.npy" for i in range(10)),
    "encoder_bpe_40000.json",
    "vocab_40000.bpe",
)
_GPT2_DATA = re.compile(r"model\.ckpt\.data-\d{5}-of-\d{5}")
_GPT1_SHARD = re.compile(r"params_\d+\.npy")


def _layer_index(template: str, name: str) -> int | None:
    match = re.fullmatch(re.escape(template).replace(r"\{\}", r"(\d+)"), name)
    return int(match.group(1)) if match else None


def gpt2_target(source: str) -> tuple[str, Op] | None:
    """The parameter a GPT-2 TF tensor maps to, or None when the table has no row for it."""
    for template, (target, op) in GPT2_WEIGHT_MAP.items():
        if "{}" not in template:
            if template == source:
                return target, op
            continue
        layer = _layer_index(template, source)
        if layer is not None:
            return target.format(layer), op
    return None


def gpt1_order(n_layer: int) -> list[tuple[str, str, Op]]:
    """GPT-1's positional order, expanded for ``n_layer`` layers: (source name, parameter name, op)."""
    rows = list(GPT1_EMBEDDING_MAP)
    for i in range(n_layer):
        rows += [(src.format(i), dst.format(i), op) for src, dst, op in GPT1_LAYER_MAP]
    return rows


# --- reading the releases ---------------------------------------------------------------------------------

# The most bytes read from each small file of a release. The real ones: checkpoint 77 bytes, hparams.json
# ~90, params_shapes.json ~4 KiB, encoder.json 1.0 MB, vocab.bpe 456 KB, encoder_bpe_40000.json 816 KB,
# vocab_40000.bpe 458 KB. Anything far larger is not a release file, and is refused before it is read.
SMALL_FILE_LIMIT = 1 << 20
VOCABULARY_FILE_LIMIT = 64 << 20

# Bounds on the sizes a release may declare, checked before anything is built from them. OpenAI's largest
# release (GPT-2 1558M) has n_layer 48, n_embd 1600, n_head 25, n_ctx 1024, n_vocab 50257; these leave
# room for far larger models of the same format while keeping a hostile hparams.json (n_layer 10**6,
# n_embd 2**40) from making the converter build a model before it finds the release does not hold one.
SIZE_LIMITS = {"n_vocab": 1 << 24, "n_ctx": 1 << 20, "n_embd": 1 << 16, "n_head": 1 << 16, "n_layer": 1 << 8}


@dataclass(frozen=True)
class SourceTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]


# A Hugging Face cache keeps each file once, in `<cache>/<type>s--<owner>--<name>/blobs/<hash>`, and links
# it from `snapshots/<revision>/<path>` with a relative link (`../../blobs/<hash>`).
_HUB_REPO_FOLDER = re.compile(r"(models|datasets|spaces)--.+")


def _hub_blobs_folder(root: Path) -> Path | None:
    """The ``blobs`` folder of the Hub cache repo whose snapshot holds ``root`` (a resolved path), if any."""
    for folder in (root, *root.parents):
        if folder.name == "snapshots" and _HUB_REPO_FOLDER.fullmatch(folder.parent.name):
            return folder.parent / "blobs"
    return None


def check_source_file(root: Path, path: Path) -> None:
    """Refuse a file of the release folder ``root`` (resolved) that the converter must not read.

    Only regular files are read: FIFOs, devices (``/dev/zero``), sockets and folders are refused. A symbolic
    link must stay inside the release folder, or, in a Hugging Face cache, point at a file of the ``blobs``
    folder of the same cached repo (how the Hub's cache lays out every snapshot). Any other link, to
    ``/etc/shadow`` or to another model's folder, is refused with its target named: the converter copies
    what it reads into the output, which may be published.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise ConversionError(f"missing release file {path}") from None
    if stat.S_ISLNK(info.st_mode):
        target = Path(os.path.realpath(path))
        blobs = _hub_blobs_folder(root)
        if not (target.is_relative_to(root) or (blobs is not None and target.parent == blobs)):
            raise ConversionError(
                f"{path} is a symbolic link to {target}, outside the release folder {root}; copy the file "
                "into the folder (links are followed only inside it, or into the blobs folder of the "
                "Hugging Face cache repo it belongs to)"
            )
        try:
            info = os.stat(path)
        except FileNotFoundError:
            raise ConversionError(f"{path} is a broken symbolic link (to {target})") from None
    if not stat.S_ISREG(info.st_mode):
        kinds = {
            stat.S_IFIFO: "a FIFO (named pipe)",
            stat.S_IFCHR: "a character device",
            stat.S_IFBLK: "a block device",
            stat.S_IFSOCK: "a socket",
            stat.S_IFDIR: "a folder",
        }
        what = kinds.get(stat.S_IFMT(info.st_mode), "not a regular file")
        raise ConversionError(f"{path} is {what}, not a regular file; refusing to read it")


def detect_release(source_dir: str | Path, *, weights: bool = True) -> ReleaseKind:
    """Which release ``source_dir`` holds, from its files. Raises ConversionError naming what is wrong.

    ``weights=False`` (``--inspect``) asks only for the files that describe the tensors: GPT-2's
    ``model.ckpt.index`` and ``hparams.json``, GPT-1's ``params_shapes.json``.
    """
    source_dir = Path(source_dir)
    if not source_dir.is_dir():
        what = "is a file, not a release folder" if source_dir.exists() else "does not exist"
        raise ConversionError(f"source folder {source_dir} {what}")
    names = {p.name for p in source_dir.iterdir()}
    looks_gpt2 = "model.ckpt.index" in names or "hparams.json" in names
    looks_gpt1 = "params_shapes.json" in names
    if looks_gpt2 and looks_gpt1:
        raise ConversionError(f"{source_dir} holds files of both the GPT-1 and the GPT-2 release")
    if not looks_gpt2 and not looks_gpt1:
        raise ConversionError(
            f"{source_dir} is neither a GPT-2 release (model.ckpt.index, hparams.json, ...) nor a GPT-1 "
            "release (params_shapes.json, params_0.npy ... params_9.npy, ...)"
        )
    kind: ReleaseKind = "gpt2" if looks_gpt2 else "gpt1"
    if weights:
        required = GPT2_FILES if kind == "gpt2" else GPT1_FILES
    else:
        required = ("model.ckpt.index", "hparams.json") if kind == "gpt2" else ("params_shapes.json",)
    for name in required:
        if name not in names:
            raise ConversionError(f"{source_dir} looks like a {kind.upper()} release but has no {name}")
    return kind


def _read_json(path: Path, limit: int = SMALL_FILE_LIMIT) -> Any:
    """The JSON value in ``path``: a regular file of at most ``limit`` bytes, UTF-8, not nested too deep."""
    try:
        return json.loads(read_regular_file(path, limit).decode("utf-8"))
    except RecursionError:
        raise ConversionError(f"cannot read {path}: JSON nested too deeply") from None
    except (OSError, ValueError) as exc:  # ValueError: JSON syntax, UTF-8, an integer of 4300+ digits
        raise ConversionError(f"cannot read {path}: {exc}") from exc


def _check_sizes(values: Mapping[str, Any], where: str) -> None:
    """Each of ``values`` (hyper-parameters by name) is a positive integer within SIZE_LIMITS."""
    for key, value in values.items():
        if type(value) is not int or value <= 0:  # not bool, not float
            raise ConversionError(f"{where}: {key} must be a positive integer")
        if value > SIZE_LIMITS[key]:
            raise ConversionError(
                f"{where}: {key} is {value}, more than the {SIZE_LIMITS[key]} this converter accepts "
                "(the largest OpenAI release has n_layer 48, n_embd 1600, n_ctx 1024, n_vocab 50257)"
            )


class GPT2Release:
    """A GPT-2 model folder (``models/124M`` etc.). Opening reads only the index and ``hparams.json``
    (and ``checkpoint``); ``weights=False`` needs no data shard and no ``checkpoint`` (``--inspect``)."""

    kind: ReleaseKind = "gpt2"

    def __init__(self, source_dir: str | Path, *, weights: bool = True):
        self.source_dir = Path(source_dir)
        self.root = Path(os.path.realpath(self.source_dir))
        self.weights = weights
        if weights:
            path = self._file("checkpoint")
            try:
                checkpoint = read_regular_file(path, SMALL_FILE_LIMIT).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConversionError(f"{path} is not a text file: {exc}") from exc
            match = re.search(r'^model_checkpoint_path:\s*"([^"]+)"', checkpoint, re.M)
            if match is None:
                raise ConversionError(f"{path}: no model_checkpoint_path line")
            if Path(match.group(1)).name != "model.ckpt":
                raise ConversionError(f"{path} names checkpoint {match.group(1)!r}; expected model.ckpt")
        hparams_path = self._file("hparams.json")
        self.hparams = _read_json(hparams_path)
        if not isinstance(self.hparams, dict):
            raise ConversionError(f"{hparams_path}: expected a JSON object")
        _check_sizes({key: self.hparams.get(key) for key in SIZE_LIMITS}, str(hparams_path))
        self.bundle = TensorBundleReader(
            self.source_dir / "model.ckpt",
            data=weights,
            check_file=lambda path: check_source_file(self.root, path),
        )
        if weights:
            expected = {p.name for p in self.bundle.data_files}
            for path in self.source_dir.iterdir():
                if _GPT2_DATA.fullmatch(path.name) and path.name not in expected:
                    raise ConversionError(
                        f"extra file {path}: the index names {self.bundle.num_shards} data shard(s) "
                        f"({', '.join(sorted(expected))})"
                    )

    def _file(self, name: str) -> Path:
        path = self.source_dir / name
        check_source_file(self.root, path)
        return path

    @property
    def n_layer(self) -> int:
        return self.hparams["n_layer"]

    def tensors(self) -> list[SourceTensor]:
        return [SourceTensor(e.name, e.dtype, e.shape) for e in self.bundle.entries.values()]

    def mapping(self) -> list[tuple[str, str, Op]]:
        rows = []
        for name in self.bundle.entries:
            target = gpt2_target(name)
            if target is None:
                raise ConversionError(
                    f"tensor {name!r} in {self.bundle.prefix}.index has no parameter to map to"
                )
            rows.append((name, *target))
        # Read in file order: one sequential pass over each data shard.
        return sorted(
            rows, key=lambda r: (self.bundle.entries[r[0]].shard_id, self.bundle.entries[r[0]].offset)
        )

    def files(self) -> list[Path]:
        """Every file a conversion reads, in the order it reads them."""
        names = ["checkpoint", "hparams.json", "model.ckpt.index"]
        names += [p.name for p in self.bundle.data_files]
        return [self.source_dir / name for name in (*names, "encoder.json", "vocab.bpe")]

    def tensors_in(self, file_name: str) -> list[str]:
        """The tensors whose bytes lie in the release file ``file_name`` (a data shard), in file order."""
        shards = [p.name for p in self.bundle.data_files]
        if file_name not in shards:
            return []
        shard = shards.index(file_name)
        entries = [e for e in self.bundle.entries.values() if e.shard_id == shard]
        return [e.name for e in sorted(entries, key=lambda e: e.offset)]

    def get(self, name: str) -> np.ndarray:
        return self.bundle.get(name)

    def release(self, name: str) -> None:
        self.bundle.release(name)

    def close(self) -> None:
        self.bundle.close()

    def config_fields(self) -> tuple[str, dict[str, Any]]:
        """(preset name, overrides) of the GPTConfig this release needs."""
        h = self.hparams
        presets = {
            (12, 768): "gpt2",
            (24, 1024): "gpt2-medium",
            (36, 1280): "gpt2-large",
            (48, 1600): "gpt2-xl",
        }
        preset = presets.get((h["n_layer"], h["n_embd"]), "gpt2")
        return preset, dict(
            vocab_size=h["n_vocab"],
            n_positions=h["n_ctx"],
            n_embd=h["n_embd"],
            n_head=h["n_head"],
            n_layer=h["n_layer"],
        )


@dataclass
class _NpyShard:
    path: Path
    dtype: np.dtype
    length: int
    data_offset: int
    mapped: mmap.mmap | None = None


def _npy_header(path: Path) -> tuple[np.dtype, int, int, int]:
    """(dtype, element count, byte offset of the data, file size) of a 1-D .npy file, reading only its
    header. Nothing in the file is evaluated beyond numpy's literal parsing of the header (no pickle)."""
    with os.fdopen(open_regular_file(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(f)
        # numpy parses the header with the tokenizer and ast.literal_eval: damaged bytes raise whatever
        # those raise (ValueError, SyntaxError, tokenize.TokenError, TypeError, MemoryError, ...).
        except Exception as exc:
            raise ConversionError(f"{path} is not a valid .npy file: {type(exc).__name__}: {exc}") from exc
        offset = f.tell()
    if len(shape) != 1:
        raise ConversionError(
            f"{path}: expected a 1-D array of flattened parameters, found shape {list(shape)}"
        )
    if not 0 <= shape[0] < 1 << 62:
        raise ConversionError(f"{path}: its header's length {shape[0]} is not a possible element count")
    return dtype, int(shape[0]), offset, size


def _is_shape(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= MAX_RANK
        and all(type(d) is int and 0 <= d < 1 << 63 for d in value)
    )


class GPT1Release:
    """A GPT-1 ``model/`` folder. Opening reads ``params_shapes.json`` and the ten .npy headers
    (``weights=False``: ``params_shapes.json`` alone, for ``--inspect``)."""

    kind: ReleaseKind = "gpt1"

    def __init__(self, source_dir: str | Path, n_head: int | None = None, *, weights: bool = True):
        self.source_dir = Path(source_dir)
        self.root = Path(os.path.realpath(self.source_dir))
        self.weights = weights
        shapes_path = self._file("params_shapes.json")
        shapes = _read_json(shapes_path)
        if not isinstance(shapes, list) or not all(_is_shape(s) for s in shapes):
            raise ConversionError(
                f"{shapes_path}: expected a list of shapes (lists of non-negative integers, below 2**63, "
                f"at most {MAX_RANK} of them)"
            )
        if len(shapes) < 2 or (len(shapes) - 2) % len(GPT1_LAYER_MAP):
            raise ConversionError(
                f"{shapes_path} lists {len(shapes)} parameters; GPT-1 has 2 embeddings plus "
                f"{len(GPT1_LAYER_MAP)} per layer"
            )
        self.shapes = [tuple(s) for s in shapes]
        self.n_layer = (len(shapes) - 2) // len(GPT1_LAYER_MAP)
        if len(self.shapes[0]) != 2:
            raise ConversionError(f"{shapes_path}: the first entry (positions) must be 2-D, got {shapes[0]}")
        if len(self.shapes[1]) != 2:
            raise ConversionError(f"{shapes_path}: the second entry (tokens) must be 2-D, got {shapes[1]}")
        self.n_positions, self.n_embd = self.shapes[0]
        self.n_vocab = self.shapes[1][0]
        sizes = {"n_ctx": self.n_positions, "n_embd": self.n_embd, "n_vocab": self.n_vocab}
        _check_sizes({**sizes, "n_layer": self.n_layer}, f"{shapes_path} (from its shapes)")
        # train.py hard-codes n_head=12 (its --n_head default); a release's files do not record it.
        self.n_head = 12 if n_head is None else n_head
        if self.n_head <= 0 or self.n_embd % self.n_head:
            raise ConversionError(
                f"GPT-1 n_head {self.n_head} does not divide n_embd {self.n_embd} (from {shapes_path}); "
                "pass the right n_head (--n-head)"
            )
        self.sizes = [math.prod(s) for s in self.shapes]  # Python ints: no overflow
        self.offsets = list(itertools.accumulate(self.sizes, initial=0))
        self.order = gpt1_order(self.n_layer)
        self.index = {src: i for i, (src, _, _) in enumerate(self.order)}
        self.shards: list[_NpyShard] = []
        self.starts = [0]
        if weights:
            self._open_shards(shapes_path)

    def _open_shards(self, shapes_path: Path) -> None:
        for path in self.source_dir.iterdir():
            if _GPT1_SHARD.fullmatch(path.name) and path.name not in GPT1_FILES:
                raise ConversionError(f"extra file {path}: GPT-1 releases have params_0.npy ... params_9.npy")
        for i in range(10):
            path = self._file(f"params_{i}.npy")
            dtype, length, offset, size = _npy_header(path)
            if dtype != np.float32:
                raise ConversionError(f"{path}: unsupported dtype {dtype}; the release stores float32")
            promised = offset + length * dtype.itemsize
            # Exactly: the shards carry no checksum, so a byte inserted anywhere would shift every value
            # after it, and only the file's size can tell.
            if size < promised:
                raise CorruptCheckpointError(
                    f"{path} is truncated: {size} bytes, its header promises {promised}"
                )
            if size > promised:
                raise CorruptCheckpointError(
                    f"{path} has {size} bytes, {size - promised} more than its header promises ({promised}): "
                    "bytes were added to it"
                )
            self.shards.append(_NpyShard(path, dtype, length, offset))
        self.starts = list(itertools.accumulate((s.length for s in self.shards), initial=0))
        total, needed = self.starts[-1], self.offsets[-1]
        if total != needed:
            raise ConversionError(
                f"params_0.npy ... params_9.npy hold {total} values in all, but {shapes_path} needs {needed}"
            )

    def _file(self, name: str) -> Path:
        path = self.source_dir / name
        check_source_file(self.root, path)
        return path

    def tensors(self) -> list[SourceTensor]:
        return [
            SourceTensor(src, "float32", shape)
            for (src, _, _), shape in zip(self.order, self.shapes, strict=True)
        ]

    def mapping(self) -> list[tuple[str, str, Op]]:
        return list(self.order)

    def files(self) -> list[Path]:
        """Every file a conversion reads, in the order it reads them."""
        names = ("params_shapes.json", *(f"params_{i}.npy" for i in range(10)), *GPT1_FILES[-2:])
        return [self.source_dir / name for name in names]

    def tensors_in(self, file_name: str) -> list[str]:
        """The tensors with values in the release file ``file_name`` (a shard ``params_{i}.npy``), in order.

        The shards hold the flattened parameters end to end, so a tensor may span two shards."""
        names = [s.path.name for s in self.shards]
        if file_name not in names:
            return []
        shard = names.index(file_name)
        lo, hi = self.starts[shard], self.starts[shard + 1]
        return [
            src
            for i, (src, _, _) in enumerate(self.order)
            if self.offsets[i] < hi and self.offsets[i + 1] > lo
        ]

    def _pieces(self, name: str) -> Iterator[tuple[_NpyShard, int, int]]:
        """(shard, first element, end element) ranges that make up tensor ``name``."""
        i = self.index[name]
        begin, end = self.offsets[i], self.offsets[i + 1]
        for shard, start in zip(self.shards, self.starts[:-1], strict=True):
            lo, hi = max(begin, start), min(end, start + shard.length)
            if lo < hi:
                yield shard, lo - start, hi - start

    def get(self, name: str) -> np.ndarray:
        """The parameter as train.py sees it after `np.split(np.concatenate(shards), offsets)`."""
        if not self.weights:
            raise ConversionError(f"{self.source_dir} was opened without its shards (weights=False)")
        arrays = []
        for shard, lo, hi in self._pieces(name):
            if shard.mapped is None:
                check_source_file(self.root, shard.path)
                fd = open_regular_file(shard.path)
                try:
                    shard.mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                finally:
                    os.close(fd)  # the map keeps its own reference
            arrays.append(np.frombuffer(shard.mapped, shard.dtype, hi - lo, shard.data_offset + lo * 4))
        if not arrays:  # a parameter of no values
            return np.empty(self.shapes[self.index[name]], np.float32)
        flat = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        return flat.reshape(self.shapes[self.index[name]])

    def release(self, name: str) -> None:
        for shard, lo, hi in self._pieces(name):
            if shard.mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
                start = shard.data_offset + lo * 4
                page = start - start % mmap.PAGESIZE
                shard.mapped.madvise(mmap.MADV_DONTNEED, page, shard.data_offset + hi * 4 - page)

    def close(self) -> None:
        for shard in self.shards:
            if shard.mapped is not None:
                # Arrays from get() may still view the map; then it unmaps when they are freed.
                with contextlib.suppress(BufferError):
                    shard.mapped.close()
                shard.mapped = None

    def config_fields(self) -> tuple[str, dict[str, Any]]:
        return "openai-gpt", dict(
            vocab_size=self.n_vocab,
            n_positions=self.n_positions,
            n_embd=self.n_embd,
            n_head=self.n_head,
            n_layer=self.n_layer,
        )


Release = GPT2Release | GPT1Release


def open_release(source_dir: str | Path, *, n_head: int | None = None, weights: bool = True) -> Release:
    """Open whichever release ``source_dir`` holds (``n_head`` only matters for GPT-1, see GPT1Release).

    ``weights=False`` opens it from the files that describe its tensors alone (no weights, vocabulary or
    GPT-2 ``checkpoint`` needed): enough to plan a conversion, not to run one.
    """
    if n_head is not None and (not isinstance(n_head, int) or n_head <= 0):
        raise InvalidOptionError(f"n_head must be a positive integer, not {n_head!r}")
    kind = detect_release(source_dir, weights=weights)
    if kind == "gpt2":
        if n_head is not None:
            raise InvalidOptionError("n_head comes from hparams.json for GPT-2 releases; do not pass it")
        return GPT2Release(source_dir, weights=weights)
    return GPT1Release(source_dir, n_head=n_head, weights=weights)


# --- the conversion plan ----------------------------------------------------------------------------------


@dataclass
class MappedTensor:
    """One parameter of the output and where it comes from."""

    source: str
    source_dtype: str
    source_shape: tuple[int, ...]
    target: str
    shape: tuple[int, ...]
    op: Op
    extra_rows: np.ndarray | None = field(default=None, repr=False)  # GPT-1 fine-tuning embeddings


def _expected_shapes(config: Any, fmt: Literal["hfgpt", "transformers"]) -> dict[str, tuple[int, ...]]:
    """Every stored parameter of the output model with its shape, from the model itself on `meta`."""
    import torch

    with torch.device("meta"):
        model = _model_for(config, fmt)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    shapes = {}
    for name, tensor in model.state_dict().items():
        if name in tied or name == "lm_head.weight":  # tied to wte, not stored
            continue
        shapes[name] = tuple(tensor.shape)
    return shapes


def _release_shapes(config: Any, fmt: str, kind: ReleaseKind) -> dict[str, tuple[int, ...]]:
    """The same table as :func:`_expected_shapes`, worked out from the config's sizes without a model.

    It is checked against the release first, so hyper-parameters that disagree with the release's tensors
    (a hostile ``n_layer`` of 10**6 in hparams.json, say) are refused before a model of that size is built.
    """
    e, inner = config.n_embd, getattr(config, "n_inner", None) or 4 * config.n_embd
    shapes = {
        "transformer.wte.weight": (config.vocab_size, e),
        "transformer.wpe.weight": (config.n_positions, e),
    }
    layer = {
        "ln_1.weight": (e,),
        "ln_1.bias": (e,),
        "attn.c_attn.weight": (e, 3 * e),
        "attn.c_attn.bias": (3 * e,),
        "attn.c_proj.weight": (e, e),
        "attn.c_proj.bias": (e,),
        "ln_2.weight": (e,),
        "ln_2.bias": (e,),
        "mlp.c_fc.weight": (e, inner),
        "mlp.c_fc.bias": (inner,),
        "mlp.c_proj.weight": (inner, e),
        "mlp.c_proj.bias": (e,),
    }
    for i in range(config.n_layer):
        shapes.update({f"transformer.h.{i}.{name}": shape for name, shape in layer.items()})
    if kind == "gpt2":  # pre-norm blocks and a final layer norm; GPT-1's post-norm blocks have none
        shapes.update({"transformer.ln_f.weight": (e,), "transformer.ln_f.bias": (e,)})
    return {_target_name(name, fmt, kind): shape for name, shape in shapes.items()}


def _model_for(config: Any, fmt: str) -> Any:
    if fmt == "hfgpt":
        from hfgpt.modeling import GPTForCausalLM

        return GPTForCausalLM(config)
    from transformers import GPT2LMHeadModel, OpenAIGPTLMHeadModel

    return (GPT2LMHeadModel if config.model_type == "gpt2" else OpenAIGPTLMHeadModel)(config)


def build_config(
    release: Release,
    *,
    fmt: Literal["hfgpt", "transformers"] = "hfgpt",
    add_finetune_tokens: bool = False,
    dtype: DType = "float32",
) -> Any:
    """The config of the converted model: the release's preset with the released hyper-parameters."""
    try:
        return _build_config(release, fmt, add_finetune_tokens, dtype)
    # GPTConfig validates sizes (e.g. n_head divides n_embd) through huggingface_hub's strict dataclasses.
    except (ValueError, TypeError, StrictDataclassError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        source = "hparams.json" if release.kind == "gpt2" else "params_shapes.json"
        reason = exc.__cause__ if isinstance(exc, StrictDataclassError) and exc.__cause__ else exc
        raise ConversionError(
            f"the hyper-parameters from {release.source_dir / source} are invalid: {reason}"
        ) from exc


def _build_config(release: Release, fmt: str, add_finetune_tokens: bool, dtype: str) -> Any:
    from hfgpt.modeling import GPTConfig

    preset, fields = release.config_fields()
    if add_finetune_tokens:
        fields["vocab_size"] += len(FINETUNE_TOKENS)
        if fmt == "hfgpt":
            fields["classify_token_id"] = fields["vocab_size"] - 1
    config = GPTConfig.from_preset(preset, **fields)
    if fmt == "hfgpt":
        config.architectures = ["GPTForCausalLM"]
    else:
        # The same model as transformers' own GPT2Config / OpenAIGPTConfig (hfgpt.modeling.interop).
        from hfgpt.modeling.interop import to_transformers_config

        config = to_transformers_config(config)
        config.architectures = ["GPT2LMHeadModel" if release.kind == "gpt2" else "OpenAIGPTLMHeadModel"]
    config.dtype = dtype
    return config


def plan_conversion(
    release: Release,
    config: Any,
    *,
    fmt: Literal["hfgpt", "transformers"] = "hfgpt",
    add_finetune_tokens: bool = False,
    seed: int = 42,
) -> list[MappedTensor]:
    """Map every source tensor to a parameter, checking names and shapes against the model.

    Raises ConversionError naming the key when a source tensor is unused, a parameter unfilled, or a
    shape disagrees with the hyper-parameters.
    """
    if add_finetune_tokens and release.kind != "gpt1":
        raise InvalidOptionError("--add-finetune-tokens applies to GPT-1 releases only")
    if add_finetune_tokens and not (isinstance(seed, int) and 0 <= seed < 2**32):
        raise InvalidOptionError(f"seed must be an integer in 0..2**32-1 (numpy's RandomState), not {seed!r}")
    # First against the shapes the config's sizes imply, before any model is built; then against the
    # model itself (on `meta`), which is the authority on what it stores.
    _plan(release, _release_shapes(config, fmt, release.kind), fmt, add_finetune_tokens, seed)
    return _plan(release, _expected_shapes(config, fmt), fmt, add_finetune_tokens, seed)


def _plan(
    release: Release,
    expected: dict[str, tuple[int, ...]],
    fmt: Literal["hfgpt", "transformers"],
    add_finetune_tokens: bool,
    seed: int,
) -> list[MappedTensor]:
    sources = {t.name: t for t in release.tensors()}
    hparams_file = "hparams.json" if release.kind == "gpt2" else "params_shapes.json"
    plan, filled = [], {}
    for source, target, op in release.mapping():
        target = _target_name(target, fmt, release.kind)
        if target not in expected:
            raise ConversionError(
                f"tensor {source!r} maps to {target!r}, which the model (from {hparams_file}) does not have"
            )
        if target in filled:
            raise ConversionError(f"tensors {filled[target]!r} and {source!r} both map to {target!r}")
        info = sources[source]
        shape = op.forward_shape(info.shape)
        extra = None
        if add_finetune_tokens and target == _embedding_name(fmt, release.kind) and shape is not None:
            # train.py: `(np.random.randn(n_special, n_embd) * 0.02).astype(np.float32)` after the tokens.
            rng = np.random.RandomState(seed)
            extra = (rng.randn(len(FINETUNE_TOKENS), shape[1]) * 0.02).astype(np.float32)
            shape = (shape[0] + len(FINETUNE_TOKENS), shape[1])
        if shape != expected[target]:
            wanted = op.reverse_shape(expected[target])
            if extra is not None:  # the release holds the rows before the fine-tuning tokens
                wanted = (wanted[0] - len(FINETUNE_TOKENS), *wanted[1:])
            raise ConversionError(
                f"tensor {source!r} has shape {list(info.shape)}, but {hparams_file} implies "
                f"{list(wanted)} (for {target!r}, shape {list(expected[target])})"
            )
        if info.dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise ConversionError(
                f"tensor {source!r} has dtype {info.dtype}; expected floating-point weights"
            )
        filled[target] = source
        plan.append(MappedTensor(source, info.dtype, info.shape, target, shape, op, extra))
    missing = sorted(set(expected) - set(filled))
    if missing:
        raise ConversionError(
            f"parameter {missing[0]!r} has no source tensor in the release"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return plan


def _target_name(name: str, fmt: str, kind: str) -> str:
    """The parameter name in the output format: transformers' OpenAIGPT* name GPT-1's two embeddings
    differently (the same renames hfgpt applies when loading their checkpoints)."""
    if fmt == "transformers" and kind == "gpt1":
        from .modeling_hfgpt import OPENAI_GPT_RENAMES

        for theirs, ours in OPENAI_GPT_RENAMES.items():
            name = name.replace(ours, theirs)
    return name


def _embedding_name(fmt: str, kind: str) -> str:
    return _target_name("transformer.wte.weight", fmt, kind)


def inspect_release(source_dir: str | Path, *, n_head: int | None = None) -> list[MappedTensor]:
    """Every tensor of the release with the parameter it maps to, from the index alone (no weights).

    Needs only GPT-2's ``model.ckpt.index`` and ``hparams.json`` (or GPT-1's ``params_shapes.json``), so a
    release can be looked into before its data shards are downloaded.
    """
    release = open_release(source_dir, n_head=n_head, weights=False)
    try:
        return plan_conversion(release, build_config(release))
    finally:
        release.close()


# --- safetensors, written as a stream ---------------------------------------------------------------------

_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def parse_size(size: int | str) -> int:
    """Bytes in a size such as "5GB", "500MB", "2GiB" or 1000 (GB/MB/KB decimal, as transformers' max_shard_size)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, re.I)
    if match is None:
        raise InvalidOptionError(f"cannot read size {size!r}; write e.g. 5GB or 500MB")
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    return int(float(match.group(1)) * units[(match.group(2) or "B").upper()])


def _cast(array: np.ndarray, dtype: DType) -> np.ndarray:
    """The contiguous little-endian bytes of ``array`` in ``dtype`` (bfloat16 as its int16 bit pattern)."""
    if dtype == "bfloat16":
        import torch  # numpy has no bfloat16; torch rounds to nearest even

        tensor = torch.from_numpy(np.array(array, dtype=np.float32)).to(torch.bfloat16)  # a writable copy
        return tensor.view(torch.int16).numpy()
    return np.ascontiguousarray(array, dtype=dtype)


def _source_array(release: Release, item: MappedTensor) -> np.ndarray:
    array = release.get(item.source)
    if item.source_dtype == "bfloat16":
        import torch

        array = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    array = item.op.forward(array)
    if item.extra_rows is not None:
        array = np.concatenate([array, item.extra_rows.astype(array.dtype)])
    return array


def write_safetensors_shards(
    out_dir: Path,
    plan: list[MappedTensor],
    fetch: Callable[[MappedTensor], np.ndarray],
    after: Callable[[MappedTensor], None],
    *,
    dtype: DType,
    max_shard_size: int,
) -> list[str]:
    """Stream ``plan`` into ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` + index.

    Each file is the safetensors layout (8-byte header length, JSON header, raw little-endian bytes);
    only one tensor is held in memory at a time. Returns the file names written.
    """
    itemsize = _ITEMSIZE[dtype]
    groups: list[list[MappedTensor]] = [[]]
    size = 0
    for item in plan:
        nbytes = int(np.prod(item.shape, dtype=np.int64)) * itemsize
        if groups[-1] and size + nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    weight_map, total = {}, 0
    for name, group in zip(names, groups, strict=True):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for item in group:
            nbytes = int(np.prod(item.shape, dtype=np.int64)) * itemsize
            header[item.target] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(item.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            weight_map[item.target] = name
        total += offset
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned (safetensors spec)
        with open(out_dir / name, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for item in group:
                data = _cast(fetch(item), dtype)
                f.write(memoryview(data).cast("B") if data.size else b"")
                del data
                after(item)
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


# --- tokenizer, model card, the whole conversion ----------------------------------------------------------


def _vocabulary_files(release: Release) -> tuple[Path, Path]:
    names = (
        ("encoder.json", "vocab.bpe")
        if release.kind == "gpt2"
        else ("encoder_bpe_40000.json", "vocab_40000.bpe")
    )
    return release.source_dir / names[0], release.source_dir / names[1]


def _byte_symbols() -> list[str]:
    """GPT-2's 256 byte symbols (openai/gpt-2 encoder.py ``bytes_to_unicode``): printable bytes stand for
    themselves, the others for the characters from U+0100 on."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


# How each release lays out its vocabulary: the ids of its base symbols, then one token per line of its
# merges file in order (a BPE merge makes the token its two symbols join into), then the rest.
#   GPT-2 encoder.json: ids 0..255 the 256 byte symbols, 256.. the merges, last "<|endoftext|>".
#   GPT-1 encoder_bpe_40000.json: id 0 "<unk>", 1..238 characters and 239..476 the same characters ending
#   a word ("c</w>"), 477.. the merges, last "\n</w>": 40,478 tokens for the 40,000 merges of
#   vocab_40000.bpe (finetune-transformer-lm's text_utils.py reads its lines 2..40,001).
_GPT1_CHARACTERS = 238
_FIRST_MERGE_ID = {"gpt2": 256, "gpt1": 1 + 2 * _GPT1_CHARACTERS}
_TOKENS_BESIDE_MERGES = {"gpt2": 256 + 1, "gpt1": 1 + 2 * _GPT1_CHARACTERS + 1}


def _check_vocabulary(release: Release, rows: int) -> None:
    """The vocabulary files must be the release's formats, for an embedding of ``rows`` token rows.

    The encoder gives each row one token, ids 0 .. rows-1, as the original code assumes (GPT-2's
    ``n_vocab``; GPT-1's train.py sets ``n_vocab = len(text_encoder.encoder)``). The merges file is a
    ``#version`` line, then exactly one line per merge token of the encoder, each two symbols and a
    space, ending in a newline: merge ``i`` joins symbols the encoder already has into the token of id
    ``first merge id + i``. So a truncated file, a deleted, moved or altered line, or a file from
    elsewhere (``/etc/shadow``) is refused before anything is written.
    """
    vocab, merges = _vocabulary_files(release)
    for path in (vocab, merges):
        check_source_file(release.root, path)
    encoder = _read_json(vocab, VOCABULARY_FILE_LIMIT)
    if not isinstance(encoder, dict) or not all(type(i) is int for i in encoder.values()):
        raise ConversionError(f"{vocab}: expected a JSON object mapping each token to its integer id")
    ids = set(encoder.values())
    if len(encoder) != rows or len(ids) != len(encoder) or not all(0 <= i < rows for i in ids):
        source = "hparams.json's n_vocab" if release.kind == "gpt2" else "params_shapes.json"
        span = f"ids {min(ids)}..{max(ids)}" if ids else "no ids"
        raise ConversionError(
            f"{vocab} has {len(encoder)} tokens ({span}), but the embedding has {rows} rows ({source}): "
            f"the ids must be 0..{rows - 1}, each once"
        )
    token_of = {i: token for token, i in encoder.items()}
    both = f"cannot build the tokenizer from {vocab} and {merges}"
    first_merge = _FIRST_MERGE_ID[release.kind]
    wanted = len(encoder) - _TOKENS_BESIDE_MERGES[release.kind]
    if wanted < 0:
        raise ConversionError(f"{both}: {vocab.name} has only {len(encoder)} tokens, too few for the release")

    def base_token(i: int, expected: str, what: str) -> None:
        if token_of[i] != expected:
            raise ConversionError(f"{both}: {vocab.name} gives id {i} to {token_of[i]!r}; {what}")

    if release.kind == "gpt2":
        if sorted(token_of[i] for i in range(256)) != sorted(_byte_symbols()):
            raise ConversionError(f"{both}: ids 0..255 of {vocab.name} are not the 256 byte symbols")
        base_token(len(encoder) - 1, "<|endoftext|>", "the release's last token is '<|endoftext|>'")
        layout = "256 bytes + one token per merge + <|endoftext|>"
    else:
        base_token(0, "<unk>", "the release's token 0 is '<unk>'")
        for i in range(1, 1 + _GPT1_CHARACTERS):
            if len(token_of[i]) != 1:
                raise ConversionError(
                    f"{both}: {vocab.name} gives id {i} to {token_of[i]!r}; ids 1..{_GPT1_CHARACTERS} are "
                    "single characters in the release"
                )
            base_token(
                i + _GPT1_CHARACTERS, token_of[i] + "</w>", f"the release has {token_of[i] + '</w>'!r}"
            )
        base_token(len(encoder) - 1, "\n</w>", "the release's last token is '\\n</w>'")
        layout = f"<unk> + {2 * _GPT1_CHARACTERS} symbols + one token per merge + '\\n</w>'"
    try:
        text = read_regular_file(merges, VOCABULARY_FILE_LIMIT).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConversionError(f"{merges} is not UTF-8 text: {exc}") from exc
    lines = text.split("\n")  # as the original code reads it: the lines between the first and the end
    if not lines[0].startswith("#version"):
        raise ConversionError(f"{both}: the first line of {merges.name} must be its '#version: ...' header")
    count = len(lines) - 2
    if count != wanted:
        raise ConversionError(
            f"{merges} has {count} merges; {vocab}'s {len(encoder)} tokens need {wanted} ({layout})"
        )
    if lines[-1]:
        raise ConversionError(f"{both}: {merges.name} does not end with a newline (truncated?)")
    for i, line in enumerate(lines[1:-1]):
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ConversionError(
                f"{both}: line {i + 2} of {merges.name} is {line[:60]!r}, not a merge (two symbols and a space)"
            )
        made = first_merge + i
        if parts[0] + parts[1] != token_of[made]:
            raise ConversionError(
                f"{both}: line {i + 2} of {merges.name} joins {line!r} into {parts[0] + parts[1]!r}, but merge "
                f"{i + 1} makes the token of id {made}, {token_of[made]!r}: the files do not belong together"
            )
        for part in parts:  # a base symbol or the token of an earlier merge
            if not (release.kind == "gpt1" and encoder.get(part) == 0) and encoder.get(part, made) < made:
                continue
            raise ConversionError(
                f"{both}: line {i + 2} of {merges.name} joins {part!r}, which is neither a symbol of "
                f"{vocab.name} nor made by an earlier merge"
            )


def _load_tokenizer(release: Release, fmt: str, add_finetune_tokens: bool, rows: int) -> Any:
    """The tokenizer of the release, built from its own vocabulary files and checked against the weights.

    hfgpt format: hfgpt's tokenizers (GPT-1's reproduces the original ftfy + spaCy pipeline).
    transformers format: transformers' GPT2Tokenizer / OpenAIGPTTokenizer, so plain transformers loads it.
    ``rows``: the token rows of the release's embedding, before any fine-tuning tokens.
    """
    _check_vocabulary(release, rows)
    vocab, merges = _vocabulary_files(release)
    try:
        if fmt == "hfgpt" and release.kind == "gpt2":
            from hfgpt.tokenization import GPT2Tokenizer

            tokenizer = GPT2Tokenizer(vocab=str(vocab), merges=str(merges))
        elif fmt == "hfgpt":
            from hfgpt.tokenization import GPT1Tokenizer

            # The tokenizer adds the fine-tuning tokens itself, with the original's ids.
            tokenizer = GPT1Tokenizer(
                vocab_file=vocab, merges_file=merges, add_finetune_tokens=add_finetune_tokens
            )
        elif release.kind == "gpt2":
            from transformers import GPT2Tokenizer as HFGPT2Tokenizer

            tokenizer = HFGPT2Tokenizer(vocab=str(vocab), merges=str(merges))
        else:
            from transformers import OpenAIGPTTokenizer

            tokenizer = OpenAIGPTTokenizer(vocab=str(vocab), merges=str(merges))
            if add_finetune_tokens:
                tokenizer.add_special_tokens({"additional_special_tokens": list(FINETUNE_TOKENS)})
    except ImportError:
        raise
    except Exception as exc:  # the tokenizer libraries' own complaints about the files
        raise ConversionError(f"cannot build the tokenizer from {vocab} and {merges}: {exc}") from exc
    if add_finetune_tokens:  # they must take the rows the weights give them: right after the vocabulary
        ids = tokenizer.convert_tokens_to_ids(list(FINETUNE_TOKENS))
        if ids != list(range(rows, rows + len(FINETUNE_TOKENS))):
            raise ConversionError(
                f"fine-tuning tokens got ids {ids}; the weights give them rows {rows}..{rows + 2}"
            )
    return tokenizer


# --- SHA-256 of the files read -----------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    """The SHA-256 of a regular file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with os.fdopen(open_regular_file(path), "rb") as f:
        while piece := f.read(1 << 20):
            digest.update(piece)
    return digest.hexdigest()


def parse_sha256_list(text: str, source: str = "the SHA-256 list") -> dict[str, str]:
    """File name -> SHA-256 from ``sha256sum`` output (``<64 hex digits>  <name>``, ``*<name>`` in binary
    mode). Only a name's last component counts (``models/124M/vocab.bpe`` lists ``vocab.bpe``); blank
    lines and lines starting with ``#`` are skipped. Raises InvalidOptionError for any other line."""
    listed: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"([0-9a-fA-F]{64}) [ *](.+)", line.rstrip("\r"))
        if match is None:
            raise InvalidOptionError(
                f"{source}, line {number}: expected '<sha256>  <file name>', got {line[:80]!r}"
            )
        name = match.group(2).replace("\\", "/").rsplit("/", 1)[-1]
        if listed.get(name, match.group(1).lower()) != match.group(1).lower():
            raise InvalidOptionError(f"{source} lists {name} twice, with different digests")
        listed[name] = match.group(1).lower()
    return listed


def _check_sha256(release: Release, digests: Mapping[str, str], expected: Mapping[str, str]) -> None:
    """Every file of the release that ``expected`` lists must have its digest there; a difference names
    the file and the tensors it holds (GPT-1's shards carry no checksum of their own: this is their check)."""
    checked = [name for name in digests if name in expected]
    if not checked:
        raise InvalidOptionError(
            f"the SHA-256 list names none of the files of {release.source_dir} ({', '.join(digests)})"
        )
    for name in checked:
        if digests[name] != expected[name]:
            tensors = release.tensors_in(name)
            held = (
                f"; it holds {len(tensors)} tensor(s): {', '.join(tensors)}"
                if tensors
                else " (it holds no weights)"
            )
            raise CorruptCheckpointError(
                f"{release.source_dir / name} has SHA-256 {digests[name]}, but the list gives "
                f"{expected[name]}: the file differs from the published one{held}"
            )


def _write_model_card(release: Release, out_dir: Path, config: Any) -> None:
    from hfgpt.model_cards import render_model_card

    preset, _ = release.config_fields()  # the card of the release this is (tiny test releases: "gpt2")
    # The folder's name only: a full local path would publish the converter's home directory on the Hub.
    source = release.source_dir.resolve().name
    render_model_card(preset, config=config, source=source).save(out_dir / "README.md")


def _check_output(output_dir: Path) -> None:
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        what = "a model" if (output_dir / "config.json").exists() else "files"
        raise OutputExistsError(
            f"output folder {output_dir} already holds {what}; choose an empty or new folder"
        )


def _make_temporary_folder(output_dir: Path) -> Path:
    """A new folder beside ``output_dir`` with the permissions a plain mkdir gives (tempfile.mkdtemp's are
    0700, which the finished model would keep after the rename)."""
    for _ in range(100):
        tmp = output_dir.parent / f".{output_dir.name}.tmp-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a temporary folder beside {output_dir}")


def convert_release(
    source_dir: str | Path,
    output_dir: str | Path,
    *,
    dtype: DType = "float32",
    fmt: Literal["hfgpt", "transformers"] = "hfgpt",
    add_finetune_tokens: bool = False,
    seed: int = 42,
    n_head: int | None = None,
    max_shard_size: int | str = "5GB",
    tokenizer: bool = True,
    model_card: bool = True,
    expected_sha256: Mapping[str, str] | None = None,
    sha256: dict[str, str] | None = None,
) -> Path:
    """Convert an OpenAI release folder into a complete checkpoint in ``output_dir``; returns its path.

    Everything is written to a temporary folder beside ``output_dir`` and moved into place at the end,
    so a failure leaves no half-written output. Raises a ``CheckpointError`` subclass on bad input.

    ``sha256``: a dict this fills with the SHA-256 of every release file read (by file name), for
    comparison with a published list. ``expected_sha256``: such a list (see :func:`parse_sha256_list`);
    a listed file with another digest is refused before anything is written, naming the tensors it holds.
    """
    if dtype not in _SAFETENSORS_DTYPES:
        raise InvalidOptionError(f"unsupported dtype {dtype!r}; choose float32, float16 or bfloat16")
    if fmt not in ("hfgpt", "transformers"):
        raise InvalidOptionError(f"unsupported format {fmt!r}; choose hfgpt or transformers")
    output_dir = Path(output_dir)
    if output_dir.is_symlink():  # write into the folder it names (replacing the link would lose it)
        output_dir = output_dir.resolve()
    _check_output(output_dir)
    max_shard = parse_size(max_shard_size)
    release = open_release(source_dir, n_head=n_head)
    try:
        if sha256 is not None or expected_sha256 is not None:
            digests = {}
            for path in release.files():
                check_source_file(release.root, path)
                digests[path.name] = file_sha256(path)
            if expected_sha256 is not None:
                _check_sha256(release, digests, expected_sha256)
            if sha256 is not None:
                sha256.update(digests)
        config = build_config(release, fmt=fmt, add_finetune_tokens=add_finetune_tokens, dtype=dtype)
        plan = plan_conversion(release, config, fmt=fmt, add_finetune_tokens=add_finetune_tokens, seed=seed)
        rows = config.vocab_size - (len(FINETUNE_TOKENS) if add_finetune_tokens else 0)
        # Checked before any weight is written: a bad vocabulary costs nothing.
        release_tokenizer = _load_tokenizer(release, fmt, add_finetune_tokens, rows) if tokenizer else None
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = _make_temporary_folder(output_dir)
        try:
            write_safetensors_shards(
                tmp,
                plan,
                lambda item: _source_array(release, item),
                lambda item: release.release(item.source),
                dtype=dtype,
                max_shard_size=max_shard,
            )
            if fmt == "hfgpt":
                # auto_map for every head and the code files, for trust_remote_code users.
                from .modeling_hfgpt import copy_remote_code, record_every_head

                record_every_head(config)
                copy_remote_code(tmp)
            config.save_pretrained(tmp)
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(config).save_pretrained(tmp)
            if release_tokenizer is not None:
                release_tokenizer.save_pretrained(tmp)
            if model_card:
                _write_model_card(release, tmp, config)
            _check_output(output_dir)
            if output_dir.exists():
                output_dir.rmdir()  # empty, checked just above
            os.replace(tmp, output_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        release.close()
    return output_dir


# --- building releases from a state dict (tests, benchmarks) ----------------------------------------------


def _reverse_gpt2() -> dict[str, tuple[str, Op]]:
    return {target: (source, op) for source, (target, op) in GPT2_WEIGHT_MAP.items()}


def write_gpt2_release(
    state_dict: Mapping[str, np.ndarray],
    output_dir: str | Path,
    hparams: Mapping[str, int],
    *,
    vocab_dir: str | Path | None = None,
    **writer_options: Any,
) -> Path:
    """Write a GPT-2 release folder from a parameter state dict, through the reverse of GPT2_WEIGHT_MAP.

    ``vocab_dir`` provides ``encoder.json`` / ``vocab.bpe`` to copy; ``writer_options`` go to
    :class:`~hfgpt.modeling.tf_bundle.TensorBundleWriter` (shards, compression).
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    reverse = _reverse_gpt2()
    tensors = {}
    for target, array in state_dict.items():
        if target == "lm_head.weight":  # tied to wte; the release stores it once
            continue
        for template, (source, op) in reverse.items():
            layer = (
                _layer_index(template, target) if "{}" in template else (0 if template == target else None)
            )
            if layer is not None:
                tensors[source.format(layer)] = op.reverse(np.asarray(array))
                break
        else:
            raise ConversionError(f"parameter {target!r} has no GPT-2 release name")
    TensorBundleWriter(output_dir / "model.ckpt", **writer_options).write(tensors)
    (output_dir / "checkpoint").write_text(
        'model_checkpoint_path: "model.ckpt"\nall_model_checkpoint_paths: "model.ckpt"\n'
    )
    (output_dir / "hparams.json").write_text(json.dumps(dict(hparams)))
    _copy_vocab(vocab_dir, output_dir, ("encoder.json", "vocab.bpe"))
    return output_dir


def write_gpt1_release(
    state_dict: Mapping[str, np.ndarray],
    output_dir: str | Path,
    *,
    vocab_dir: str | Path | None = None,
    num_shards: int = 10,
) -> Path:
    """Write a GPT-1 release folder (params_shapes.json + params_{i}.npy) from a parameter state dict."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    n_layer = 1 + max(int(k.split(".")[2]) for k in state_dict if k.startswith("transformer.h."))
    arrays = [
        op.reverse(np.asarray(state_dict[target], dtype=np.float32)) for _, target, op in gpt1_order(n_layer)
    ]
    (output_dir / "params_shapes.json").write_text(json.dumps([list(a.shape) for a in arrays]))
    flat = np.concatenate([a.ravel() for a in arrays])
    for i, part in enumerate(np.array_split(flat, num_shards)):
        np.save(output_dir / f"params_{i}.npy", part)
    _copy_vocab(vocab_dir, output_dir, ("encoder_bpe_40000.json", "vocab_40000.bpe"))
    return output_dir


def _copy_vocab(vocab_dir: str | Path | None, output_dir: Path, names: tuple[str, ...]) -> None:
    for name in names:
        if vocab_dir is not None:
            shutil.copyfile(Path(vocab_dir) / name, output_dir / name)
        else:
            (output_dir / name).write_text("")
