"""Two revisions of hfgpt on this host, side by side: `bench_model.py`'s sections run against each, every arm
in fresh processes, in interleaved rounds (old then new, new then old, ...), with each row's new/old ratio
round by round.

    python benchmarks/compare_revisions.py --base main~1                   # old main against this checkout
    python benchmarks/compare_revisions.py --base REV --quick --sections ttft,prefill,decode,lowp,train
    .ci/as-avx2 python benchmarks/compare_revisions.py --base main~1 --json old-new-avx2.json

Only hfgpt differs between the arms: both run this checkout's benchmark scripts (the same contenders,
rounds and host naming), each importing hfgpt from its own revision. A revision is checked out with
`git worktree add --detach` into a temporary folder (removed after); a folder holding a checkout may be
named instead. An arm's processes find its packages first on PYTHONPATH, in a folder `hfgpt/` of links to
them (`modeling/`, `cpu/`, ...), ahead of the editable install's finder; each arm checks that it did.
hfgpt's C kernels build once per revision (their cache names the sources' hash). transformers' rows run
the same code in both arms: their ratios show how far the host's noise alone moves a row.

`--paired` resolves finer differences in the decoding rows (GPT-2, float32 B=1 and B=8, the int8 copy,
time to first token; transformers beside each as the control). A round of `bench_model.py` lasts minutes,
and a shared host's speed moves by tens of percent between minutes, so its rounds' ratios spread wide. Here
each arm's process stays up with its models built, and the two take turns one run at a time (`--runs`
turns, the order alternating), the other arm idle meanwhile: each new/old ratio is taken between two runs
seconds apart. The process itself can be fast or slow (where its memory landed), so this repeats in
`--pairs` fresh pairs of processes; a row's ratio by pair is the median of its runs' ratios.

    python benchmarks/compare_revisions.py --base REV --paired --pairs 6 --runs 8 --json old-new.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Where each of hfgpt's packages lives in a checkout (pyproject.toml's [tool.setuptools.package-dir]).
PACKAGES = ("modeling", "cpu", "tokenization", "scripts", "model_cards")
# A row's figure is a rate (higher is better) except peak memory's (lower is better).
LOWER_IS_BETTER = {"memory"}


@contextlib.contextmanager
def checkout(revision: str, workdir: Path) -> Iterator[Path]:
    """A folder holding `revision`: the folder itself where one is named, else a `git worktree` of this
    repository's revision in `workdir`, removed on leaving."""
    if Path(revision).is_dir():
        yield Path(revision).resolve()
        return
    target = workdir / f"checkout-{len(list(workdir.iterdir()))}"
    git = ["git", "-C", str(ROOT)]
    subprocess.run([*git, "worktree", "add", "--detach", "--quiet", str(target), revision], check=True)
    try:
        yield target
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(target)], check=False)


def arm_env(tree: Path, workdir: Path) -> dict[str, str]:
    """The environment of an arm's processes: PYTHONPATH led by a folder whose `hfgpt/` links to `tree`'s
    packages, so that `import hfgpt.cpu` finds `tree`'s (namespace packages, as the editable install's)."""
    links = Path(tempfile.mkdtemp(prefix="hfgpt-arm-", dir=workdir))
    (links / "hfgpt").mkdir()
    for package in PACKAGES:
        if (tree / package).is_dir():
            (links / "hfgpt" / package).symlink_to(tree / package, target_is_directory=True)
    path = os.pathsep.join(p for p in (str(links), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TRANSFORMERS_VERBOSITY": "error"}


def imported_from(env: dict[str, str]) -> Path:
    """The folder `hfgpt.cpu` is imported from under `env` (its links resolved)."""
    code = "import hfgpt.cpu, os; print(os.path.realpath(os.path.dirname(hfgpt.cpu.__file__)))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"cannot import hfgpt.cpu from {env['PYTHONPATH']}:\n{out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def run_arm(env: dict[str, str], bench_args: list[str], out: Path) -> dict[str, Any]:
    """One arm, one round: `bench_model.py bench_args` in a fresh process under `env`; its figures."""
    command = [sys.executable, str(HERE / "bench_model.py"), *bench_args, "--json", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def compare(old_runs: list[dict[str, Any]], new_runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row (family, section, case, contender) both arms measured in every round: each arm's figure by
    round and the new/old ratio of each round (the two arms of a round meet the same minutes), their median;
    `no_worse` where that median is at least 0.97 (a rate) or at most 1.03 (peak memory)."""

    def by_key(run: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
        return {(r["family"], r["section"], r["case"], r["impl"]): r for r in run["rows"]}

    old, new = [by_key(run) for run in old_runs], [by_key(run) for run in new_runs]
    rows = []
    for key, first in new[0].items():
        if not all(key in arm for arm in old + new):
            continue
        old_figures, new_figures = [arm[key]["rate"] for arm in old], [arm[key]["rate"] for arm in new]
        ratios = [n / o for n, o in zip(new_figures, old_figures, strict=True)]
        rows.append(comparison_row(key, first["unit"], old_figures, new_figures, ratios))
    return rows


def comparison_row(
    key: tuple, unit: str, old: list[float], new: list[float], ratios: list[float]
) -> dict[str, Any]:
    """A row of the comparison: each arm's figure and the new/old ratio by round, their median, and
    `no_worse` where that median is at least 0.97 (a rate) or at most 1.03 (peak memory)."""
    median = statistics.median(ratios)
    lower = key[1] in LOWER_IS_BETTER
    return dict(
        zip(("family", "section", "case", "impl"), key, strict=True),
        unit=unit,
        old=old,
        new=new,
        new_over_old=ratios,
        median_new_over_old=median,
        better="lower" if lower else "higher",
        no_worse=median <= 1.03 if lower else median >= 0.97,
    )


def format_comparison(result: dict[str, Any]) -> str:
    by = "pair" if "pairs" in result else "round"
    lines = [
        f"hfgpt {result['new']['revision']} against {result['base']['revision']}, {result['method']}. "
        f"Host: {result['host']}.",
        "",
        f"| family | section | case | contender | old | new | new/old by {by} | median | within 3% or better |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        rounds = ", ".join(f"{ratio:.3f}" for ratio in row["new_over_old"])
        lines.append(
            f"| {row['family']} | {row['section']} | {row['case']} | {row['impl']} | "
            f"{statistics.median(row['old']):.4g} {row['unit']} | {statistics.median(row['new']):.4g} {row['unit']} | "
            f"{rounds} | {row['median_new_over_old']:.3f}x | {'yes' if row['no_worse'] else 'NO'} |"
        )
    differ = [
        f"{row['section']} {row['case']} {row['impl']} "
        + (
            "(between the arms)"
            if all(len(row["tokens"][arm]) == 1 for arm in row["tokens"])
            else "(between runs)"
        )
        for row in result["rows"]
        if not row.get("tokens_identical", True)
    ]
    if any("tokens_identical" in row for row in result["rows"]):
        lines += ["", f"Tokens differing between runs or arms: {', '.join(differ) or 'none'}."]
    lines += [
        "",
        "new/old: the rates' ratio (>1 = the new revision faster); for peak memory the peaks' (<1 = smaller). "
        "Old and new: medians over the "
        f"{by}s. transformers' rows are the same code in both arms: the noise.",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Paired processes (`--paired`)


def paired_worker(profile_name: str, threads: int | None) -> int:
    """`--worker PROFILE`: one arm's process of `--paired`, importing hfgpt from its arm's checkout. Builds
    GPT-2 (`build_ours`' weights), transformers' model on the same weights and the int8 copy, runs each task
    once untimed, says which tasks it has; then for each task named on stdin, one timed run: its seconds and
    a digest of its tokens, a JSON line each. Whatever else prints goes to stderr."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from functools import partial

    import torch
    from contenders import INT8, build_ours, build_peer, first_token_prompt, greedy, left_padded_prompts
    from harness import PROFILES, machine_info

    from hfgpt.cpu import quantize_for_decoding

    if threads:
        torch.set_num_threads(threads)
    profile = PROFILES[profile_name]
    ours = build_ours("gpt2", profile["model_overrides"], "cpu").eval()
    peer = build_peer(ours).eval()
    length, new, vocab = profile["prompt_len"], profile["new_tokens"], ours.config.vocab_size
    tasks = {}  # (section, case, contender): (run, work done in the run's unit, unit)
    for batch in profile["decode_batches"]:
        prompts = left_padded_prompts(batch, length, vocab, 0, "cpu")
        for impl, model in (("hfgpt", ours), ("transformers", peer)):
            run = partial(greedy, model, prompts, new)
            tasks[("decode", f"B={batch}, {length}+{new} tokens", impl)] = (run, batch * new, "new tok/s")
    one_row = left_padded_prompts(1, length, vocab, 0, "cpu")
    run = partial(greedy, quantize_for_decoding(ours), one_row, new)
    tasks[("lowp", f"B=1, {length}+{new} tokens", INT8)] = (run, new, "new tok/s")
    prompt = first_token_prompt(length, vocab, "cpu")
    for impl, model in (("hfgpt", ours), ("transformers", peer)):
        run = partial(greedy, model, prompt, 1)
        tasks[("ttft", f"B=1, {length}-token prompt + first token", impl)] = (run, 1, "first tokens/s")
    with torch.inference_mode():
        for run, _, _ in tasks.values():
            run()
    listed = [[*key, work, unit] for key, (_, work, unit) in tasks.items()]
    reply.write(json.dumps({"machine": machine_info("cpu"), "tasks": listed}) + "\n")
    for line in sys.stdin:
        run = tasks[tuple(json.loads(line))][0]
        with torch.inference_mode():
            start = time.perf_counter()
            tokens = run()
            seconds = time.perf_counter() - start
        digest = hashlib.sha256(tokens.numpy().tobytes()).hexdigest()[:16]
        reply.write(json.dumps({"seconds": seconds, "tokens": digest}) + "\n")
    return 0


class PairedArm:
    """One arm's `paired_worker` process: `answer()` reads its next JSON line, `run(task)` times one task."""

    def __init__(self, name: str, env: dict[str, str], profile: str, threads: int | None, log: Path):
        self.name, self.log_path = name, log
        command = [sys.executable, __file__, "--worker", profile, *([str(threads)] if threads else [])]
        with log.open("w") as stderr:
            self.process = subprocess.Popen(
                command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True
            )

    def answer(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise RuntimeError(
                f"the {self.name} arm's --paired worker ended (exit status {self.process.returncode}):\n"
                f"{self.log_path.read_text()[-3000:]}"
            )
        return json.loads(line)

    def run(self, task: list[str]) -> dict[str, Any]:
        self.process.stdin.write(json.dumps(task) + "\n")
        self.process.stdin.flush()
        return self.answer()

    def close(self, kill: bool = False) -> None:
        """End the process: its stdin closed, which ends its loop; killed where `kill` (a failed comparison)
        or where it has not ended within a minute."""
        if kill:
            self.process.kill()
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def paired(
    arms: dict[str, dict[str, str]], profile: str, threads: int | None, pairs: int, runs: int, workdir: Path
) -> dict[str, Any]:
    """`pairs` pairs of `paired_worker` processes, one per arm; in each, `runs` turns of every task, each task
    run by one arm then the other (the order alternating by turn and by pair). Per task and pair: each arm's
    median rate, and the median of the turns' new/old rate ratios. Also each run's seconds, the order of
    the turns, and the digests of the tokens each arm's runs gave (`tokens_identical`: one for all)."""
    seconds: dict[tuple, dict[str, list[list[float]]]] = {}
    digests: dict[tuple, dict[str, set[str]]] = {}
    orders, host = [], None
    for pair in range(pairs):
        workers = {
            name: PairedArm(name, env, profile, threads, workdir / f"{name}-{pair}.log")
            for name, env in arms.items()
        }
        failed = True
        try:
            ready = {name: worker.answer() for name, worker in workers.items()}
            tasks = ready["new"]["tasks"]
            if ready["base"]["tasks"] != tasks:
                raise RuntimeError(f"the arms list other tasks: {ready['base']['tasks']} and {tasks}")
            host = ready["new"]["machine"]["host"]
            for task in tasks:
                seconds.setdefault(tuple(task), {"base": [], "new": []})
                for name in workers:
                    seconds[tuple(task)][name].append([])
            for turn in range(runs):
                order = ("base", "new") if (pair + turn) % 2 == 0 else ("new", "base")
                orders.append(list(order))
                for task in tasks:
                    for name in order:
                        answer = workers[name].run(task[:3])
                        seconds[tuple(task)][name][-1].append(answer["seconds"])
                        digests.setdefault(tuple(task), {"base": set(), "new": set()})[name].add(
                            answer["tokens"]
                        )
            failed = False
        finally:
            for worker in workers.values():
                worker.close(kill=failed)
    rows = []
    for (section, case, impl, work, unit), times in seconds.items():
        old = [statistics.median(work / t for t in pair) for pair in times["base"]]
        new = [statistics.median(work / t for t in pair) for pair in times["new"]]
        ratios = [
            statistics.median(o / n for o, n in zip(old_pair, new_pair, strict=True))
            for old_pair, new_pair in zip(times["base"], times["new"], strict=True)
        ]
        row = comparison_row(("gpt2", section, case, impl), unit, old, new, ratios)
        tokens = {name: sorted(found) for name, found in digests[(section, case, impl, work, unit)].items()}
        row.update(seconds=times, tokens=tokens, tokens_identical=len({*tokens["base"], *tokens["new"]}) == 1)
        rows.append(row)
    return {"host": host, "orders": orders, "rows": rows}


def revision_name(revision: str) -> str:
    """`revision` with the commit it names (a folder: the commit checked out there, "+ uncommitted changes" where its
    files differ from it)."""
    folder = Path(revision).is_dir()
    command = (
        ["describe", "--always", "--dirty= + uncommitted changes"]
        if folder
        else ["rev-parse", "--short", revision]
    )
    where = str(Path(revision).resolve()) if folder else str(ROOT)
    out = subprocess.run(["git", "-C", where, *command], capture_output=True, text=True, check=False)
    commit = out.stdout.strip() if out.returncode == 0 else "not a git checkout"
    name = where if folder else revision
    return name if commit == name else f"{name} ({commit})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the old revision (or a folder holding a checkout)")
    parser.add_argument(
        "--new", default=str(ROOT), help="the new revision or folder (default: this checkout)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each arm once a round (default 2)")
    parser.add_argument("--json", type=Path, help="write the comparison to this JSON file")
    parser.add_argument("--sections", default="prefill,ttft,decode,lowp,train", help="bench_model.py's")
    parser.add_argument("--families", default="gpt2", help="bench_model.py's (default gpt2)")
    parser.add_argument("--peers", default="none", help="bench_model.py's (default none)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="bench_model.py's --quick")
    size.add_argument("--tiny", action="store_true", help="bench_model.py's --tiny (a smoke run)")
    parser.add_argument("--repeats", type=int, help="bench_model.py's --repeats")
    parser.add_argument("--threads", type=int, help="bench_model.py's --threads")
    parser.add_argument(
        "--paired",
        action="store_true",
        help="the decoding rows (GPT-2) in pairs of long-lived processes taking turns, run by run "
        "(--sections, --families, --peers, --rounds and --repeats do not apply)",
    )
    parser.add_argument("--pairs", type=int, default=4, help="--paired: pairs of processes (default 4)")
    parser.add_argument("--runs", type=int, default=8, help="--paired: turns per pair (default 8)")
    args = parser.parse_args(argv)
    for option in ("rounds", "pairs", "runs"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1, not {getattr(args, option)}")
    bench_args = ["--sections", args.sections, "--families", args.families, "--peers", args.peers]
    bench_args += ["--quick"] if args.quick else ["--tiny"] if args.tiny else []
    for option in ("repeats", "threads"):
        if getattr(args, option) is not None:
            bench_args += [f"--{option}", str(getattr(args, option))]
    profile = "tiny" if args.tiny else "quick" if args.quick else "full"
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="hfgpt-compare-") as tmp:
        workdir = Path(tmp)
        with checkout(args.base, workdir) as base_tree, checkout(args.new, workdir) as new_tree:
            arms = checked_arms(base_tree, new_tree, workdir)
            if args.paired:
                measured = paired(arms, profile, args.threads, args.pairs, args.runs, workdir)
            for round_ in range(0 if args.paired else args.rounds):
                for arm in ("base", "new") if round_ % 2 == 0 else ("new", "base"):
                    print(f"[round {round_ + 1}: {arm}]", file=sys.stderr)
                    runs[arm].append(run_arm(arms[arm], bench_args, workdir / f"{arm}-{round_}.json"))
    base, new = {"revision": revision_name(args.base)}, {"revision": revision_name(args.new)}
    if args.paired:
        result = {
            "base": base,
            "new": new,
            "method": f"{args.pairs} pairs of processes taking turns, {args.runs} runs each (`--paired`)",
            "host": measured["host"],
            "pairs": args.pairs,
            "runs": args.runs,
            "profile": profile,
            "orders": measured["orders"],
            "rows": measured["rows"],
        }
    else:
        result = {
            "base": {**base, "runs": runs["base"]},
            "new": {**new, "runs": runs["new"]},
            "method": f"{args.rounds} rounds of fresh processes in alternating order",
            "host": runs["new"][0]["machine"]["host"],
            "rounds": args.rounds,
            "bench_model_args": bench_args,
            "rows": compare(runs["base"], runs["new"]),
        }
    return publish_comparison(result, args.json)


def checked_arms(base_tree: Path, new_tree: Path, workdir: Path) -> dict[str, dict[str, str]]:
    """The two arms' environments (`arm_env`), each checked to import hfgpt from its own tree."""
    arms = {"base": arm_env(base_tree, workdir), "new": arm_env(new_tree, workdir)}
    for arm, tree in (("base", base_tree), ("new", new_tree)):
        found = imported_from(arms[arm])
        if found != (tree / "cpu").resolve():
            raise RuntimeError(f"the {arm} arm imports hfgpt.cpu from {found}, not from {tree}")
    return arms


def publish_comparison(result: dict[str, Any], path: Path | None) -> int:
    """Print the comparison's table; write it as JSON to `path` where given (`harness.write_json`: strict
    JSON, written aside, then moved into place)."""
    print(format_comparison(result))
    if path:
        from harness import write_json  # (torch and hfgpt: loaded once the arms have run)

        write_json(path, result)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(paired_worker(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None))
    sys.exit(main())
