"""Smoke test of benchmarks/bench_tokenizer.py on a tiny corpus (the figures themselves are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import bench_tokenizer  # benchmarks/ is on pytest's pythonpath (pyproject.toml)


def test_benchmark_runs_and_writes_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert (
        bench_tokenizer.main(
            ["--size-mb", "0.05", "--repeats", "1", "--gpt1-mb", "0.005", "--json", str(out)]
        )
        == 0
    )
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["corpus_mb"] >= 0.05
    assert set(report["results"]) == {"hfgpt_gpt2", "transformers_gpt2_fast", "tiktoken"}
    for result in [*report["results"].values(), report["gpt1"]]:
        assert result["mb_per_s"] > 0 and result["tokens_per_s"] > 0
    assert report["ratios"]["hfgpt_vs_tiktoken"] > 0
    assert report["ids_equal"] == {"hfgpt_vs_tiktoken": True, "hfgpt_vs_transformers": True}
    assert "MB/s" in capsys.readouterr().out
