"""GPT-1's original tokenizer, reproduced exactly, as a transformers tokenizer.

OpenAI's GPT-1 release (openai/finetune-transformer-lm, ``text_utils.py``, class ``TextEncoder``) encodes
a text in five steps, all reproduced here:

1. ``ftfy.fix_text`` repairs mojibake, uncurls quotes and normalises the text;
2. ``text_standardize`` maps dashes/ellipsis/acute accent, pads runs of punctuation with spaces and
   collapses whitespace (each newline run becomes a lone ``\\n`` token);
3. spaCy's English tokenizer splits words (``spacy.blank("en")`` carries the same tokenizer rules as the
   ``en`` model the original loaded with every pipeline component disabled);
4. each spaCy token is lower-cased and split by BPE over ``encoder_bpe_40000.json`` / ``vocab_40000.bpe``,
   its last symbol carrying the ``</w>`` word end;
5. each BPE piece is looked up in the encoder, anything missing becomes id 0 (``<unk>``).

transformers' own ``OpenAIGPTTokenizer`` (v5) replaced steps 1-3 by BERT's basic tokenizer, so it splits
contractions and punctuation differently (``isn't`` -> ``isn ' t`` instead of spaCy's ``is n't``).

This file is self-contained (standard library + transformers; ftfy and spaCy are imported when a tokenizer
is built) because ``save_pretrained`` copies it next to the vocabulary for ``trust_remote_code`` loading.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import re
import sys
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from transformers import AddedToken, BatchEncoding, PreTrainedTokenizer
from transformers.tokenization_utils_base import PaddingStrategy, TruncationStrategy

VOCAB_FILES_NAMES = {"vocab_file": "encoder_bpe_40000.json", "merges_file": "vocab_40000.bpe"}

# The original's fine-tuning tokens, appended after the 40,478-token vocabulary in this order
# (finetune-transformer-lm train.py: encoder['_start_'] = len(encoder), then _delimiter_, _classify_).
FINETUNE_TOKENS: tuple[str, ...] = ("_start_", "_delimiter_", "_classify_")

_INSTALL_HINT = "pip install 'hfgpt[gpt1]'"

# text_standardize's one-for-one character replacements (text_utils.py, applied in this order; none of
# the outputs is an input of a later one, so a table is equivalent).
_STANDARDIZE_REPLACEMENTS: dict[str, str] = {"—": "-", "–": "-", "―": "-", "…": "...", "´": "'"}
# text_standardize's three regular expressions, verbatim from text_utils.py.
_PUNCTUATION_RUN = re.compile(r"""(-+|~+|!+|"+|;+|\?+|\++|,+|\)+|\(+|\\+|\/+|\*+|\[+|\]+|}+|{+|\|+|_+)""")
_NEWLINE_RUN = re.compile(r"\s*\n\s*")
_OTHER_WHITESPACE_RUN = re.compile(r"[^\S\n]+")

_WORD_END = "</w>"
# What the `tokenizers` library counts as a word character around a single_word added token (regex \w).
_JOIN_CONTROLS = "\u200c\u200d"


def _is_word_character(char: str) -> bool:
    """Rust regex's Unicode ``\\w`` (letters, marks, decimal digits, connector punctuation, join controls), which
    the ``tokenizers`` library tests around a single_word token; Python's ``\\w`` differs (it takes ``²``,
    not combining marks)."""
    category = unicodedata.category(char)
    return category[0] in "LM" or category in ("Nd", "Nl", "Pc") or char in _JOIN_CONTROLS


def _is_white_space(char: str) -> bool:
    """Unicode White_Space, Rust's ``char::is_whitespace`` (lstrip/rstrip in ``tokenizers``); Python's
    ``str.isspace`` also takes the separators U+001C..U+001F."""
    return char.isspace() and not "\x1c" <= char <= "\x1f"


class MissingDependencyError(ImportError):
    """ftfy or spaCy, which GPT-1's tokenizer needs, is not installed."""


def _import_gpt1_dependencies() -> tuple[Any, Any]:
    """Import ftfy and spaCy, or refuse with the command that installs them.

    There is deliberately no fallback: without ftfy and spaCy's rules the ids would silently differ from
    the ones GPT-1 was trained on.
    """
    missing, modules = [], []
    for name in ("ftfy", "spacy"):
        try:
            # importlib rather than an import statement: transformers' remote-code loader scans import
            # statements and would otherwise replace this message by its own.
            modules.append(importlib.import_module(name))
        except ImportError:
            missing.append(name)
    if missing:
        raise MissingDependencyError(
            f"GPT1Tokenizer reproduces GPT-1's original tokenizer, which needs {' and '.join(missing)} "
            f"(not installed). Install them with: {_INSTALL_HINT}  (or: pip install ftfy spacy)"
        )
    return modules[0], modules[1]


def text_standardize(text: str) -> str:
    """The original ``text_standardize`` of finetune-transformer-lm's text_utils.py."""
    for source, target in _STANDARDIZE_REPLACEMENTS.items():
        text = text.replace(source, target)
    text = _PUNCTUATION_RUN.sub(r" \1 ", text)
    text = _NEWLINE_RUN.sub(" \n ", text)
    text = _OTHER_WHITESPACE_RUN.sub(" ", text)
    return text.strip()


def _standardized_to_fixed(fixed: str, standardized: str) -> list[int]:
    """For each character of ``text_standardize(fixed)``, its index in ``fixed`` (-1 for inserted spaces).

    text_standardize only replaces characters (table above), inserts spaces and collapses whitespace, so
    the non-space characters of both strings pair up in order once the replacements are expanded.
    """
    produced = [(out, j) for j, char in enumerate(fixed) for out in _STANDARDIZE_REPLACEMENTS.get(char, char)]
    positions = [-1] * len(standardized)
    k = 0
    for i, char in enumerate(standardized):
        if char.isspace() and char != "\n":
            continue
        while k < len(produced) and produced[k][0] != char:
            k += 1  # only source whitespace is skipped here
        if k == len(produced):
            break
        positions[i] = produced[k][1]
        k += 1
    return positions


def _fixed_to_original(original: str, fixed: str, fix_text: Callable[..., str]) -> list[tuple[int, int]]:
    """For each character of ``fixed = fix_text(original)`` (``ftfy.fix_text``), the span of ``original``
    it came from.

    ftfy offers no alignment, and a character diff is no substitute: difflib's is quadratic (minutes on a
    page of text) and pairs a fixed character with any equal one nearby (in ``x&amp;&amp;&amp;ab`` it
    gave an ``&`` the ``amp;`` of an entity, and ``ab`` the stretch ``amp;&amp;ab``). ftfy's fixes are
    local instead (an HTML entity, a mojibake sequence, a ligature, a curly quote), so: cut a stretch
    into parts, fix each part alone, and where the parts' fixes concatenate to the stretch's fix, each
    fixed character comes from its part. Repeating this narrows every change down to the smallest
    stretch ftfy rewrites as a whole (``&amp;`` -> ``&``, ``Ã©`` -> ``é``, ``ﬁ`` -> ``fi``), all of whose
    fixed characters map onto it. Unchanged parts map one to one at once, so the cost is a few ftfy
    passes over the changed text.
    """
    first_lt = original.find("<")
    # A memo: words recur, and a part's fix depends only on its text and on the HTML rule below.
    fixes: dict[tuple[str, bool], str] = {}

    def fix(start: int, end: int) -> str:
        # fix_text works line by line and, from the first line holding a "<" on, leaves HTML entities
        # alone (TextFixerConfig.unescape_html="auto"); a part fixed on its own must do the same.
        line_end = original.find("\n", start) + 1 or len(original)
        key = (original[start:end], 0 <= first_lt < line_end)
        if key not in fixes:
            fixes[key] = fix_text(key[0], unescape_html=False) if key[1] else fix_text(key[0])
        return fixes[key]

    spans: list[tuple[int, int]] = []
    stretches = [(0, len(original), fixed)]  # still to align, the next one last
    while stretches:
        start, end, target = stretches.pop()
        if original[start:end] == target:
            spans.extend((i, i + 1) for i in range(start, end))
            continue
        for cuts in _cut_plans(original, start, end):
            parts = _split_where_fixes_agree(start, end, cuts, target, fix)
            if parts is not None:
                stretches.extend(reversed(parts))
                break
        else:
            if end - start <= _ALIGN_CUTS + 1:
                # Every cut changes ftfy's result: it rewrote this stretch as a whole.
                spans.extend([(start, end)] * len(target))
            else:
                # A long stretch that no cut tried splits (rare: mojibake that ftfy decodes a line at a
                # time); a diff of that stretch alone is the best guess left.
                spans.extend((start + s, start + e) for s, e in _diff_spans(original[start:end], target))
    return spans


def _split_where_fixes_agree(
    start: int, end: int, cuts: list[int], target: str, fix: Callable[[int, int], str]
) -> list[tuple[int, int, str]] | None:
    """``[start, end)`` cut at those of ``cuts`` where the parts' own fixes concatenate to ``target``, the
    fix of the whole, as (start, end, fixed part); None when no cut keeps to ``target``.

    A cut whose left part's fix does not continue ``target`` (it split an entity, a mojibake sequence or
    a CR LF) is dropped, the part growing to the next cut.
    """
    parts: list[tuple[int, int, str]] = []
    part_start, position = start, 0
    for cut in [*cuts, end]:
        part = fix(part_start, cut)
        if target.startswith(part, position) and (cut < end or position + len(part) == len(target)):
            parts.append((part_start, cut, part))
            part_start, position = cut, position + len(part)
    return parts if part_start == end and len(parts) > 1 else None


# _fixed_to_original cuts a changed stretch into up to _ALIGN_PARTS parts at once, moving each cut up to
# _ALIGN_SNAP characters forward to the end of a whitespace run (so that it rarely splits an entity, a
# mojibake sequence or a CR LF); failing that, it tries each single cut within _ALIGN_CUTS // 2 of the
# middle, so every cut of a stretch of up to _ALIGN_CUTS + 1 characters.
_ALIGN_PARTS = 16
_ALIGN_SNAP = 16
_ALIGN_CUTS = 24
_WHITESPACE_RUN = re.compile(r"\s+")


def _cut_plans(text: str, start: int, end: int) -> Iterator[list[int]]:
    """Ways to cut ``text[start:end]``, best first: many parts ending in whitespace, then single cuts
    (those after whitespace first)."""
    length = end - start
    if length < 2:
        return
    parts = min(_ALIGN_PARTS, length)
    cuts: list[int] = []
    for k in range(1, parts):
        cut = start + k * length // parts
        space = _WHITESPACE_RUN.search(text, cut - 1, min(cut - 1 + _ALIGN_SNAP, end))
        if space and space.end() < end:
            cut = space.end()
        if (cuts[-1] if cuts else start) < cut:
            cuts.append(cut)
    yield cuts
    middle = start + length // 2
    nearest = range(max(start + 1, middle - _ALIGN_CUTS // 2), min(end, middle + _ALIGN_CUTS // 2 + 1))
    inside_word = [not text[cut - 1].isspace() or text[cut].isspace() for cut in nearest]
    for _, _, cut in sorted(zip(inside_word, (abs(cut - middle) for cut in nearest), nearest, strict=True)):
        yield [cut]


def _diff_spans(original: str, fixed: str) -> list[tuple[int, int]]:
    """difflib's alignment of two strings, as spans of ``original`` per character of ``fixed``."""
    spans: list[tuple[int, int]] = [(0, 0)] * len(fixed)
    matcher = difflib.SequenceMatcher(None, original, fixed, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        for j in range(j1, j2):
            spans[j] = (i1 + j - j1, i1 + j - j1 + 1) if tag == "equal" else (i1, i2)
    return spans


class _EnglishWordSplitter:
    """spaCy's English tokenizer rules, pickled as the recipe that rebuilds them.

    ``spacy.blank("en")`` carries the tokenizer alone: the original loaded spaCy's ``en`` with the parser,
    tagger, ner and textcat disabled. spaCy adds every new string it meets to its vocabulary, so pickling
    the pipeline itself would make a GPT1Tokenizer's pickle, and datasets' fingerprint of it, change with
    every text it has tokenized (and Dataset.map never reuse its cache).
    """

    def __init__(self) -> None:
        self._nlp = importlib.import_module("spacy").blank("en")
        # spaCy refuses texts over 1,000,000 characters (E088) to bound the parser's and NER's memory; the
        # tokenizer alone runs here, in memory proportional to the text, so any length is tokenized whole.
        self._nlp.max_length = sys.maxsize

    def __call__(self, text: str) -> Any:
        return self._nlp.make_doc(text)

    def __reduce__(self) -> tuple[type, tuple]:
        return (type(self), ())


class GPT1Tokenizer(PreTrainedTokenizer):
    """GPT-1's tokenizer, giving the ids of OpenAI's original ``TextEncoder`` on any text.

    Args:
        vocab_file: ``encoder_bpe_40000.json``; defaults to the released file shipped with hfgpt.
        merges_file: ``vocab_40000.bpe``; defaults to the released file shipped with hfgpt.
        add_finetune_tokens: add ``_start_``, ``_delimiter_``, ``_classify_`` as special tokens with ids
            40478-40480, as the original fine-tuning code does.
        unk_token: the token of id 0, which the original gives every piece missing from the vocabulary.
        bos_token, eos_token: ``<unk>`` too (id 0). GPT-1 was trained without a start- or end-of-text
            token, but generic code needs one it can name: lm-evaluation-harness conditions a text's first
            token on the BOS (else the EOS) id and stops generation at the EOS, and failed with a TypeError
            on ``None``. Id 0 is in the released vocabulary, so no id moves and no embedding row is added
            (the fine-tuning tokens exist only after ``add_finetune_tokens``); the ids of a text are the
            original's with or without ``add_special_tokens``, which adds nothing.
    """

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str | os.PathLike | None = None,
        merges_file: str | os.PathLike | None = None,
        add_finetune_tokens: bool = False,
        unk_token: str = "<unk>",
        bos_token: str = "<unk>",
        eos_token: str = "<unk>",
        model_max_length: int = 512,
        clean_up_tokenization_spaces: bool = True,
        **kwargs: Any,
    ) -> None:
        ftfy, _ = _import_gpt1_dependencies()
        self._fix_text = ftfy.fix_text
        self._nlp = _EnglishWordSplitter()

        shipped = Path(__file__).parent / "data" / "openai-gpt"
        self.vocab_file = str(vocab_file or shipped / VOCAB_FILES_NAMES["vocab_file"])
        self.merges_file = str(merges_file or shipped / VOCAB_FILES_NAMES["merges_file"])
        with open(self.vocab_file, encoding="utf-8") as handle:
            self.encoder: dict[str, int] = json.load(handle)
        self.decoder: dict[int, str] = {index: piece for piece, index in self.encoder.items()}
        with open(self.merges_file, encoding="utf-8") as handle:
            # The original skips the "#version" header and the empty string after the final newline.
            merges = handle.read().split("\n")[1:-1]
        self.bpe_ranks: dict[tuple[str, ...], int] = {tuple(m.split()): i for i, m in enumerate(merges)}
        # The BPE memo. Named `cache` as in transformers' Python tokenizers: datasets' fingerprinting (its
        # pickler for PreTrainedTokenizerBase) empties an attribute of that name, so that a tokenizer that
        # has already tokenized some text hashes the same and Dataset.map finds its cached results.
        self.cache: dict[str, str] = {}

        super().__init__(
            unk_token=unk_token,
            bos_token=bos_token,
            eos_token=eos_token,
            model_max_length=model_max_length,
            clean_up_tokenization_spaces=clean_up_tokenization_spaces,
            add_finetune_tokens=add_finetune_tokens,
            **kwargs,
        )
        if add_finetune_tokens:
            self.add_finetune_special_tokens()

    # -- vocabulary -------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    def get_vocab(self) -> dict[str, int]:
        return {**self.encoder, **self.added_tokens_encoder}

    def add_finetune_special_tokens(self) -> dict[str, int]:
        """Add GPT-1's fine-tuning tokens (ids 40478-40480 on the released vocabulary); returns their ids."""
        new = [AddedToken(token, special=True, normalized=False) for token in FINETUNE_TOKENS]
        self.add_tokens([t for t in new if t.content not in self.get_vocab()], special_tokens=True)
        self.init_kwargs["add_finetune_tokens"] = True
        return self.finetune_token_ids

    @property
    def finetune_token_ids(self) -> dict[str, int]:
        """Ids of ``_start_``, ``_delimiter_``, ``_classify_`` (empty until they are added)."""
        vocab = self.get_vocab()
        return {token: vocab[token] for token in FINETUNE_TOKENS if token in vocab}

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.encoder[str(self.unk_token)])

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder.get(index, str(self.unk_token))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Join pieces into words, a space before each word: ``</w>`` ends a word; a newline token stands
        on its own.

        The space goes before a word, as GPT-2's byte-level pieces carry it (``Ġfox``), not after it, so
        that ids decoded in parts join as the whole does: ``decode(a) + decode(b) == decode(a + b)`` where
        ``a`` ends a word. The first piece is taken to follow a word end too, as the new tokens of a
        generation always do (GPT-1's encoder ends every text with one): transformers' text-generation
        pipeline, its streamers and its server decode only the new tokens and append them to the prompt,
        which then reads "fox jumps" rather than "foxjumps". A whole text therefore decodes with a leading
        space (``" the quick brown fox"``).
        """
        if not tokens:
            return ""
        text = " " + "".join(tokens).replace(_WORD_END, " ")
        if text.endswith(" ") and tokens[-1].endswith(_WORD_END):
            text = text[:-1]  # the next decoded part brings the space
        return re.sub(r" *\n *", "\n", text)

    # -- the original pipeline ----------------------------------------------------------------------------
    def bpe(self, token: str) -> str:
        """BPE of one lower-cased spaCy token, as the original's ``TextEncoder.bpe``: space-joined pieces."""
        if token in self.cache:
            return self.cache[token]
        word = tuple(token[:-1]) + (token[-1] + _WORD_END,)
        while len(word) > 1:
            pairs = set(zip(word, word[1:], strict=False))
            best = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if best not in self.bpe_ranks:
                break
            merged: list[str] = []
            i = 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        result = " ".join(word)
        # The original's special case: spaCy's newline token "\n " would otherwise give "\n", "", "</w>".
        if result == "\n  </w>":
            result = "\n</w>"
        self.cache[token] = result
        return result

    def _pieces(self, text: str, with_offsets: bool) -> tuple[list[str], list[tuple[int, int]]]:
        fixed = self._fix_text(text)
        standardized = text_standardize(fixed)
        doc = self._nlp(standardized)
        pieces: list[str] = []
        offsets: list[tuple[int, int]] = []
        if with_offsets:
            to_fixed = _standardized_to_fixed(fixed, standardized)
            to_original = _fixed_to_original(text, fixed, self._fix_text)
        for token in doc:
            lowered = token.text.lower()
            # The original splits the joined string on " ", so do the same (no piece contains a space).
            token_pieces = self.bpe(lowered).split(" ")
            pieces.extend(token_pieces)
            if with_offsets:
                offsets.extend(self._piece_spans(token, lowered, token_pieces, to_fixed, to_original))
        return pieces, offsets

    @staticmethod
    def _piece_spans(token, lowered, token_pieces, to_fixed, to_original) -> list[tuple[int, int]]:
        # Lower-casing can lengthen a character ("İ" -> "i̇"): map lowered characters back to the token's.
        lowered_to_token = [i for i, char in enumerate(token.text) for _ in char.lower()]
        if len(lowered_to_token) != len(lowered):
            lowered_to_token = [min(i, len(token.text) - 1) for i in range(len(lowered))]
        spans, position = [], 0
        for piece in token_pieces:
            length = len(piece.removesuffix(_WORD_END))
            sources = [
                to_original[to_fixed[token.idx + lowered_to_token[k]]]
                for k in range(position, min(position + length, len(lowered)))
                if to_fixed[token.idx + lowered_to_token[k]] >= 0
            ]
            position += length
            spans.append((min(s for s, _ in sources), max(e for _, e in sources)) if sources else (0, 0))
        return spans

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return self._pieces(text, with_offsets=False)[0]

    def _chunks(self, text: str, split_special_tokens: bool) -> list[tuple[str, int | None]]:
        """The text split at added tokens (the fine-tuning tokens), but never at ``<unk>``: each chunk with
        the id of the added token it is, or None for text.

        transformers' own splitting would also match a literal "<unk>" in the text, which the original
        tokenizes as ordinary text (it only ever produces id 0, never reads it). Each added token's options
        apply as in transformers' tokenizers (the ``tokenizers`` library's ``AddedVocabulary.find_matches``):
        a ``single_word`` token is no match where a word character touches it, and ``lstrip``/``rstrip``
        make its chunk take the whitespace on its left/right (so its offsets cover that whitespace too).
        """
        unk = str(self.unk_token)
        added = {
            t: i
            for t, i in self._added_tokens_encoder.items()
            # split_special_tokens splits special tokens only; other added tokens still match (as tokenizers').
            if t != unk and not (split_special_tokens and self._added_tokens_decoder[i].special)
        }
        if not added:
            return [(text, None)]
        # Longest first, so that of two tokens starting at one place the longer matches (leftmost-longest).
        pattern = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
        chunks: list[tuple[str, int | None]] = []
        done = 0  # end of the last added token's chunk
        for match in pattern.finditer(text):
            start, end = match.span()
            token_id = added[match.group()]
            token = self._added_tokens_decoder[token_id]
            if start < done:
                continue  # inside the whitespace the previous token's rstrip took
            if token.single_word and (
                (start > 0 and _is_word_character(text[start - 1]))
                or (end < len(text) and _is_word_character(text[end]))
            ):
                continue
            if token.lstrip:
                while start > done and _is_white_space(text[start - 1]):
                    start -= 1
            if token.rstrip:
                while end < len(text) and _is_white_space(text[end]):
                    end += 1
            if done < start:
                chunks.append((text[done:start], None))
            chunks.append((text[start:end], token_id))
            done = end
        if done < len(text):
            chunks.append((text[done:], None))
        return chunks

    def tokenize(self, text: str, **kwargs: Any) -> list[str]:
        split_special_tokens = kwargs.pop("split_special_tokens", self.split_special_tokens)
        text, kwargs = self.prepare_for_tokenization(text, **kwargs)
        pieces: list[str] = []
        for chunk, added_id in self._chunks(text, split_special_tokens):
            if added_id is None:
                pieces.extend(self._tokenize(chunk))
            else:
                pieces.append(self._added_tokens_decoder[added_id].content)
        return pieces

    def _ids_and_offsets(self, text: str, split_special_tokens: bool) -> tuple[list[int], list]:
        """Ids and character spans of one text, splitting out added tokens as ``tokenize`` does."""
        ids, offsets, start = [], [], 0
        for chunk, added_id in self._chunks(text, split_special_tokens):
            if added_id is not None:
                ids.append(added_id)
                offsets.append((start, start + len(chunk)))
            else:
                pieces, spans = self._pieces(chunk, with_offsets=True)
                ids.extend(self._convert_token_to_id(p) for p in pieces)
                offsets.extend((s + start, e + start) for s, e in spans)
            start += len(chunk)
        return ids, offsets

    # -- offsets (transformers' Python tokenizers have none) ----------------------------------------------
    def _encode_plus(self, text, text_pair=None, return_offsets_mapping: bool = False, **kwargs):
        if not return_offsets_mapping:
            return super()._encode_plus(text, text_pair, **kwargs)
        return self._encode_with_offsets(text, text_pair, **kwargs)

    def _encode_with_offsets(
        self,
        text,
        text_pair=None,
        padding_strategy: PaddingStrategy = PaddingStrategy.DO_NOT_PAD,
        truncation_strategy: TruncationStrategy = TruncationStrategy.DO_NOT_TRUNCATE,
        max_length: int | None = None,
        stride: int = 0,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_tensors=None,
        return_attention_mask: bool | None = None,
        split_special_tokens: bool = False,
        is_split_into_words: bool = False,
        return_overflowing_tokens: bool = False,
        **kwargs,
    ) -> BatchEncoding:
        if is_split_into_words or return_overflowing_tokens:
            raise NotImplementedError(
                "GPT1Tokenizer returns offsets for plain texts only (not with is_split_into_words or "
                "return_overflowing_tokens)."
            )
        if isinstance(text, (list, tuple)):
            pairs = text_pair if text_pair is not None else [None] * len(text)
            items = [
                self._encode_with_offsets(
                    *_text_and_pair(t, p),
                    truncation_strategy=truncation_strategy,
                    max_length=max_length,
                    stride=stride,
                    split_special_tokens=split_special_tokens,
                    return_attention_mask=False,
                    **kwargs,
                )
                for t, p in zip(text, pairs, strict=True)
            ]
            batch = {key: [item[key] for item in items] for key in items[0]} if items else {"input_ids": []}
            offsets = batch.pop("offset_mapping", [])
            padded = self.pad(
                batch,
                padding=padding_strategy.value,
                max_length=max_length,
                pad_to_multiple_of=pad_to_multiple_of,
                padding_side=padding_side,
                return_attention_mask=return_attention_mask,
            )
            padded["offset_mapping"] = [
                self._pad_offsets(o, len(ids), padding_side)
                for o, ids in zip(offsets, padded["input_ids"], strict=True)
            ]
            return BatchEncoding(dict(padded), tensor_type=return_tensors)

        if not isinstance(text, str) or not isinstance(text_pair, (str, type(None))):
            raise NotImplementedError(
                "GPT1Tokenizer returns offsets for texts (str) only, not for token ids or tokens."
            )
        ids, offsets = self._ids_and_offsets(text, split_special_tokens)
        pair_ids, pair_offsets = (
            self._ids_and_offsets(text_pair, split_special_tokens) if text_pair is not None else (None, None)
        )
        total = len(ids) + len(pair_ids or [])
        if truncation_strategy != TruncationStrategy.DO_NOT_TRUNCATE and max_length and total > max_length:
            # Truncate (id, span) pairs with transformers' own rules so ids and spans stay together.
            kept, kept_pair, _ = self.truncate_sequences(
                list(zip(ids, offsets, strict=True)),
                list(zip(pair_ids, pair_offsets, strict=True)) if pair_ids is not None else None,
                num_tokens_to_remove=total - max_length,
                truncation_strategy=truncation_strategy,
                stride=stride,
            )
            ids, offsets = [i for i, _ in kept], [o for _, o in kept]
            if kept_pair is not None:
                pair_ids, pair_offsets = [i for i, _ in kept_pair], [o for _, o in kept_pair]
        encoded = self.prepare_for_model(
            ids,
            pair_ids=pair_ids,
            padding=padding_strategy.value,
            truncation=False,
            max_length=max_length,
            pad_to_multiple_of=pad_to_multiple_of,
            padding_side=padding_side,
            return_attention_mask=return_attention_mask,
            **{k: v for k, v in kwargs.items() if k in _PREPARE_FOR_MODEL_FLAGS},
        )
        spans = offsets + (pair_offsets or [])
        encoded["offset_mapping"] = self._pad_offsets(spans, len(encoded["input_ids"]), padding_side)
        return BatchEncoding(
            dict(encoded), tensor_type=return_tensors, prepend_batch_axis=bool(return_tensors)
        )

    def _pad_offsets(self, offsets: list, length: int, padding_side: str | None) -> list:
        padding = [(0, 0)] * (length - len(offsets))
        return (
            padding + list(offsets)
            if (padding_side or self.padding_side) == "left"
            else list(offsets) + padding
        )

    # -- saving -------------------------------------------------------------------------------------------
    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, str]:
        """Write the vocabulary in the original release's format and file names."""
        prefix = f"{filename_prefix}-" if filename_prefix else ""
        vocab_path = os.path.join(save_directory, prefix + VOCAB_FILES_NAMES["vocab_file"])
        merges_path = os.path.join(save_directory, prefix + VOCAB_FILES_NAMES["merges_file"])
        with open(vocab_path, "w", encoding="utf-8") as handle:
            json.dump(self.encoder, handle, ensure_ascii=False)
        merges = sorted(self.bpe_ranks, key=self.bpe_ranks.__getitem__)
        with open(merges_path, "w", encoding="utf-8") as handle:
            handle.write("#version: 0.2\n" + "".join(" ".join(m) + "\n" for m in merges))
        return vocab_path, merges_path


def _text_and_pair(text: Any, pair: Any) -> tuple[Any, Any]:
    """One batch item as (text, pair): a (text, pair) tuple or list in a batch is one pair of texts, as
    transformers' own batch loop (PreTrainedTokenizer._encode_plus) reads it."""
    if isinstance(text, (list, tuple)) and pair is None:
        if len(text) == 2:
            return text[0], text[1]
        if len(text) == 1:
            return text[0], None
        raise ValueError(f"Expected a pair of sequences, got {len(text)} sequences.")
    return text, pair


# prepare_for_model's output flags that callers may pass through __call__.
_PREPARE_FOR_MODEL_FLAGS = (
    "add_special_tokens",
    "return_token_type_ids",
    "return_special_tokens_mask",
    "return_length",
    "verbose",
)

# save_pretrained copies this file beside the vocabulary and writes an `auto_map` entry, so that
# AutoTokenizer can load GPT-1 checkpoints with trust_remote_code where hfgpt is not installed.
GPT1Tokenizer.register_for_auto_class("AutoTokenizer")

__all__ = ["FINETUNE_TOKENS", "GPT1Tokenizer", "MissingDependencyError", "text_standardize"]
