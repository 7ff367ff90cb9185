"""GPT-1 tokenizer: the original TextEncoder's ids, fine-tuning tokens, offsets, decoding, saving."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AddedToken

from hfgpt.tokenization import FINETUNE_TOKENS, GPT1Tokenizer, MissingDependencyError, text_standardize

FIXTURE = Path(__file__).parent / "fixtures" / "openai-gpt1-tiny"
EXPECTED = json.loads((FIXTURE / "expected_texts.json").read_text(encoding="utf-8"))


class ReferenceTextEncoder:
    """An independent transcription of finetune-transformer-lm's text_utils.TextEncoder.encode, written
    from its description: ftfy, text_standardize, spaCy's English rules, lower-case, BPE with </w>,
    pieces looked up with 0 for anything missing."""

    def __init__(self) -> None:
        import ftfy
        import spacy

        self.fix = ftfy.fix_text
        self.nlp = spacy.blank("en")
        self.encoder = json.loads((FIXTURE / "encoder_bpe_40000.json").read_text(encoding="utf-8"))
        lines = (FIXTURE / "vocab_40000.bpe").read_text(encoding="utf-8").split("\n")[1:-1]
        self.ranks = {tuple(line.split()): rank for rank, line in enumerate(lines)}

    @staticmethod
    def standardize(text: str) -> str:
        for a, b in (("—", "-"), ("–", "-"), ("―", "-"), ("…", "..."), ("´", "'")):
            text = text.replace(a, b)
        text = re.sub(
            r"""(-+|~+|!+|"+|;+|\?+|\++|,+|\)+|\(+|\\+|\/+|\*+|\[+|\]+|}+|{+|\|+|_+)""", r" \1 ", text
        )
        text = re.sub(r"\s*\n\s*", " \n ", text)
        return re.sub(r"[^\S\n]+", " ", text).strip()

    def bpe(self, token: str) -> list[str]:
        symbols = list(token[:-1]) + [token[-1] + "</w>"]
        while len(symbols) > 1:
            ranked = [(self.ranks.get(p, float("inf")), p) for p in zip(symbols, symbols[1:], strict=False)]
            rank, pair = min(ranked)
            if rank == float("inf"):
                break
            out, i = [], 0
            while i < len(symbols):
                if tuple(symbols[i : i + 2]) == pair:
                    out.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            symbols = out
        joined = " ".join(symbols)
        return ["\n</w>"] if joined == "\n  </w>" else joined.split(" ")

    def encode(self, text: str) -> list[int]:
        doc = self.nlp(self.standardize(self.fix(text)))
        return [self.encoder.get(piece, 0) for token in doc for piece in self.bpe(token.text.lower())]


@pytest.fixture(scope="module")
def tokenizer() -> GPT1Tokenizer:
    return GPT1Tokenizer()


_SHARED: dict = {}


def _shared() -> tuple[GPT1Tokenizer, ReferenceTextEncoder]:
    # hypothesis forbids function-scoped fixtures; build once.
    if not _SHARED:
        _SHARED["pair"] = (GPT1Tokenizer(), ReferenceTextEncoder())
    return _SHARED["pair"]


def test_fixture_texts_give_the_original_ids(tokenizer: GPT1Tokenizer) -> None:
    for text, ids in zip(EXPECTED["texts"], EXPECTED["ids"], strict=True):
        assert tokenizer(text)["input_ids"] == ids
    assert tokenizer.tokenize("isn't he?") == ["is</w>", "n't</w>", "he</w>", "?</w>"]


TRICKY = [
    "isn't it? I'm sure you'll've done what we'd've said, can't you? O'Neill's rock'n'roll",
    "“Smart” ‘single’ \"straight\" 'quotes' ``latex''",
    "dashes — em – en ― bar -- double --- triple ~~ tildes; ellipsis… and ... dots",
    "Numbers: 3.14, 1,000,000, $5.99, 10%, 2nd, 1990s, 9:30pm, +44-20, 1e-3",
    "line one\nline two\n\n\nline five\r\nwindows\n  \n  indented\t\ttabs  ",
    "Ünïcödé café naïve Привет 日本語 🙂👍🏽 <unk> ﬁ ligature Ã©tÃ© mojibake &amp; html",
    "U.S.A. e.g. i.e. Mr. Dr. St. etc. (parens) [brackets] {braces} a/b\\c *stars* |pipes| __under__",
    "_start_ _delimiter_ _classify_ are plain text until they are added",
    "İstanbul ΣΊΣΥΦΟΣ straße ǅ",
    "<unk>",  # the whole text equal to the unknown token (found by hypothesis): still text, as in the original
]


@pytest.mark.parametrize("text", TRICKY)
def test_tricky_texts_match_the_reference(tokenizer: GPT1Tokenizer, text: str) -> None:
    assert tokenizer(text)["input_ids"] == _shared()[1].encode(text)


@settings(max_examples=80, deadline=None)
@given(st.text(max_size=120))
def test_any_text_matches_the_reference(text: str) -> None:
    tokenizer, reference = _shared()
    assert tokenizer(text)["input_ids"] == reference.encode(text)


def test_transformers_openai_gpt_tokenizer_differs(tokenizer: GPT1Tokenizer) -> None:
    # transformers 5's OpenAIGPTTokenizer uses BERT's pre-tokenizer, splitting at the apostrophe.
    from transformers import OpenAIGPTTokenizer

    theirs = OpenAIGPTTokenizer(
        vocab=str(FIXTURE / "encoder_bpe_40000.json"), merges=str(FIXTURE / "vocab_40000.bpe")
    )
    text = EXPECTED["texts"][0]  # "The president is a very good man, isn't he?"
    assert theirs.tokenize("isn't") == ["is", "n</w>", "'</w>", "t</w>"]
    assert tokenizer.tokenize("isn't") == ["is</w>", "n't</w>"]
    assert theirs(text)["input_ids"] != EXPECTED["ids"][0]
    assert tokenizer(text)["input_ids"] == EXPECTED["ids"][0]


def test_finetune_tokens_have_the_original_ids() -> None:
    tokenizer = GPT1Tokenizer(add_finetune_tokens=True)
    assert tokenizer.finetune_token_ids == EXPECTED["special_tokens"]
    assert len(tokenizer) == 40481
    assert [tokenizer.convert_tokens_to_ids(t) for t in FINETUNE_TOKENS] == [40478, 40479, 40480]
    # The original's ROCStories input: [_start_] text_0 [_delimiter_] text_k [_classify_].
    expected = np.load(FIXTURE / "expected.npz")
    texts = EXPECTED["texts"]
    for k, mc in ((1, "mc_ids_0"), (2, "mc_ids_1")):
        ids = tokenizer(f"_start_{texts[0]}_delimiter_{texts[k]}_classify_")["input_ids"]
        assert ids == expected[mc].tolist()
    # "<unk>" stays text between added tokens, in ids and in offsets.
    unk_ids = _shared()[1].encode("<unk>")
    for offsets in (False, True):
        encoded = tokenizer("_start_<unk>_classify_", return_offsets_mapping=offsets)
        assert encoded["input_ids"] == [40478, *unk_ids, 40480]
    assert encoded["offset_mapping"][0] == (0, 7) and encoded["offset_mapping"][-1] == (12, 22)
    assert tokenizer.tokenize("_start_<unk>") == ["_start_", *tokenizer.convert_ids_to_tokens(unk_ids)]
    # Added later through the method, the same ids.
    later = GPT1Tokenizer()
    assert later.finetune_token_ids == {}
    assert later.add_finetune_special_tokens() == EXPECTED["special_tokens"]


def test_decoding_joins_pieces_into_words(tokenizer: GPT1Tokenizer) -> None:
    # A space before each word, the first one too (see convert_tokens_to_string).
    assert tokenizer.decode(EXPECTED["ids"][0]) == " the president is a very good man, isn't he?"
    assert tokenizer.decode(EXPECTED["ids"][1]) == " karen was assigned a roommate her first year of college."
    ids = tokenizer("first line\nsecond line")["input_ids"]
    assert tokenizer.decode(ids) == " first line\nsecond line"
    assert tokenizer.decode([]) == ""


def test_decoded_parts_join_as_the_whole(tokenizer: GPT1Tokenizer) -> None:
    # What streamers, pipelines and servers rely on: the new tokens, decoded alone and appended, read as the
    # whole sequence decoded at once (cut after any word; GPT-2's byte-level pieces do the same).
    ids = tokenizer("The quick brown fox, isn't it? It jumps\nover the lazy dog.")["input_ids"]
    # (Not after a newline, where the part after it keeps its leading space: no prompt ends there, as the
    # encoder drops a text's trailing whitespace, and streamers decode all the new tokens each time.)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    words_end = [
        i for i in range(1, len(ids)) if pieces[i - 1].endswith("</w>") and pieces[i - 1] != "\n</w>"
    ]
    assert len(words_end) > 10 and "\n</w>" in pieces
    for cut in words_end:
        assert tokenizer.decode(ids[:cut]) + tokenizer.decode(ids[cut:]) == tokenizer.decode(ids), cut


def test_offsets_point_into_the_original_text(tokenizer: GPT1Tokenizer) -> None:
    text = EXPECTED["texts"][2]  # 'Hello WORLD -- it's 9:30 a.m. “Smart quotes” and naïve café…'
    encoded = tokenizer(text, return_offsets_mapping=True)
    assert encoded["input_ids"] == EXPECTED["ids"][2]
    spans = [text[s:e] for s, e in encoded["offset_mapping"]]
    assert spans == ["Hello", "WORLD", "--", "it", "'s", "9", ":30", "a.m.", "“", "Smart", "quotes", "”"] + [
        "and",
        "naïve",
        "café",
        "…",
    ]
    # ftfy repairs mojibake and ligatures: spans cover the characters that were repaired.
    fixed = "ﬁne Ã©tÃ©"
    encoded = tokenizer(fixed, return_offsets_mapping=True)
    assert [fixed[s:e] for s, e in encoded["offset_mapping"]][0] == "ﬁne"
    assert "".join(fixed[s:e] for s, e in encoded["offset_mapping"][1:]) == "Ã©tÃ©"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("abcXYZ019 .,!?-'\n")), max_size=60))
def test_offsets_cover_each_piece(text: str) -> None:
    for piece, span in _pieces_and_spans(text):
        assert span.lower() == piece


def _pieces_and_spans(text: str) -> list[tuple[str, str]]:
    """Each BPE piece of `text` (without its word end) with the text its offsets point at; the ids of the
    offsets path checked against the plain path's."""
    tokenizer, _ = _shared()
    encoded = tokenizer(text, return_offsets_mapping=True)
    assert encoded["input_ids"] == tokenizer(text)["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(encoded["input_ids"])
    return [
        (piece.removesuffix("</w>"), text[start:end])
        for piece, (start, end) in zip(pieces, encoded["offset_mapping"], strict=True)
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Adjacent HTML entities (found by hypothesis): a character diff gave "&" the "amp;" of an entity
        # and "ab" the stretch "amp;&amp;ab". Each piece's span is what it stands for, worked by hand.
        ("x&amp;&amp;&amp;ab’", ["x", "&amp;", "&amp;", "&amp;", "ab", "’"]),
        ("ab&amp;'&amp;&amp;ab’", ["ab", "&amp;", "'", "&amp;", "&amp;", "ab", "’"]),
        ("AT&amp;T and P&amp;G", ["AT", "&amp;", "T", "and", "P", "&amp;", "G"]),
        # From the first line holding a "<" on, ftfy leaves entities alone: "&amp;" stays text.
        (
            "“a” &amp; b\n<b> &amp; “c”",
            ["“", "a", "”", "&amp;", "b", "\n", "<", "b", ">", "&", "amp", ";", "“", "c", "”"],
        ),
        # A ligature, mojibake (BPE splits "été" into "é", "t", "é"), an accent NFC composes.
        ("ﬁne Ã©tÃ© e\u0301", ["ﬁne", "Ã©", "t", "Ã©", "e\u0301"]),
    ],
)
def test_offsets_after_ftfy_repairs_point_at_what_each_piece_stands_for(
    tokenizer: GPT1Tokenizer, text: str, expected: list[str]
) -> None:
    encoded = tokenizer(text, return_offsets_mapping=True)
    assert encoded["input_ids"] == tokenizer(text)["input_ids"] == _shared()[1].encode(text)
    assert [text[start:end] for start, end in encoded["offset_mapping"]] == expected


_FTFY_FRAGMENTS = [
    "a",
    "ab",
    "b",
    " ",
    "“",
    "”",
    "…",
    "—",
    "ﬁ",
    "Ã©",
    "'",
    '"',
    "’",
    "&amp;",
    "\n",
    "é",
    "e\u0301",
]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from(_FTFY_FRAGMENTS), max_size=25).map("".join))
def test_offsets_after_ftfy_repairs_cover_each_piece(text: str) -> None:
    import ftfy

    unknown = _shared()[0].unk_token
    for piece, span in _pieces_and_spans(text):
        if piece == "\n":
            assert span == "\n"
        elif piece != unknown:
            # The span, repaired and standardised on its own, gives the piece.
            assert piece in text_standardize(ftfy.fix_text(span)).lower()
        if piece and set(piece) <= set("ab"):
            # Letters no fragment repairs into are their own span, unless ftfy rewrote a stretch around
            # them as a whole (every cut of it changes ftfy's result).
            assert span.lower() == piece or all(
                ftfy.fix_text(span[:k]) + ftfy.fix_text(span[k:]) != ftfy.fix_text(span)
                for k in range(1, len(span))
            )


def test_offsets_on_long_repaired_text_take_linear_work(
    tokenizer: GPT1Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ftfy changes this text (curly quotes uncurled): the offsets path must align the repaired text with
    # the original without a diff of the whole text (quadratic: over 30 s on these 8,200 characters).
    # Counted in work done, not time: characters given to ftfy, and the longest stretch diffed.
    import difflib

    import hfgpt.tokenization.tokenization_gpt1 as module

    text = "He said “hello” — it's 9:30… naïve café. " * 200
    fixed_chars, diffed = [0], [0]
    fix_text, matcher = tokenizer._fix_text, difflib.SequenceMatcher

    def counting_fix_text(part: str, *args: Any, **kwargs: Any) -> str:
        fixed_chars[0] += len(part)
        return fix_text(part, *args, **kwargs)

    def counting_matcher(junk: Any, a: str, b: str, **kwargs: Any) -> difflib.SequenceMatcher:
        diffed[0] = max(diffed[0], len(a))
        return matcher(junk, a, b, **kwargs)

    monkeypatch.setattr(tokenizer, "_fix_text", counting_fix_text)
    monkeypatch.setattr(module.difflib, "SequenceMatcher", counting_matcher)
    plain = tokenizer(text)["input_ids"]
    plain_chars, fixed_chars[0] = fixed_chars[0], 0
    encoded = tokenizer(text, return_offsets_mapping=True)
    assert encoded["input_ids"] == plain
    assert diffed[0] <= 100  # no diff of the whole text
    assert fixed_chars[0] <= 20 * plain_chars  # a few ftfy passes over the text, not one per character
    spans = {text[start:end] for start, end in encoded["offset_mapping"]}
    assert {"“", "”", "…", "hello", "naïve"} <= spans


def test_batches_pad_truncate_and_mask() -> None:
    tokenizer = GPT1Tokenizer(add_finetune_tokens=True, pad_token="<unk>", padding_side="left")
    texts = ["a b c", "hello\n\nthere  world, friend"]
    lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
    assert lengths == [3, 6]
    batch = tokenizer(texts, padding=True, return_offsets_mapping=True, return_tensors="pt")
    assert batch["input_ids"].shape == (2, 6)
    assert batch["input_ids"][0, :3].tolist() == [0, 0, 0]
    assert batch["attention_mask"].tolist() == [[0, 0, 0, 1, 1, 1], [1] * 6]
    assert batch["offset_mapping"][0].tolist() == [[0, 0]] * 3 + [[0, 1], [2, 3], [4, 5]]
    assert [texts[1][s:e] for s, e in batch["offset_mapping"][1].tolist()][:3] == ["hello", "\n", "there"]
    right = tokenizer(texts, padding="max_length", max_length=8, padding_side="right")
    assert right["attention_mask"][0] == [1, 1, 1, 0, 0, 0, 0, 0]
    truncated = tokenizer(texts, truncation=True, max_length=4, return_offsets_mapping=True)
    assert truncated["input_ids"][1] == tokenizer(texts[1])["input_ids"][:4]
    assert len(truncated["offset_mapping"][1]) == 4
    pair = tokenizer("a b", "c d e", truncation="only_second", max_length=4, return_offsets_mapping=True)
    assert pair["input_ids"] == tokenizer("a b c d")["input_ids"]
    assert pair["offset_mapping"] == [(0, 1), (2, 3), (0, 1), (2, 3)]


def test_batch_of_pairs_with_offsets_encodes_each_pair(tokenizer: GPT1Tokenizer) -> None:
    # transformers' batch loop reads a (text, pair) tuple (or two-item list) in a batch as one pair.
    batch = [("a b", "c d e"), ["hello", "world"]]
    expected_ids = tokenizer(batch)["input_ids"]
    assert expected_ids == [tokenizer(text, pair)["input_ids"] for text, pair in batch]
    for encoded in (
        tokenizer(batch, return_offsets_mapping=True),
        tokenizer([t for t, _ in batch], [p for _, p in batch], return_offsets_mapping=True),
    ):
        assert encoded["input_ids"] == expected_ids
        assert encoded["offset_mapping"] == [
            tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
            + tokenizer(pair, return_offsets_mapping=True)["offset_mapping"]
            for text, pair in batch
        ]


def test_missing_dependencies_refuse_with_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ftfy", "spacy"):
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
            with pytest.raises(MissingDependencyError, match=re.escape("pip install 'hfgpt[gpt1]'")) as error:
                GPT1Tokenizer()
            assert name in str(error.value)


def test_save_writes_original_files_and_reloads(tmp_path: Path) -> None:
    tokenizer = GPT1Tokenizer(add_finetune_tokens=True)
    tokenizer.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "encoder_bpe_40000.json").read_text(encoding="utf-8")) == json.loads(
        (FIXTURE / "encoder_bpe_40000.json").read_text(encoding="utf-8")
    )
    assert (tmp_path / "vocab_40000.bpe").read_text(encoding="utf-8") == (
        FIXTURE / "vocab_40000.bpe"
    ).read_text(encoding="utf-8")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "GPT1Tokenizer"
    assert config["auto_map"]["AutoTokenizer"][0] == "tokenization_gpt1.GPT1Tokenizer"
    assert (tmp_path / "tokenization_gpt1.py").is_file()
    reloaded = GPT1Tokenizer.from_pretrained(tmp_path)
    assert reloaded.finetune_token_ids == EXPECTED["special_tokens"]
    text = EXPECTED["texts"][2]
    assert reloaded(text)["input_ids"] == EXPECTED["ids"][2]
    # The files are the original's, so the original-format reader gives the same ids.
    assert ReferenceTextEncoder().encode(text) == EXPECTED["ids"][2]


def test_added_token_options_match_transformers_tokenizers() -> None:
    # single_word, lstrip and rstrip as transformers' GPT2Tokenizer (the `tokenizers` library) applies
    # them: where each added token matches, and the span it takes.
    from hfgpt.tokenization import GPT2Tokenizer

    options = [
        AddedToken("qqzx", single_word=True),
        AddedToken("<m>", lstrip=True, rstrip=True),
        AddedToken("<l>", lstrip=True),
        AddedToken("<r>", rstrip=True),
    ]
    texts = [
        "conqqzxenate the qqzx",
        "qqzx_a qqzx. (qqzx) éqqzx qqzx9",
        "a <m>  b a<m>b\n<m>\n",
        "x <l> <r> y <r>  <l> z",
        # Where Python's \\w / isspace differ from the Unicode classes the tokenizers library (Rust) uses.
        "qqzx\u200d qqzx\u0301 e\u0301qqzx qqzx² Ⅰqqzx qqzxª",
        "\x1c<m>\x1c a\x1f<m> \u00a0<l> <r>\u2003",
    ]
    ours, reference = GPT1Tokenizer(), GPT2Tokenizer()
    for tokenizer in (ours, reference):
        tokenizer.add_tokens(options)

    def added_spans(tokenizer: Any, text: str) -> list[tuple[str, str]]:
        encoded = tokenizer(text, return_offsets_mapping=True)
        tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"])
        return [
            (token, text[start:end])
            for token, (start, end) in zip(tokens, encoded["offset_mapping"], strict=True)
            if token in {option.content for option in options}
        ]

    for text in texts:
        assert added_spans(ours, text) == added_spans(reference, text)
        assert ours(text)["input_ids"] == ours(text, return_offsets_mapping=True)["input_ids"]
    # A single_word token inside a word leaves the word whole: the same pieces as without the token.
    qqzx = ours.convert_tokens_to_ids("qqzx")
    assert ours("conqqzxenate the qqzx")["input_ids"] == [
        *GPT1Tokenizer()("conqqzxenate the")["input_ids"],
        qqzx,
    ]
    assert ours.tokenize("a <m>  b") == ["a</w>", "<m>", "b</w>"]


def test_split_special_tokens_splits_special_tokens_only() -> None:
    # As the tokenizers library's encode_special_tokens (hfgpt's GPT2Tokenizer): a user's ordinary added
    # token still matches, only the special ones (the fine-tuning tokens) become text.
    from hfgpt.tokenization import GPT2Tokenizer

    text = "a qqzx _classify_"
    for tokenizer, special in (
        (GPT1Tokenizer(add_finetune_tokens=True), "_classify_"),
        (GPT2Tokenizer(), None),
    ):
        if special is None:
            tokenizer.add_special_tokens({"additional_special_tokens": ["_classify_"]})
        tokenizer.add_tokens(["qqzx"])
        pieces = tokenizer.tokenize(text, split_special_tokens=True)
        assert "qqzx" in pieces and "_classify_" not in pieces
        assert (
            tokenizer.convert_tokens_to_ids("_classify_")
            not in tokenizer(text, split_special_tokens=True)["input_ids"]
        )


def test_text_longer_than_spacys_limit_is_tokenized_whole() -> None:
    # spaCy refuses texts over nlp.max_length (1,000,000) for its parser's sake; the tokenizer alone has
    # no such need, and the ids of a long text are those of its pieces joined.
    tokenizer = GPT1Tokenizer()
    line = "the quick brown fox jumps over the lazy dog. "  # ends in a space: each repeat splits alike
    repeat = 1_000_001 // len(line) + 1
    ids = tokenizer(line * repeat)["input_ids"]
    assert ids == tokenizer(line)["input_ids"] * repeat


def test_datasets_fingerprint_survives_tokenizing(tmp_path: Path) -> None:
    # datasets fingerprints Dataset.map's function, tokenizer included, to find its cached result; the
    # BPE memo and spaCy's growing vocabulary must not change that fingerprint.
    import copy
    import pickle

    import datasets

    tokenizer = GPT1Tokenizer(add_finetune_tokens=True)
    datasets.Dataset.from_dict({"text": ["hello world", "isn't it?"] * 4}).save_to_disk(tmp_path / "data")
    dataset = datasets.load_from_disk(tmp_path / "data")

    def tokenize(batch: dict[str, list[str]]) -> Any:
        return tokenizer(batch["text"])

    first = dataset.map(tokenize, batched=True)  # tokenizes new words: the memo and spaCy's vocabulary grow
    second = dataset.map(tokenize, batched=True)
    assert second.cache_files == first.cache_files  # the second map found the first one's result

    # Pickling and copying still give a working tokenizer (spaCy's rules rebuilt, the memo kept).
    text = "_start_ zyzzyva quokkas aren't xylophones_classify_"
    ids = tokenizer(text)["input_ids"]
    for clone in (pickle.loads(pickle.dumps(tokenizer)), copy.deepcopy(tokenizer)):
        assert clone(text)["input_ids"] == ids
        assert clone.finetune_token_ids == EXPECTED["special_tokens"]


def test_decoding_added_tokens_as_transformers_openai_gpt() -> None:
    # An added token carries no word end, so it joins the next word ("_start_hello"): transformers'
    # OpenAIGPTTokenizer decodes the same ids to the same string.
    from transformers import OpenAIGPTTokenizer

    theirs = OpenAIGPTTokenizer(
        vocab=str(FIXTURE / "encoder_bpe_40000.json"), merges=str(FIXTURE / "vocab_40000.bpe")
    )
    theirs.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in FINETUNE_TOKENS], special_tokens=True
    )
    ours = GPT1Tokenizer(add_finetune_tokens=True)
    ids = ours("_start_Hello_delimiter_World_classify_")["input_ids"]
    assert theirs.convert_ids_to_tokens(ids) == ours.convert_ids_to_tokens(ids)
    for skip in (False, True):
        # Ours puts a space before the first word too (convert_tokens_to_string), theirs does not.
        assert ours.decode(ids, skip_special_tokens=skip) == " " + theirs.decode(
            ids, skip_special_tokens=skip
        )


def test_resize_embeddings_to_tokenizer() -> None:
    import torch

    from hfgpt.modeling import GPTConfig, GPTForCausalLM
    from hfgpt.tokenization import resize_embeddings_to_tokenizer

    config = GPTConfig.from_preset("openai-gpt", n_embd=32, n_layer=2, n_head=4, n_positions=16)
    model = GPTForCausalLM(config)
    assert model.get_input_embeddings().weight.shape[0] == 40478
    before = model.get_input_embeddings().weight[:40478].detach().clone()
    tokenizer = GPT1Tokenizer(add_finetune_tokens=True)
    resize_embeddings_to_tokenizer(model, tokenizer)
    weight = model.get_input_embeddings().weight
    assert weight.shape == (40481, 32)
    assert torch.equal(weight[:40478], before)
    assert model.config.classify_token_id == 40480
    ids = torch.tensor([tokenizer("_start_ hello _classify_")["input_ids"]])
    assert model(ids).logits.shape == (1, 3, 40481)
