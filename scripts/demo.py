"""hfgpt's demo: train a small GPT-2-style model from scratch to sort digits, with nothing to download.

    hfgpt-demo                       # under a minute on 2 CPU cores
    hfgpt-demo --output-dir /tmp/demo --steps 200   # a quicker, less accurate run

Each example is `<s> 3 1 4 1 5 9 2 6 > 1 1 2 3 4 5 6 9 </s>` (one token per character): the model sees
the digits, then learns to write them sorted; the loss covers only the sorted half. The run uses the
same pieces a real training would: a `tokenizers` WordLevel tokenizer wrapped in
`PreTrainedTokenizerFast`, `GPTConfig` / `GPTForCausalLM`, `Trainer`, `save_pretrained`, then
`AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` and `generate()` on held-out sequences. It
prints the exact-match accuracy and writes two pictures: the loss curve and the last layer's attention.

Exit status: 0 after the run; 2 for settings it cannot run with (a usage error from the argument parser,
or an `error: ...` line naming the setting).
"""

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    ProgressCallback,
    Trainer,
    TrainingArguments,
    set_seed,
)

import hfgpt.modeling  # noqa: F401  (registers hfgpt with the Auto classes)
from hfgpt.modeling import GPTConfig, GPTForCausalLM

BOS, EOS, PAD, SEP = "<s>", "</s>", "<pad>", ">"
DIGITS = "0123456789"


class DemoError(ValueError):
    """Bad demo settings; the message names the setting."""


def build_char_tokenizer(
    symbols: str, bos: str = BOS, eos: str = EOS, pad: str = PAD
) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per character of `symbols` (plus BOS/EOS/PAD), a WordLevel model from
    `tokenizers` wrapped in `PreTrainedTokenizerFast`: `save_pretrained` writes tokenizer.json, which
    `AutoTokenizer.from_pretrained` loads offline with no custom code."""
    vocab = {token: i for i, token in enumerate([pad, bos, eos, *dict.fromkeys(symbols)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    # Special tokens are matched first; every other character is its own token; decoding fuses them back.
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=eos, pad_token=pad)


@dataclass
class DemoSettings:
    """Sizes tuned so the full run reaches >= 0.99 exact match in under a minute on 2 CPU cores."""

    length: int = 8  # digits per sequence
    n_train: int = 20_000
    n_test: int = 500
    steps: int = 1500
    batch_size: int = 64
    learning_rate: float = 3e-3
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    seed: int = 0


class LossInProgressBar(ProgressCallback):
    """Trainer's progress bar, showing the latest loss beside it instead of printing every log line."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs and "loss" in logs:
            self.training_bar.set_postfix(loss=f"{logs['loss']:.4g}")


MAX_LENGTH = 64  # digits per sequence; see check_settings


def make_sequences(n: int, length: int, rng: random.Random, exclude: set[str] | None = None) -> list[str]:
    """`n` distinct digit strings, none in `exclude` (so the held-out set is truly unseen)."""
    seen = set(exclude or ())
    available = len(DIGITS) ** length - sum(len(s) == length and set(s) <= set(DIGITS) for s in seen)
    if n > available:
        # Drawing until n distinct strings turn up would never end.
        raise DemoError(
            f"{n} distinct sequences of {length} digits asked for, but only {available} are left "
            f"(of {len(DIGITS)}**{length})"
        )
    out: list[str] = []
    while len(out) < n:
        digits = "".join(rng.choice(DIGITS) for _ in range(length))
        if digits not in seen:
            seen.add(digits)
            out.append(digits)
    return out


def encode_example(tokenizer: PreTrainedTokenizerFast, digits: str) -> dict[str, list[int]]:
    """`<s> digits > sorted </s>`, labels -100 on the prompt so the loss covers only the sorted half."""
    prompt = tokenizer(BOS + digits + SEP, add_special_tokens=False)["input_ids"]
    answer = tokenizer("".join(sorted(digits)) + EOS, add_special_tokens=False)["input_ids"]
    return {"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer}


def exact_match(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, tests: list[str]) -> float:
    """Greedy `generate()` on each prompt; a sequence counts only if every sorted digit is right."""
    prompts = [BOS + digits + SEP for digits in tests]
    batch = tokenizer(prompts, add_special_tokens=False, return_tensors="pt")
    length = len(tests[0])
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=length,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(a == "".join(sorted(d)) for a, d in zip(answers, tests, strict=True)) / len(tests)


def plot_loss(log_history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    points = [(e["step"], e["loss"]) for e in log_history if "loss" in e]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot([s for s, _ in points], [v for _, v in points], color="tab:blue")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy on the sorted half (log scale)")
    ax.set_title("hfgpt demo: learning to sort digits")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def plot_attention(attentions: torch.Tensor, tokens: list[str], path: Path) -> None:
    """attentions: (H, T, T) of the last layer for one example; one panel per head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_head = attentions.shape[0]
    fig, axes = plt.subplots(1, n_head, figsize=(3.2 * n_head, 3.6), dpi=120, squeeze=False)
    for h, ax in enumerate(axes[0]):
        ax.imshow(attentions[h].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_xticks(range(len(tokens)), tokens, fontsize=6)
        ax.set_yticks(range(len(tokens)), tokens, fontsize=6)
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xlabel("attends to (key)", fontsize=7)
    axes[0][0].set_ylabel("query position", fontsize=7)
    fig.suptitle("last layer attention weights (rows: query tokens)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def check_settings(s: DemoSettings) -> None:
    """Refuse settings the demo cannot run with, naming the one at fault."""
    if s.length < 2:
        raise DemoError(f"length {s.length}: a sequence needs at least 2 digits to sort")
    if s.length > MAX_LENGTH:
        raise DemoError(
            f"length {s.length}: at most {MAX_LENGTH} digits (the model's context is 2 * length + 3 "
            "positions, and a small model learns short sorts in minutes)"
        )
    if s.steps < 1:
        raise DemoError(f"steps {s.steps}: train at least 1 step")
    if s.n_test < 1:
        raise DemoError(f"n_test {s.n_test}: the accuracy needs at least 1 held-out sequence")
    if s.n_train < s.batch_size:
        raise DemoError(f"n_train {s.n_train}: fewer training sequences than one batch ({s.batch_size})")
    distinct = len(DIGITS) ** s.length
    if s.n_train + s.n_test > distinct:
        raise DemoError(
            f"n_train + n_test = {s.n_train + s.n_test} distinct sequences, but only {distinct} of "
            f"length {s.length} exist; lower --n-train / --n-test or raise --length"
        )


def run_demo(
    output_dir: str | os.PathLike = "hfgpt-demo-output", settings: DemoSettings | None = None
) -> dict:
    """Train, save, reload, evaluate and draw. Returns accuracy, paths and timings."""
    s = settings or DemoSettings()
    check_settings(s)
    start = time.perf_counter()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    set_seed(s.seed)
    rng = random.Random(s.seed)
    tests = make_sequences(s.n_test, s.length, rng)
    train = make_sequences(s.n_train, s.length, rng, exclude=set(tests))

    tokenizer = build_char_tokenizer(DIGITS + SEP)
    config = GPTConfig(
        vocab_size=len(tokenizer),
        n_positions=2 * s.length + 3,  # <s> digits > sorted </s>
        n_embd=s.n_embd,
        n_layer=s.n_layer,
        n_head=s.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = GPTForCausalLM(config)
    dataset = Dataset.from_list([encode_example(tokenizer, d) for d in train])
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=s.steps,
        per_device_train_batch_size=s.batch_size,
        learning_rate=s.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, s.steps // 20),
        weight_decay=0.01,
        logging_steps=max(1, s.steps // 60),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        optim="adamw_torch_fused",  # one fused kernel per step: far faster on the CPU than the for-loop AdamW
        seed=s.seed,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(LossInProgressBar)
    trainer.train()
    train_seconds = time.perf_counter() - start

    model_dir = out / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    # Reload through the Auto classes, as a user of the saved folder would.
    reloaded = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    reloaded_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    accuracy = exact_match(reloaded, reloaded_tokenizer, tests)

    example = encode_example(reloaded_tokenizer, tests[0])["input_ids"][:-1]
    with torch.no_grad():
        attentions = reloaded(torch.tensor([example]), output_attentions=True).attentions[-1][0]  # (H, T, T)
    loss_png, attention_png = out / "loss_curve.png", out / "attention_last_layer.png"
    plot_loss(trainer.state.log_history, loss_png)
    plot_attention(attentions, reloaded_tokenizer.convert_ids_to_tokens(example), attention_png)
    return {
        "accuracy": accuracy,
        "model_dir": str(model_dir),
        "loss_curve": str(loss_png),
        "attention": str(attention_png),
        "train_seconds": train_seconds,
        "total_seconds": time.perf_counter() - start,
        "final_loss": next(e["loss"] for e in reversed(trainer.state.log_history) if "loss" in e),
    }


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse reports anything else as a usage error, exit 2)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    defaults = DemoSettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="hfgpt-demo-output", help="where the model and pictures go")
    parser.add_argument("--steps", type=positive_int, default=defaults.steps, help="training steps")
    parser.add_argument("--length", type=int, default=defaults.length, help="digits per sequence")
    parser.add_argument("--n-train", type=positive_int, default=defaults.n_train, help="training sequences")
    parser.add_argument(
        "--n-test", type=positive_int, default=defaults.n_test, help="held-out sequences to sort"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="CPU threads for torch (default 1: the model is so small that a second thread mostly waits "
        "at OpenMP barriers, which on a busy machine makes training many times slower)",
    )
    args = parser.parse_args(argv)
    settings = DemoSettings(
        steps=args.steps, length=args.length, n_train=args.n_train, n_test=args.n_test, seed=args.seed
    )
    try:
        check_settings(settings)  # before anything is set or written
        torch.set_num_threads(args.threads)
        result = run_demo(args.output_dir, settings)
    except DemoError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"model and tokenizer: {result['model_dir']}")
    print(f"loss curve: {result['loss_curve']}")
    print(f"attention: {result['attention']}")
    print(f"training took {result['train_seconds']:.0f} s, {result['total_seconds']:.0f} s in all")
    print(f"exact-match accuracy: {result['accuracy']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
