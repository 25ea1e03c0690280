"""An in-memory stand-in for the Hugging Face Hub HTTP API, served on 127.0.0.1 for tests.

`FakeHub` answers the requests that `transformers.Trainer` (5.23) makes with `push_to_hub=True`
(any `hub_strategy`) through `huggingface_hub` 2.4: `init_hf_repo` calls `HfApi.create_repo`,
and `push_to_hub` / `_push_from_checkpoint` call `HfApi.upload_folder` (never with
`delete_patterns`, so no deletion, tree listing or paths-info request is made).

Endpoints (model repos only; the token is checked on every one):

* `GET  /api/whoami-v2`: `HfApi.whoami`.
* `POST /api/repos/create`: `create_repo`; 409 (with the repo's `url`) if the repo exists, which
  the client accepts with `exist_ok=True`.
* `POST /api/validate-yaml`: always valid; the client calls it whenever a commit carries a
  `README.md` (the Trainer's model card).
* `GET  /api/models/{ns}/{name}[/revision/main]`: `repo_info`. The client calls it after an upload
  in which every file was unchanged (no commit is made), and when `create_repo(exist_ok=True)` is
  answered 401/402/403.
* `POST /api/models/{ns}/{name}/preupload/main`: answers `"regular"` for every file, with the stored
  file's git oid so that the client skips unchanged files, as against the real Hub.
* `POST /api/models/{ns}/{name}/commit/main`: ndjson commit of base64 `file` lines; a stale
  `parentCommit` gets 412. Other operations (LFS files, deletions, copies) get 400.

Only the `main` branch exists. Because the server never answers `"lfs"`, no LFS or Xet transfer
can happen; `env()` still sets `HF_HUB_DISABLE_XET=1`, which also makes `upload_folder` use the
single-commit `create_commit` path instead of the Xet upload pipeline.

Failure injection: set `refuse_uploads` to a status (403, 500) to answer the endpoints named in
`refuse_endpoints` with `{"error": refuse_message}`, optionally only after `refuse_after_commits`
accepted commits. The client retries preupload on 5xx for about 23 s, so prefer 4xx in tests.

Use from a subprocess (`HF_ENDPOINT` is read when `huggingface_hub` is imported)::

    with FakeHub(token="hf_test_secret") as hub:
        subprocess.run([sys.executable, "train.py"], env=hub.env(), check=True)
        assert "model.safetensors" in hub.files("test-user/my-model")

In-process, use `HfApi(endpoint=hub.endpoint, token=...)` and set `huggingface_hub.constants`
`HF_HUB_OFFLINE = False` (this repo's conftest sets `HF_HUB_OFFLINE=1`) and `HF_HUB_DISABLE_XET = True`.

The token is never logged or printed: request logging is off, `requests` records only method,
path and status, and `repr(FakeHub)` shows the endpoint only.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["WRITE_ENDPOINTS", "CommitRecord", "FakeHub", "RequestRecord"]

#: Endpoint names that `FakeHub.refuse_endpoints` can contain.
WRITE_ENDPOINTS: frozenset[str] = frozenset({"create_repo", "preupload", "commit"})

_MISSING_TOKEN = "You must be authenticated: send an 'Authorization: Bearer <token>' header"
_BAD_TOKEN = "Invalid credentials in Authorization header"  # the client recognises this text on 401s


def _git_blob_oid(content: bytes) -> str:
    """The oid the client computes for a regular file to tell whether it changed."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass(frozen=True)
class CommitRecord:
    """One accepted commit, in arrival order."""

    oid: str
    title: str
    added: tuple[str, ...]  # paths added or overwritten


@dataclass(frozen=True)
class RequestRecord:
    """One handled request (the query string and headers are not kept)."""

    method: str
    path: str
    status: int


@dataclass
class _Repo:
    private: bool
    head: str = field(default_factory=lambda: secrets.token_hex(20))  # the Hub starts repos with one commit
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[CommitRecord] = field(default_factory=list)


class _HubError(Exception):
    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


class FakeHub:
    """A Hub look-alike on `http://127.0.0.1:<free port>`; start it with `with` or `start()`.

    `token` is the only token accepted (as `Authorization: Bearer <token>`); repos created without
    a namespace go under `user`. The `refuse_*` attributes may be changed while the server runs.
    """

    def __init__(self, token: str = "hf_test_secret", *, user: str = "test-user") -> None:
        self._token = token
        self.user = user
        self.refuse_uploads: int | None = None
        self.refuse_message = "FakeHub refuses uploads (failure injection)"
        self.refuse_endpoints: set[str] = set(WRITE_ENDPOINTS)
        self.refuse_after_commits: int | None = None
        self.requests: list[RequestRecord] = []
        self._repos: dict[str, _Repo] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def endpoint(self) -> str:
        """Base URL to use as `HF_ENDPOINT` or `HfApi(endpoint=...)`."""
        if self._server is None:
            raise RuntimeError("FakeHub is not running")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> FakeHub:
        if self._server is None:
            handler = type("_BoundHandler", (_Handler,), {"hub": self})
            self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
            self._server.daemon_threads = True
            # A short poll interval keeps `stop()` (and so test teardown) fast.
            kwargs = {"poll_interval": 0.05}
            threading.Thread(target=self._server.serve_forever, kwargs=kwargs, name="fake-hub", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()  # returns once `serve_forever` has stopped
            self._server.server_close()
            self._server = None

    def __repr__(self) -> str:
        return f"FakeHub({self.endpoint if self._server else 'stopped'}, user={self.user!r})"

    def env(self, base: Mapping[str, str] | None = None, *, with_token: bool = True, **extra: str) -> dict[str, str]:
        """Environment for a child process that should talk to this server.

        Starts from `base` (default `os.environ`), points `HF_ENDPOINT` here, turns offline mode and
        telemetry off, sets `HF_HUB_DISABLE_XET=1` (see module docs), `HF_TOKEN` unless
        `with_token=False`, then `extra`.
        """
        env = dict(os.environ if base is None else base)
        env.update(
            HF_ENDPOINT=self.endpoint,
            HF_HUB_OFFLINE="0",
            TRANSFORMERS_OFFLINE="0",
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_DISABLE_XET="1",
        )
        if with_token:
            env["HF_TOKEN"] = self._token
        env.update(extra)
        return env

    # ------------------------------------------------------------------ inspection

    def repo_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._repos)

    def files(self, repo_id: str) -> dict[str, bytes]:
        """Content of every file on `main`; KeyError if the repo is unknown."""
        with self._lock:
            return dict(sorted(self._repos[repo_id].files.items()))

    def commits(self, repo_id: str) -> list[CommitRecord]:
        """Accepted commits, oldest first (the repo's empty initial commit is not listed)."""
        with self._lock:
            return list(self._repos[repo_id].commits)

    # ------------------------------------------------------------------ request handling

    def handle(self, method: str, raw_path: str, headers: Mapping[str, str], body: bytes) -> tuple[int, Any]:
        """Answer one request with (status, JSON payload); Hub errors are `{"error": message}`."""
        seg = [unquote(s) for s in urlsplit(raw_path).path.split("/")[1:]]
        try:
            self._check_token(headers.get("Authorization"))
            return 200, self._route(method, seg, body)
        except _HubError as err:
            return err.status, {"error": err.message, **err.extra}

    def _check_token(self, authorization: str | None) -> None:
        if not authorization:
            raise _HubError(401, _MISSING_TOKEN)
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token.encode()):
            raise _HubError(401, _BAD_TOKEN)

    def _maybe_refuse(self, endpoint_name: str) -> None:
        if self.refuse_uploads is None or endpoint_name not in self.refuse_endpoints:
            return
        if self.refuse_after_commits is not None:
            with self._lock:
                if sum(len(repo.commits) for repo in self._repos.values()) < self.refuse_after_commits:
                    return
        raise _HubError(self.refuse_uploads, self.refuse_message)

    def _route(self, method: str, seg: list[str], body: bytes) -> Any:
        if method == "GET" and seg == ["api", "whoami-v2"]:
            return {"type": "user", "name": self.user, "fullname": self.user, "orgs": []}
        if method == "POST" and seg == ["api", "repos", "create"]:
            return self._create_repo(_json(body))
        if method == "POST" and seg == ["api", "validate-yaml"]:
            return {"errors": [], "warnings": []}
        if len(seg) >= 4 and seg[:2] == ["api", "models"]:
            repo_id, rest = f"{seg[2]}/{seg[3]}", seg[4:]
            if method == "GET" and rest in ([], ["revision", "main"]):
                return self._info(repo_id)
            if method == "POST" and len(rest) == 2 and rest[0] == "preupload":
                return self._preupload(repo_id, rest[1], _json(body))
            if method == "POST" and len(rest) == 2 and rest[0] == "commit":
                return self._commit(repo_id, rest[1], body)
        raise _HubError(404, f"FakeHub does not implement {method} /{'/'.join(seg)}")

    def _repo(self, repo_id: str, revision: str = "main") -> _Repo:
        """The repo (lock held); 404 for an unknown repo or any revision but `main`."""
        repo = self._repos.get(repo_id)
        if repo is None:
            raise _HubError(404, "Repository not found")
        if revision != "main":
            raise _HubError(404, f"Invalid rev id: {revision} (FakeHub only has 'main')")
        return repo

    # ------------------------------------------------------------------ endpoints

    def _create_repo(self, payload: dict[str, Any]) -> Any:
        self._maybe_refuse("create_repo")
        name = payload.get("name")
        if not isinstance(name, str) or not name or "/" in name:
            raise _HubError(400, f"Invalid repo name: {name!r}")
        if payload.get("type") not in (None, "model"):
            raise _HubError(400, "FakeHub only hosts model repos")
        repo_id = f"{payload.get('organization') or self.user}/{name}"
        url = f"{self.endpoint}/{repo_id}"
        with self._lock:
            if repo_id in self._repos:
                raise _HubError(409, "You already created this model repo", url=url)  # the client reads `url`
            private = payload.get("visibility", "private" if payload.get("private") else "public") != "public"
            self._repos[repo_id] = _Repo(private)
        return {"url": url, "name": repo_id}

    def _info(self, repo_id: str) -> Any:
        with self._lock:
            repo = self._repo(repo_id)
            siblings = [{"rfilename": path} for path in sorted(repo.files)]
            return {"id": repo_id, "sha": repo.head, "private": repo.private, "siblings": siblings}

    def _preupload(self, repo_id: str, revision: str, payload: dict[str, Any]) -> Any:
        self._maybe_refuse("preupload")
        with self._lock:
            repo = self._repo(repo_id, revision)
            answers = []
            for item in payload.get("files", []):
                answer = {"path": item["path"], "uploadMode": "regular", "shouldIgnore": False}
                if item["path"] in repo.files:
                    answer["oid"] = _git_blob_oid(repo.files[item["path"]])
                answers.append(answer)
            return {"files": answers, "commitOid": repo.head}

    def _commit(self, repo_id: str, revision: str, body: bytes) -> Any:
        self._maybe_refuse("commit")
        try:
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        except json.JSONDecodeError as err:
            raise _HubError(400, f"Invalid ndjson commit payload: {err}") from None
        if not lines or lines[0].get("key") != "header":
            raise _HubError(400, "Commit payload must start with a header line")
        header, added = lines[0]["value"], {}
        for line in lines[1:]:
            value = line.get("value", {})
            if line.get("key") != "file" or value.get("encoding") != "base64":
                raise _HubError(400, f"FakeHub only accepts base64 'file' operations, not {line.get('key')!r}")
            added[value["path"]] = base64.b64decode(value["content"])
        with self._lock:
            repo = self._repo(repo_id, revision)
            if header.get("parentCommit") not in (None, repo.head):
                raise _HubError(412, "A commit has happened since. Please refresh and try again.")
            repo.files.update(added)
            repo.head = secrets.token_hex(20)
            repo.commits.append(CommitRecord(repo.head, header.get("summary", ""), tuple(added)))
            commit_url = f"{self.endpoint}/{repo_id}/commit/{repo.head}"
            return {"success": True, "commitOid": repo.head, "commitUrl": commit_url}


def _json(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body or b"{}")
    except json.JSONDecodeError as err:
        raise _HubError(400, f"Invalid JSON body: {err}") from None
    if not isinstance(payload, dict):
        raise _HubError(400, "JSON body must be an object")
    return payload


class _Handler(BaseHTTPRequestHandler):
    """Reads one request, hands it to `FakeHub.handle`, writes the JSON answer."""

    hub: FakeHub  # set on the subclass built in `FakeHub.start`
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    timeout = 60  # idle keep-alive connections end instead of holding a thread forever

    def _serve(self) -> None:
        # Read the whole body before answering, or a keep-alive connection desynchronises.
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            status, payload = self.hub.handle(self.command, self.path, self.headers, body)
        except Exception as err:  # a bug in the fake must still reach the client as a Hub-style error
            status, payload = 500, {"error": f"FakeHub internal error: {type(err).__name__}: {err}"}
        with self.hub._lock:
            self.hub.requests.append(RequestRecord(self.command, urlsplit(self.path).path, status))
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if status >= 400:
            self.send_header("X-Error-Message", payload["error"])  # the client prefers this header's text
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _serve

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - signature from the base class
        pass  # quiet tests; `FakeHub.requests` keeps a header-free log instead
