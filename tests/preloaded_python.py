"""A Python interpreter that imports torch, transformers and its Trainer once, then runs each script or
console command it is sent in a forked copy of itself, as `python script.py` or the command would run in a
fresh interpreter, less those imports (about 13 seconds of each on 2 CPU cores).

tests/test_readme.py runs the README's and docs' code blocks through it: started with the blocks'
environment (huggingface_hub reads the Hub's address and HF_HOME when it is imported), it imports nothing
of hfgpt, whose import registers it with transformers' Auto classes: a block that needs that registration
must import hfgpt itself, as a user's would.

Requests, one JSON object a line on stdin: {"argv": [script.py or a console script's name, *arguments],
"cwd": folder, "output": file}. The copy runs in `cwd` with `sys.argv` = argv, stdin from /dev/null and
stdout and stderr into `output`, and exits as the interpreter would (atexit handlers run); the answer is
one line on stdout: its exit status.
"""

import json
import os
import runpy
import sys
from importlib.metadata import entry_points

import torch  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments  # noqa: F401


def run(argv: list[str], cwd: str, output: str) -> None:
    """In the forked copy: runs argv[0] (a script, or a console script's entry point) and exits."""
    os.chdir(cwd)
    with open(os.devnull) as nothing, open(output, "w") as out:
        os.dup2(nothing.fileno(), 0)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    sys.argv = list(argv)
    if argv[0].endswith(".py"):
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    else:
        (command,) = entry_points(group="console_scripts", name=argv[0])
        sys.path[0] = os.path.dirname(sys.executable)
        sys.exit(command.load()())


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run(request["argv"], request["cwd"], request["output"])
            # (the script ran to its end: an exception or sys.exit leaves before, as python's would)
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    main()
