"""Sharing on the Hub, against a real HTTP server speaking the Hub's protocol on 127.0.0.1 (tests/hub_server.py).

huggingface_hub reads HF_ENDPOINT when it is imported, so every client that must believe the test Hub is
the Hub (transformers' from_pretrained, the hfgpt-push command) runs in a fresh Python process with the
environment set; checks that only need HfApi run in this process with an explicit endpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from safetensors.torch import load_file, save_file

from hfgpt.cpu import unkernelize
from hfgpt.modeling import GPTForCausalLM
from hfgpt.scripts.convert_openai_checkpoint import convert_openai_checkpoint
from hfgpt.scripts.push_to_hub import PushError, collect_upload, push_to_hub

sys.path.insert(0, str(Path(__file__).parent))
from hub_server import DEFAULT_TOKENS, HubServer, git_blob_oid  # noqa: E402

TOKEN = next(iter(DEFAULT_TOKENS))
USER = DEFAULT_TOKENS[TOKEN]
GPT2_FIXTURE = Path(__file__).parent / "fixtures" / "openai-gpt2-tiny"
INPUT_IDS = [[464, 2068, 7586, 21831, 18045, 625, 262, 16931]]  # "The quick brown fox jumps over the lazy"
EVERY_HEAD = {
    "AutoConfig",
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
}


def copy_of(checkpoint: Path, folder: Path) -> Path:
    """A copy of a saved checkpoint to damage or extend in a test."""
    shutil.copytree(checkpoint, folder)
    return folder


def client_env(hub: HubServer, home: Path, token: str | None = TOKEN) -> dict[str, str]:
    """The environment of a fresh client process pointed at the test Hub, with no saved login."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_")) and k != "PYTHONPATH"
    }
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(home),
        HF_HUB_DISABLE_XET="1",  # uploads try Xet storage first; the test Hub only speaks LFS
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        TRANSFORMERS_VERBOSITY="error",
    )
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def run_client(script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"client failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    with HubServer(tmp_path_factory.mktemp("hub")) as server:
        yield server


@pytest.fixture(autouse=True)
def online_to_the_test_hub(use_test_hub, hub: HubServer) -> None:
    """The clients in this process talk to the test Hub whatever the user's environment (the session is
    offline, tests/conftest.py): online, and pushing through LFS, as huggingface_hub reads
    HF_HUB_DISABLE_XET again on each upload (utils/_runtime.is_xet_available). No token: each call here
    passes its own."""
    use_test_hub(hub.url)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two converted checkpoints of OpenAI's (tiny) GPT-2 release, the second with different weights,
    and the logits each gives when loaded locally (the ground truth every round trip must reproduce)."""
    root = tmp_path_factory.mktemp("checkpoints")
    first = convert_openai_checkpoint(GPT2_FIXTURE, root / "converted")
    second = root / "changed"
    shutil.copytree(first, second)
    weights = load_file(second / "model.safetensors")
    weights["transformer.wte.weight"] = weights["transformer.wte.weight"] * 1.5
    save_file(weights, second / "model.safetensors", metadata={"format": "pt"})
    expected = {}
    for name, path in (("first", first), ("second", second)):
        model = GPTForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            expected[name] = model(torch.tensor(INPUT_IDS)).logits
            # What the checkpoint's own code computes (trust_remote_code): the plain model, no CPU backend.
            expected[f"{name} plain"] = unkernelize(model)(torch.tensor(INPUT_IDS)).logits
    torch.save(expected, root / "expected.pt")
    assert not torch.equal(expected["first"], expected["second"])
    return {"first": first, "second": second, "expected": root / "expected.pt"}


# --- push and load, with hfgpt installed --------------------------------------------------------------

PUSH_AND_LOAD = """
import json, sys
import torch
import hfgpt.modeling  # registers the Auto classes
from huggingface_hub import HfApi, ModelCard
from transformers import AutoModelForCausalLM, AutoTokenizer
from hfgpt.scripts.push_to_hub import main

first, second, out = sys.argv[1:4]
repo = "tester/gpt2-tiny"
ids = torch.tensor(json.loads(sys.argv[4]))
api = HfApi()
rc = [main([first, repo, "--commit-message", "first weights"])]
commit1 = api.list_repo_commits(repo)[0].commit_id
rc.append(main([second, repo]))  # pushed twice: main now holds the second weights
commit2 = api.list_repo_commits(repo)[0].commit_id
rc.append(main([first, repo, "--revision", "experiment"]))  # a branch made from main, first weights again
api.create_tag(repo, tag="v1", revision=commit1)

def logits(**kw):
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(repo, **kw).eval()(ids).logits

results = {
    "main": logits(),
    "commit1": logits(revision=commit1),
    "tag": logits(revision="v1"),
    "branch": logits(revision="experiment"),
}
tokenizer = AutoTokenizer.from_pretrained(repo, revision=commit1)
facts = {
    "rc": rc,
    "commit1": commit1,
    "commit2": commit2,
    "files": sorted(api.list_repo_files(repo)),
    "branch_files": sorted(api.list_repo_files(repo, revision="experiment")),
    "commit_titles": [c.title for c in api.list_repo_commits(repo)],
    "model_class": type(AutoModelForCausalLM.from_pretrained(repo)).__module__,
    "tokens": tokenizer("The quick brown fox jumps over the lazy")["input_ids"],
}
card = ModelCard.load(repo)
card.validate()  # posts to the Hub's /api/validate-yaml
facts["card_license"] = card.data.license
torch.save(results, out + ".pt")
json.dump(facts, open(out + ".json", "w"))
"""


@pytest.fixture(scope="module")
def pushed(hub: HubServer, checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    home, out = tmp_path_factory.mktemp("client-home"), tmp_path_factory.mktemp("client-out") / "result"
    check(
        run_client(
            PUSH_AND_LOAD,
            client_env(hub, home),
            str(checkpoints["first"]),
            str(checkpoints["second"]),
            str(out),
            json.dumps(INPUT_IDS),
        )
    )
    facts = json.loads(Path(f"{out}.json").read_text())
    facts["logits"] = torch.load(f"{out}.pt")
    facts["expected"] = torch.load(checkpoints["expected"])
    facts["home"] = home
    return facts


@pytest.mark.slow
def test_push_converted_checkpoint_then_load_by_repo_id_gives_same_logits(pushed: dict) -> None:
    assert pushed["rc"] == [0, 0, 0]
    assert pushed["model_class"] == "hfgpt.modeling.modeling_hfgpt"  # the installed hfgpt, not remote code
    torch.testing.assert_close(pushed["logits"]["main"], pushed["expected"]["second"], rtol=0, atol=0)
    assert pushed["tokens"] == INPUT_IDS[0]


def test_repo_holds_weights_config_code_tokenizer_generation_config_and_card(
    pushed: dict, hub: HubServer, checkpoints: dict[str, Path]
) -> None:
    files = set(pushed["files"])
    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer_config.json",
        "configuration_hfgpt.py",
        "modeling_hfgpt.py",
        "README.md",
    ):
        assert name in files, name
    assert "ops_hfgpt.py" not in files  # the CPU backend stays with hfgpt, never beside a checkpoint
    api = HfApi(endpoint=hub.url, token=TOKEN)
    config = json.loads(
        Path(api.hf_hub_download("tester/gpt2-tiny", "config.json", cache_dir=pushed["home"])).read_text()
    )
    assert set(config["auto_map"]) >= EVERY_HEAD
    for target in config["auto_map"].values():
        assert f"{target.split('.')[0]}.py" in files
    # The converter's own card went up unchanged, and it passed the Hub's validation in the client.
    readme = Path(api.hf_hub_download("tester/gpt2-tiny", "README.md", cache_dir=pushed["home"])).read_text()
    assert readme == (checkpoints["first"] / "README.md").read_text()
    assert pushed["card_license"] == "mit"
    # Weights went through LFS, and were stored once although pushed to two branches.
    info = api.get_paths_info("tester/gpt2-tiny", ["model.safetensors"])[0]
    assert (
        info.lfs is not None and info.lfs.size == (checkpoints["second"] / "model.safetensors").stat().st_size
    )


def test_first_commit_loads_by_hash_and_by_tag_after_a_second_push(pushed: dict) -> None:
    assert pushed["commit1"] != pushed["commit2"]
    assert pushed["commit_titles"][-1] == "initial commit" and "first weights" in pushed["commit_titles"]
    torch.testing.assert_close(pushed["logits"]["commit1"], pushed["expected"]["first"], rtol=0, atol=0)
    torch.testing.assert_close(pushed["logits"]["tag"], pushed["expected"]["first"], rtol=0, atol=0)


def test_push_to_a_branch_leaves_main_alone(pushed: dict, hub: HubServer) -> None:
    torch.testing.assert_close(pushed["logits"]["branch"], pushed["expected"]["first"], rtol=0, atol=0)
    torch.testing.assert_close(pushed["logits"]["main"], pushed["expected"]["second"], rtol=0, atol=0)
    refs = HfApi(endpoint=hub.url, token=TOKEN).list_repo_refs("tester/gpt2-tiny")
    branches = {b.name: b.target_commit for b in refs.branches}
    assert branches["main"] == pushed["commit2"] and branches["experiment"] != pushed["commit2"]


# --- load where hfgpt cannot be imported ---------------------------------------------------------------

LOAD_WITHOUT_HFGPT = """
import json, sys
sys.modules["hfgpt"] = None  # as if hfgpt were not installed: any `import hfgpt...` raises ImportError
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

repo, commit1, out = sys.argv[1:4]
ids = torch.tensor(json.loads(sys.argv[4]))
try:
    import hfgpt.modeling
    blocked = False
except ImportError:
    blocked = True
with torch.no_grad():
    main = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True).eval()
    first = AutoModelForCausalLM.from_pretrained(repo, revision=commit1, trust_remote_code=True).eval()
    results = {"main": main(ids).logits, "commit1": first(ids).logits}
classifier = AutoModelForSequenceClassification.from_pretrained(repo, num_labels=3, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
facts = {
    "blocked": blocked,
    "model_module": type(main).__module__,
    "classifier": type(classifier).__name__,
    "classifier_labels": classifier.config.num_labels,
    "tokens": tokenizer("The quick brown fox jumps over the lazy")["input_ids"],
}
torch.save(results, out + ".pt")
json.dump(facts, open(out + ".json", "w"))
"""


@pytest.mark.slow
def test_load_with_trust_remote_code_where_hfgpt_cannot_be_imported(
    pushed: dict, hub: HubServer, tmp_path: Path
) -> None:
    out = tmp_path / "result"
    env = client_env(hub, tmp_path / "home")
    check(
        run_client(
            LOAD_WITHOUT_HFGPT, env, "tester/gpt2-tiny", pushed["commit1"], str(out), json.dumps(INPUT_IDS)
        )
    )
    facts, logits = json.loads(Path(f"{out}.json").read_text()), torch.load(f"{out}.pt")
    assert facts["blocked"]
    assert facts["model_module"].startswith("transformers_modules.")  # the code files from the repo
    assert facts["classifier"] == "GPTForSequenceClassification" and facts["classifier_labels"] == 3
    assert facts["tokens"] == INPUT_IDS[0]
    torch.testing.assert_close(logits["main"], pushed["expected"]["second plain"], rtol=0, atol=0)
    torch.testing.assert_close(logits["commit1"], pushed["expected"]["first plain"], rtol=0, atol=0)


# --- tokens and private repos --------------------------------------------------------------------------

NO_TOKEN = """
import json, sys
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import RepositoryNotFoundError
from hfgpt.scripts.push_to_hub import main

checkpoint, out = sys.argv[1:3]
facts = {"rc": main([checkpoint, "tester/new-private", "--private"])}
try:
    hf_hub_download("tester/private", "config.json")
    facts["download"] = "downloaded"
except RepositoryNotFoundError as err:
    facts["download"] = type(err).__name__
facts["torch_imported"] = "torch" in sys.modules  # pushing needs no torch
json.dump(facts, open(out, "w"))
"""


def test_private_repo_refused_without_a_token(
    hub: HubServer, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    info = push_to_hub(checkpoints["first"], "tester/private", private=True, token=TOKEN, endpoint=hub.url)
    assert HfApi(endpoint=hub.url, token=TOKEN).model_info("tester/private").private
    assert info.oid == HfApi(endpoint=hub.url, token=TOKEN).model_info("tester/private").sha

    out = tmp_path / "facts.json"
    proc = check(
        run_client(
            NO_TOKEN, client_env(hub, tmp_path / "home", token=None), str(checkpoints["first"]), str(out)
        )
    )
    facts = json.loads(out.read_text())
    assert facts["rc"] == 1
    assert "error: no Hugging Face token found" in proc.stderr and "HF_TOKEN" in proc.stderr
    assert facts["download"] == "RepositoryNotFoundError"
    assert not facts["torch_imported"]
    with pytest.raises(RepositoryNotFoundError):  # nothing was created by the refused push
        HfApi(endpoint=hub.url, token=TOKEN).model_info("tester/new-private")


def test_wrong_token_refused_with_a_clear_message(hub: HubServer, checkpoints: dict[str, Path]) -> None:
    with pytest.raises(PushError, match=r"refused the token: Invalid user token"):
        push_to_hub(checkpoints["first"], "tester/wrong-token", token="hf_not_a_real_token", endpoint=hub.url)


def test_private_push_refuses_an_existing_public_repo(hub: HubServer, checkpoints: dict[str, Path]) -> None:
    HfApi(endpoint=hub.url, token=TOKEN).create_repo("tester/already-public")
    with pytest.raises(PushError, match="already exists and is public"):
        push_to_hub(
            checkpoints["first"], "tester/already-public", private=True, token=TOKEN, endpoint=hub.url
        )


def test_push_to_another_users_namespace_is_refused(hub: HubServer, checkpoints: dict[str, Path]) -> None:
    with pytest.raises(PushError, match="403"):
        push_to_hub(checkpoints["first"], "someone-else/model", token=TOKEN, endpoint=hub.url)


def test_token_is_never_written(pushed: dict, checkpoints: dict[str, Path]) -> None:
    for folder in (pushed["home"], checkpoints["first"].parent):
        for path in folder.rglob("*"):
            if path.is_file():
                assert TOKEN.encode() not in path.read_bytes(), path


# --- an interrupted push -------------------------------------------------------------------------------


def test_push_interrupted_by_a_stopped_server_is_reported_and_a_retry_completes_it(
    tmp_path: Path, checkpoints: dict[str, Path], use_test_hub
) -> None:
    hub = HubServer(tmp_path / "hub").start()
    use_test_hub(hub.url)
    try:
        hub.fail_on.add("commit")  # the server stops when the commit arrives, after the LFS upload
        env = client_env(hub, tmp_path / "home")
        command = [str(checkpoints["first"]), "tester/interrupted"]
        script = "import sys; from hfgpt.scripts.push_to_hub import main; sys.exit(main(sys.argv[1:]))"
        failed = run_client(script, env, *command)
        assert failed.returncode == 1
        assert "error: upload to" in failed.stderr and "was interrupted" in failed.stderr
        assert "Run the same push again" in failed.stderr
        assert "Traceback" not in failed.stderr
        hub.wait_stopped()
        assert not hub.running
        uploaded_before = [path for method, path, _ in hub.log if method == "PUT"]
        assert len(uploaded_before) == 1  # model.safetensors reached the LFS store

        hub.start()  # same port, same storage
        assert "model.safetensors" not in HfApi(endpoint=hub.url, token=TOKEN).list_repo_files(
            "tester/interrupted"
        )
        check(run_client(script, env, *command))
        assert [path for method, path, _ in hub.log if method == "PUT"] == []  # not sent twice
        local = hf_hub_download(
            "tester/interrupted", "model.safetensors", endpoint=hub.url, token=TOKEN, cache_dir=tmp_path / "c"
        )
        assert Path(local).read_bytes() == (checkpoints["first"] / "model.safetensors").read_bytes()
    finally:
        hub.stop()


# --- the checkpoint folder is checked before anything is sent ------------------------------------------


def test_folder_without_weights_is_refused(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    folder = copy_of(checkpoints["first"], tmp_path / "no-weights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(PushError, match=r"no safetensors weights in .*no-weights"):
        collect_upload(folder)
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(PushError, match=r"only pickle weights pytorch_model.bin"):
        collect_upload(folder)


def test_missing_shard_tokenizer_or_generation_config_is_refused(
    tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    folder = copy_of(checkpoints["first"], tmp_path / "incomplete")
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PushError, match="model-00001-of-00002.safetensors"):
        collect_upload(folder)
    shutil.copy(checkpoints["first"] / "model.safetensors", folder / "model-00001-of-00002.safetensors")
    (folder / "generation_config.json").unlink()
    with pytest.raises(PushError, match="no generation_config.json .* GPTForCausalLM"):
        collect_upload(folder)
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(PushError, match=r"no tokenizer in .*tokenizer_config.json"):
        collect_upload(folder)
    with pytest.raises(PushError, match="does not exist"):
        collect_upload(tmp_path / "nowhere")


def test_upload_completes_auto_map_adds_a_card_and_leaves_out_training_state(
    tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    folder = copy_of(checkpoints["first"], tmp_path / "trainer-checkpoint")
    for name in ("README.md", "modeling_hfgpt.py"):  # as a Trainer checkpoint of an older hfgpt
        (folder / name).unlink(missing_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_hfgpt.GPTConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "optimizer.pt").write_bytes(b"x")
    (folder / "training_args.bin").write_bytes(b"x")
    (folder / "checkpoint-500").mkdir()
    (folder / "checkpoint-500" / "model.safetensors").write_bytes(b"x")
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    ops = {op.path_in_repo: op for op in collect_upload(folder, "me/run")}
    assert not {"optimizer.pt", "training_args.bin", "checkpoint-500/model.safetensors"} & set(ops)
    assert "model.safetensors" in ops and "tokenizer_config.json" in ops
    uploaded_config = json.loads(ops["config.json"].path_or_fileobj)
    assert set(uploaded_config["auto_map"]) >= EVERY_HEAD
    assert Path(ops["modeling_hfgpt.py"].path_or_fileobj).name == "modeling_hfgpt.py"
    card = ModelCard(ops["README.md"].path_or_fileobj.decode())
    assert card.data.library_name == "transformers" and 'from_pretrained("me/run"' in card.text
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before  # folder untouched


def test_trainer_state_of_a_checkpoint_folder_stays_behind(
    tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    """A Trainer `checkpoint-N` folder holds the model and Trainer's state; only the model is uploaded."""
    folder = copy_of(checkpoints["first"], tmp_path / "checkpoint-4")
    state = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "trainer_state.json"}
    for name in state:
        (folder / name).write_bytes(b"{}")
    uploaded = {op.path_in_repo for op in collect_upload(folder, "me/run")}
    assert "model.safetensors" in uploaded and not uploaded & state


def test_console_entry_point_is_installed() -> None:
    script = Path(sys.executable).parent / "hfgpt-push"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--private" in proc.stdout and "--revision" in proc.stdout


# --- the test Hub itself: answers huggingface_hub relies on --------------------------------------------


def test_hub_protocol_answers(hub: HubServer, tmp_path: Path) -> None:
    api = HfApi(endpoint=hub.url, token=TOKEN)
    assert api.whoami()["name"] == USER
    url = api.create_repo("tester/protocol")
    assert api.create_repo("tester/protocol", exist_ok=True) == url  # 409 carries the url
    with pytest.raises(HfHubHTTPError, match="409"):
        api.create_repo("tester/protocol")
    with pytest.raises(HfHubHTTPError, match="Invalid user token"):
        HfApi(endpoint=hub.url, token="hf_wrong").whoami()

    info = api.upload_file(path_or_fileobj=b"hello\n", path_in_repo="a/b.txt", repo_id="tester/protocol")
    meta = get_hf_file_metadata(hf_hub_url("tester/protocol", "a/b.txt", endpoint=hub.url), token=TOKEN)
    assert meta.commit_hash == info.oid and meta.etag == git_blob_oid(b"hello\n") and meta.size == 6
    assert [f.path for f in api.list_repo_tree("tester/protocol")] == [".gitattributes", "a"]
    assert [f.path for f in api.list_repo_tree("tester/protocol", recursive=True)] == [
        ".gitattributes",
        "a/b.txt",
        "a",
    ]
    with pytest.raises(RevisionNotFoundError):
        api.model_info("tester/protocol", revision="no-such-branch")
    api.delete_repo("tester/protocol")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("tester/protocol")


@pytest.mark.parametrize(
    ("weight_map", "message"),
    [
        (["transformer.wte.weight"], "weight_map must be a non-empty JSON object"),
        ({}, "weight_map must be a non-empty JSON object"),
        ({"transformer.wte.weight": 3}, r"weight_map\['transformer.wte.weight'\] must be a shard file name"),
        (
            {"transformer.wte.weight": "../model.safetensors"},
            "'../model.safetensors', outside the model folder",
        ),
        ({"transformer.wte.weight": "/tmp/model.safetensors"}, "outside the model folder"),
        ({"transformer.wte.weight": "checkpoint-5/model.safetensors"}, "a path that is never uploaded"),
    ],
)
def test_malformed_weights_index_is_refused_naming_the_index(
    tmp_path: Path, checkpoints: dict[str, Path], weight_map: object, message: str
) -> None:
    folder = copy_of(checkpoints["first"], tmp_path / "sharded")
    (folder / "model.safetensors").rename(tmp_path / "model.safetensors")  # beside the folder, as ../
    (folder / "checkpoint-5").mkdir()
    shutil.copy(tmp_path / "model.safetensors", folder / "checkpoint-5" / "model.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(PushError, match=rf"sharded/model.safetensors.index.json: .*{message}"):
        collect_upload(folder)


def test_shards_in_a_subfolder_are_uploaded_with_the_index(
    tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    folder = copy_of(checkpoints["first"], tmp_path / "subfolder-shards")
    (folder / "shards").mkdir()
    (folder / "model.safetensors").rename(folder / "shards" / "model-00001-of-00001.safetensors")
    index = {"weight_map": {"transformer.wte.weight": "./shards/model-00001-of-00001.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    uploaded = {op.path_in_repo for op in collect_upload(folder)}
    assert {"model.safetensors.index.json", "shards/model-00001-of-00001.safetensors"} <= uploaded


def test_tokenizer_code_file_named_by_auto_map_is_added_or_refused(
    tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    """A folder whose tokenizer_config.json's auto_map names GPT-1's tokenization_gpt1.py but lacks the
    file gets the one GPT1Tokenizer.save_pretrained writes; a code file hfgpt does not have is refused."""
    from hfgpt.tokenization import GPT1Tokenizer

    GPT1Tokenizer().save_pretrained(tmp_path / "reference")
    folder = copy_of(checkpoints["first"], tmp_path / "gpt1-tokenizer")
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        (folder / name).unlink(missing_ok=True)
    GPT1Tokenizer().save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["auto_map"]["AutoTokenizer"][0] == "tokenization_gpt1.GPT1Tokenizer"
    (folder / "tokenization_gpt1.py").unlink()

    ops = {op.path_in_repo: op.path_or_fileobj for op in collect_upload(folder)}
    added = Path(ops["tokenization_gpt1.py"]).read_bytes()
    assert added == (tmp_path / "reference" / "tokenization_gpt1.py").read_bytes()

    config["auto_map"]["AutoTokenizer"] = ["tokenization_mine.MyTokenizer", None]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(PushError, match=r"tokenizer_config.json names tokenization_mine.py in auto_map"):
        collect_upload(folder)


def test_config_the_model_card_cannot_describe_is_refused_naming_config_json(
    tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    folder = copy_of(checkpoints["first"], tmp_path / "architectures-string")
    (folder / "README.md").unlink()
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = "GPTForCausalLM"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        PushError, match=r"architectures-string/config.json: config architectures must be a list"
    ):
        collect_upload(folder)
