"""A Hugging Face Hub-compatible HTTP server for tests, on 127.0.0.1.

The real ``huggingface_hub`` client talks to it over TCP, so the tests exercise the same requests a
private Hub or mirror would see: whoami, repo create / info, branch create, preupload, the git-LFS
batch API with basic transfer (PUT to a signed URL), NDJSON commits, tree listing (paginated, LFS
entries carry their sha256), resolve (HEAD + GET) and README metadata validation.

State lives in memory: repos -> branches -> commits -> trees of files; file bytes are kept once
per sha256 (LFS objects survive a failed commit, as on the Hub, so a re-run does not re-send them).
Hub behaviours the client depends on are kept: private repos answer 401 (anonymous) or 404 (no
access), a bad token 401 "Invalid credentials in Authorization header", writing without rights 403.

Tests inject failures by rule, e.g. ``hub.fail("POST", "/commit/", status=503)`` or
``hub.drop("PUT", "/lfs/")`` (the connection closes half-way through the request body), make it
store wrong bytes with ``hub.corrupt(path)``, and read ``hub.requests`` to see what the client sent.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

_REPO_TYPES = ("model", "dataset", "space")
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".model", ".npy", ".gguf")
_REGULAR_MAX = 10 << 20  # the Hub stores larger files in LFS whatever their name
_GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
_INVALID_TOKEN = "Invalid credentials in Authorization header"


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class File:
    size: int
    sha256: str
    lfs: bool
    git_oid: str  # of the content; an LFS file's tree entry carries its pointer's instead

    def entry(self, path: str) -> dict:
        if not self.lfs:
            return {"type": "file", "path": path, "size": self.size, "oid": self.git_oid}
        pointer = lfs_pointer(self.sha256, self.size)
        lfs = {"oid": self.sha256, "size": self.size, "pointerSize": len(pointer)}
        return {"type": "file", "path": path, "size": self.size, "oid": git_blob_oid(pointer), "lfs": lfs}


@dataclass
class Commit:
    oid: str
    message: str
    tree: dict[str, File]
    added: list[str]
    deleted: list[str]


@dataclass
class Repo:
    type: str
    id: str
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)  # name -> commit oid

    def resolve(self, revision: str) -> Commit | None:
        oid = self.branches.get(revision, revision)
        return self.commits.get(oid)


@dataclass(frozen=True)
class User:
    name: str
    orgs: tuple[str, ...] = ()
    write: bool = True

    def owns(self, namespace: str) -> bool:
        return namespace == self.name or namespace in self.orgs


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query
    status: int | None  # None: the connection was dropped


@dataclass
class _Rule:
    method: str
    pattern: re.Pattern
    times: int
    status: int | None  # None: drop the connection
    echo_headers: bool = False
    action: Callable[[], None] | None = None  # run, then the request served as usual


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra


class FakeHub:
    """The server and its state. ``with FakeHub(tokens) as hub:`` serves on ``hub.endpoint``."""

    def __init__(self, users: dict[str, User], *, page_size: int = 4):
        self.users = users  # token -> user
        self.page_size = page_size  # small, so the client's tree pagination is exercised
        self.repos: dict[tuple[str, str], Repo] = {}
        self.objects: dict[str, bytes] = {}  # sha256 -> bytes, regular and LFS alike
        self.requests: list[Request] = []
        self._rules: list[_Rule] = []
        self._corrupted: set[str] = set()
        self._lock = threading.RLock()
        self._secret = secrets.token_bytes(16)  # signs LFS upload URLs, like presigned S3 URLs
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self._server.hub = self
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- what tests call ------------------------------------------------------------------------

    def fail(self, method: str, path_regex: str, *, status: int, times: int = 1, echo_headers: bool = False) -> None:
        """Answer the next ``times`` matching requests with ``status`` instead of serving them.

        ``echo_headers``: the error message quotes the request's headers, Authorization included, as
        a misconfigured proxy or debugging server does.
        """
        self._rules.append(_Rule(method, re.compile(path_regex), times, status, echo_headers))

    def drop(self, method: str, path_regex: str, *, times: int = 1) -> None:
        """Close the connection half-way through the next ``times`` matching requests' bodies."""
        self._rules.append(_Rule(method, re.compile(path_regex), times, None))

    def before(self, method: str, path_regex: str, action: Callable[[], None]) -> None:
        """Run ``action`` when the next matching request arrives, then serve it: something the client's
        user does while the client waits on the Hub."""
        self._rules.append(_Rule(method, re.compile(path_regex), 1, None, action=action))

    def corrupt(self, path_in_repo: str) -> None:
        """From now on, store a file committed at ``path_in_repo`` with one bit flipped: a faulty mirror."""
        self._corrupted.add(path_in_repo)

    def add_repo(self, repo_id: str, *, repo_type: str = "model", private: bool = False) -> Repo:
        with self._lock:
            repo = Repo(repo_type, repo_id, private)
            self.repos[(repo_type, repo_id)] = repo
            self._commit(repo, "main", "initial commit", {".gitattributes": _GITATTRIBUTES}, [])
            return repo

    def commit(self, repo_id: str, added: dict[str, bytes], deleted: list[str] = (), *, branch: str = "main") -> None:
        """Commit as another client would have: to set up what a re-run finds."""
        with self._lock:
            self._commit(self.repos[("model", repo_id)], branch, "another commit", dict(added), list(deleted))

    def tree(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The model repo's files at ``revision``, as bytes."""
        commit = self.repos[("model", repo_id)].resolve(revision)
        return {path: self.objects[f.sha256] for path, f in commit.tree.items()}

    def sent(self, method: str, path_regex: str) -> list[Request]:
        return [r for r in self.requests if r.method == method and re.search(path_regex, r.path)]

    # --- state changes --------------------------------------------------------------------------

    def _store(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        self.objects[sha] = data
        return sha

    def _file(self, path: str, data: bytes) -> File:
        return File(len(data), self._store(data), _is_lfs(path, len(data), data[:512]), git_blob_oid(data))

    def _commit(
        self, repo: Repo, branch: str, message: str, added: dict[str, bytes | File], deleted: list[str]
    ) -> Commit:
        parent = repo.resolve(branch)
        tree = dict(parent.tree) if parent else {}
        for path in deleted:
            tree = {p: f for p, f in tree.items() if p != path and not p.startswith(path.rstrip("/") + "/")}
        for path, content in added.items():
            if path in self._corrupted:
                data = self.objects[content.sha256] if isinstance(content, File) else content
                content = bytes([data[0] ^ 1]) + data[1:]
            tree[path] = content if isinstance(content, File) else self._file(path, content)
        oid = hashlib.sha1(f"{repo.id}:{len(repo.commits)}:{message}".encode()).hexdigest()
        repo.commits[oid] = Commit(oid, message, tree, list(added), deleted)
        repo.branches[branch] = oid
        return repo.commits[oid]

    def _sign(self, oid: str) -> str:
        return hmac.new(self._secret, oid.encode(), "sha256").hexdigest()

    # --- access ---------------------------------------------------------------------------------

    def _user(self, headers) -> User | None:
        auth = headers.get("Authorization")
        if auth is None:
            return None
        user = self.users.get(auth.removeprefix("Bearer ").strip())
        if user is None:
            raise HubError(401, _INVALID_TOKEN)
        return user

    def _repo(self, repo_type: str, repo_id: str, user: User | None, *, write: bool = False) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        visible = repo is not None and (not repo.private or (user is not None and user.owns(repo_id.split("/")[0])))
        if not visible:
            # The Hub answers 401 to anonymous callers and 404 otherwise, whether or not the repo exists.
            raise HubError(401 if user is None else 404, "Repository not found", "RepoNotFound")
        if write:
            _check_write(user, repo_id.split("/")[0], repo_type)
        return repo


def _check_write(user: User | None, namespace: str, repo_type: str) -> None:
    if user is None:
        raise HubError(401, _INVALID_TOKEN)
    if not user.owns(namespace) or not user.write:
        raise HubError(403, f'You don\'t have the rights to write a {repo_type} under the namespace "{namespace}"')


def _is_lfs(path: str, size: int, sample: bytes) -> bool:
    return path.endswith(_LFS_SUFFIXES) or size > _REGULAR_MAX or b"\0" in sample


def _commit_from(repo: Repo, revision: str) -> Commit:
    commit = repo.resolve(revision)
    if commit is None:
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
    return commit


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    timeout = 30  # an idle kept-alive connection frees its thread eventually

    server: ThreadingHTTPServer

    def log_message(self, *args) -> None:  # the request log replaces stderr chatter
        pass

    def do_GET(self):
        self._serve("GET")

    def do_HEAD(self):
        self._serve("HEAD")

    def do_POST(self):
        self._serve("POST")

    def do_PUT(self):
        self._serve("PUT")

    # --- plumbing -------------------------------------------------------------------------------

    def _serve(self, method: str) -> None:
        hub: FakeHub = self.server.hub
        url = urlsplit(self.path)
        self.query = {k: v[0] for k, v in parse_qs(url.query).items()}
        self.segments = [unquote(s) for s in url.path.split("/")[1:]]
        self.base = f"http://{self.headers['Host']}"
        rule = self._matching_rule(hub, method, url.path)
        if rule is not None and rule.action is not None:
            rule.action()
            rule = None
        if rule is not None and rule.status is None:
            self._drop()
            hub.requests.append(Request(method, url.path, None))
            return
        body = self._read_body()
        try:
            user = hub._user(self.headers)
            if rule is not None:
                raise HubError(
                    rule.status,
                    f"injected {rule.status}"
                    + (f"; request headers: {dict(self.headers)}" if rule.echo_headers else ""),
                )
            status, payload, headers = self._route(hub, method, user, body)
        except HubError as err:
            status, headers = err.status, {"X-Error-Message": err.message}
            if err.code:
                headers["X-Error-Code"] = err.code
            payload = {"error": err.message, **err.extra}
        hub.requests.append(Request(method, url.path, status))
        self._respond(status, payload, headers, head=method == "HEAD")

    def _matching_rule(self, hub: FakeHub, method: str, path: str) -> _Rule | None:
        with hub._lock:
            for rule in hub._rules:
                if rule.times > 0 and rule.method == method and rule.pattern.search(path):
                    rule.times -= 1
                    return rule
        return None

    def _read_body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))  # the client always sends one

    def _drop(self) -> None:
        """Read a little of the body, then reset the connection: a network failure mid-upload."""
        if self.headers.get("Content-Length") != "0":
            self.rfile.read1(1024)
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
        self.connection.close()
        self.close_connection = True

    def _respond(self, status: int, payload, headers: dict, *, head: bool) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        if not isinstance(payload, bytes):
            self.send_header("Content-Type", "application/json")
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)

    # --- routes ---------------------------------------------------------------------------------

    def _route(self, hub: FakeHub, method: str, user: User | None, body: bytes):
        s = self.segments
        with hub._lock:
            if s[:2] == ["api", "whoami-v2"] and method == "GET":
                return self._whoami(user)
            if s[:3] == ["api", "repos", "create"] and method == "POST":
                return self._create_repo(hub, user, json.loads(body))
            if s[:2] == ["api", "validate-yaml"] and method == "POST":
                return 200, {"errors": [], "warnings": []}, {}
            if s[:1] == ["api"] and len(s) >= 4 and s[1].removesuffix("s") in _REPO_TYPES:
                repo_type, repo_id, rest = s[1].removesuffix("s"), f"{s[2]}/{s[3]}", s[4:]
                return self._repo_api(hub, method, user, repo_type, repo_id, rest, body)
            if s[:1] == ["lfs"] and method == "PUT":
                return self._lfs_put(hub, s[1], body)
            repo_type = next((t for t in ("dataset", "space") if s[:1] == [t + "s"]), "model")
            s = s[1:] if repo_type != "model" else s
            if len(s) >= 5 and s[2] == "resolve" and method in ("GET", "HEAD"):
                repo = hub._repo(repo_type, f"{s[0]}/{s[1]}", user)
                return self._resolve(hub, repo, s[3], "/".join(s[4:]))
            if len(s) == 6 and s[1].endswith(".git") and s[2:] == ["info", "lfs", "objects", "batch"]:
                hub._repo(repo_type, f"{s[0]}/{s[1].removesuffix('.git')}", user, write=True)
                return self._lfs_batch(hub, json.loads(body))
        raise HubError(404, "Not Found")

    def _whoami(self, user: User | None):
        if user is None:
            raise HubError(401, _INVALID_TOKEN)
        orgs = [{"name": org, "type": "org"} for org in user.orgs]
        role = "write" if user.write else "read"
        return 200, {"type": "user", "name": user.name, "orgs": orgs, "auth": {"accessToken": {"role": role}}}, {}

    def _create_repo(self, hub: FakeHub, user: User | None, payload: dict):
        repo_type = payload.get("type") or "model"
        namespace = payload.get("organization") or (user.name if user else "")
        repo_id = f"{namespace}/{payload['name']}"
        _check_write(user, namespace, repo_type)
        # One name per namespace across repo types: creating it again under another type conflicts.
        existing = next((r for (t, i), r in hub.repos.items() if i == repo_id), None)
        if existing is not None:
            url = f"{self.base}/{_URL_PREFIX[existing.type]}{repo_id}"
            raise HubError(409, f"You already created this {existing.type} repo", url=url)
        hub.add_repo(repo_id, repo_type=repo_type, private=payload.get("visibility") == "private")
        return 200, {"url": f"{self.base}/{_URL_PREFIX[repo_type]}{repo_id}", "name": repo_id}, {}

    def _repo_api(self, hub: FakeHub, method: str, user, repo_type: str, repo_id: str, rest: list[str], body: bytes):
        write = method == "POST" and rest[:1] != ["paths-info"]  # a POST that only reads, as on the Hub
        repo = hub._repo(repo_type, repo_id, user, write=write)
        if method == "GET" and rest[:1] in ([], ["revision"]):
            commit = _commit_from(repo, rest[1] if rest else "main")
            siblings = [{"rfilename": path} for path in sorted(commit.tree)]
            return 200, {"id": repo_id, "private": repo.private, "sha": commit.oid, "siblings": siblings}, {}
        if method == "GET" and rest[:1] == ["tree"] and len(rest) == 2:
            return self._tree(_commit_from(repo, rest[1]), hub.page_size)
        if method == "POST" and rest[:1] == [
            "paths-info"
        ]:  # the entries of the paths asked for, as the tree lists them
            commit, asked = _commit_from(repo, rest[1]), parse_qs(body.decode()).get("paths", [])
            return 200, [commit.tree[p].entry(p) for p in asked if p in commit.tree], {}
        if method == "POST" and rest[:1] == ["preupload"]:
            return self._preupload(_commit_from(repo, rest[1]), json.loads(body))
        if method == "POST" and rest[:1] == ["commit"]:
            return self._commit(hub, repo, rest[1], body)
        if method == "POST" and rest[:1] == ["branch"]:
            if rest[1] in repo.branches:
                raise HubError(409, f"Reference refs/heads/{rest[1]} already exists")
            start = (json.loads(body) if body else {}).get("startingPoint", "main")
            repo.branches[rest[1]] = _commit_from(repo, start).oid
            return 200, {}, {}
        raise HubError(404, "Not Found")

    def _tree(self, commit: Commit, page_size: int):
        if self.query.get("recursive") != "true":
            raise HubError(400, "this test Hub lists whole trees only (recursive=true)")
        folders = {path.rsplit("/", depth)[0] for path in commit.tree for depth in range(1, path.count("/") + 1)}
        entries = [f.entry(path) for path, f in sorted(commit.tree.items())]
        entries += [
            {"type": "directory", "path": p, "size": 0, "oid": git_blob_oid(p.encode())} for p in sorted(folders)
        ]
        start = int(self.query.get("cursor", 0))
        headers = {}
        if start + page_size < len(entries):
            path = "/".join(quote(s, safe="") for s in self.segments)
            headers["Link"] = f'<{self.base}/{path}?recursive=true&cursor={start + page_size}>; rel="next"'
        return 200, entries[start : start + page_size], headers

    def _preupload(self, commit: Commit, payload: dict):
        files = []
        for item in payload["files"]:
            sample = base64.b64decode(item["sample"])
            info = {
                "path": item["path"],
                "uploadMode": "lfs" if _is_lfs(item["path"], item["size"], sample) else "regular",
                "shouldIgnore": False,
            }
            existing = commit.tree.get(item["path"])
            if existing is not None:  # lets the client skip unchanged files
                info["oid"] = existing.sha256 if existing.lfs else existing.git_oid
            files.append(info)
        return 200, {"files": files, "commitOid": commit.oid}, {}

    def _lfs_batch(self, hub: FakeHub, payload: dict):
        objects = []
        for obj in payload["objects"]:
            oid, size = obj["oid"], obj["size"]
            entry = {"oid": oid, "size": size, "authenticated": True}
            if oid not in hub.objects:  # already stored objects get no action: nothing to send
                href = f"{self.base}/lfs/{oid}?size={size}&sig={hub._sign(oid)}"
                entry["actions"] = {"upload": {"href": href, "expires_in": 3600}}
            objects.append(entry)
        return 200, {"transfer": "basic", "objects": objects}, {}

    def _lfs_put(self, hub: FakeHub, oid: str, body: bytes):
        if not hmac.compare_digest(self.query.get("sig", ""), hub._sign(oid)):
            raise HubError(403, "Request signature does not match")
        if hashlib.sha256(body).hexdigest() != oid or len(body) != int(self.query["size"]):
            raise HubError(400, "Uploaded content does not match its oid and size")
        hub.objects[oid] = body
        return 200, {}, {}

    def _commit(self, hub: FakeHub, repo: Repo, branch: str, body: bytes):
        _commit_from(repo, branch)
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        added: dict[str, bytes | File] = {}
        deleted = []
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "file":
                added[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                if value["oid"] not in hub.objects:
                    raise HubError(422, f"LFS object {value['oid']} for {value['path']} was never uploaded")
                data = hub.objects[value["oid"]]
                added[value["path"]] = File(len(data), value["oid"], True, git_blob_oid(data))
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
        commit = hub._commit(repo, branch, header["summary"], added, deleted)
        url = f"{self.base}/{_URL_PREFIX[repo.type]}{repo.id}/commit/{commit.oid}"
        return 200, {"success": True, "commitOid": commit.oid, "commitUrl": url}, {}

    def _resolve(self, hub: FakeHub, repo: Repo, revision: str, path: str):
        commit = _commit_from(repo, revision)
        f = commit.tree.get(path)
        if f is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{f.git_oid}"'}
        if f.lfs:
            headers.update({"X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size)})
        return 200, hub.objects[f.sha256], headers
