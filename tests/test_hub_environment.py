"""The suite's Hub environment (tests/conftest.py): whatever the user has exported (HF_HUB_OFFLINE,
TRANSFORMERS_OFFLINE, HF_TOKEN, HF_HOME, HF_ENDPOINT, HF_HUB_DISABLE_PROGRESS_BARS), the tests run offline,
without a token, in a private HF_HOME; those that need the stand-in Hub (tests/hub_server.py) go online to it
for their own duration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import pytest
from huggingface_hub import HfApi
from huggingface_hub.errors import OfflineModeIsEnabled

sys.path.insert(0, str(Path(__file__).parent))
from conftest import HUB_ENV_PREFIXES, point_at_test_hub  # noqa: E402
from hub_server import DEFAULT_TOKENS, HubServer  # noqa: E402

ROOT = Path(__file__).parent.parent
TOKEN = next(iter(DEFAULT_TOKENS))

# What a user who works offline, with a token and a Hub cache of their own, has exported.
USERS_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_TOKEN": "hf_dummy",
    "HF_ENDPOINT": "http://127.0.0.1:1",  # nothing listens there
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}

# A few tests of each kind the user's environment broke or could break: in-process clients of the stand-in
# Hub (online), a subprocess client, a token refused, Hub validation of a model card, a training run's
# push, and this module's own checks of the offline session.
SELECTION = [
    "tests/test_hub.py::test_hub_protocol_answers",
    "tests/test_hub.py::test_private_repo_refused_without_a_token",
    "tests/test_hub.py::test_wrong_token_refused_with_a_clear_message",
    "tests/test_model_cards.py::test_validation_rejects_unknown_licence_and_broken_yaml",
    "tests/test_training.py::test_push_to_hub_problems_stop_before_training",
    "tests/test_hub_environment.py::test_session_is_offline_tokenless_and_in_a_private_hf_home",
    "tests/test_hub_environment.py::test_subprocesses_inherit_the_session_environment",
    "tests/test_hub_environment.py::test_the_test_hub_is_reached_online_and_the_session_is_offline_after",
]


def test_session_is_offline_tokenless_and_in_a_private_hf_home() -> None:
    home = Path(os.environ["HF_HOME"])
    assert home.name.startswith("hfgpt-tests-hf-home-") and home.parent == Path(tempfile.gettempdir())
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert {name for name in os.environ if name.startswith(HUB_ENV_PREFIXES)} == {
        "HF_HOME",
        "HF_HUB_OFFLINE",
        "HF_HUB_DISABLE_TELEMETRY",
    }
    constants = huggingface_hub.constants
    assert constants.HF_HUB_OFFLINE and constants.ENDPOINT == "https://huggingface.co"
    assert str(home) == constants.HF_HOME
    for path in (constants.HF_HUB_CACHE, constants.HF_TOKEN_PATH, constants.HF_XET_CACHE):
        assert Path(path).is_relative_to(home), path
    assert constants.HF_HUB_DISABLE_PROGRESS_BARS is None  # huggingface_hub's default: bars shown
    assert huggingface_hub.get_token() is None
    from transformers.utils.hub import HF_MODULES_CACHE  # trust_remote_code's modules

    assert Path(HF_MODULES_CACHE).is_relative_to(home)
    with pytest.raises(OfflineModeIsEnabled):  # a test that reached for the real Hub would stop here
        HfApi().model_info("openai-community/gpt2")


def test_subprocesses_inherit_the_session_environment() -> None:
    script = (
        "import json, huggingface_hub.constants as c, huggingface_hub as h; "
        "print(json.dumps([c.HF_HUB_OFFLINE, c.HF_HOME, h.get_token()]))"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [True, os.environ["HF_HOME"], None]


def test_the_test_hub_is_reached_online_and_the_session_is_offline_after(tmp_path: Path) -> None:
    constants = huggingface_hub.constants
    session = (dict(os.environ), constants.HF_HUB_OFFLINE, constants.ENDPOINT, constants.HF_HUB_DISABLE_XET)
    with HubServer(tmp_path / "hub") as hub, pytest.MonkeyPatch.context() as monkeypatch:
        point_at_test_hub(monkeypatch, hub.url, TOKEN)
        api = HfApi()  # no endpoint, no token: both from the environment the helper set
        assert api.whoami()["name"] == DEFAULT_TOKENS[TOKEN]
        repo_id = api.create_repo("tester/env").repo_id
        api.upload_file(path_or_fileobj=b"x" * 100, path_in_repo="w.safetensors", repo_id=repo_id)
        assert [path for method, path, _ in hub.log if method == "PUT"]  # through LFS, not Xet
        path = huggingface_hub.hf_hub_download(repo_id, "w.safetensors", cache_dir=tmp_path / "cache")
        assert Path(path).read_bytes() == b"x" * 100
    assert (
        dict(os.environ),
        constants.HF_HUB_OFFLINE,
        constants.ENDPOINT,
        constants.HF_HUB_DISABLE_XET,
    ) == session
    with pytest.raises(OfflineModeIsEnabled):
        HfApi(endpoint=hub.url, token=TOKEN).whoami()  # the stand-in Hub has stopped: never reached


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {
        str(path.relative_to(folder)): (path.stat().st_mtime_ns, path.read_bytes() if path.is_file() else b"")
        for path in sorted(folder.rglob("*"))
    }


@pytest.mark.slow
def test_hub_tests_pass_in_an_offline_users_environment_and_leave_their_hf_home_alone(tmp_path: Path) -> None:
    """Hub tests run in a pytest of their own under a user's environment: they pass, and nothing under the
    user's HF_HOME (a saved login and a cached file) is read into them or written."""
    user_home = tmp_path / "users-hf-home"
    (user_home / "hub").mkdir(parents=True)
    (user_home / "token").write_text("hf_saved_login")
    (user_home / "hub" / "version.txt").write_text("1")
    before = _snapshot(user_home)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not an xdist worker's
    env.update(USERS_ENVIRONMENT, HF_HOME=str(user_home))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    proc = subprocess.run(
        [*command, f"--basetemp={tmp_path / 'inner'}", *SELECTION],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert summary.startswith(f"{len(SELECTION) + 2} passed"), summary  # the training test has 3 cases
    assert "skipped" not in summary and "failed" not in summary
    assert _snapshot(user_home) == before


@pytest.mark.slow
def test_constants_read_before_the_session_began_are_set_again(tmp_path: Path) -> None:
    """A plugin that imports huggingface_hub before tests/conftest.py (here `-p huggingface_hub.constants`)
    leaves constants read from the user's environment: the session sets them to its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(USERS_ENVIRONMENT, HF_HOME=str(tmp_path / "users-hf-home"))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    proc = subprocess.run(
        [
            *command,
            "-p",
            "huggingface_hub.constants",
            f"--basetemp={tmp_path / 'inner'}",
            "tests/test_hub_environment.py::test_session_is_offline_tokenless_and_in_a_private_hf_home",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("1 passed")
    assert not (tmp_path / "users-hf-home").exists()
