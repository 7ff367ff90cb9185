"""Time and peak memory of `hfgpt-convert` on a synthetic GPT-2 release, beside a load-everything peer.

A release with the exact tensor names and shapes of OpenAI's GPT-2 `--size` model (random float32 values)
is written with hfgpt's TensorFlow-bundle writer into a temporary folder. Then, each in a fresh child
process so that peak RSS is its own:

* hfgpt: `convert_release` (memory-mapped reads, tensor-by-tensor streaming into safetensors);
* peer:  the usual recipe: read every tensor into one state dict of torch tensors, then
         `safetensors.torch.save_file` (in-memory copies of the whole model; no TensorFlow here, so
         transformers' own TF converter cannot run).

Both read the same files, hot in the page cache after writing. The report gives seconds, peak RSS during
the conversion (VmHWM, reset after imports), the RSS when it started (imports), the excess of one over
the other and that excess as a fraction of the weights' size, with the ratios hfgpt / peer (below 1
means hfgpt is faster / uses less). Linux only (reads /proc/self/status).

    python benchmarks/bench_convert.py --size 1558M --json bench_convert.json
    python benchmarks/bench_convert.py --size tiny          # smoke test (a few MB)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from pathlib import Path
from queue import Empty
from typing import Any

import numpy as np

from hfgpt.modeling.tf_bundle import TensorBundleWriter

# openai/gpt-2 models/<size>/hparams.json; "tiny" is the test fixture's shape.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(n_vocab=50257, n_ctx=64, n_embd=32, n_head=4, n_layer=2),
    "124M": dict(n_vocab=50257, n_ctx=1024, n_embd=768, n_head=12, n_layer=12),
    "355M": dict(n_vocab=50257, n_ctx=1024, n_embd=1024, n_head=16, n_layer=24),
    "774M": dict(n_vocab=50257, n_ctx=1024, n_embd=1280, n_head=20, n_layer=36),
    "1558M": dict(n_vocab=50257, n_ctx=1024, n_embd=1600, n_head=25, n_layer=48),
}


def release_shapes(h: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a GPT-2 release (openai/gpt-2 src/model.py)."""
    e = h["n_embd"]
    shapes: dict[str, tuple[int, ...]] = {
        "model/wte": (h["n_vocab"], e),
        "model/wpe": (h["n_ctx"], e),
        "model/ln_f/g": (e,),
        "model/ln_f/b": (e,),
    }
    for i in range(h["n_layer"]):
        layer = {
            "ln_1/g": (e,), "ln_1/b": (e,), "attn/c_attn/w": (1, e, 3 * e), "attn/c_attn/b": (3 * e,),
            "attn/c_proj/w": (1, e, e), "attn/c_proj/b": (e,), "ln_2/g": (e,), "ln_2/b": (e,),
            "mlp/c_fc/w": (1, e, 4 * e), "mlp/c_fc/b": (4 * e,), "mlp/c_proj/w": (1, 4 * e, e), "mlp/c_proj/b": (e,),
        }  # fmt: skip
        shapes.update({f"model/h{i}/{name}": shape for name, shape in layer.items()})
    return shapes


def write_synthetic_release(folder: Path, hparams: dict[str, int], seed: int = 0) -> int:
    """Write a GPT-2 release folder of random weights, one tensor in memory at a time; returns its bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes = release_shapes(hparams)

    def make(shape: tuple[int, ...]) -> Any:
        return lambda: rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    TensorBundleWriter(folder / "model.ckpt").write({name: make(shape) for name, shape in shapes.items()})
    (folder / "checkpoint").write_text('model_checkpoint_path: "model.ckpt"\n')
    (folder / "hparams.json").write_text(json.dumps(hparams))
    vocab = Path(__file__).resolve().parent.parent / "tokenization" / "data" / "gpt2"
    for name in ("encoder.json", "vocab.bpe"):
        shutil.copyfile(vocab / name, folder / name)
    return sum(int(np.prod(s)) * 4 for s in shapes.values())


def _proc_status(field: str) -> int:
    """A memory figure of this process from /proc/self/status (Linux), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _start_measuring() -> int:
    """Reset the peak-RSS mark (VmHWM) so that it covers the conversion only; returns the RSS now.

    Writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS (Linux >= 4.0, proc(5)).
    """
    Path("/proc/self/clear_refs").write_text("5")
    return _proc_status("VmRSS")


def _run_hfgpt(source: str, output: str, dtype: str) -> dict[str, float]:
    import hfgpt.modeling  # noqa: F401 - the imports count as baseline, not as conversion memory
    from hfgpt.modeling.openai_release import convert_release

    baseline = _start_measuring()
    start = time.perf_counter()
    convert_release(source, output, dtype=dtype, tokenizer=False, model_card=False)
    return {
        "seconds": time.perf_counter() - start,
        "baseline_rss": baseline,
        "peak_rss": _proc_status("VmHWM"),
    }


def _run_peer(source: str, output: str, dtype: str) -> dict[str, float]:
    import torch
    from safetensors.torch import save_file

    from hfgpt.modeling.openai_release import GPT2Release

    baseline = _start_measuring()
    start = time.perf_counter()
    release = GPT2Release(source)
    state = {}
    for src, target, op in release.mapping():
        state[target] = torch.from_numpy(op.forward(release.get(src)).copy()).to(getattr(torch, dtype))
    release.close()
    Path(output).mkdir()
    save_file(state, str(Path(output) / "model.safetensors"), metadata={"format": "pt"})
    return {
        "seconds": time.perf_counter() - start,
        "baseline_rss": baseline,
        "peak_rss": _proc_status("VmHWM"),
    }


def _child(fn_name: str, args: tuple, queue: Any) -> None:
    queue.put(globals()[fn_name](*args))


def measure(fn_name: str, *args: str, isolate: bool = True) -> dict[str, float]:
    """Run one contender, in a fresh process when ``isolate`` (peak RSS is then its own)."""
    if not isolate:
        return globals()[fn_name](*args)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn_name, args, queue))
    proc.start()
    while True:  # a child that fails puts nothing: waiting on the queue alone would wait forever
        try:
            result = queue.get(timeout=1.0)
            break
        except Empty:
            if not proc.is_alive() and queue.empty():
                proc.join()
                raise RuntimeError(
                    f"{fn_name} exited with {proc.exitcode} without figures (its traceback is above)"
                ) from None
    proc.join()
    if proc.exitcode:
        raise RuntimeError(f"{fn_name} exited with {proc.exitcode}")
    return result


def run_benchmark(
    size: str = "1558M",
    dtype: str = "float32",
    workdir: str | None = None,
    isolate: bool = True,
    peer: bool = True,
) -> dict[str, Any]:
    hparams = SIZES[size]
    if workdir is not None and not Path(workdir).is_dir():
        raise NotADirectoryError(
            f"workdir {workdir} is not an existing folder (the release is written there)"
        )
    root = Path(tempfile.mkdtemp(prefix="bench_convert-", dir=workdir))
    try:
        start = time.perf_counter()
        weight_bytes = write_synthetic_release(root / "release", hparams)
        write_seconds = time.perf_counter() - start
        results: dict[str, Any] = {
            "size": size,
            "dtype": dtype,
            "weights_bytes_float32": weight_bytes,
            "write_release_seconds": write_seconds,
        }
        contenders = [("hfgpt", "_run_hfgpt")] + ([("peer", "_run_peer")] if peer else [])
        for label, fn in contenders:
            r = measure(fn, str(root / "release"), str(root / f"out-{label}"), dtype, isolate=isolate)
            r["excess_rss"] = r["peak_rss"] - r["baseline_rss"]
            r["excess_rss_over_weights"] = r["excess_rss"] / weight_bytes
            r["gb_per_s"] = weight_bytes / r["seconds"] / 1e9
            results[label] = r
            shutil.rmtree(root / f"out-{label}")
        if peer:
            results["ratio_seconds_hfgpt_over_peer"] = (
                results["hfgpt"]["seconds"] / results["peer"]["seconds"]
            )
            results["ratio_excess_rss_hfgpt_over_peer"] = (
                results["hfgpt"]["excess_rss"] / results["peer"]["excess_rss"]
            )
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _report(r: dict[str, Any]) -> str:
    gib = 2**30
    lines = [
        f"GPT-2 {r['size']} synthetic release: {r['weights_bytes_float32'] / gib:.2f} GiB float32 "
        f"(written in {r['write_release_seconds']:.1f} s), output {r['dtype']}",
        f"{'':8}{'seconds':>9}{'GB/s':>7}{'peak RSS':>11}{'baseline':>10}{'excess':>10}{'excess/weights':>16}",
    ]
    for label in ("hfgpt", "peer"):
        if label in r:
            x = r[label]
            lines.append(
                f"{label:8}{x['seconds']:9.2f}{x['gb_per_s']:7.2f}{x['peak_rss'] / gib:9.2f}Gi"
                f"{x['baseline_rss'] / gib:8.2f}Gi{x['excess_rss'] / gib:8.2f}Gi{x['excess_rss_over_weights']:16.2f}"
            )
    if "ratio_seconds_hfgpt_over_peer" in r:
        lines.append(
            f"hfgpt / peer: time {r['ratio_seconds_hfgpt_over_peer']:.2f}, "
            f"excess RSS {r['ratio_excess_rss_hfgpt_over_peer']:.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="1558M")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--workdir", default=None, help="where the temporary release is written")
    parser.add_argument("--no-peer", action="store_true", help="time hfgpt only")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    # Checked before the minutes of conversion, not after.
    if args.workdir is not None and not Path(args.workdir).is_dir():
        parser.error(f"--workdir {args.workdir} is not an existing folder; create it first")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json {args.json}: folder {args.json.parent} does not exist")
    results = run_benchmark(args.size, args.dtype, args.workdir, peer=not args.no_peer)
    print(_report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
