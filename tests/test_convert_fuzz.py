"""Seeded random damage to both release fixtures, run through hfgpt-convert.

Each case copies a release (hard links), damages one of its files (a flipped bit, a truncation, inserted
or deleted bytes; half of them within the first 128 bytes, where the headers are) and converts it in
process through ``main(argv)``. Every outcome must be a documented exit code: 0, or 3/4 with exactly one
``error: ...`` line on stderr, no traceback, no output folder and no temporary folder left behind, each in
well under 30 s. A damaged release that still converts must give what the intact one gives where the data
is checksummed (GPT-2: every output file byte for byte, so the same logits). GPT-1's .npy shards carry no
checksum, so damage to their values converts; those cases are reported by tensor name, and each must be
visible in the ``--sha256`` digests the converter prints, which is how a user catches it.

A few refused cases (one of each exit code of each release, and a hand-made FIFO) run again in one
separate process, the script file executed as ``__main__`` once per case (``runpy``: torch is imported
once, not once a case), to show what reaches a real stderr: one ``error:`` line each, no traceback.
The seed is fixed, so a failure names a case that reruns the same way.
"""

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.numpy import load_file

from hfgpt.modeling.openai_release import open_release
from hfgpt.scripts.convert_openai_checkpoint import main

ROOT = Path(__file__).parent.parent
FIXTURES = {
    "gpt2": ROOT / "tests" / "fixtures" / "openai-gpt2-tiny",
    "gpt1": ROOT / "tests" / "fixtures" / "openai-gpt1-tiny",
}
EXTRA = {"gpt2": [], "gpt1": ["--n-head", "4"]}  # GPT-1's n_head is not in its files (fixture README: 4)
SEED = 20_260_101
CASES = 80  # per release
PER_CASE_LIMIT = 30.0  # seconds
SUBPROCESS_CASES = 4


def release_files(kind: str) -> list[str]:
    return sorted(p.name for p in FIXTURES[kind].iterdir() if not p.name.startswith("expected"))


def mutate(data: bytes, rng: random.Random) -> tuple[str, int, bytes]:
    """(what was done, where, the damaged bytes)."""
    head = min(len(data), 128)
    pos = rng.randrange(head) if rng.random() < 0.5 or head == len(data) else rng.randrange(len(data))
    op = rng.choice(["flip", "truncate", "insert", "delete"])
    if op == "flip":
        damaged = bytearray(data)
        damaged[pos] ^= 1 << rng.randrange(8)
        return f"flip bit of byte {pos}", pos, bytes(damaged)
    if op == "truncate":
        return f"truncate to {pos} bytes", pos, data[:pos]
    if op == "insert":
        extra = rng.randbytes(rng.randint(1, 8))
        return f"insert {extra.hex()} at {pos}", pos, data[:pos] + extra + data[pos:]
    count = rng.randint(1, 8)
    return f"delete {count} bytes at {pos}", pos, data[:pos] + data[pos + count :]


def convert(capsys, src: Path, out: Path, kind: str) -> tuple[int, str, str, float]:
    start = time.monotonic()
    code = main([str(src), str(out), *EXTRA[kind], *(["--sha256"] if kind == "gpt1" else [])])
    seconds = time.monotonic() - start
    captured = capsys.readouterr()
    return code, captured.out, captured.err, seconds


def digests_of(stdout: str) -> dict[str, str]:
    return dict(
        reversed(line.split("  ", 1)) for line in stdout.splitlines() if re.match(r"[0-9a-f]{64}  ", line)
    )


def outputs(folder: Path) -> dict[str, bytes]:
    """The converted files, but the model code copied from hfgpt's source (not from the release, and
    possibly edited while the test runs)."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.suffix != ".py"}


def logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(torch.arange(20)[None]).logits


@pytest.mark.slow
def test_random_damage_is_refused_or_harmless(tmp_path, capsys):
    started, cpu = time.monotonic(), time.process_time()
    report: list[str] = []  # printed at the end: capsys takes what is printed before its last read
    kept = fuzz("gpt2", tmp_path / "gpt2", capsys, report) + fuzz("gpt1", tmp_path / "gpt1", capsys, report)
    in_process, cpu = time.monotonic() - started, time.process_time() - cpu

    # The same refusals through the script in a separate process: what reaches a real stderr.
    driver = (
        "import json, runpy, sys\n"
        "script, cases = sys.argv[1], json.loads(sys.argv[2])\n"
        "for argv in cases:\n"
        "    sys.argv = [script, *argv]\n"
        "    try:\n"
        "        runpy.run_path(script, run_name='__main__')\n"
        "        code = 0\n"
        "    except SystemExit as stop:\n"
        "        code = stop.code\n"
        "    print(f'@@ exit {code}', file=sys.stderr, flush=True)\n"
    )
    # And a hand-made one: hparams.json a FIFO, which a plain open() would wait on for ever.
    fifo = tmp_path / "fifo" / "model"
    ignore = shutil.ignore_patterns("expected*", "hparams.json")
    shutil.copytree(FIXTURES["gpt2"], fifo, ignore=ignore, copy_function=shutil.copyfile)
    os.mkfifo(fifo / "hparams.json")
    kept.append(("gpt2", 3, fifo))
    cases = [[str(src), str(src.parent / "out"), *EXTRA[kind]] for kind, _, src in kept]
    script = ROOT / "scripts" / "convert_openai_checkpoint.py"
    done = subprocess.run(
        [sys.executable, "-c", driver, str(script), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    chunks = re.split(r"@@ exit (\d+)\n", done.stderr)
    assert [int(c) for c in chunks[1::2]] == [code for _, code, _ in kept], done.stderr
    for chunk in chunks[0:-1:2]:
        errors = [line for line in chunk.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and chunk.rstrip("\n").endswith(errors[0]), done.stderr
    assert "hparams.json is a FIFO (named pipe), not a regular file" in chunks[-3]
    for _, _, src in kept:
        assert not (src.parent / "out").exists()
    print("\n" + "\n".join(report))
    print(
        f"in process {in_process:.1f} s ({cpu:.1f} s CPU), {len(kept)} cases in a subprocess "
        f"{time.monotonic() - started - in_process:.1f} s"
    )


def fuzz(kind: str, tmp_path: Path, capsys, report: list[str]) -> list[tuple[str, int, Path]]:
    """Run CASES damaged copies of the ``kind`` release; returns a few refused cases' (kind, exit code, folder)."""
    pristine = tmp_path / "model"  # the folder name the cases use too: the model card names it
    pristine.mkdir(parents=True)
    names = release_files(kind)
    for name in names:
        shutil.copyfile(FIXTURES[kind] / name, pristine / name)
    code, stdout, err, _ = convert(capsys, pristine, tmp_path / "baseline", kind)
    assert code == 0, err
    baseline = outputs(tmp_path / "baseline")
    baseline_weights = load_file(tmp_path / "baseline" / "model.safetensors")
    baseline_digests = digests_of(stdout)
    release = open_release(pristine, n_head=4 if kind == "gpt1" else None)
    release.close()

    rng = random.Random(f"{SEED}-{kind}")
    outcomes: dict[int, int] = {}
    converted, reported, kept, logits_checked = [], [], [], 0
    slowest = 0.0
    for k in range(CASES):
        name = names[k % len(names)]  # every file of the release in turn
        what, _, damaged = mutate((pristine / name).read_bytes(), rng)
        case = tmp_path / f"case-{k:03d}"
        src = case / "model"  # the same folder name for every case: the model card names it
        src.mkdir(parents=True)
        for other in names:
            if other != name:
                try:
                    os.link(pristine / other, src / other)  # a hard link: a regular file of the folder
                except OSError:  # a file system without hard links
                    shutil.copyfile(pristine / other, src / other)
        (src / name).write_bytes(damaged)
        out = case / "out"
        code, stdout, err, seconds = convert(capsys, src, out, kind)
        label = f"case {k}: {name}: {what} -> exit {code}: {err.strip()[:300]}"
        slowest = max(slowest, seconds)
        assert seconds < PER_CASE_LIMIT, label
        assert code in (0, 3, 4), label
        assert "Traceback" not in err, label
        outcomes[code] = outcomes.get(code, 0) + 1
        if code != 0:
            assert err.startswith("error: ") and err.count("\n") == 1, label
            assert not out.exists(), label
            assert [p.name for p in case.iterdir()] == ["model"], label  # no temporary folder either
            if len(kept) < SUBPROCESS_CASES // 2 and code not in [c for _, c, _ in kept]:
                kept.append((kind, code, src))
                continue
            shutil.rmtree(case)
            continue
        converted.append(label)
        files = outputs(out)
        assert set(files) == set(baseline), label
        if kind == "gpt2":
            # Checksummed data: whatever converts is the release itself.
            assert files == baseline, label
            if logits_checked < 1:
                assert torch.equal(logits(out), logits(tmp_path / "baseline")), label
                logits_checked += 1
                capsys.readouterr()  # loading reports its progress on stderr
        else:
            # Everything but the weights is as the release gives it (vocabulary, config, card).
            assert {n: b for n, b in files.items() if n != "model.safetensors"} == {
                n: b for n, b in baseline.items() if n != "model.safetensors"
            }, label
            weights = load_file(out / "model.safetensors")
            changed = sorted(n for n in weights if not (weights[n] == baseline_weights[n]).all())
            if changed:
                # Only a shard's body can change values, and only of the tensors that shard holds ...
                assert re.fullmatch(r"params_\d\.npy", name), label
                held = {target for source, _, target in _targets(release, name)}
                assert set(changed) <= held, (label, changed)
                # ... and the digest the converter printed for that shard gives it away.
                assert digests_of(stdout)[name] != baseline_digests[name], label
                reported.append(f"{label.split(' -> ')[0]}: values changed in {', '.join(changed)}")
        shutil.rmtree(case)
    report.append(
        f"{kind}: {CASES} cases, exit codes {dict(sorted(outcomes.items()))}, slowest {slowest:.2f} s"
    )
    report += [*converted, *reported]
    assert outcomes.get(3, 0) + outcomes.get(4, 0) > CASES // 2  # the damage is mostly refused

    return kept


def _targets(release, file_name: str) -> list[tuple[str, str, str]]:
    """(source tensor, op, parameter) of every tensor the file holds, for the hfgpt format."""
    held = set(release.tensors_in(file_name))
    return [(source, op.name, target) for source, target, op in release.mapping() if source in held]
