"""The accuracy cost of hfgpt's lower-precision decoding copies on *trained* weights.

`quantize_for_decoding` makes bfloat16 and int8-weight copies of a model (and a float32 copy that
should change nothing). `bench_model.py`'s `lowp` section times them on random weights, whose nearly
flat output distribution says little about accuracy: a tiny error flips the argmax there. This script
compares each copy with the float32 model on held-out text: the loss (and perplexity), the logit error,
top-1 agreement, and the tokens of greedy continuations.

    python benchmarks/lowp_accuracy.py --json lowp.json                # GPT-2 124M, trained here first
    python benchmarks/lowp_accuracy.py --model PATH --text FILE ...    # a converted release, your text

Without `--model`, GPT-2 124M shapes are trained here for `--steps` steps (inside CPU bfloat16 autocast
where the CPU has bfloat16 products, else in float32; float32 weights) on a local English corpus: the
docstrings of the installed transformers package, one file in ten held out. That is a briefly trained
model, not OpenAI's: it has learned the common tokens, not the large activation outliers of the real
GPT-2, which are what int8 weights are most sensitive to. With `--model` (any checkpoint
`GPTForCausalLM.from_pretrained` reads, e.g. one written by `hfgpt-convert`) the same figures come from the
real weights.
"""

from __future__ import annotations

import argparse
import ast
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from harness import bfloat16_native, host_line, machine_info, publish  # (a sibling script's module)
from transformers import AutoTokenizer

from hfgpt.cpu import quantize_for_decoding
from hfgpt.modeling import GPTConfig, GPTForCausalLM
from hfgpt.tokenization import GPT2Tokenizer

PROFILES = {
    # seq_len, batch, eval sequences, greedy prompts, prompt / new tokens
    "full": dict(seq_len=256, batch=4, eval_rows=16, prompts=8, prompt_len=32, new_tokens=64),
    "tiny": dict(seq_len=32, batch=4, eval_rows=4, prompts=2, prompt_len=8, new_tokens=8),
}


def docstring_corpus(package_dir: Path, max_files: int | None = None) -> tuple[str, str]:
    """(training text, held-out text): the module, class and function docstrings of the `.py` files
    under `package_dir` in sorted order, every tenth file held out."""
    train, held_out = [], []
    files = sorted(package_dir.rglob("*.py"))[:max_files]
    for index, path in enumerate(files):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef))]
        docs = [doc for node in nodes if (doc := ast.get_docstring(node))]
        (held_out if index % 10 == 9 else train).extend(docs)
    return "\n\n".join(train), "\n\n".join(held_out)


def read_texts(paths: list[Path]) -> str:
    texts = []
    for path in paths:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as error:
            raise SystemExit(f"cannot read --text file {path}: {error}") from None
    return "\n\n".join(texts)


def as_rows(ids: list[int], seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Consecutive, non-overlapping rows of `seq_len` tokens (the remainder dropped)."""
    rows = len(ids) // seq_len if limit is None else min(limit, len(ids) // seq_len)
    if rows == 0:
        raise SystemExit(f"the text holds {len(ids)} tokens, fewer than one row of {seq_len}")
    return torch.tensor(ids[: rows * seq_len]).view(rows, seq_len)


def train(model: GPTForCausalLM, rows: torch.Tensor, steps: int, batch: int, seed: int) -> dict[str, float]:
    """`steps` AdamW steps (linear warm-up, cosine decay) on random batches of `rows`, inside CPU
    bfloat16 autocast where the CPU has bfloat16 products, else in float32."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            (s + 1) / warmup
            if s < warmup
            else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))
        ),
    )
    # (not on torch's slow reference loop of bfloat16 products, which would take ten times float32's time)
    in_bfloat16 = bfloat16_native("cpu")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=in_bfloat16)
    model.train()
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        ids = rows[torch.randint(len(rows), (batch,), generator=generator)]
        with autocast:
            loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    tail = losses[-max(1, steps // 10) :]
    return {
        "steps": steps,
        "precision": "bfloat16 autocast" if in_bfloat16 else "float32",
        "first_loss": losses[0],
        "last_loss": sum(tail) / len(tail),
        "seconds": time.perf_counter() - start,
    }


@torch.inference_mode()
def compare(
    reference: GPTForCausalLM,
    variants: dict[str, torch.nn.Module],
    rows: torch.Tensor,
    prompts: torch.Tensor,
    new: int,
) -> dict[str, dict[str, float]]:
    """Each variant against `reference` on held-out `rows` (loss, logit error, top-1 agreement) and on
    greedy continuations of `prompts`."""

    def loss_of(logits: torch.Tensor) -> float:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), rows[:, 1:].flatten()).item()

    def greedy(model: torch.nn.Module) -> torch.Tensor:
        mask = torch.ones_like(prompts)
        out = model.generate(
            input_ids=prompts,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=reference.config.eos_token_id or 0,
        )
        return out[:, prompts.shape[1] :]

    ref_logits = reference(rows).logits.float()
    ref_tokens = greedy(reference)
    figures = {"float32": {"loss": loss_of(ref_logits), "perplexity": math.exp(loss_of(ref_logits))}}
    for name, model in variants.items():
        logits = model(rows).logits.float()
        tokens = greedy(model)
        agree = tokens == ref_tokens
        # Per prompt: tokens before the first that differs (all of them where none does).
        prefix = torch.where(agree.all(1), new, (~agree).int().argmax(1)).float()
        loss = loss_of(logits)
        figures[name] = {
            "loss": loss,
            "perplexity": math.exp(loss),
            "rel_logit_err": ((logits - ref_logits).norm() / ref_logits.norm()).item(),
            "max_abs_logit_err": (logits - ref_logits).abs().max().item(),
            "top1_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
            "greedy_token_agreement": agree.float().mean().item(),
            "greedy_prompts_identical": agree.all(1).float().mean().item(),
            "greedy_mean_first_divergence": prefix.mean().item(),
        }
    return figures


def run(args: argparse.Namespace) -> dict[str, Any]:
    profile = PROFILES["tiny" if args.tiny else "full"]
    torch.manual_seed(args.seed)
    training = None
    held_out_text = read_texts(args.text) if args.text else None
    if args.model:
        try:
            model = GPTForCausalLM.from_pretrained(args.model).float().eval()
        except (OSError, ValueError) as error:
            raise SystemExit(f"cannot load --model {args.model}: {error}") from None
        tokenizer = (
            AutoTokenizer.from_pretrained(args.model)
            if (Path(args.model) / "tokenizer_config.json").exists()
            else GPT2Tokenizer()
        )
    else:
        tokenizer = GPT2Tokenizer()
        if args.tiny:
            config = GPTConfig(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=4)
        else:
            config = GPTConfig.from_preset("gpt2")
        model = GPTForCausalLM(config)
    train_text = ""
    if held_out_text is None or not args.model:
        train_text, corpus_held_out = docstring_corpus(
            Path(transformers.__file__).parent, max_files=60 if args.tiny else None
        )
        held_out_text = held_out_text or corpus_held_out
    seq_len = min(profile["seq_len"], model.config.n_positions)
    held_out = as_rows(tokenizer(held_out_text, verbose=False)["input_ids"], seq_len)
    if not args.model:
        training = train(
            model,
            as_rows(tokenizer(train_text, verbose=False)["input_ids"], seq_len),
            args.steps,
            profile["batch"],
            args.seed,
        )
        if args.save:  # written next to the folder, then moved into place once complete
            partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=Path(args.save).parent))
            model.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
            partial.rename(args.save)
    eval_rows = held_out[: profile["eval_rows"]]
    prompts = held_out[-profile["prompts"] :, : profile["prompt_len"]]
    variants = {
        "float32 copy": quantize_for_decoding(model, torch.float32),
        "bfloat16": quantize_for_decoding(model, torch.bfloat16),
        "int8 weights": quantize_for_decoding(model),
    }
    return {
        "model": args.model or f"GPT-2 {'tiny' if args.tiny else '124M'} shapes, trained here",
        "machine": machine_info("cpu"),
        "training": training,
        "held_out_tokens": held_out.numel(),
        "eval_shape": list(eval_rows.shape),
        "greedy": {
            "prompts": len(prompts),
            "prompt_len": prompts.shape[1],
            "new_tokens": profile["new_tokens"],
        },
        "figures": compare(model, variants, eval_rows, prompts, profile["new_tokens"]),
    }


def format_report(report: dict[str, Any]) -> str:
    host = host_line(report["machine"]) if "machine" in report else "not recorded"
    lines = [f"Model: {report['model']}. Host: {host}."]
    if report["training"]:
        t = report["training"]
        precision = f" ({t['precision']})" if "precision" in t else ""  # (not recorded by older runs)
        lines.append(
            f"Trained {t['steps']} steps{precision} in {t['seconds']:.0f} s: "
            f"loss {t['first_loss']:.2f} -> {t['last_loss']:.2f}."
        )
    g = report["greedy"]
    lines += [
        f"Held out: {report['eval_shape'][0]} x {report['eval_shape'][1]} tokens; greedy: {g['prompts']} prompts "
        f"of {g['prompt_len']} tokens, {g['new_tokens']} new tokens each.",
        "",
        "| weights | held-out loss (perplexity) | relative logit error | max abs logit error | top-1 agreement | "
        "greedy tokens equal | prompts identical | mean first divergence |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, f in report["figures"].items():
        if name == "float32":
            lines.append(
                f"| float32 (reference) | {f['loss']:.4f} ({f['perplexity']:.1f}) | 0 | 0 | 100% | 100% | 100% | - |"
            )
            continue
        lines.append(
            f"| {name} | {f['loss']:.4f} ({f['perplexity']:.1f}) | {f['rel_logit_err']:.2%} | "
            f"{f['max_abs_logit_err']:.3g} | {f['top1_agreement']:.1%} | {f['greedy_token_agreement']:.1%} | "
            f"{f['greedy_prompts_identical']:.0%} | {f['greedy_mean_first_divergence']:.1f} tokens |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a checkpoint folder to evaluate (default: train GPT-2 124M here)")
    parser.add_argument(
        "--text", type=Path, nargs="+", help="held-out text files (default: the docstring corpus)"
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps without --model (default 300)")
    parser.add_argument("--save", help="also save the model trained here to this folder")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and corpus: a smoke run of seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, not {args.steps}")
    if args.save and Path(args.save).exists():
        parser.error(f"--save {args.save} exists already; name a new folder")
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
    report = run(args)
    publish(format_report(report), report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
