"""Encoding throughput of hfgpt's GPT-2 tokenizer beside tiktoken and transformers' GPT2TokenizerFast.

All three are built offline from the same released `encoder.json` / `vocab.bpe` and run in one process on
the same locally generated corpus (prose, code, numbers, whitespace runs, many scripts and emoji), one
line per text. Each is timed best-of-`--repeats`; the report gives MB/s, tokens/s and the ratios
hfgpt / peer (above 1 means hfgpt is faster). The ids of the three are compared too. GPT-1's tokenizer
(Python, ftfy + spaCy) is timed on a smaller slice with `--gpt1-mb`.

    python benchmarks/bench_tokenizer.py --size-mb 4 --json bench_tokenizer.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import tiktoken
from transformers import GPT2TokenizerFast

from hfgpt.tokenization import GPT1Tokenizer, GPT2Tokenizer
from hfgpt.tokenization.tokenization_gpt2 import SHIPPED_GPT2_DIR

# tiktoken's `gpt2` split pattern (tiktoken_ext/openai_public.py), equal to OpenAI's encoder.py regex.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

_WORDS = tuple(
    """
    the of and to in is was that for it with as his on be at by had he not but from have they you this
    which one were all her she there would their we him been has when who will more no if out so said
    what up its about into than them can only other new some could time these two may then do first
    """.split()  # noqa: SIM905  (one word list, not 68 lines of literals)
)
_CODE = [
    "def forward(self, x: torch.Tensor) -> torch.Tensor:\n        return self.proj(x) * 0.5\n",
    "for (int i = 0; i < n; ++i) { total += values[i]; }\n",
    '    if key not in cache:\n        cache[key] = {"id": 42, "name": f"{prefix}_{i}"}\n',
]
_UNICODE = [
    "naïve café",
    "Ünïcödé",
    "日本語のテキスト",
    "Привет, мир",
    "مرحبا بالعالم",
    "🙂👍🏽👨‍👩‍👧",
    "Ελληνικά",
    "हिन्दी",
]


def make_corpus(size_bytes: int, seed: int = 0) -> list[str]:
    """Deterministic mixed text, one line per item, about `size_bytes` of UTF-8 in total."""
    rng = random.Random(seed)
    lines, total = [], 0
    while total < size_bytes:
        kind = rng.random()
        if kind < 0.6:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 40))]
            words[0] = words[0].capitalize()
            line = " ".join(words) + rng.choice([".", "!", "?", ", isn't it?", " -- he'd said."])
        elif kind < 0.75:
            line = rng.choice(_CODE)
        elif kind < 0.85:
            line = " ".join(rng.choice(_UNICODE) for _ in range(rng.randint(1, 6)))
        elif kind < 0.95:
            line = " ".join(str(rng.randint(0, 10 ** rng.randint(1, 9))) for _ in range(rng.randint(1, 10)))
        else:
            line = "word" + " " * rng.randint(2, 40) + "\t" * rng.randint(0, 3) + "\n" * rng.randint(0, 3)
        lines.append(line)
        total += len(line.encode("utf-8"))
    return lines


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte-to-printable-character table (openai/gpt-2 src/encoder.py, bytes_to_unicode).
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def tiktoken_gpt2(directory: Path = SHIPPED_GPT2_DIR) -> tiktoken.Encoding:
    """tiktoken's `gpt2` encoding, built offline from `encoder.json` (ranks = ids, as tiktoken's loader)."""
    byte_decoder = {char: byte for byte, char in _bytes_to_unicode().items()}
    encoder = json.loads((directory / "encoder.json").read_text(encoding="utf-8"))
    ranks = {
        bytes(byte_decoder[c] for c in token): rank
        for token, rank in encoder.items()
        if token != "<|endoftext|>"
    }
    return tiktoken.Encoding(
        name="gpt2-offline",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": encoder["<|endoftext|>"]},
    )


def _best_time(function: Callable[[], list[list[int]]], repeats: int) -> tuple[float, list[list[int]]]:
    best, result = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return best, result


def run_benchmark(size_mb: float = 4.0, repeats: int = 3, gpt1_mb: float = 0.1, seed: int = 0) -> dict:
    """Time the tokenizers on one corpus; returns the report as a dict."""
    lines = make_corpus(int(size_mb * 1e6), seed)
    megabytes = sum(len(line.encode("utf-8")) for line in lines) / 1e6
    ours = GPT2Tokenizer()
    peer_hf = GPT2TokenizerFast(
        vocab=str(SHIPPED_GPT2_DIR / "encoder.json"), merges=str(SHIPPED_GPT2_DIR / "vocab.bpe")
    )
    peer_tt = tiktoken_gpt2()
    runs = {
        "hfgpt_gpt2": lambda: ours(lines)["input_ids"],
        "transformers_gpt2_fast": lambda: peer_hf(lines)["input_ids"],
        "tiktoken": lambda: peer_tt.encode_ordinary_batch(lines),
    }
    results, outputs = {}, {}
    for name, function in runs.items():
        seconds, ids = _best_time(function, repeats)
        tokens = sum(len(x) for x in ids)
        outputs[name] = ids
        results[name] = {
            "seconds": seconds,
            "mb_per_s": megabytes / seconds,
            "tokens_per_s": tokens / seconds,
        }
    report = {
        "corpus_mb": megabytes,
        "lines": len(lines),
        "tokens": sum(len(x) for x in outputs["tiktoken"]),
        "repeats": repeats,
        "results": results,
        "ratios": {
            "hfgpt_vs_tiktoken": results["hfgpt_gpt2"]["mb_per_s"] / results["tiktoken"]["mb_per_s"],
            "hfgpt_vs_transformers": results["hfgpt_gpt2"]["mb_per_s"]
            / results["transformers_gpt2_fast"]["mb_per_s"],
        },
        "ids_equal": {
            "hfgpt_vs_tiktoken": outputs["hfgpt_gpt2"] == outputs["tiktoken"],
            "hfgpt_vs_transformers": outputs["hfgpt_gpt2"] == outputs["transformers_gpt2_fast"],
        },
    }
    if gpt1_mb > 0:
        gpt1_lines = make_corpus(int(gpt1_mb * 1e6), seed + 1)
        gpt1_megabytes = sum(len(line.encode("utf-8")) for line in gpt1_lines) / 1e6
        gpt1 = GPT1Tokenizer()
        seconds, ids = _best_time(lambda: gpt1(gpt1_lines)["input_ids"], 1)
        report["gpt1"] = {
            "corpus_mb": gpt1_megabytes,
            "seconds": seconds,
            "mb_per_s": gpt1_megabytes / seconds,
            "tokens_per_s": sum(len(x) for x in ids) / seconds,
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=4.0, help="GPT-2 corpus size (default 4 MB)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per tokenizer, best kept")
    parser.add_argument("--gpt1-mb", type=float, default=0.1, help="GPT-1 corpus size, 0 to skip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    report = run_benchmark(args.size_mb, args.repeats, args.gpt1_mb, args.seed)
    print(f"corpus: {report['corpus_mb']:.2f} MB, {report['lines']} lines, {report['tokens']} tokens")
    for name, result in report["results"].items():
        print(f"{name:>24}: {result['mb_per_s']:7.2f} MB/s  {result['tokens_per_s']:12,.0f} tokens/s")
    if "gpt1" in report:
        gpt1 = report["gpt1"]
        print(f"{'hfgpt_gpt1':>24}: {gpt1['mb_per_s']:7.2f} MB/s  {gpt1['tokens_per_s']:12,.0f} tokens/s")
    for name, ratio in report["ratios"].items():
        print(f"{name}: {ratio:.2f}x (throughput ratio, >1 = hfgpt faster)")
    print(f"ids equal: {report['ids_equal']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
