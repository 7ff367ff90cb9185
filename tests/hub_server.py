"""A small Hugging Face Hub on 127.0.0.1 for the tests: it speaks the Hub's HTTP protocol as
`huggingface_hub` (and through it `transformers`) uses it, so the real clients run against it.

Protocol as read from huggingface_hub's own source (hf_api.py, _commit_api.py, lfs.py, file_download.py,
utils/_http.py): repos are created/deleted through `/api/repos/{create,delete}`; a commit first asks
`/api/models/{repo}/preupload/{rev}` which files go to LFS, pushes those through the git-LFS batch API
(`/{repo}.git/info/lfs/objects/batch`, then a PUT to the `href` we hand out), then posts one
newline-delimited JSON document to `/api/models/{repo}/commit/{rev}`. Downloads are HEAD + GET on
`/{repo}/resolve/{rev}/{path}`, answered with `X-Repo-Commit` and an `ETag` (git blob sha1 for regular
files, sha256 for LFS files). Errors carry `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`,
`EntryNotFound`) and `X-Error-Message`, which huggingface_hub turns into its typed exceptions.

Storage lives in one folder: `blobs/<sha256>` for file contents and `state.json` for repos, commits and
refs, so a server stopped half-way through a push and started again on the same folder resumes where
the client left it. Xet storage is not implemented: clients must run with `HF_HUB_DISABLE_XET=1`.

Run standalone for manual poking: `python tests/hub_server.py STORAGE_DIR --port 8080`.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

DEFAULT_TOKENS = {"hf_test_write_token": "tester"}

# Where the Hub sends a file to LFS: the default `.gitattributes` it writes into a new repo lists these
# suffixes; anything binary or above 10 MB goes there too.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".npy", ".npz", ".onnx")
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
GITATTRIBUTES = "".join(f"*{suffix} filter=lfs diff=lfs merge=lfs -text\n" for suffix in LFS_SUFFIXES)

# SPDX ids and the Hub's own ids accepted in the `license` metadata field (a subset of
# https://huggingface.co/docs/hub/repositories-licenses).
KNOWN_LICENSES = {
    "apache-2.0", "mit", "openrail", "bigscience-openrail-m", "creativeml-openrail-m", "bsd-3-clause",
    "bsd-2-clause", "cc-by-4.0", "cc-by-sa-4.0", "cc-by-nc-4.0", "cc0-1.0", "gpl-3.0", "lgpl-3.0",
    "agpl-3.0", "llama2", "llama3", "gemma", "unlicense", "other", "unknown",
}  # fmt: skip


def git_blob_oid(data: bytes) -> str:
    """The object id git gives a file's content (what the Hub reports as `oid` for regular files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The pointer file git-LFS stores in the git tree in place of the content."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


class HubError(Exception):
    """An error answer: status, message, and the `X-Error-Code` huggingface_hub dispatches on."""

    def __init__(self, status: int, message: str, code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra or {}


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: Any
    body: bytes
    user: str | None

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except json.JSONDecodeError as err:
            raise HubError(400, f"request body is not JSON: {err}") from err


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(status, json.dumps(data).encode(), headers or {})


class HubState:
    """Repos, commits and refs, persisted as JSON next to the blobs so a restarted server resumes."""

    def __init__(self, storage: Path, tokens: dict[str, str]):
        self.storage = Path(storage)
        self.blobs = self.storage / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.state_file = self.storage / "state.json"
        self.tokens = dict(tokens)
        self.lock = threading.RLock()
        self.repos: dict[str, dict] = {}
        if self.state_file.exists():
            self.repos = json.loads(self.state_file.read_text())["repos"]

    def save(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"repos": self.repos}, indent=1))
        tmp.replace(self.state_file)

    # -- blobs -------------------------------------------------------------------------------------
    def put_blob(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self.blobs / sha
        if not path.exists():
            tmp = path.with_suffix(f".tmp{threading.get_ident()}")
            tmp.write_bytes(data)
            tmp.replace(path)
        return sha

    def has_blob(self, sha: str) -> bool:
        return (self.blobs / sha).exists()

    def read_blob(self, sha: str) -> bytes:
        return (self.blobs / sha).read_bytes()

    # -- repos and revisions -----------------------------------------------------------------------
    def repo(self, repo_id: str, user: str | None, write: bool = False) -> dict:
        """The repo, or the error the Hub gives: a private repo is 'not found' for anyone but its owner."""
        repo = self.repos.get(repo_id)
        if repo is None or (repo["private"] and user != repo["owner"]):
            if user is None:
                raise HubError(401, "Repository not found", "RepoNotFound")
            raise HubError(404, "Repository not found", "RepoNotFound")
        if write:
            self.check_write(repo_id, user)
        return repo

    def check_write(self, repo_id: str, user: str | None) -> None:
        if user is None:
            raise HubError(401, "You must be authenticated to write to this repo")
        if repo_id.split("/")[0] != user:
            raise HubError(403, f"You don't have the rights to write to {repo_id}")

    def resolve(self, repo: dict, revision: str) -> str:
        """Branch, tag or full commit id -> commit id, as the Hub accepts all three."""
        revision = unquote(revision)
        if revision in repo["branches"]:
            return repo["branches"][revision]
        if revision in repo["tags"]:
            return repo["tags"][revision]
        if revision in repo["commits"]:
            return revision
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def new_commit(self, repo: dict, parent: str | None, files: dict, title: str, message: str) -> str:
        payload = json.dumps([parent, files, title, message, time.time_ns()], sort_keys=True)
        oid = hashlib.sha1(payload.encode()).hexdigest()
        repo["commits"][oid] = {
            "parent": parent,
            "files": files,
            "title": title,
            "message": message,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
        }
        return oid

    def file_entry(self, data: bytes, lfs: bool) -> dict:
        sha = self.put_blob(data)
        return self.lfs_entry(sha, len(data)) if lfs else {"sha256": sha, "size": len(data), "lfs": False}

    @staticmethod
    def lfs_entry(sha: str, size: int) -> dict:
        return {"sha256": sha, "size": size, "lfs": True}

    def git_oid(self, entry: dict) -> str:
        if entry["lfs"]:
            return git_blob_oid(lfs_pointer(entry["sha256"], entry["size"]))
        return git_blob_oid(self.read_blob(entry["sha256"]))


class Hub:
    """The route table and its handlers, independent of the HTTP plumbing."""

    def __init__(self, state: HubState, base_url: str):
        self.state = state
        self.base_url = base_url
        self.log: list[tuple[str, str, int]] = []  # (method, path, status) of every request answered
        self.fail_on: set[str] = set()  # route names that stop the server when hit (see HubServer)
        R = r"(?P<repo>[^/]+/[^/]+)"
        self.routes: list[tuple[str, str, re.Pattern, Any]] = [
            (m, name, re.compile(p), h)
            for m, name, p, h in [
                ("GET", "whoami", r"^/api/whoami-v2$", self.whoami),
                ("POST", "validate-yaml", r"^/api/validate-yaml$", self.validate_yaml),
                ("POST", "create", r"^/api/repos/create$", self.create_repo),
                ("DELETE", "delete", r"^/api/repos/delete$", self.delete_repo),
                ("GET", "info", rf"^/api/models/{R}(?:/revision/(?P<rev>[^/]+))?$", self.model_info),
                ("GET", "tree", rf"^/api/models/{R}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?$", self.tree),
                ("POST", "paths-info", rf"^/api/models/{R}/paths-info/(?P<rev>[^/]+)$", self.paths_info),
                ("GET", "refs", rf"^/api/models/{R}/refs$", self.refs),
                ("GET", "commits", rf"^/api/models/{R}/commits/(?P<rev>[^/]+)$", self.commits),
                ("POST", "branch", rf"^/api/models/{R}/branch/(?P<name>[^/]+)$", self.create_branch),
                ("DELETE", "branch", rf"^/api/models/{R}/branch/(?P<name>[^/]+)$", self.delete_branch),
                ("POST", "tag", rf"^/api/models/{R}/tag/(?P<rev>[^/]+)$", self.create_tag),
                ("DELETE", "tag", rf"^/api/models/{R}/tag/(?P<name>[^/]+)$", self.delete_tag),
                ("POST", "preupload", rf"^/api/models/{R}/preupload/(?P<rev>[^/]+)$", self.preupload),
                ("POST", "commit", rf"^/api/models/{R}/commit/(?P<rev>[^/]+)$", self.commit),
                ("POST", "lfs-batch", rf"^/{R}\.git/info/lfs/objects/batch$", self.lfs_batch),
                ("PUT", "lfs-upload", r"^/lfs-upload/(?P<oid>[0-9a-f]{64})$", self.lfs_upload),
                ("POST", "lfs-verify", r"^/lfs-verify/(?P<oid>[0-9a-f]{64})$", self.lfs_verify),
                ("GET", "resolve", rf"^/{R}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", self.resolve),
                ("HEAD", "resolve", rf"^/{R}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", self.resolve),
            ]
        ]

    def route(self, method: str, path: str) -> tuple[str, Any, dict[str, str]]:
        known_path = False
        for m, name, pattern, handler in self.routes:
            match = pattern.match(path)
            if match:
                known_path = True
                if m == method:
                    return name, handler, {k: v for k, v in match.groupdict().items() if v is not None}
        if known_path:
            raise HubError(405, f"{method} not allowed on {path}")
        raise HubError(404, f"no such endpoint: {method} {path}")

    def user_for(self, headers: Any) -> str | None:
        """Token -> user. A token the Hub does not know is refused outright, as on huggingface.co."""
        auth = headers.get("Authorization")
        if not auth:
            return None
        token = auth.removeprefix("Bearer ").strip()
        if token not in self.state.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        return self.state.tokens[token]

    # -- account -----------------------------------------------------------------------------------
    def whoami(self, req: Request) -> Response:
        if req.user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return json_response(
            {
                "type": "user",
                "id": hashlib.sha1(req.user.encode()).hexdigest()[:24],
                "name": req.user,
                "fullname": req.user,
                "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "tests", "role": "write"}},
            }
        )

    def validate_yaml(self, req: Request) -> Response:
        """Checks the card's front matter the way the Hub does for the parts our cards use: it must parse,
        be a mapping, name a known licence, and carry a well-formed `model-index`."""
        content = req.json().get("content", "")
        errors, warnings = card_metadata_problems(content)
        if req.headers.get("Accept") == "text/plain":
            text = "\n".join(errors or warnings)
            return Response(400 if errors else 200, text.encode(), content_type="text/plain")
        return json_response(
            {"errors": [{"message": e} for e in errors], "warnings": [{"message": w} for w in warnings]},
            status=400 if errors else 200,
        )

    # -- repos -------------------------------------------------------------------------------------
    def create_repo(self, req: Request) -> Response:
        payload = req.json()
        if payload.get("type", "model") != "model":
            raise HubError(400, "this test Hub only hosts model repos")
        namespace = payload.get("organization") or req.user
        repo_id = f"{namespace}/{payload['name']}"
        self.state.check_write(repo_id, req.user)
        url = f"{self.base_url}/{repo_id}"
        with self.state.lock:
            if repo_id in self.state.repos:
                # huggingface_hub's create_repo(exist_ok=True) reads `url` from this 409.
                raise HubError(409, "You already created this model repo", extra={"url": url})
            private = payload.get("visibility", "public") != "public" or bool(payload.get("private"))
            repo = {"owner": req.user, "private": private, "branches": {}, "tags": {}, "commits": {}}
            # A new Hub repo holds one commit with the default .gitattributes.
            files = {".gitattributes": self.state.file_entry(GITATTRIBUTES.encode(), lfs=False)}
            repo["branches"]["main"] = self.state.new_commit(repo, None, files, "initial commit", "")
            self.state.repos[repo_id] = repo
            self.state.save()
        return json_response({"url": url, "name": repo_id, "id": repo_id})

    def delete_repo(self, req: Request) -> Response:
        payload = req.json()
        repo_id = f"{payload.get('organization') or req.user}/{payload['name']}"
        with self.state.lock:
            self.state.repo(repo_id, req.user, write=True)
            del self.state.repos[repo_id]
            self.state.save()
        return json_response({})

    def model_info(self, req: Request, repo: str, rev: str = "main") -> Response:
        r = self.state.repo(repo, req.user)
        oid = self.state.resolve(r, rev)
        commit = r["commits"][oid]
        siblings = [{"rfilename": p} for p in sorted(commit["files"])]
        return json_response(
            {
                "id": repo,
                "modelId": repo,
                "author": repo.split("/")[0],
                "sha": oid,
                "private": r["private"],
                "lastModified": commit["date"],
                "library_name": "transformers",
                "siblings": siblings,
            }
        )

    def _path_info(self, path: str, entry: dict) -> dict:
        info = {"type": "file", "oid": self.state.git_oid(entry), "size": entry["size"], "path": path}
        if entry["lfs"]:
            pointer = lfs_pointer(entry["sha256"], entry["size"])
            info["lfs"] = {"oid": entry["sha256"], "size": entry["size"], "pointerSize": len(pointer)}
        return info

    def _listing(self, files: dict, prefix: str, recursive: bool) -> list[dict]:
        out, folders = [], set()
        base = f"{prefix.rstrip('/')}/" if prefix else ""
        for path in sorted(files):
            if not path.startswith(base):
                continue
            rest = path[len(base) :]
            if "/" in rest and not recursive:
                folders.add(base + rest.split("/")[0])
                continue
            if recursive:
                parts = rest.split("/")[:-1]
                folders.update(base + "/".join(parts[: i + 1]) for i in range(len(parts)))
            out.append(self._path_info(path, files[path]))
        out += [
            {"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
            for f in folders
        ]
        return out

    def tree(self, req: Request, repo: str, rev: str, path: str = "") -> Response:
        r = self.state.repo(repo, req.user)
        files = r["commits"][self.state.resolve(r, rev)]["files"]
        path = unquote(path)
        if path and path in files:
            raise HubError(404, f"{path} is a file, not a folder", "EntryNotFound")
        listing = self._listing(files, path, req.query.get("recursive", ["False"])[0].lower() == "true")
        if path and not listing:
            raise HubError(404, f"{path} does not exist at {rev}", "EntryNotFound")
        return json_response(listing)

    def paths_info(self, req: Request, repo: str, rev: str) -> Response:
        r = self.state.repo(repo, req.user)
        files = r["commits"][self.state.resolve(r, rev)]["files"]
        form = parse_qs(req.body.decode())
        out = []
        for path in form.get("paths", []):
            if path in files:
                out.append(self._path_info(path, files[path]))
            elif any(p.startswith(path.rstrip("/") + "/") for p in files):
                out.append(
                    {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "path": path}
                )
        return json_response(out)

    def refs(self, req: Request, repo: str) -> Response:
        r = self.state.repo(repo, req.user)

        def ref_list(kind: str, git_dir: str) -> list[dict]:
            return [
                {"name": n, "ref": f"refs/{git_dir}/{n}", "targetCommit": c}
                for n, c in sorted(r[kind].items())
            ]

        return json_response(
            {
                "branches": ref_list("branches", "heads"),
                "tags": ref_list("tags", "tags"),
                "converts": [],
                "pullRequests": [],
            }
        )

    def commits(self, req: Request, repo: str, rev: str) -> Response:
        r = self.state.repo(repo, req.user)
        oid: str | None = self.state.resolve(r, rev)
        out = []
        while oid is not None:
            c = r["commits"][oid]
            out.append(
                {"id": oid, "title": c["title"], "message": c["message"], "date": c["date"], "authors": []}
            )
            oid = c["parent"]
        return json_response(out)

    def create_branch(self, req: Request, repo: str, name: str) -> Response:
        name = unquote(name)
        with self.state.lock:
            r = self.state.repo(repo, req.user, write=True)
            if name in r["branches"]:
                raise HubError(409, f"Branch {name} already exists")
            start = req.json().get("startingPoint") or "main"
            r["branches"][name] = self.state.resolve(r, start)
            self.state.save()
        return json_response({})

    def delete_branch(self, req: Request, repo: str, name: str) -> Response:
        name = unquote(name)
        with self.state.lock:
            r = self.state.repo(repo, req.user, write=True)
            if name not in r["branches"] or name == "main":
                raise HubError(404 if name != "main" else 403, f"cannot delete branch {name}")
            del r["branches"][name]
            self.state.save()
        return json_response({})

    def create_tag(self, req: Request, repo: str, rev: str) -> Response:
        tag = req.json().get("tag")
        with self.state.lock:
            r = self.state.repo(repo, req.user, write=True)
            if not tag or tag in r["tags"]:
                raise HubError(409, f"Tag {tag} already exists")
            r["tags"][tag] = self.state.resolve(r, rev)
            self.state.save()
        return json_response({})

    def delete_tag(self, req: Request, repo: str, name: str) -> Response:
        with self.state.lock:
            r = self.state.repo(repo, req.user, write=True)
            if r["tags"].pop(unquote(name), None) is None:
                raise HubError(404, f"no tag {name}", "RevisionNotFound")
            self.state.save()
        return json_response({})

    # -- uploads -----------------------------------------------------------------------------------
    def preupload(self, req: Request, repo: str, rev: str) -> Response:
        r = self.state.repo(repo, req.user, write=True)
        files = r["commits"][self.state.resolve(r, rev)]["files"]
        out = []
        for f in req.json().get("files", []):
            sample = base64.b64decode(f.get("sample", ""))
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_SIZE_THRESHOLD or b"\0" in sample
            existing = files.get(f["path"])
            # `oid` lets the client skip unchanged files: sha256 for LFS, git sha1 for regular files.
            oid = None
            if existing is not None:
                oid = existing["sha256"] if existing["lfs"] else self.state.git_oid(existing)
            out.append(
                {
                    "path": f["path"],
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": False,
                    "oid": oid,
                }
            )
        return json_response({"files": out})

    def lfs_batch(self, req: Request, repo: str) -> Response:
        self.state.repo(repo, req.user, write=True)
        payload = req.json()
        if payload.get("operation") != "upload":
            raise HubError(400, "only uploads go through this batch endpoint")
        objects = []
        for obj in payload.get("objects", []):
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if not self.state.has_blob(obj["oid"]):  # no `actions` = already stored, client skips it
                entry["actions"] = {
                    "upload": {"href": f"{self.base_url}/lfs-upload/{obj['oid']}"},
                    "verify": {"href": f"{self.base_url}/lfs-verify/{obj['oid']}"},
                }
            objects.append(entry)
        return Response(200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                        content_type="application/vnd.git-lfs+json")  # fmt: skip

    def lfs_upload(self, req: Request, oid: str) -> Response:
        if hashlib.sha256(req.body).hexdigest() != oid:
            raise HubError(400, f"uploaded content does not hash to {oid}")
        self.state.put_blob(req.body)
        return Response(200)

    def lfs_verify(self, req: Request, oid: str) -> Response:
        if not self.state.has_blob(oid):
            raise HubError(404, f"object {oid} was never uploaded")
        return json_response({})

    def commit(self, req: Request, repo: str, rev: str) -> Response:
        lines = [json.loads(line) for line in req.body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "a commit starts with a header line")
        header = lines[0]["value"]
        with self.state.lock:
            r = self.state.repo(repo, req.user, write=True)
            branch = unquote(rev)
            if branch not in r["branches"]:
                raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            parent = r["branches"][branch]
            if header.get("parentCommit") not in (None, parent):
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(r["commits"][parent]["files"])
            for line in lines[1:]:
                key, value = line["key"], line["value"]
                path = value["path"]
                if key == "file":
                    files[path] = self.state.file_entry(base64.b64decode(value["content"]), lfs=False)
                elif key == "lfsFile":
                    if not self.state.has_blob(value["oid"]):
                        raise HubError(422, f"LFS object {value['oid']} for {path} was never uploaded")
                    size = value.get("size") or (self.state.blobs / value["oid"]).stat().st_size
                    files[path] = self.state.lfs_entry(value["oid"], size)
                elif key == "deletedFile":
                    if files.pop(path, None) is None:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                elif key == "deletedFolder":
                    files = {p: e for p, e in files.items() if not p.startswith(path.rstrip("/") + "/")}
                else:
                    raise HubError(400, f"unknown commit operation {key!r}")
            oid = self.state.new_commit(r, parent, files, header["summary"], header.get("description", ""))
            r["branches"][branch] = oid
            self.state.save()
        return json_response(
            {"commitUrl": f"{self.base_url}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}
        )

    # -- downloads ---------------------------------------------------------------------------------
    def resolve(self, req: Request, repo: str, rev: str, path: str) -> Response:
        r = self.state.repo(repo, req.user)
        oid = self.state.resolve(r, rev)
        entry = r["commits"][oid]["files"].get(unquote(path))
        if entry is None:
            raise HubError(404, "Entry not found", "EntryNotFound", extra={"X-Repo-Commit": oid})
        etag = entry["sha256"] if entry["lfs"] else self.state.git_oid(entry)
        headers = {"X-Repo-Commit": oid, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if entry["lfs"]:
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(entry["size"])})
        body = self.state.read_blob(entry["sha256"])
        status = 200
        byte_range = re.fullmatch(r"bytes=(\d+)-(\d*)", req.headers.get("Range", ""))
        if byte_range and req.method == "GET":
            start = int(byte_range[1])
            end = int(byte_range[2]) if byte_range[2] else len(body) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(body)}"
            body, status = body[start : end + 1], 206
        return Response(status, body, headers, content_type="application/octet-stream")


def card_metadata_problems(content: str) -> tuple[list[str], list[str]]:
    """(errors, warnings) for a README's YAML front matter, following the Hub's rules for the fields
    our cards set. See https://huggingface.co/docs/hub/model-cards#model-card-metadata."""
    match = re.match(r"^\s*---\r?\n(.*?)\r?\n---\s*(\r?\n|$)", content, re.DOTALL)
    if match is None:
        return [], ["empty or missing yaml metadata in repo card"]
    try:
        meta = yaml.safe_load(match[1])
    except yaml.YAMLError as err:
        return [f"Invalid YAML in the front matter: {err}"], []
    if meta is None:
        return [], ["empty or missing yaml metadata in repo card"]
    if not isinstance(meta, dict):
        return ["The front matter must be a YAML mapping"], []
    errors = []
    licenses = meta.get("license")
    for lic in licenses if isinstance(licenses, list) else [licenses] if licenses is not None else []:
        if lic not in KNOWN_LICENSES:
            errors.append(f'"license" must be a known license id, got {lic!r}')
    for key in ("tags", "datasets", "language"):
        value = meta.get(key)
        if value is not None and not isinstance(value, (str, list)):
            errors.append(f'"{key}" must be a string or a list of strings')
    model_index = meta.get("model-index")
    if model_index is not None:
        errors += model_index_problems(model_index)
    return errors, []


def model_index_problems(model_index: Any) -> list[str]:
    if not isinstance(model_index, list):
        return ['"model-index" must be a list']
    errors = []
    for i, model in enumerate(model_index):
        if not isinstance(model, dict) or not isinstance(model.get("name"), str):
            errors.append(f'"model-index[{i}].name" is required')
            continue
        for j, result in enumerate(model.get("results") or []):
            where = f"model-index[{i}].results[{j}]"
            if not isinstance((result.get("task") or {}).get("type"), str):
                errors.append(f'"{where}.task.type" is required')
            dataset = result.get("dataset") or {}
            if not (isinstance(dataset.get("type"), str) and isinstance(dataset.get("name"), str)):
                errors.append(f'"{where}.dataset" needs a type and a name')
            metrics = result.get("metrics")
            if not isinstance(metrics, list) or not metrics:
                errors.append(f'"{where}.metrics" must be a non-empty list')
                continue
            for k, metric in enumerate(metrics):
                if not isinstance(metric.get("type"), str) or "value" not in metric:
                    errors.append(f'"{where}.metrics[{k}]" needs a type and a value')
    return errors


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects
    server: _HubHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read `hub.log` instead
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _dispatch(self) -> None:
        hub = self.server.hub
        url = urlsplit(self.path)
        # Read the body before anything else: answering early leaves unread bytes on a keep-alive
        # connection and the client's next request on it breaks.
        body = self._read_body()
        if self.server.dead:  # stopped: connections kept alive from before get no answer either
            self.close_connection = True
            return
        name = None
        try:
            name, handler, params = hub.route(self.command, url.path)
            if name in hub.fail_on:
                hub.fail_on.discard(name)
                self.server.die()  # the "server stopped mid-push" scenario: no answer, then gone
                self.close_connection = True
                return
            req = Request(self.command, url.path, parse_qs(url.query), self.headers, body, None)
            req.user = hub.user_for(self.headers)
            response = handler(req, **params)
        except HubError as err:
            payload = {"error": err.message, **err.extra}
            headers = {
                "X-Error-Message": err.message,
                **{k: v for k, v in err.extra.items() if k.startswith("X-")},
            }
            if err.code:
                headers["X-Error-Code"] = err.code
            response = json_response(payload, err.status, headers)
        except Exception as err:  # a server bug: answer 500 with the reason rather than hang the client
            response = json_response({"error": f"test Hub crashed: {type(err).__name__}: {err}"}, 500)
        hub.log.append((self.command, url.path, response.status))
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        for key, value in response.headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _dispatch


class _HubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    hub: Hub

    dead = False

    def die(self) -> None:
        self.dead = True
        threading.Thread(target=self.shutdown, daemon=True).start()


class HubServer:
    """A Hub on 127.0.0.1 serving from `storage`; `with HubServer(tmp_path) as hub: hub.url`.

    `tokens` maps access tokens to user names. `stop()` then `start()` keeps the port and the data.
    `fail_on.add("commit")` makes the server stop, without answering, when the next commit arrives.
    """

    def __init__(self, storage: Path, tokens: dict[str, str] | None = None, port: int = 0):
        self.state = HubState(Path(storage), tokens or DEFAULT_TOKENS)
        self.port = port
        self._httpd: _HubHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.hub: Hub | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> list[tuple[str, str, int]]:
        return self.hub.log if self.hub else []

    @property
    def fail_on(self) -> set[str]:
        assert self.hub is not None, "start the server first"
        return self.hub.fail_on

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> HubServer:
        self._httpd = _HubHTTPServer(("127.0.0.1", self.port), _Handler)
        self.port = self._httpd.server_address[1]
        self.hub = Hub(self.state, self.url)
        self._httpd.hub = self.hub
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True, name="test-hub")
        self._thread.start()
        return self

    def wait_stopped(self, timeout: float = 30) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        if self._httpd is not None:
            self._httpd.server_close()

    def stop(self) -> None:
        if self._httpd is not None and self.running:
            self._httpd.shutdown()
        self.wait_stopped()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("storage", type=Path)
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    server = HubServer(args.storage, port=args.port).start()
    print(f"test Hub at {server.url}; token {next(iter(DEFAULT_TOKENS))}", flush=True)
    server.wait_stopped(timeout=None)


if __name__ == "__main__":
    main()
