"""GPT-2's byte-level BPE tokenizer, built on the `tokenizers` library from OpenAI's released files.

transformers' `GPT2Tokenizer` (a `tokenizers` backend) already splits text with the same regular expression
and byte-to-unicode table as OpenAI's `encoder.py` (openai/gpt-2, src/encoder.py), so it gives the original
ids; this subclass only adds what hfgpt promises on top:

- built with no arguments from the vocabulary shipped with hfgpt (`encoder.json`, `vocab.bpe`);
- `model_max_length` 1024 (GPT-2's context);
- `save_pretrained` also writes the release's `encoder.json` / `vocab.bpe` and the `vocab.json` /
  `merges.txt` pair older transformers versions read, next to `tokenizer.json`. The saved
  `tokenizer_class` is "GPT2Tokenizer", so plain transformers loads the folder with its own class;
- errors where encoder.py raises and the backend does not say why: a lone surrogate in the text is a
  UnicodeEncodeError, decoding an id outside the vocabulary (or labels' -100) a ValueError naming it.

One deliberate difference from OpenAI's encoder, as in every transformers GPT-2 tokenizer: the literal text
"<|endoftext|>" becomes the single special id 50256. Pass `split_special_tokens=True` to encode it as
ordinary text, as OpenAI's encoder does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import GPT2Tokenizer as _TransformersGPT2Tokenizer

SHIPPED_GPT2_DIR = Path(__file__).parent / "data" / "gpt2"
ORIGINAL_FILES_NAMES = {"vocab_file": "encoder.json", "merges_file": "vocab.bpe"}
LEGACY_FILES_NAMES = {"vocab_file": "vocab.json", "merges_file": "merges.txt"}


class GPT2Tokenizer(_TransformersGPT2Tokenizer):
    """GPT-2's tokenizer: `<|endoftext|>` (50256) is the end of text; no pad token unless one is set.

    Args:
        vocab: a vocabulary dict or the path of `encoder.json`/`vocab.json` (or `vocab_file=`).
        merges: a merges list or the path of `vocab.bpe`/`merges.txt` (or `merges_file=`). Give both or
            neither: without them, the released vocabulary and merges.
        padding_side: "right" (default) or "left", the side for batched generation.
        **kwargs: as transformers' `GPT2Tokenizer` (`pad_token`, `add_prefix_space`, ...).
    """

    def __init__(
        self,
        vocab: str | dict[str, int] | None = None,
        merges: str | list[str] | None = None,
        model_max_length: int = 1024,
        **kwargs: Any,
    ) -> None:
        if "tokenizer_object" not in kwargs:
            # transformers' file arguments name the same files; its own class would ignore them here.
            vocab = kwargs.get("vocab_file") if vocab is None else vocab
            merges = kwargs.get("merges_file") if merges is None else merges
            if vocab is None and merges is None:
                vocab = str(SHIPPED_GPT2_DIR / ORIGINAL_FILES_NAMES["vocab_file"])
                merges = str(SHIPPED_GPT2_DIR / ORIGINAL_FILES_NAMES["merges_file"])
            elif vocab is None or merges is None:
                # A vocabulary without merges would tokenize every byte on its own, without an error.
                raise ValueError(
                    "GPT2Tokenizer needs both `vocab` and `merges` (or neither, for the released ones)"
                )
        if isinstance(merges, (list, tuple)):
            # `tokenizers` takes (left, right) pairs; merges.txt / vocab.bpe lines are "left right".
            merges = [tuple(m.split()) if isinstance(m, str) else tuple(m) for m in merges]
        super().__init__(vocab=vocab, merges=merges, model_max_length=model_max_length, **kwargs)

    def _encode_plus(self, text: Any, text_pair: Any = None, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._encode_plus(text, text_pair, *args, **kwargs)
        except TypeError as error:
            # `tokenizers` refuses a str with a lone surrogate with a TypeError about its input types; name the
            # cause as OpenAI's encoder.py does (`text.encode("utf-8")` raises UnicodeEncodeError).
            for piece in _strings(text) + _strings(text_pair):
                try:
                    piece.encode("utf-8")
                except UnicodeEncodeError as unencodable:
                    unencodable.add_note(
                        f"GPT-2 encodes text as UTF-8 bytes, which a lone surrogate has not: {piece!r:.80}"
                    )
                    raise unencodable from error
            raise

    def _decode(self, token_ids: int | list[int], *args: Any, **kwargs: Any) -> str:
        ids = token_ids["input_ids"] if isinstance(token_ids, dict) else token_ids
        ids = [ids] if isinstance(ids, int) else ids
        size = len(self)
        if ids and (min(ids) < 0 or max(ids) >= size):
            # The backend drops ids past the vocabulary without a word and overflows on negative ones (labels'
            # -100); OpenAI's encoder.py raises (KeyError) for both.
            bad = sorted({i for i in ids if not 0 <= i < size})
            raise ValueError(
                f"cannot decode token ids {bad[:5]}: token ids are 0 to {size - 1} "
                "(labels mark ignored positions with -100: replace those before decoding)"
            )
        return super()._decode(token_ids, *args, **kwargs)

    def _save_pretrained(
        self,
        save_directory: str | os.PathLike,
        file_names: tuple[str, ...],
        legacy_format: bool | None = None,
        filename_prefix: str | None = None,
    ) -> tuple[str, ...]:
        file_names = super()._save_pretrained(save_directory, file_names, legacy_format, filename_prefix)
        model = json.loads(self.backend_tokenizer.to_str())["model"]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        prefix = f"{filename_prefix}-" if filename_prefix else ""
        written = []
        for names in (ORIGINAL_FILES_NAMES, LEGACY_FILES_NAMES):
            vocab_path = os.path.join(save_directory, prefix + names["vocab_file"])
            merges_path = os.path.join(save_directory, prefix + names["merges_file"])
            with open(vocab_path, "w", encoding="utf-8") as handle:
                json.dump(model["vocab"], handle, ensure_ascii=False)
            # OpenAI's encoder.py reads `bpe_data.split("\n")[1:-1]`: a header line, one merge a line.
            with open(merges_path, "w", encoding="utf-8") as handle:
                handle.write("#version: 0.2\n" + "".join(m + "\n" for m in merges))
            written += [vocab_path, merges_path]
        return (*file_names, *written)


def _strings(texts: Any) -> list[str]:
    """The strings in a text argument of `__call__` (a str, a batch, words, pairs), flattened."""
    if isinstance(texts, str):
        return [texts]
    if isinstance(texts, (list, tuple)):
        return [piece for item in texts for piece in _strings(item)]
    return []


__all__ = ["GPT2Tokenizer"]
