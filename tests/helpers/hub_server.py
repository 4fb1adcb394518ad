"""A small Hugging Face Hub on 127.0.0.1 for tests: the endpoints ``huggingface_hub`` calls to push.

whoami, create repo, repo info, branches, validate-yaml, preupload and commit, with tokens,
namespaces and private repos. Preupload answers ``regular`` for every file, so file contents
travel inline (base64) in the commit and no LFS/Xet storage is needed. A commit is applied
all at once or not at all, as on the Hub.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml

REPO = re.compile(r"^/api/models/([^/]+)/([^/]+)(?:/(revision|preupload|commit|branch)/(.+))?$")


@dataclass
class Commit:
    oid: str
    summary: str
    description: str
    files: dict[str, bytes]


@dataclass
class Repo:
    owner: str
    private: bool
    branches: dict[str, list[Commit]] = field(default_factory=dict)

    def head(self, branch: str = "main") -> Commit:
        return self.branches[branch][-1]


@dataclass
class User:
    name: str
    orgs: list[str] = field(default_factory=list)
    role: str = "write"


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra


class FakeHub:
    """The server's state; ``requests`` records every (method, path) it was sent."""

    def __init__(self) -> None:
        self.users: dict[str, User] = {}
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.authorizations: list[str] = []
        self.fail_next_commit = False
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add_user(self, token: str, name: str, orgs: list[str] | None = None, role: str = "write") -> None:
        self.users[token] = User(name, orgs or [], role)

    def create(self, repo_id: str, private: bool = False) -> Repo:
        repo = Repo(repo_id.split("/")[0], private)
        repo.branches["main"] = [_commit("initial commit", "", {".gitattributes": b"*.safetensors filter=lfs\n"})]
        self.repos[repo_id] = repo
        return repo

    # ---------------------------------------------------------------- request handling

    def user(self, headers: Any, required: bool = True) -> User | None:
        auth = headers.get("authorization") or ""
        token = auth.removeprefix("Bearer ").strip()
        if auth:
            self.authorizations.append(token)
        if token in self.users:
            return self.users[token]
        if required or auth:
            raise HubError(401, "Invalid credentials in Authorization header")
        return None

    def visible(self, repo_id: str, user: User | None) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not self.can_write(repo.owner, user, check_role=False)):
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def can_write(self, owner: str, user: User | None, check_role: bool = True) -> bool:
        if user is None or (check_role and user.role != "write"):
            return False
        return owner == user.name or owner in user.orgs

    def writable(self, repo_id: str, user: User | None) -> Repo:
        repo = self.visible(repo_id, user)
        if not self.can_write(repo.owner, user):
            raise HubError(403, "You don't have the rights to write to this repository")
        return repo

    def handle(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, Any]:
        self.requests.append((method, path))
        if path == "/api/whoami-v2" and method == "GET":
            u = self.user(headers)
            access = {"displayName": "test", "role": u.role}
            orgs = [{"name": org} for org in u.orgs]
            return 200, {"type": "user", "name": u.name, "orgs": orgs, "auth": {"accessToken": access}}
        if path == "/api/repos/create" and method == "POST":
            return self.create_repo(self.user(headers), json.loads(body))
        if path == "/api/validate-yaml" and method == "POST":
            return self.validate_yaml(json.loads(body)["content"])
        match = REPO.match(path)
        if not match:
            raise HubError(404, f"no route for {method} {path}")
        repo_id, action, rest = f"{match[1]}/{match[2]}", match[3], unquote(match[4] or "")
        user = self.user(headers, required=method != "GET")
        with self.lock:
            if action is None or action == "revision":
                return self.info(repo_id, self.visible(repo_id, user), rest or "main")
            repo = self.writable(repo_id, user)
            if action == "branch":
                return self.branch(repo, rest, method)
            branch = self.branch_of(repo, rest)
            if action == "preupload":
                files = json.loads(body)["files"]
                modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                return 200, {"files": modes}
            return self.commit(repo_id, repo, branch, body)

    def create_repo(self, user: User, payload: dict[str, Any]) -> tuple[int, Any]:
        owner = payload.get("organization") or user.name
        repo_id = f"{owner}/{payload['name']}"
        if not self.can_write(owner, user):
            raise HubError(403, f"You don't have the rights to create a model under the namespace {owner!r}")
        with self.lock:
            if repo_id in self.repos:
                raise HubError(409, "You already created this model repo", url=f"{self.url}/{repo_id}")
            self.create(repo_id, private=payload.get("visibility") == "private" or bool(payload.get("private")))
        return 200, {"url": f"{self.url}/{repo_id}", "name": repo_id}

    def validate_yaml(self, content: str) -> tuple[int, Any]:
        match = re.match(r"^---\n(.*?)\n---\n", content, re.S)
        try:
            data = yaml.safe_load(match[1]) if match else {}
        except yaml.YAMLError as err:
            return 400, {"errors": [{"message": str(err)}]}
        if not isinstance(data, dict):
            return 400, {"errors": [{"message": "metadata must be a mapping"}]}
        return 200, {"errors": [], "warnings": []}

    def info(self, repo_id: str, repo: Repo, revision: str) -> tuple[int, Any]:
        commit = repo.head(self.branch_of(repo, revision))
        siblings = [{"rfilename": name, "size": len(data)} for name, data in commit.files.items()]
        return 200, {"id": repo_id, "sha": commit.oid, "private": repo.private, "siblings": siblings}

    def branch_of(self, repo: Repo, name: str) -> str:
        if name not in repo.branches:
            raise HubError(404, f"Invalid rev id: {name}", "RevisionNotFound")
        return name

    def branch(self, repo: Repo, name: str, method: str) -> tuple[int, Any]:
        if method == "DELETE":
            repo.branches.pop(self.branch_of(repo, name))
            return 200, {}
        if name in repo.branches:
            raise HubError(409, f"Branch {name} already exists")
        repo.branches[name] = [repo.head("main")]
        return 200, {}

    def commit(self, repo_id: str, repo: Repo, branch: str, body: bytes) -> tuple[int, Any]:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(item["value"] for item in lines if item["key"] == "header")
        files = dict(repo.head(branch).files)
        for item in lines:
            value = item["value"]
            if item["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif item["key"] == "deletedFile":
                files.pop(value["path"], None)
            elif item["key"] != "header":
                raise HubError(400, f"unsupported commit operation {item['key']}")
        if self.fail_next_commit:  # fails after parsing: nothing of the commit may become visible
            self.fail_next_commit = False
            raise HubError(500, "Internal Error - We're working hard to fix this as soon as possible!")
        commit = _commit(header["summary"], header.get("description", ""), files)
        repo.branches[branch].append(commit)
        return 200, {"commitUrl": f"{self.url}/{repo_id}/commit/{commit.oid}", "commitOid": commit.oid}


def _commit(summary: str, description: str, files: dict[str, bytes]) -> Commit:
    digest = hashlib.sha1(summary.encode() + b"".join(k.encode() + v for k, v in sorted(files.items())))
    return Commit(digest.hexdigest(), summary, description, files)


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            headers: dict[str, str] = {}
            try:
                status, payload = hub.handle(self.command, urlsplit(self.path).path, self.headers, body)
            except HubError as err:
                status, payload = err.status, {"error": err.message, **err.extra}
                headers["X-Error-Message"] = err.message
                if err.code:
                    headers["X-Error-Code"] = err.code
            data = json.dumps(payload).encode()
            self.send_response(status)
            for key, value in {"Content-Type": "application/json", **headers}.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = do_PUT = _serve

        def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
            pass

    return Handler
