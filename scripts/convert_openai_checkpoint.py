"""Convert OpenAI's original GPT-1 / GPT-2 release folders into Hugging Face checkpoints, without TensorFlow.

    hfgpt-convert models/124M gpt2-hf                  # GPT-2 release (model.ckpt.*, hparams.json, ...)
    hfgpt-convert finetune-transformer-lm/model gpt1-hf --add-finetune-tokens
    hfgpt-convert models/1558M gpt2-xl-hf --dtype float16 --format transformers
    hfgpt-convert --inspect models/124M                # list tensors and their parameters; loads no weights
    hfgpt-convert model/ gpt1-hf --sha256              # also print the SHA-256 of every file it read

--inspect needs only model.ckpt.index and hparams.json (GPT-1: params_shapes.json), so a release can be
looked into before its data shards are downloaded. The converter reads only regular files of the release
folder: FIFOs and devices are refused, and so is a symbolic link out of the folder (links into the blobs
folder of the Hugging Face cache repo holding the folder are followed). GPT-2's data and index carry
CRC-32C checksums, which are checked; GPT-1's .npy shards carry none, so compare the --sha256 digests with
a published list, or give that list to --check-sha256.

The output folder then loads with `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
(after `import hfgpt.modeling`; with `--format transformers`, with plain transformers).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from hfgpt.modeling.openai_release import (
    CONVERSION_ERRORS,
    SMALL_FILE_LIMIT,
    CheckpointError,
    InvalidOptionError,
    convert_release,
    inspect_release,
    parse_sha256_list,
    parse_size,
)
from hfgpt.modeling.tf_bundle import read_regular_file

__all__ = ["convert_openai_checkpoint", "format_inspection", "main"]


def convert_openai_checkpoint(
    source_dir: str | Path,
    output_dir: str | Path,
    *,
    dtype: Literal["float32", "float16", "bfloat16"] = "float32",
    format: Literal["hfgpt", "transformers"] = "hfgpt",  # noqa: A002 - mirrors the --format option
    add_finetune_tokens: bool = False,
    seed: int = 42,
    n_head: int | None = None,
    max_shard_size: int | str = "5GB",
    push_to_hub: str | None = None,
    expected_sha256: dict[str, str] | None = None,
    sha256: dict[str, str] | None = None,
) -> Path:
    """Convert the release in ``source_dir`` into ``output_dir`` (see :func:`convert_release`).

    ``push_to_hub``: a repo id to upload the finished folder to, through ``hfgpt.scripts.push_to_hub``
    (checked before converting; a refused push raises its ``PushError`` and leaves the folder converted).
    ``expected_sha256`` / ``sha256``: digests to check the release's files against / a dict to fill with
    them (see :func:`convert_release`).
    """
    if push_to_hub:
        from hfgpt.scripts.push_to_hub import PushError, check_repo_id

        try:
            check_repo_id(push_to_hub)
        except PushError as exc:
            raise InvalidOptionError(str(exc)) from exc
    out = convert_release(
        source_dir,
        output_dir,
        dtype=dtype,
        fmt=format,
        add_finetune_tokens=add_finetune_tokens,
        seed=seed,
        n_head=n_head,
        max_shard_size=max_shard_size,
        expected_sha256=expected_sha256,
        sha256=sha256,
    )
    if push_to_hub:
        from hfgpt.scripts.push_to_hub import push_to_hub as push  # imported only when asked for

        push(out, push_to_hub)
    return out


def format_inspection(source_dir: str | Path, n_head: int | None = None) -> str:
    """The --inspect table: every release tensor, its dtype and shape, and the parameter it fills."""
    rows = [("source tensor", "dtype", "shape", "operation", "parameter", "shape")]
    for item in inspect_release(source_dir, n_head=n_head):
        rows.append(
            (
                item.source,
                item.source_dtype,
                str(list(item.source_shape)),
                item.op.name,
                item.target,
                str(list(item.shape)),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _ranged(low: int, high: int | None) -> Callable[[str], int]:
    """An argparse type: an integer in low..high (high None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high if high is not None else ''}")
        return value

    return parse


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except InvalidOptionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def read_sha256_list(path: Path) -> dict[str, str]:
    """The ``sha256sum``-format list in ``path`` (a regular file of at most 1 MiB), for --check-sha256."""
    try:
        text = read_regular_file(path, SMALL_FILE_LIMIT).decode("utf-8")
    except (CheckpointError, UnicodeDecodeError) as exc:
        raise InvalidOptionError(f"--check-sha256: {exc}") from exc
    return parse_sha256_list(text, str(path))


def _stop_on_sigterm(signum: int, frame: object) -> None:
    # Unwinds like Ctrl-C, so the temporary output folder is removed (convert_release's cleanup).
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hfgpt-convert",
        description=__doc__.split("\n\n")[0],
        epilog="exit codes: 0 done, 1 file system error, 2 bad arguments, 3 not a valid release (missing or "
        "extra file, shape or dtype), 4 corrupt data (checksum, truncated file), 5 output folder not empty",
    )
    parser.add_argument(
        "source_dir", type=Path, help="the release folder (GPT-2 models/<size> or GPT-1 model/)"
    )
    parser.add_argument(
        "output_dir", type=Path, nargs="?", help="where to write the checkpoint (new or empty)"
    )
    parser.add_argument(
        "--inspect",
        action="store_true",
        help="list the release's tensors and exit (reads only model.ckpt.index and hparams.json, or GPT-1's "
        "params_shapes.json: the data shards need not be there)",
    )
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument(
        "--format",
        choices=["hfgpt", "transformers"],
        default="hfgpt",
        dest="fmt",
        help="hfgpt models, or transformers' own GPT2LMHeadModel / OpenAIGPTLMHeadModel",
    )
    parser.add_argument(
        "--add-finetune-tokens",
        action="store_true",
        help="GPT-1: add _start_, _delimiter_, _classify_ (ids 40478-40480), rows ~ N(0, 0.02)",
    )
    parser.add_argument(
        "--seed", type=_ranged(0, 2**32 - 1), default=42, help="seed of the fine-tuning token rows"
    )
    parser.add_argument(
        "--n-head",
        type=_ranged(1, None),
        default=None,
        help="GPT-1 only: attention heads (not recorded in the release; train.py uses 12)",
    )
    parser.add_argument(
        "--max-shard-size", type=_size, default="5GB", help="split safetensors above this size (5GB, 500MB)"
    )
    parser.add_argument("--push-to-hub", metavar="REPO_ID", default=None, help="upload the result")
    parser.add_argument(
        "--sha256",
        action="store_true",
        help="after converting, print the SHA-256 of every release file read ('<digest>  <name>', as "
        "sha256sum does), to compare with a published list (GPT-1's shards have no checksums of their own)",
    )
    parser.add_argument(
        "--check-sha256",
        metavar="SUMS",
        type=Path,
        default=None,
        help="a sha256sum-format list of the release's files: refuse (exit 4), before writing anything, a "
        "listed file with another digest, naming the tensors it holds",
    )
    args = parser.parse_args(argv)
    from hfgpt.scripts.push_to_hub import PushError  # no torch, no network: cheap

    # Only the main thread may set a handler (main() can be called from others, e.g. a worker thread).
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm) if in_main_thread else None

    def holds_a_model() -> bool:
        return args.output_dir is not None and (args.output_dir / "config.json").is_file()

    had_a_model = holds_a_model()  # then the conversion refuses the folder (exit 5)
    try:
        if args.inspect:
            print(format_inspection(args.source_dir, n_head=args.n_head))
            return 0
        if args.output_dir is None:
            parser.error("OUTPUT_DIR is required unless --inspect is given")
        expected = read_sha256_list(args.check_sha256) if args.check_sha256 is not None else None
        digests: dict[str, str] | None = {} if args.sha256 else None
        out = convert_openai_checkpoint(
            args.source_dir,
            args.output_dir,
            dtype=args.dtype,
            format=args.fmt,
            add_finetune_tokens=args.add_finetune_tokens,
            seed=args.seed,
            n_head=args.n_head,
            max_shard_size=args.max_shard_size,
            push_to_hub=args.push_to_hub,
            expected_sha256=expected,
            sha256=digests,
        )
    except CONVERSION_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # unreadable source, unwritable destination, full disk: the OS says which file
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except PushError as exc:  # the conversion itself is complete and in place
        print(f"wrote {args.output_dir}", file=sys.stderr)
        print(
            f"error: {exc} (push it again with: hfgpt-push {args.output_dir} {args.push_to_hub})",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        if holds_a_model() and not had_a_model:  # the conversion finished: the push was interrupted
            print(f"interrupted while pushing: {args.output_dir} is converted and complete", file=sys.stderr)
        else:
            print("interrupted: nothing was written", file=sys.stderr)
        return 130
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
    print(f"wrote {out}")
    for name, digest in (digests or {}).items():
        print(f"{digest}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
