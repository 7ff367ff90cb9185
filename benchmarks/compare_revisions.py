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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
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
        median = statistics.median(ratios)
        lower = key[1] in LOWER_IS_BETTER
        rows.append(
            dict(
                zip(("family", "section", "case", "impl"), key, strict=True),
                unit=first["unit"],
                old=old_figures,
                new=new_figures,
                new_over_old=ratios,
                median_new_over_old=median,
                better="lower" if lower else "higher",
                no_worse=median <= 1.03 if lower else median >= 0.97,
            )
        )
    return rows


def format_comparison(result: dict[str, Any]) -> str:
    lines = [
        f"hfgpt {result['new']['revision']} against {result['base']['revision']}, {result['rounds']} rounds "
        f"of fresh processes in alternating order. Host: {result['host']}.",
        "",
        "| family | section | case | contender | old | new | new/old by round | median | within 3% or better |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        rounds = ", ".join(f"{ratio:.3f}" for ratio in row["new_over_old"])
        lines.append(
            f"| {row['family']} | {row['section']} | {row['case']} | {row['impl']} | "
            f"{statistics.median(row['old']):.4g} {row['unit']} | {statistics.median(row['new']):.4g} {row['unit']} | "
            f"{rounds} | {row['median_new_over_old']:.3f}x | {'yes' if row['no_worse'] else 'NO'} |"
        )
    lines += [
        "",
        "new/old: the rates' ratio (>1 = the new revision faster); for peak memory the peaks' (<1 = smaller). "
        "Old and new: medians over the rounds. transformers' rows are the same code in both arms: the noise.",
    ]
    return "\n".join(lines)


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
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    bench_args = ["--sections", args.sections, "--families", args.families, "--peers", args.peers]
    bench_args += ["--quick"] if args.quick else ["--tiny"] if args.tiny else []
    for option in ("repeats", "threads"):
        if getattr(args, option) is not None:
            bench_args += [f"--{option}", str(getattr(args, option))]
    with tempfile.TemporaryDirectory(prefix="hfgpt-compare-") as tmp:
        workdir = Path(tmp)
        with checkout(args.base, workdir) as base_tree, checkout(args.new, workdir) as new_tree:
            arms = {"base": arm_env(base_tree, workdir), "new": arm_env(new_tree, workdir)}
            for arm, tree in (("base", base_tree), ("new", new_tree)):
                found = imported_from(arms[arm])
                if found != (tree / "cpu").resolve():
                    raise RuntimeError(f"the {arm} arm imports hfgpt.cpu from {found}, not from {tree}")
            runs: dict[str, list[dict[str, Any]]] = {"base": [], "new": []}
            for round_ in range(args.rounds):
                for arm in ("base", "new") if round_ % 2 == 0 else ("new", "base"):
                    print(f"[round {round_ + 1}: {arm}]", file=sys.stderr)
                    runs[arm].append(run_arm(arms[arm], bench_args, workdir / f"{arm}-{round_}.json"))
    result = {
        "base": {"revision": revision_name(args.base), "runs": runs["base"]},
        "new": {"revision": revision_name(args.new), "runs": runs["new"]},
        "host": runs["new"][0]["machine"]["host"],
        "rounds": args.rounds,
        "bench_model_args": bench_args,
        "rows": compare(runs["base"], runs["new"]),
    }
    print(format_comparison(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
