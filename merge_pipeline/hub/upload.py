"""Publish a merged folder to a Hugging Face Hub, then prove that the Hub holds what was merged.

Every step is idempotent, so a failed attempt is simply made again, and a re-run after a failure
resumes where the last one stopped:

1. check the folder against its ``merge_manifest.json``: a folder changed since the merge is refused;
2. create the repo, and the branch for a revision, if missing;
3. list the remote tree and skip every file already there (same size, and same sha256 for LFS files
   or same git blob id for small ones); in the same commit, delete the stale files of an earlier
   upload of ours, so one revision never mixes two merges. Only files we published are ever
   deleted: those the revision's ``merge_manifest.json`` records, and the weights beside it (root
   ``*.safetensors`` and their index: loaders would read a stale shard with the new ones). Anything
   else (notes, eval results) stays; foreign weights where we never published are refused;
4. one commit of what is missing plus the model card (README.md, built in memory: the merged folder
   is never written to). A README.md on the Hub that we did not write is kept, without the card;
   one that carries our markers gets only its marked part replaced (``model_card.readme_to_publish``);
5. list the tree of the resulting head commit and compare every file with the manifest.

The endpoint, token and timeouts follow ``connection``'s rules (``HF_ENDPOINT``, ``HF_TOKEN`` or the stored
login, ``MERGE_PIPELINE_HUB_TIMEOUT``). Transient failures (timeouts, 5xx, 408, 429, dropped
connections) are retried with backoff, per request by huggingface_hub and per attempt here (the
client never retries a commit POST: a lost answer could duplicate it; step 3 of the next attempt
sees whether it landed). Everything a user must fix becomes a one-line MergeError; the token is
never part of any message or log line, and the HTTP client's own log lines and progress bars stay
out of the user's output (shown with DEBUG logging, bars on a terminal only).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    constants,
)
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

from merge_pipeline import __version__
from merge_pipeline.checkpoint_name import CheckpointName
from merge_pipeline.errors import MergeError
from merge_pipeline.files.json_files import read_json_object
from merge_pipeline.hub.card_metadata import card_metadata
from merge_pipeline.hub.connection import DEFAULT_ENDPOINT, HUB_ERRORS, Hub, connect, describe, hub_timeout_s
from merge_pipeline.hub.model_card import CARD, readme_to_publish, render_card
from merge_pipeline.store.object_upload import sha256_uploaded_with
from merge_pipeline.store.record import MANIFEST
from merge_pipeline.store.sources import SourceRange
from merge_pipeline.store.view import byte_source, store_object

log = logging.getLogger("merge_pipeline")

_REGULAR_MAX = 10 << 20  # the Hub keeps larger files in LFS, so only smaller ones need a git blob id
_HUB_FILES = {".gitattributes"}  # written by the Hub itself when it creates a repo
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
_WEIGHTS = re.compile(r"[^/]+\.safetensors(\.index\.json)?")  # what loaders read from a repo's root
_READ_MAX = 16 << 20  # a manifest or README on the Hub larger than this is not one of ours (client caps any answer)
_STORE_READ = 8 << 20  # each ranged GET of a weight file uploaded from a store
# A branch name as git (and so the Hub) takes it: no "..", no component starting with "." or ending in
# ".lock", no control characters or ~^:?*[\ or space, no "@{", not ending in "/" or ".".
_BAD_REVISION = re.compile(r"\.\.|//|@\{|(^|/)\.|\.lock(/|$)|[/.]$|^/|^@$|[\x00-\x20\x7f~^:?*\[\\]")
_CLIENT_LOGGERS = ("httpx2", "httpcore2", "huggingface_hub")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    first_wait_s: float = 2.0
    max_wait_s: float = 30.0

    def wait_s(self, failed_attempt: int) -> float:
        return min(self.max_wait_s, self.first_wait_s * 2 ** (failed_attempt - 1))


@dataclass(frozen=True)
class UploadResult:
    repo_id: str
    revision: str
    url: str  # the revision's page
    commit_url: str  # the verified head commit
    files: int
    bytes: int
    sent: tuple[str, ...]  # files this call committed; empty when the Hub already had them all


@dataclass(frozen=True)
class _Local:
    """One file to publish, with the sums the Hub's tree listing can be compared with."""

    path: str
    size: int
    sha256: str
    git_oid: str | None  # git blob id, for files small enough to be stored outside LFS
    source: Path | bytes

    def matches(self, remote: RepoFile | None) -> bool:
        if remote is None or remote.size != self.size:
            return False
        if remote.lfs is not None:
            return remote.lfs.sha256 == self.sha256
        return remote.blob_id == self.git_oid


def upload_folder_verified(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    timeout_s: float | None = None,
    retry: RetryPolicy = RetryPolicy(),
    smoke: dict | None = None,
) -> UploadResult:
    """Upload a merged folder (plus its model card) to ``repo_id`` and verify it against the manifest.

    ``smoke``: the smoke test's prompt, text and loss, for the card (``model_card.render_card``)."""
    folder = Path(folder).absolute()
    hub = connect(endpoint, token, check_upload_settings(repo_id, revision, timeout_s))
    if not (folder / MANIFEST).is_file():
        raise MergeError(folder, f"has no {MANIFEST}: only folders written by `merge-pipeline merge` can be uploaded")
    manifest = _our_manifest(folder)
    try:  # the card reads every part of the manifest: one edited by hand may lack or garble any of them
        name = CheckpointName.from_manifest(manifest["source"])
        card = render_card(
            manifest,
            repo_id,
            replaces_readme=CARD in manifest["files"],
            smoke=smoke,
            hub=card_metadata(folder, manifest),
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        raise _not_our_manifest(folder) from None
    upload = _Upload(
        api=hub.api,
        repo_id=repo_id,
        revision=revision or constants.DEFAULT_REVISION,
        private=private,
        message=commit_message or f"Upload {name} (merge_pipeline {__version__})",
        folder_files=_local_files(folder, manifest),
        card=card,
    )
    with _xet_only_where_spoken(hub.endpoint), _client_output_quiet():
        try:
            files, sent, head = _retrying(upload.attempt, retry, hub)
        except Exception as exc:
            cause = _hub_cause(exc)
            if not isinstance(cause, HUB_ERRORS):
                raise
            # from None: the client's exception may quote a server's echo of the request headers.
            raise MergeError(None, hub.redact(_explain(cause, repo_id, hub.endpoint, folder))) from None
    page = f"{hub.endpoint}/{repo_id}" + (
        "" if upload.revision == constants.DEFAULT_REVISION else f"/tree/{upload.revision}"
    )
    total = sum(f.size for f in files.values())
    log.info("hub: %s@%s verified: %d files (%d bytes) match %s", repo_id, upload.revision, len(files), total, MANIFEST)
    return UploadResult(
        repo_id, upload.revision, page, f"{hub.endpoint}/{repo_id}/commit/{head}", len(files), total, tuple(sent)
    )


@dataclass
class _Upload:
    api: HfApi
    repo_id: str
    revision: str
    private: bool
    message: str
    folder_files: dict[str, _Local]  # without README.md: the card takes its place
    card: str

    def attempt(self) -> tuple[dict[str, _Local], list[str], str]:
        """Bring the revision to the folder's state; return the files published, those sent, and the verified head."""
        self._ensure_repo()
        remote = self._tree(self.revision)
        files = self._with_card(remote)
        stale, kept = self._stale_and_kept(remote, files)
        send = [f for f in files.values() if not f.matches(remote.get(f.path))]
        if kept:
            log.info(
                "hub: %s@%s: keeping %d file(s) merge_pipeline did not publish: %s",
                self.repo_id,
                self.revision,
                len(kept),
                ", ".join(kept),
            )
        if send or stale:
            log.info(
                "hub: %s@%s: sending %d of %d files (%d bytes), deleting %d stale",
                self.repo_id,
                self.revision,
                len(send),
                len(files),
                sum(f.size for f in send),
                len(stale),
            )
            operations = [_addition(f) for f in send] + [CommitOperationDelete(p) for p in stale]
            self.api.create_commit(self.repo_id, operations, commit_message=self.message, revision=self.revision)
        else:
            log.info("hub: %s@%s already holds all %d files", self.repo_id, self.revision, len(files))
        head = self.api.repo_info(self.repo_id, revision=self.revision).sha
        self._verify(head, files, kept)
        return files, [f.path for f in send], head

    def _with_card(self, remote: dict[str, RepoFile]) -> dict[str, _Local]:
        readme = readme_to_publish(self.card, self._read(remote, CARD))
        if readme is None:
            log.warning(
                "hub: %s@%s: its %s was not written by merge_pipeline: kept as it is, without the model card",
                self.repo_id,
                self.revision,
                CARD,
            )
            return dict(self.folder_files)
        return {**self.folder_files, CARD: _hash(CARD, readme.encode())}

    def _stale_and_kept(self, remote: dict[str, RepoFile], files: dict[str, _Local]) -> tuple[list[str], list[str]]:
        """Split what the revision holds beyond ``files``: stale files of ours (deleted) and everything else (kept)."""
        ours = self._published_by_us(remote)
        extra = sorted(set(remote) - set(files) - _HUB_FILES)
        # A README.md left out of ``files`` is one we did not write (its markers decide, not a manifest).
        stale = [p for p in extra if p != CARD and (p in ours or (ours and _WEIGHTS.fullmatch(p)))]
        kept = [p for p in extra if p not in stale]
        foreign_weights = [p for p in kept if _WEIGHTS.fullmatch(p)]
        if foreign_weights:  # kept beside ours, a loader would read them as part of the merged model
            raise MergeError(
                None,
                f"{self.repo_id}@{self.revision} holds {', '.join(foreign_weights)}, not published by merge_pipeline, that loaders would read with the merged weights: delete it there or upload to another --revision",
            )
        return stale, kept

    def _published_by_us(self, remote: dict[str, RepoFile]) -> set[str]:
        """The files the revision's merge_manifest.json records (and itself): the only ones an upload may delete."""
        try:
            manifest = json.loads(self._read(remote, MANIFEST) or b"null")
        except (ValueError, RecursionError):
            return set()
        recorded = manifest.get("files") if isinstance(manifest, dict) else None
        return {*recorded, MANIFEST} if isinstance(recorded, dict) else set()

    def _read(self, remote: dict[str, RepoFile], path: str) -> bytes | None:
        """A small file of the revision; None when absent, empty when too large to be one of ours."""
        entry = remote.get(path)
        if entry is None or entry.size > _READ_MAX:
            return None if entry is None else b""
        with tempfile.TemporaryDirectory() as scratch:
            return Path(
                self.api.hf_hub_download(self.repo_id, path, revision=self.revision, local_dir=scratch)
            ).read_bytes()

    def _ensure_repo(self) -> None:
        self.api.create_repo(self.repo_id, private=self.private, exist_ok=True)
        try:
            info = self.api.repo_info(self.repo_id)
        except RepositoryNotFoundError:
            # create_repo(exist_ok) also accepts a name taken by a repo of another type.
            for other in ("dataset", "space"):
                if self.api.repo_exists(self.repo_id, repo_type=other):
                    raise MergeError(
                        None,
                        f"{self.repo_id} exists on {self.api.endpoint} as a {other} repo, not a model repo: choose another name",
                    ) from None
            raise
        if self.private and not info.private:
            log.warning("hub: %s already exists and is public: --private only applies to a new repo", self.repo_id)
        if self.revision != constants.DEFAULT_REVISION:
            self.api.create_branch(self.repo_id, branch=self.revision, exist_ok=True)

    def _tree(self, revision: str) -> dict[str, RepoFile]:
        entries = self.api.list_repo_tree(self.repo_id, recursive=True, revision=revision)
        return {e.path: e for e in entries if isinstance(e, RepoFile)}

    def _verify(self, head: str, files: dict[str, _Local], kept: list[str]) -> None:
        remote = self._tree(head)
        problems = [_difference(f, remote.get(f.path)) for f in files.values() if not f.matches(remote.get(f.path))]
        unexpected = sorted(set(remote) - set(files) - _HUB_FILES - set(kept))
        if unexpected:
            problems.append(f"not in the folder: {', '.join(unexpected)}")
        if problems:
            raise MergeError(
                None,
                f"{self.repo_id}@{self.revision} (commit {head[:12]}) does not hold what was merged: {'; '.join(problems)}",
            )


def check_upload_settings(repo_id: str, revision: str | None, timeout_s: float | None) -> float:
    """Refuse a bad repo id, branch or timeout before any work (a merge checks them before merging);
    return the timeout in seconds."""
    if not _REPO_ID.fullmatch(repo_id):
        raise MergeError(None, f"{repo_id!r} is not a Hub repo id: expected ORG/NAME")
    if revision is not None and _BAD_REVISION.search(revision):
        raise MergeError(None, f"--revision {revision!r}: not a branch name the Hub accepts (git's rules)")
    return hub_timeout_s(timeout_s)


def _our_manifest(folder: Path) -> dict:
    """The folder's manifest, refused in one line unless it is ours: our tool, and a file list of safe names."""
    manifest = read_json_object(folder / MANIFEST)
    files = manifest.get("files")
    if not (
        isinstance(manifest.get("tool"), dict)
        and manifest["tool"].get("name") == "merge_pipeline"
        and isinstance(files, dict)
        and all(
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("sha256"), str)
            and not os.path.isabs(name)
            and ".." not in Path(name).parts
            for name, entry in files.items()
        )
    ):
        raise _not_our_manifest(folder)
    return manifest


def _not_our_manifest(folder: Path) -> MergeError:
    return MergeError(folder / MANIFEST, "is not a manifest written by merge_pipeline (edited or foreign): merge again")


def _difference(local: _Local, remote: RepoFile | None) -> str:
    if remote is None:
        return f"{local.path} is missing"
    if remote.size != local.size:
        return f"{local.path} has {remote.size} bytes on the Hub, {local.size} in the manifest"
    if remote.lfs is not None:
        return f"{local.path} has sha256 {remote.lfs.sha256} on the Hub, {local.sha256} in the manifest"
    return f"{local.path} has git blob {remote.blob_id} on the Hub, {local.git_oid} from the manifest's bytes"


def _local_files(folder: Path, manifest: dict) -> dict[str, _Local]:
    """Every file of the folder, each checked against the manifest; a README.md is left out: the card replaces it."""
    listed = manifest["files"]
    on_disk = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
    missing = sorted(set(listed) - set(on_disk))
    extra = sorted(set(on_disk) - set(listed) - {MANIFEST})
    if missing or extra:
        what = [f"missing {', '.join(missing)}"] * bool(missing) + [f"not listed: {', '.join(extra)}"] * bool(extra)
        raise MergeError(folder, f"does not match its {MANIFEST} ({'; '.join(what)}): merge again")
    files = {}
    for path, local in on_disk.items():
        expected = listed.get(path)
        files[path] = _recorded(path, local, expected) or _hash(path, local)
        if expected is not None and (files[path].size, files[path].sha256) != (expected["size"], expected["sha256"]):
            raise MergeError(
                local,
                f"changed since the merge (sha256 {files[path].sha256}, {MANIFEST} says {expected['sha256']}): merge again",
            )
    files.pop(CARD, None)
    return files


def _recorded(path: str, source: Path, expected: dict | None) -> _Local | None:
    """A weight file of a store that its merge uploaded with the manifest's sha256 (the object's metadata):
    not read to be hashed. The client's own hash, compared before the commit (``_addition``), reads it once;
    no git blob id, as the Hub keeps weights in LFS."""
    stored = store_object(source)
    if stored is None or expected is None or stored.identity.size != expected["size"]:
        return None
    if sha256_uploaded_with(stored) != expected["sha256"]:
        return None
    return _Local(path, expected["size"], expected["sha256"], None, source)


def _addition(local: _Local) -> CommitOperationAdd:
    """The client hashes what it will send: anything but the bytes checked is refused before the commit."""
    addition = CommitOperationAdd(local.path, _client_source(local.source))
    sent = (addition.upload_info.size, addition.upload_info.sha256.hex())
    if sent != (local.size, local.sha256):
        raise MergeError(
            local.source if isinstance(local.source, Path) else local.path,
            f"changed while it was being uploaded (sha256 {sent[1]}, expected {local.sha256}): nothing was committed",
        )
    return addition


def _hash(path: str, source: Path | bytes) -> _Local:
    """sha256, and the git blob id for small files, in one read."""
    size = len(source) if isinstance(source, bytes) else _size(source)
    sha256 = hashlib.sha256()
    git = hashlib.sha1(b"blob %d\0" % size) if size <= _REGULAR_MAX else None
    for chunk in _chunks(source):
        sha256.update(chunk)
        if git is not None:
            git.update(chunk)
    return _Local(path, size, sha256.hexdigest(), git.hexdigest() if git else None, source)


def _size(path: Path) -> int:
    """The size of a file to upload: of the object a placeholder of a store's view stands for, if it is one."""
    with contextlib.closing(byte_source(path)) as source:
        return source.size


def _chunks(source: Path | bytes, block: int = 8 << 20):
    source = _client_source(source)
    if isinstance(source, bytes):
        yield source
        return
    with source if isinstance(source, io.IOBase) else open(source, "rb") as f:
        while chunk := f.read(block):
            yield chunk


def _client_source(source: Path | bytes) -> Path | bytes | io.BufferedReader:
    """What a file is read from: its bytes or local path as they are; for a placeholder of a store's view
    (``store.view.viewed``), a seekable reader of ranged GETs pinned to the object's ETag (never downloaded)."""
    if isinstance(source, bytes) or store_object(source) is None:
        return source
    stored = byte_source(source)
    return io.BufferedReader(SourceRange(stored, 0, stored.size), _STORE_READ)


def _retrying(attempt, policy: RetryPolicy, hub: Hub):
    for number in range(1, policy.attempts):
        try:
            return attempt()
        except Exception as exc:
            cause = _hub_cause(exc)
            if not _transient(cause):
                raise
            wait = policy.wait_s(number)
            log.warning(
                "hub: attempt %d of %d failed (%s); retrying in %.3g s",
                number,
                policy.attempts,
                hub.redact(describe(cause)),
                wait,
            )
            time.sleep(wait)
    return attempt()  # the last one: its failure is reported


def _hub_cause(exc: BaseException) -> BaseException:
    """The Hub's answer or the network failure behind ``exc`` (huggingface_hub wraps some of them)."""
    seen = exc
    while seen is not None:
        if isinstance(seen, HUB_ERRORS):
            return seen
        seen = seen.__cause__
    return exc


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, HfHubHTTPError):
        return exc.response is not None and exc.response.status_code in _TRANSIENT_STATUS
    return isinstance(exc, httpx2.TransportError)


def _explain(exc: BaseException, repo_id: str, endpoint: str, folder: Path) -> str:
    """One line a user can act on, for an error the retries could not (or must not) get past."""
    resume = f"resume with `merge-pipeline upload {folder} {repo_id}` (files already on the Hub are not sent again)"
    if isinstance(exc, HFValidationError):
        return f"{repo_id!r} is not a valid Hub repo id: {exc}"
    status = exc.response.status_code if isinstance(exc, HfHubHTTPError) and exc.response is not None else None
    if isinstance(exc, RepositoryNotFoundError) or status == 404:
        return f"{repo_id}: not found at {endpoint} ({describe(exc)}): check HF_ENDPOINT, the repo name, and that the token can see it"
    if status == 401:
        return f"{endpoint} rejected the token (401 Unauthorized): set HF_TOKEN to a valid token or run `hf auth login`"
    if status == 403:
        server = f": {exc.server_message}" if exc.server_message else ""
        return f"{repo_id}: the token may not write there (403 Forbidden{server}): use a token with write access to {repo_id.split('/')[0]}"
    if status is None:
        return f"{repo_id}: cannot reach {endpoint} ({describe(exc)}): {resume}"
    return f"{repo_id}: the Hub at {endpoint} failed ({describe(exc)}): {resume}"


@contextlib.contextmanager
def _client_output_quiet():
    """Keep the HTTP client's chatter out of the user's output while uploading.

    httpx2 logs every request at INFO ("HTTP Request: ...", signed upload URLs included) and
    huggingface_hub its own retries at WARNING, through its own stderr handler: the one line this
    module reports says what failed. DEBUG logging (``-v``) shows them. huggingface_hub's progress
    bars only on a terminal, as the merge's own.
    """
    loggers = [] if log.isEnabledFor(logging.DEBUG) else [logging.getLogger(name) for name in _CLIENT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    hide_bars = not sys.stderr.isatty() and not are_progress_bars_disabled()
    if hide_bars:
        disable_progress_bars()
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if hide_bars:
            enable_progress_bars()


@contextlib.contextmanager
def _xet_only_where_spoken(endpoint: str):
    """Use Xet transfers only with huggingface.co (or when HF_HUB_DISABLE_XET says otherwise).

    huggingface_hub reads HF_HUB_DISABLE_XET once, at import, and then uploads through Xet even to a
    private Hub or mirror that only speaks LFS; the endpoint is known only now, so decide now.
    """
    setting = os.environ.get("HF_HUB_DISABLE_XET")
    disable = (
        setting.strip().upper() in {"1", "ON", "YES", "TRUE"} if setting is not None else endpoint != DEFAULT_ENDPOINT
    )
    saved = constants.HF_HUB_DISABLE_XET
    constants.HF_HUB_DISABLE_XET = disable
    try:
        yield
    finally:
        constants.HF_HUB_DISABLE_XET = saved
