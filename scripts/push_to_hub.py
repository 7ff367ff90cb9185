"""Upload an hfgpt checkpoint folder to the Hugging Face Hub.

    hfgpt-push gpt2-hf my-name/gpt2-hfgpt
    hfgpt-push runs/sst2/final my-name/gpt2-sst2 --private --revision experiment-1 --commit-message "SST-2 run"

The folder must hold what `save_pretrained` writes: safetensors weights, `config.json`, the tokenizer files
and (for generating heads) `generation_config.json`. What lands in the repo on top of them: a `README.md`
model card when the folder has none, and for hfgpt checkpoints `config.json`'s `auto_map` for every head
plus the code files it names, so that the repo loads with `trust_remote_code=True` where hfgpt is not
installed. The folder itself is never modified.

The token is the one huggingface_hub finds (the `HF_TOKEN` environment variable, else the login saved by
`hf auth login`); it is sent to the Hub and written nowhere. Set `HF_ENDPOINT` to push to another Hub.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import importlib.util
import json
import re
import sys
from pathlib import Path, PurePosixPath
from typing import Any

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalTokenNotFoundError
from huggingface_hub.utils import validate_repo_id

__all__ = ["PushError", "collect_upload", "main", "push_to_hub", "token_user"]

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

# Files and folders `Trainer` leaves in a checkpoint folder that are training state, not the model: not
# uploaded. Matched against every part of a file's path.
NOT_UPLOADED = (
    "optimizer.pt",  # optimizer state, as large as the model again (twice with Adam)
    "scheduler.pt",
    "scaler.pt",
    "rng_state*.pth",
    "training_args.bin",  # a pickle of TrainingArguments
    "trainer_state.json",  # Trainer's step, log history and best checkpoint, for resuming
    "pytorch_model*.bin",  # pickle weights: the safetensors ones are uploaded instead
    "checkpoint-*",  # Trainer's intermediate checkpoints in its output_dir (Trainer's own push skips them)
    ".*",  # hidden files and folders (.git, .cache, editor files)
)

# Heads that generate text and so need generation_config.json.
GENERATING_HEADS = ("ForCausalLM", "DoubleHeadsModel", "LMHeadModel")

_IMPORTS_HFGPT = re.compile(r"^\s*(from|import)\s+hfgpt\b", re.MULTILINE)
_COMMIT_ID = re.compile(r"^[0-9a-f]{40}$")


class PushError(Exception):
    """A push refused or failed; the message says why and what to do."""


def check_repo_id(repo_id: str) -> None:
    """Refuse a repo id the Hub would refuse ("namespace/name"), before any work or network call."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise PushError(f"{repo_id!r} is not a valid repo id: {err}") from err
    if "/" not in repo_id:
        raise PushError(f"repo id {repo_id!r} needs a namespace: write your-name/{repo_id}")


def _load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise PushError(f"cannot read {path}: {err}") from err
    if not isinstance(data, dict):
        raise PushError(f"{path} does not hold a JSON object")
    return data


def _weight_files(model_dir: Path) -> list[str]:
    if (model_dir / WEIGHTS).is_file():
        return [WEIGHTS]
    if (model_dir / WEIGHTS_INDEX).is_file():
        shards = _index_shards(model_dir / WEIGHTS_INDEX)
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise PushError(
                f"{model_dir / WEIGHTS_INDEX} lists shards that are not in the folder: {', '.join(missing)}"
            )
        return [WEIGHTS_INDEX, *shards]
    pickles = sorted(p.name for p in model_dir.glob("pytorch_model*.bin"))
    hint = (
        f" (found only pickle weights {', '.join(pickles)}: save with safe_serialization=True, the default)"
        if pickles
        else ""
    )
    raise PushError(f"no safetensors weights in {model_dir}: expected {WEIGHTS} or {WEIGHTS_INDEX}{hint}")


def _index_shards(index: Path) -> list[str]:
    """The shard files `index`'s weight_map names (tensor name -> file), as paths inside the folder."""
    weight_map = _load_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise PushError(
            f"{index}: weight_map must be a non-empty JSON object mapping each tensor name to its shard "
            f"file, got {json.dumps(weight_map)[:80]}"
        )
    shards = set()
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise PushError(f"{index}: weight_map[{tensor!r}] must be a shard file name, got {shard!r}")
        path = PurePosixPath(shard)
        if path.is_absolute() or ".." in path.parts or "\\" in shard:
            raise PushError(
                f"{index}: weight_map[{tensor!r}] names {shard!r}, outside the model folder; shards must be "
                "files inside it, named relative to it"
            )
        if any(fnmatch.fnmatch(part, pat) for part in path.parts for pat in NOT_UPLOADED):
            raise PushError(
                f"{index}: weight_map[{tensor!r}] names {shard!r}, a path that is never uploaded (training "
                f"state or hidden files: {', '.join(NOT_UPLOADED)})"
            )
        shards.add(path.as_posix())
    return sorted(shards)


def _hfgpt_auto_map() -> tuple[dict[str, str], Path]:
    """hfgpt's `AUTO_MAP` table (every head) and the folder of the code files it names.

    Read from the installed modeling_hfgpt.py's source rather than imported: importing it loads torch,
    which an upload does not otherwise need (it would add torch's import time to every `hfgpt-push`).
    """
    spec = importlib.util.find_spec("hfgpt.modeling")
    if spec is None or spec.origin is None:
        raise PushError("hfgpt.modeling is not installed: cannot add the code files of an hfgpt checkpoint")
    package_dir = Path(spec.origin).parent
    source = package_dir / "modeling_hfgpt.py"
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "AUTO_MAP" for t in node.targets):
            return ast.literal_eval(node.value), package_dir
    raise PushError(f"{source} defines no AUTO_MAP table")


def _remote_code(model_dir: Path, config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Path]]:
    """For an hfgpt checkpoint: the config with `auto_map` covering every head, and the code files that
    `auto_map` names (plus what they import relatively) which the folder lacks, taken from the installed
    hfgpt.modeling."""
    auto_map, package_dir = _hfgpt_auto_map()
    config = {**config, "auto_map": {**(config.get("auto_map") or {}), **auto_map}}
    needed = {ref.split(".")[0] + ".py" for ref in config["auto_map"].values()}
    return config, _code_files(model_dir, needed, package_dir)


def _code_files(model_dir: Path, names: set[str], package_dir: Path) -> dict[str, Path]:
    """The code files `names` and what they import relatively, checked loadable without hfgpt: those the
    folder lacks, taken from `package_dir` (the installed hfgpt package that writes them)."""
    from transformers.dynamic_module_utils import get_relative_import_files

    needed = set(names)
    for name in names:
        source = model_dir / name if (model_dir / name).is_file() else package_dir / name
        if source.is_file():
            needed.update(Path(f).name for f in get_relative_import_files(source))
    extra = {}
    for name in sorted(needed):
        source = model_dir / name if (model_dir / name).is_file() else package_dir / name
        if _IMPORTS_HFGPT.search(source.read_text(encoding="utf-8")):
            raise PushError(
                f"{source} imports hfgpt, so the repo would not load with trust_remote_code where hfgpt is "
                "not installed; code files must import their siblings relatively"
            )
        if source.parent != model_dir:
            extra[name] = source
    return extra


def _tokenizer_code(model_dir: Path) -> dict[str, Path]:
    """The code files tokenizer_config.json's `auto_map` names (GPT-1's `tokenization_gpt1.py`, which
    `GPT1Tokenizer.save_pretrained` writes beside it) that the folder lacks, taken from the installed
    hfgpt.tokenization; a file found in neither is refused, as the repo would not load without it."""
    path = model_dir / "tokenizer_config.json"
    auto_map = _load_json(path).get("auto_map") or {}
    if not isinstance(auto_map, dict):
        raise PushError(f"{path}: auto_map must be a JSON object, got {json.dumps(auto_map)[:80]}")
    names = set()
    for key, refs in auto_map.items():
        for ref in refs if isinstance(refs, list) else [refs]:
            if ref is None or (isinstance(ref, str) and "--" in ref):  # none, or code in another repo
                continue
            if not isinstance(ref, str) or "." not in ref:
                raise PushError(f"{path}: auto_map[{key!r}] must name module.Class, got {ref!r}")
            names.add(ref.split(".")[0] + ".py")
    spec = importlib.util.find_spec("hfgpt.tokenization")
    package_dir = Path(spec.origin).parent if spec is not None and spec.origin else model_dir
    for name in sorted(names):
        if not (model_dir / name).is_file() and not (package_dir / name).is_file():
            raise PushError(
                f"{path} names {name} in auto_map, but neither {model_dir} nor the installed "
                "hfgpt.tokenization has it: the repo would not load its tokenizer with trust_remote_code; "
                "save the tokenizer again with tokenizer.save_pretrained(model_dir)"
            )
    return _code_files(model_dir, names, package_dir)


def collect_upload(
    model_dir: str | Path, repo_id: str | None = None, *, model_card: bool = True
) -> list[CommitOperationAdd]:
    """Check `model_dir` is a complete checkpoint and list what to upload, without touching the network.

    Raises PushError naming what is missing (weights, config, tokenizer, generation config).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise PushError(f"model folder {model_dir} does not exist or is not a folder")
    if not (model_dir / "config.json").is_file():
        raise PushError(f"no config.json in {model_dir}: is it a save_pretrained folder?")
    config = _load_json(model_dir / "config.json")
    weights = _weight_files(model_dir)

    if not (model_dir / "tokenizer_config.json").is_file():
        raise PushError(
            f"no tokenizer in {model_dir} (tokenizer_config.json): save it next to the model with "
            "tokenizer.save_pretrained(model_dir)"
        )
    architectures = config.get("architectures") or []
    if (
        any(a.endswith(GENERATING_HEADS) for a in architectures)
        and not (model_dir / "generation_config.json").is_file()
    ):
        raise PushError(
            f"no generation_config.json in {model_dir} for the generating head {architectures[0]}: "
            "save the model with model.save_pretrained(model_dir)"
        )

    replaced: dict[str, bytes] = {}
    extra_files = _tokenizer_code(model_dir)
    if config.get("model_type") == "hfgpt":
        new_config, model_code = _remote_code(model_dir, config)
        extra_files.update(model_code)
        if new_config != config:
            replaced["config.json"] = (json.dumps(new_config, indent=2, sort_keys=True) + "\n").encode()
    if model_card and not (model_dir / "README.md").is_file():
        from hfgpt.model_cards import ModelCardError, render_model_card

        facts = {"repo_id": repo_id} if repo_id else {}
        try:
            replaced["README.md"] = str(render_model_card("trained", config=config, **facts)).encode()
        except ModelCardError as err:
            raise PushError(
                f"cannot write a model card from {model_dir / 'config.json'}: {err} (or add a README.md)"
            ) from err

    operations = []
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(model_dir).as_posix()
        if rel in replaced or any(
            fnmatch.fnmatch(part, pat) for part in rel.split("/") for pat in NOT_UPLOADED
        ):
            continue
        operations.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(path)))
    operations += [CommitOperationAdd(path_in_repo=n, path_or_fileobj=data) for n, data in replaced.items()]
    operations += [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(p)) for n, p in extra_files.items()]
    left_out = sorted(set(weights) - {op.path_in_repo for op in operations})
    if left_out:  # _index_shards refuses shards in paths never uploaded; this catches anything else
        raise PushError(f"weight files of {model_dir} would not be uploaded: {', '.join(left_out)}")
    return operations


def _is_transport_error(err: BaseException) -> bool:
    """A connection that failed or broke (as opposed to an answer from the Hub). huggingface_hub raises
    its HTTP client's exceptions (httpx / httpx2), sometimes wrapped in RuntimeError."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ConnectionError) or type(seen).__module__.split(".")[0] in ("httpx", "httpx2"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _token_user(api: HfApi, repo_id: str) -> str:
    """The name of the user whose token `api` sends, checked with the Hub (pushing to `repo_id`)."""
    where = api.endpoint
    try:
        return api.whoami()["name"]
    except LocalTokenNotFoundError as err:
        raise PushError(
            f"no Hugging Face token found: pushing to {repo_id} needs a token with write access "
            "(set HF_TOKEN or run `hf auth login`)"
        ) from err
    except HfHubHTTPError as err:
        if err.response is not None and err.response.status_code == 401:
            raise PushError(f"the Hub at {where} refused the token: {str(err).splitlines()[0]}") from err
        raise PushError(f"could not check the token with the Hub at {where}: {err}") from err
    except Exception as err:
        if _is_transport_error(err):
            raise PushError(f"cannot reach the Hub at {where}: {err}") from err
        raise


def token_user(repo_id: str, token: str | None = None, *, endpoint: str | None = None) -> str:
    """The name of the user whose token (`token`, else `HF_TOKEN` or the saved login) would push to
    `repo_id`, asked of the Hub: a PushError names a missing or refused token or an unreachable Hub."""
    return _token_user(HfApi(endpoint=endpoint, token=token), repo_id)


def push_to_hub(
    model_dir: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    *,
    endpoint: str | None = None,
) -> CommitInfo:
    """Upload the checkpoint in `model_dir` to the model repo `repo_id`, creating the repo if needed.

    Args:
        model_dir: a folder written by `save_pretrained` (model and tokenizer).
        repo_id: "namespace/name" on the Hub.
        private: create the repo private; refuses to push to an existing public repo.
        revision: branch to commit to (created from main if missing); default main.
        commit_message: defaults to "Upload <folder name> with hfgpt".
        token: a Hub token; default the one huggingface_hub finds (HF_TOKEN, else the saved login).
        endpoint: the Hub's URL; default huggingface_hub's (HF_ENDPOINT, else huggingface.co).

    Returns:
        huggingface_hub's `CommitInfo` (`.commit_url`, `.oid`, `.repo_url`).

    Raises:
        PushError: incomplete folder, missing or refused token, a Hub error, or an interrupted upload
            (run the same push again: files the Hub already received are not sent twice).
    """
    check_repo_id(repo_id)
    operations = collect_upload(model_dir, repo_id)
    if revision is not None and _COMMIT_ID.match(revision):
        raise PushError(f"--revision {revision} is a commit id; commits go to a branch, give a branch name")
    api = HfApi(endpoint=endpoint, token=token)
    where = api.endpoint
    user = _token_user(api, repo_id)
    message = commit_message or f"Upload {Path(model_dir).resolve().name} with hfgpt"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if private and not api.repo_info(repo_id).private:
            raise PushError(
                f"{repo_id} already exists and is public; refusing to push what was asked private"
            )
        if revision is not None and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(repo_id, operations, commit_message=message, revision=revision)
    except PushError:
        raise
    except HfHubHTTPError as err:
        raise PushError(f"the Hub refused the push to {repo_id} (as {user}): {err}") from err
    except ValueError as err:  # huggingface_hub's answer to a README the Hub's validate-yaml rejects
        raise PushError(f"cannot push to {repo_id}: {err}") from err
    except Exception as err:
        if _is_transport_error(err):
            raise PushError(
                f"upload to {where} was interrupted ({err}); nothing was "
                f"committed to {repo_id}. Run the same push again to finish it: files the Hub already "
                "received are not sent twice."
            ) from err
        raise
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hfgpt-push", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, help="folder written by save_pretrained")
    parser.add_argument("repo_id", help="namespace/name of the model repo")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--revision", "--branch", dest="revision", help="branch to push to (default main)")
    parser.add_argument("--commit-message", help="message of the commit")
    args = parser.parse_args(argv)
    try:
        info = push_to_hub(
            args.model_dir,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            commit_message=args.commit_message,
        )
    except PushError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"pushed {args.model_dir} to {info.commit_url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
