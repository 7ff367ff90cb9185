"""GPT-2 tokenizer: OpenAI's ids (fixture, tiktoken on a varied corpus), round trips, batching, saving."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hfgpt.tokenization import GPT2Tokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "openai-gpt2-tiny"
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_tokenizer import tiktoken_gpt2  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer() -> GPT2Tokenizer:
    return GPT2Tokenizer()


@pytest.fixture(scope="module")
def reference():
    # tiktoken's gpt2 encoding built offline from the fixture's copy of the released files.
    return tiktoken_gpt2(FIXTURE)


def _varied_corpus(seed: int = 0) -> list[str]:
    """Prose, code, every Unicode plane, emoji, whitespace runs, numbers and contractions."""
    rng = random.Random(seed)
    texts = [
        "The quick brown fox jumps over the lazy dog. It wasn't me, I'd say; they'll've gone.",
        "I'M SHOUTING, she's WON'T, we're 'quoted' and ''double'' -- ok?",
        "def f(x):\n    return {\"a\": [1, 2.5e-3, -7], 'b': x ** 2}  # comment\n\n\n\tindented\r\n",
        '#include <stdio.h>\nint main(void) { printf("%d\\n", 42); return 0; }\n',
        "     leading spaces and trailing     ",
        " " * 100 + "\n" * 7 + "\t \t" * 9 + "\u00a0\u2003\u3000 mixed\u2028separators\u2029",
        "1234567890 3.14159 1,000,000 0x1F 2026-01-01 12:30:45 +44 (0) 20 7946 0958",
        "🙂👍🏽👨‍👩‍👧‍👦🏳️‍🌈 ❤️ 🇫🇷 ©®™ ⌘ ⏎",
        "日本語のテキスト、中文文本。한국어 텍스트. Привет, мир! مرحبا हिन्दी ελληνικά עברית",
        "e\u0301 (combining) vs \u00e9; zero\u200bwidth; bidi \u202eoverride\u202c; BOM \ufeff",
    ]
    # Every Unicode plane that has assigned or private-use characters (0-3, 14-16), no surrogates.
    for plane in (0, 1, 2, 3, 14, 15, 16):
        for _ in range(20):
            chars = []
            while len(chars) < 30:
                cp = plane * 0x10000 + rng.randrange(0x10000)
                if not 0xD800 <= cp <= 0xDFFF:
                    chars.append(chr(cp))
            texts.append("".join(chars))
    # Random mixtures of the pieces above, to cross their boundaries.
    pieces = [t for t in texts] + ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", " ", "  ", "\n", "123"]
    for _ in range(300):
        texts.append("".join(rng.choice(pieces)[: rng.randint(1, 40)] for _ in range(rng.randint(1, 12))))
    return texts


def test_fixture_prompts_give_openai_encoder_ids(tokenizer: GPT2Tokenizer) -> None:
    expected = json.loads((FIXTURE / "expected_prompts.json").read_text(encoding="utf-8"))
    assert len(expected["prompts"]) == 3
    for prompt, ids in zip(expected["prompts"], expected["ids"], strict=True):
        assert tokenizer(prompt)["input_ids"] == ids
        assert tokenizer.decode(ids) == prompt


def test_special_tokens_are_gpt2s(tokenizer: GPT2Tokenizer) -> None:
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 50256
    assert tokenizer.bos_token_id == 50256
    assert tokenizer.pad_token is None
    assert len(tokenizer) == 50257
    assert tokenizer.model_max_length == 1024
    # The literal marker is the special id by default (transformers' convention) and plain text when
    # special tokens are split, as OpenAI's encoder reads it.
    assert tokenizer("a<|endoftext|>")["input_ids"] == [64, 50256]
    plain = tokenizer("a<|endoftext|>", split_special_tokens=True)["input_ids"]
    assert plain == tiktoken_gpt2(FIXTURE).encode_ordinary("a<|endoftext|>")
    assert len(plain) > 2


def test_large_varied_corpus_matches_tiktoken(tokenizer: GPT2Tokenizer, reference) -> None:
    texts = _varied_corpus()
    assert sum(len(t.encode("utf-8")) for t in texts) > 50_000
    ours = tokenizer(texts)["input_ids"]
    theirs = reference.encode_ordinary_batch(texts)
    mismatches = [t for t, a, b in zip(texts, ours, theirs, strict=True) if a != b]
    assert not mismatches, f"{len(mismatches)} texts differ, first: {mismatches[0]!r}"
    # The whole corpus as one text too (whitespace runs across line joins).
    joined = "\n".join(texts)
    assert tokenizer(joined)["input_ids"] == reference.encode_ordinary(joined)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
def test_any_text_matches_tiktoken_and_round_trips(text: str) -> None:
    tokenizer, reference = _shared()
    ids = tokenizer(text, split_special_tokens=True)["input_ids"]
    assert ids == reference.encode_ordinary(text)
    assert tokenizer.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.sampled_from(list(" \t\n\r'sdtlmvre0123 .,!?aZ\u00e9🙂")), max_size=80))
def test_whitespace_and_contractions_round_trip(text: str) -> None:
    tokenizer, reference = _shared()
    ids = tokenizer(text)["input_ids"]
    assert ids == reference.encode_ordinary(text)
    assert tokenizer.decode(ids) == text


_SHARED: dict = {}


def _shared():
    # hypothesis forbids function-scoped pytest fixtures; build once per module instead.
    if not _SHARED:
        _SHARED["pair"] = (GPT2Tokenizer(), tiktoken_gpt2(FIXTURE))
    return _SHARED["pair"]


def test_batch_padding_truncation_masks_and_offsets(tokenizer: GPT2Tokenizer) -> None:
    tok = GPT2Tokenizer(pad_token="<|endoftext|>", padding_side="left")
    texts = ["Hello world", "A somewhat longer sentence here."]
    lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
    batch = tok(texts, padding=True, return_tensors="pt", return_offsets_mapping=True)
    width = max(lengths)
    assert batch["input_ids"].shape == (2, width)
    short = width - lengths[0]
    assert batch["input_ids"][0, :short].tolist() == [50256] * short
    assert batch["attention_mask"][0].tolist() == [0] * short + [1] * lengths[0]
    spans = batch["offset_mapping"][0, short:].tolist()
    assert [texts[0][s:e] for s, e in spans] == ["Hello", " world"]
    right = tok(texts, padding=True, padding_side="right")
    assert right["attention_mask"][0] == [1] * lengths[0] + [0] * short
    truncated = tok(texts, truncation=True, max_length=3)
    assert [len(x) for x in truncated["input_ids"]] == [min(n, 3) for n in lengths]


def test_save_writes_transformers_and_original_files(tmp_path: Path, tokenizer: GPT2Tokenizer) -> None:
    from transformers import AutoTokenizer
    from transformers import GPT2Tokenizer as TransformersGPT2Tokenizer

    tokenizer.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        assert (tmp_path / name).is_file(), name
    # The original release's files, with the released content.
    released = json.loads((FIXTURE / "encoder.json").read_text(encoding="utf-8"))
    assert json.loads((tmp_path / "encoder.json").read_text(encoding="utf-8")) == released
    assert (tmp_path / "vocab.bpe").read_text(encoding="utf-8") == (FIXTURE / "vocab.bpe").read_text(
        encoding="utf-8"
    )
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "GPT2Tokenizer" and "auto_map" not in config
    # Plain transformers reads the folder with its own class, and so does a build from the original files.
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded) is TransformersGPT2Tokenizer
    text = "Ünïcödé — “quotes” 🙂 and tabs\tand newlines\nmixed in 2026!"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    from_original = GPT2Tokenizer(vocab=str(tmp_path / "encoder.json"), merges=str(tmp_path / "vocab.bpe"))
    assert from_original(text)["input_ids"] == tokenizer(text)["input_ids"]
    reloaded = GPT2Tokenizer.from_pretrained(tmp_path, padding_side="left")
    assert reloaded.padding_side == "left" and reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_lone_surrogate_is_a_unicode_encode_error_as_in_openai_encoder(tokenizer: GPT2Tokenizer) -> None:
    # OpenAI's encoder.py encodes each piece with str.encode("utf-8"), which refuses a lone surrogate; the
    # `tokenizers` backend refuses it with a TypeError about its input types.
    for args in (("a\ud800b",), (["fine", "\udfff"],), ("fine", "pair \ud800"), ([["word", "\ud800"]],)):
        split = isinstance(args[0], list) and isinstance(args[0][0], list)
        with pytest.raises(UnicodeEncodeError, match="surrogates not allowed"):
            tokenizer(*args, is_split_into_words=split)
    with pytest.raises(UnicodeEncodeError):
        tokenizer.tokenize("\ud800")
    assert tokenizer(["fine", "text"])["input_ids"] == [[38125], [5239]]


def test_decode_refuses_ids_outside_the_vocabulary(tokenizer: GPT2Tokenizer) -> None:
    # encoder.py's decode raises (KeyError) on an unknown id; the backend would drop ids past the vocabulary
    # silently and overflow on negative ones (the -100 of labels) with a message about integer types.
    for ids in ([50257], [15496, 50300, 995], [-100, 15496], [2**40]):
        with pytest.raises(ValueError, match="cannot decode token ids"):
            tokenizer.decode(ids)
    with pytest.raises(ValueError, match="-100"):
        tokenizer.batch_decode([[15496], [15496, -100]])
    # In range: partial UTF-8 bytes become U+FFFD, as encoder.py's errors="replace".
    assert tokenizer.decode([15496, 171, 50256]) == "Hello\ufffd<|endoftext|>"
    assert tokenizer.decode(50256) == "<|endoftext|>" and tokenizer.decode([]) == ""
    tokenizer_with_pad = GPT2Tokenizer()
    tokenizer_with_pad.add_special_tokens({"pad_token": "<pad>"})
    assert tokenizer_with_pad.decode([15496, 50257]) == "Hello<pad>"


def test_vocabulary_arguments(tmp_path: Path, tokenizer: GPT2Tokenizer) -> None:
    from transformers import GPT2Tokenizer as TransformersGPT2Tokenizer

    # A vocabulary other than the shipped one: the released vocab with only the first 2000 merges.
    released = (FIXTURE / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:-1]
    (tmp_path / "vocab.json").write_text(
        (FIXTURE / "encoder.json").read_text(encoding="utf-8"), encoding="utf-8"
    )
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in released[:2000]))
    text = "Tokenization of uncommon vocabulary"
    expected = TransformersGPT2Tokenizer.from_pretrained(tmp_path)(text)["input_ids"]
    assert expected != tokenizer(text)["input_ids"]
    # transformers' file argument names are used, not replaced by the shipped files.
    by_files = GPT2Tokenizer(
        vocab_file=str(tmp_path / "vocab.json"), merges_file=str(tmp_path / "merges.txt")
    )
    assert by_files(text)["input_ids"] == expected
    # Merges in memory as the lines of the file ("left right"), as the docstring says.
    vocab = json.loads((FIXTURE / "encoder.json").read_text(encoding="utf-8"))
    assert GPT2Tokenizer(vocab=vocab, merges=released[:2000])(text)["input_ids"] == expected
    # One without the other would tokenize byte by byte without a word: refused.
    with pytest.raises(ValueError, match="both `vocab` and `merges`"):
        GPT2Tokenizer(vocab=vocab)
    with pytest.raises(ValueError, match="both `vocab` and `merges`"):
        GPT2Tokenizer(merges=str(tmp_path / "merges.txt"))
