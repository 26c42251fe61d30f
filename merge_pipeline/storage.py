"""Checkpoints and merged folders in object storage (``s3://bucket/prefix``, ``gs://...``, any fsspec URL
whose filesystem is installed): where a store plugs into the one merge sequence, ``pipeline.merge``.

Inputs: ``viewed`` lists the prefix once and lays it out as a local folder that the readers walk as
they walk any checkpoint: other files (trackers, JSON, DCP ``.metadata``, configs, tokenizer) are
downloaded whole; weight files (rank files, ``.distcp``, ``.safetensors``, ...) are sparse placeholders of
their size (no disk used), registered here as ``StoreObject``s. ``plan.SourceFile`` reads those with
ranged GETs pinned to the ETag listed (``If-Match``): an object replaced mid-merge fails its next read,
and ``check_unchanged`` asks again before publishing. Nothing large is downloaded whole.

Output: the merge writes its staging folder locally as for a local target (the same lock, resume and
blocking checks); ``publish_folder`` then uploads it in the order ``docs/SAFETY.md`` describes: weights,
then index, configs and side files, ``merge_manifest.json`` last as the commit marker. A target prefix
without that manifest is incomplete to every reader (``complete_target``).

Credentials come from the library's own chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``, instance roles; ``AWS_ENDPOINT_URL`` for S3-compatible stores); none is ever logged,
and errors are one line made of the URL and the store's words (never a credential).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from merge_pipeline.errors import MergeError, StoreUnavailable, first_line, show_folder_as
from merge_pipeline.settings import (
    MAX_DOWNLOAD_BYTES,
    PARALLEL_UPLOADS,
    PART_BYTES,
    PARTS_IN_FLIGHT,
    PREFETCH_BYTES,
    SCRATCH,
)

log = logging.getLogger("merge_pipeline")

MANIFEST = "merge_manifest.json"  # hf.manifest's name for it (the commit marker of a published folder)
# Files read through ranged GETs, never downloaded: what the readers stream tensor bytes from.
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".distcp", ".safetensors", ".ckpt")
# Any other file is downloaded into the view whole (a JSON, a tracker, DCP's .metadata, a tokenizer): a side
# file must be copied with its bytes, never a placeholder's. Past MAX_DOWNLOAD_BYTES the prefix is refused.
# Uploads: parts of PART_BYTES, PARALLEL_UPLOADS files at once, each with PARTS_IN_FLIGHT parts in flight; the
# bytes in flight are bounded by their product. Each is read where it is used (merge_pipeline.settings).


def is_store_url(location: str | Path) -> bool:
    """An fsspec URL of another filesystem than the local one (``s3://``, ``gs://``, ...)."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


@dataclass(frozen=True)
class StoreLocation:
    """A prefix in a store: the filesystem (from the standard credential chain) and the path in it."""

    url: str
    fs: Any  # fsspec.AbstractFileSystem
    path: str  # bucket/prefix, no trailing slash

    def key(self, relative: str) -> str:
        return f"{self.path}/{relative}"

    def url_of(self, relative: str) -> str:
        return f"{self.url}/{relative}"


# Their debug logs print request headers (the signature, the key id): never shown, even with --verbose.
for _name in ("botocore", "aiobotocore", "s3fs", "urllib3", "google", "gcsfs", "fsspec"):
    logging.getLogger(_name).setLevel(logging.WARNING)


def location(url: str) -> StoreLocation:
    """The store prefix ``url`` names; a ``..`` or ``.`` in its keys, an unknown protocol: one line."""
    import fsspec

    url = url.rstrip("/")
    protocol, _, rest = url.partition("://")
    parts = rest.split("/")
    if not parts[0] or any(p in ("..", ".") for p in parts):
        raise MergeError(None, f"{url}: a store URL needs a bucket and keys without '.' or '..' parts")
    try:
        fs = fsspec.filesystem(protocol)
    except (ImportError, ValueError) as exc:
        raise MergeError(
            None,
            f"{url}: no filesystem for {protocol}:// ({first_line(exc)}; pip install 'merge_pipeline[s3]' or [gcs])",
        ) from None
    return StoreLocation(url, fs, rest.rstrip("/"))


def store_error(exc: BaseException, url: str) -> MergeError:
    """One line for a store's refusal, naming the URL: the library's words, which hold no credential."""
    if isinstance(exc, MergeError):
        return exc
    if transient(exc):
        return StoreUnavailable(
            None, f"{url}: the store did not answer after retries ({first_line(exc) or type(exc).__name__})"
        )
    if isinstance(exc, PermissionError):
        problem = f"access denied ({first_line(exc)}): check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...) and AWS_ENDPOINT_URL"
    elif isinstance(exc, FileNotFoundError) and "bucket" in str(exc).lower():
        problem = "the bucket does not exist"
    elif isinstance(exc, FileNotFoundError):
        problem = "not found"
    else:
        problem = first_line(exc) or type(exc).__name__
    return MergeError(None, f"{url}: {problem}")


# A store's words for "not now" (besides any 5xx); its library retried them (botocore: AWS_MAX_ATTEMPTS, AWS_RETRY_MODE).
_TRANSIENT_CODES = {"SlowDown", "RequestTimeout", "Throttling", "ThrottlingException"}
# Connections lost or timed out, by class name (botocore's, aiohttp's, fsspec's: optional imports).
_CONNECTION_ERRORS = {"HTTPClientError", "ConnectionError", "ClientConnectionError", "ClientPayloadError"}


def transient(exc: BaseException) -> bool:
    """Whether the store failed rather than refused: a later try may succeed (never a 412, a 403, a 404)."""
    for error in (exc, exc.__cause__):
        response = getattr(error, "response", None) or {}
        if (
            response.get("Error", {}).get("Code") in _TRANSIENT_CODES
            or response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500
            or isinstance(error, (ConnectionError, TimeoutError))
            or any(c.__name__ in _CONNECTION_ERRORS for c in type(error).__mro__)
        ):
            return True
    return False


@contextlib.contextmanager
def asking(url: str) -> Iterator[None]:
    """Turn any error of the store's library in the block into one ``MergeError`` line naming ``url``."""
    try:
        yield
    except MergeError:
        raise
    except Exception as exc:  # botocore, aiohttp and fsspec raise many kinds; each becomes one line
        raise store_error(exc, url) from None


@dataclass(frozen=True)
class ObjectIdentity:
    """Which object, in which state: a re-upload changes the ETag (and the version, where versioned)."""

    etag: str
    version: str
    size: int
    mtime: str

    @classmethod
    def of(cls, info: dict) -> ObjectIdentity:
        return cls(
            str(info.get("ETag") or info.get("etag") or info.get("md5Hash") or ""),
            str(info.get("VersionId") or info.get("generation") or ""),
            int(info["size"]),
            str(info.get("LastModified") or info.get("updated") or info.get("mtime") or ""),
        )


@dataclass(frozen=True)
class StoreObject:
    """An input object read through ranged GETs: its store, key, URL and the identity listed."""

    store: StoreLocation
    key: str
    url: str
    identity: ObjectIdentity

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)``, fewer at the end of the object; refused if it changed."""
        if length <= 0 or offset >= self.identity.size:
            return b""
        end = min(offset + length, self.identity.size)
        prefetched = _PREFETCHED.take(self, offset, end)
        if prefetched is not None:
            return prefetched
        return self._get(offset, end)

    def _get(self, offset: int, end: int) -> bytes:
        with asking(self.url):
            try:
                if is_s3(self.store.fs):
                    return _s3_range(self.store.fs, self.key, offset, end, self.identity.etag)
                data = self.store.fs.cat_file(self.key, start=offset, end=end)
            except FileNotFoundError:  # listed when the merge was planned: the trainer's rotation took it
                raise MergeError(None, f"{self.url}: deleted while it was being merged") from None
            except OSError as exc:
                if precondition_failed(exc):
                    raise self.changed() from None
                raise
        if len(data) != end - offset:
            raise self.changed()
        return data

    def prefetch(self, offset: int, length: int) -> None:
        """Start GETs of this range (the writer's hint for the next tensor), kept for ``read`` to take."""
        _PREFETCHED.start(self, offset, min(offset + length, self.identity.size))

    def check_unchanged(self) -> None:
        with asking(self.url):
            try:
                now = ObjectIdentity.of(self.store.fs.info(self.key, refresh=True))
            except FileNotFoundError:
                raise MergeError(None, f"{self.url}: deleted while it was being merged") from None
        if now != self.identity:
            raise self.changed()

    def changed(self) -> MergeError:
        return MergeError(
            None,
            f"{self.url}: changed while it was being merged (ETag {self.identity.etag} no longer matches): re-run once the save is complete",
        )


class _Prefetched:
    """Ranges of input objects being fetched ahead (pieces of ``PREFETCH_PIECE``, ``PREFETCH_BYTES`` at
    most): a hint past the budget is dropped, so memory stays bounded; a piece is handed to the read
    that asks for bytes inside it and dropped once read to its end (or, unread, when the budget needs it)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None
        # (url, ETag, start) -> (end, future of bytes): a re-uploaded object's old bytes are never handed out
        self.pieces: dict[tuple[str, str, int], tuple[int, Any]] = {}

    def start(self, obj: StoreObject, start: int, end: int) -> None:
        with self.lock:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="merge-prefetch")
            budget = PREFETCH_BYTES.value()
            for at in range(start, end, PREFETCH_PIECE):
                if (obj.url, obj.identity.etag, at) in self.pieces:
                    continue
                while self.pieces and self._held() + PREFETCH_PIECE > budget:
                    self.pieces.pop(next(iter(self.pieces)))  # the oldest hint, never read
                piece_end = min(at + PREFETCH_PIECE, end)
                self.pieces[(obj.url, obj.identity.etag, at)] = (piece_end, self.pool.submit(obj._get, at, piece_end))

    def _held(self) -> int:
        return sum(end - start for (_, _, start), (end, _) in self.pieces.items())

    def take(self, obj: StoreObject, offset: int, end: int) -> bytes | None:
        with self.lock:
            found = next(
                (
                    (key, piece)
                    for key, piece in self.pieces.items()
                    if key[:2] == (obj.url, obj.identity.etag) and key[2] <= offset and end <= piece[0]
                ),
                None,
            )
            if found is None:
                return None
            key, (piece_end, future) = found
            if end == piece_end:
                del self.pieces[key]
        data = future.result()  # an error (a changed object) is raised to the reader, as its own GET would
        return data[offset - key[2] : end - key[2]]


# Reads ahead: pieces of this size, at most PREFETCH_BYTES held or in flight, on this many threads.
PREFETCH_PIECE = 8 << 20
PREFETCH_THREADS = 8
_PREFETCHED = _Prefetched()


def is_s3(fs) -> bool:
    return "s3" in _protocols(fs)


def _is_gcs(fs) -> bool:
    return "gs" in _protocols(fs)


def _protocols(fs) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def precondition_failed(exc: BaseException) -> bool:
    """The store's 412: a conditional GET or PUT refused (``If-Match`` on an ETag that changed,
    ``If-None-Match: *`` on a key that exists). s3fs raises it as an OSError (a FileExistsError for
    ``If-None-Match``) whose cause is botocore's error, which carries the code."""
    if isinstance(exc, FileExistsError):
        return True
    response = getattr(exc.__cause__, "response", None) or {}
    return (
        response.get("Error", {}).get("Code") in ("PreconditionFailed", "412")
        or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412
    )


def _s3_range(fs, key: str, start: int, end: int, etag: str) -> bytes:
    """One GET of ``[start, end)``, only if the object still has ``etag`` (else the store answers 412). The
    library retries the request; a connection lost while its body is read is retried here as ``cat_file``
    does, with s3fs's own backoff (a refusal, a 412 among them, is not)."""
    from fsspec.asyn import sync
    from s3fs.core import _error_wrapper

    bucket, _, name = key.partition("/")

    async def get() -> bytes:
        response = await fs._call_s3(
            "get_object",
            Bucket=bucket,
            Key=name,
            Range=f"bytes={start}-{end - 1}",
            **({"IfMatch": etag} if etag else {}),
        )
        async with response["Body"] as body:
            return await body.read()

    return sync(fs.loop, _error_wrapper, get, retries=fs.retries)


# Placeholders in views, by absolute local path: what ``plan.SourceFile`` reads through the store instead.
_OBJECTS: dict[Path, StoreObject] = {}
_OBJECTS_LOCK = threading.Lock()


def store_object(path: Path) -> StoreObject | None:
    """The store object a view's placeholder at ``path`` stands for, if it is one."""
    return _OBJECTS.get(Path(path).absolute())


def _check_bucket(store: StoreLocation) -> None:
    """Ask for the bucket with the credentials: wrong ones and a missing bucket are refused here, in one
    line, before any work (``exists`` would answer False to both)."""
    bucket = store.path.split("/")[0]
    if is_s3(store.fs):
        from fsspec.asyn import sync

        try:
            sync(store.fs.loop, store.fs._call_s3, "head_bucket", Bucket=bucket)
        except FileNotFoundError:
            raise MergeError(None, f"{store.url}: the bucket does not exist") from None
    elif not store.fs.exists(bucket):
        raise MergeError(None, f"{store.url}: the bucket does not exist")


def _listing(store: StoreLocation) -> dict[str, dict]:
    """Every object under the prefix, by key relative to it (listed in the library's pages)."""
    with asking(store.url):
        _check_bucket(store)
        found = store.fs.find(store.path, detail=True, withdirs=False)
    objects = {}
    for key, info in found.items():
        relative = key[len(store.path) :].lstrip("/")
        if not relative or relative.endswith("/"):
            continue
        if any(p in ("", ".", "..") for p in relative.split("/")):
            raise MergeError(None, f"{store.url_of(relative)}: a key with an empty, '.' or '..' part: refused")
        objects[relative] = info
    return objects


@contextlib.contextmanager
def viewed(location_or_url: str | Path, *, merged: bool = False) -> Iterator[Path]:
    """A local folder standing for a store prefix while the block runs (a local path is yielded as it is).

    Other files are downloaded, weight files are sparse placeholders read through ``store_object``.
    Errors naming a file in the view name its URL (``errors.show_folder_as``). ``merged``: a merged folder
    (``test``'s reference, ``upload``, ``diff``), refused unless the listing holds its commit marker; the
    weight files listed with it are pinned to their ETags, so a re-publish under way fails their reads."""
    if not is_store_url(location_or_url):
        yield Path(location_or_url)
        return
    store = location(str(location_or_url))
    objects = _listing(store)
    if not objects:
        raise MergeError(None, f"{store.url}: no object under this prefix")
    if merged and MANIFEST not in objects:
        raise MergeError(None, f"{store.url}: incomplete: no {MANIFEST}; a merge is still publishing or failed")
    root = Path(tempfile.mkdtemp(prefix="merge_pipeline-view-")) / Path(store.path).name
    registered: list[Path] = []
    try:
        small = []
        for relative, info in objects.items():
            local = root / relative
            local.parent.mkdir(parents=True, exist_ok=True)
            if relative.endswith(WEIGHT_SUFFIXES):
                registered.append(placeholder(local, store, relative, info))
            else:
                small.append((store.key(relative), str(local)))
        downloaded = MAX_DOWNLOAD_BYTES.value()
        if sum(int(objects[k[len(store.path) + 1 :]]["size"]) for k, _ in small) > downloaded:
            raise MergeError(
                None,
                f"{store.url}: holds more than {downloaded:,} bytes of files that are not weight files "
                "(downloaded whole): give the checkpoint's own prefix, or raise MERGE_PIPELINE_MAX_DOWNLOAD_BYTES",
            )
        if small:
            with asking(store.url):
                store.fs.get([k for k, _ in small], [p for _, p in small])
        with show_folder_as(root, store.url):
            yield root
    finally:
        forget_placeholders(registered)
        shutil.rmtree(root.parent, ignore_errors=True)


def placeholder(local: Path, store: StoreLocation, relative: str, info: dict) -> Path:
    """A sparse file at ``local`` standing for the object ``relative`` listed with ``info``: stat tells its
    size, reads go to the store (``store_object``), pinned to the ETag listed. Its absolute path."""
    with open(local, "wb") as f:
        f.truncate(int(info["size"]))
    local = local.absolute()
    with _OBJECTS_LOCK:
        _OBJECTS[local] = StoreObject(store, store.key(relative), store.url_of(relative), ObjectIdentity.of(info))
    return local


def forget_placeholders(paths: list[Path]) -> None:
    with _OBJECTS_LOCK:
        for path in paths:
            _OBJECTS.pop(path, None)


# --- publishing a merged folder into a store --------------------------------------------------------------


def complete_target(url: str) -> dict | None:
    """The manifest of a complete target prefix, ``None`` while it has none (incomplete, or being replaced)."""
    store = location(url)
    with asking(url):
        try:
            return json.loads(store.fs.cat_file(store.key(MANIFEST)))
        except FileNotFoundError:
            return None


def unguarded() -> None:
    """The guard of a target no lock keeps (a local store, one without conditional writes): nothing to confirm."""


def publish_folder(folder: Path, url: str, manifest: dict, *, guard: Callable[[], None] = unguarded) -> None:
    """Upload the complete merged ``folder`` to the prefix ``url`` so that no reader ever sees a complete-
    looking target that is not (docs/SAFETY.md, "Publishing into a store"):

    1. the names to upload are recorded beside the prefix with those the old manifest names
       (``record_publishing``), then that manifest is deleted: from now on the prefix is incomplete to every reader;
    2. the weight files, each in parts, with its sha256 as object metadata (an object already there with
       the same sha256 and size is kept: what a killed upload of the same merge finished);
    3. the index, configs and side files;
    4. ``merge_manifest.json``, the commit marker;
    5. old objects the new folder does not hold are deleted (not named by the new manifest: never read), only
       those a merge wrote: named by the manifest replaced or a killed merge's record (``delete_stale``).

    ``guard`` (``store_lock.LockGuard``) confirms the target's lock before each deletion and upload, the
    manifest's included, and raises once it is lost: the merge stops there.
    """
    store = location(url)
    digests = {name: f["sha256"] for name, f in manifest["files"].items()}
    local = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    weights = [r for r in local if r.endswith(".safetensors")]
    others = [r for r in local if r not in weights and r != MANIFEST]
    with asking(url):
        ours = record_publishing(store, {*local, MANIFEST}, guard)
        before = set(_listing(store)) if store.fs.exists(store.path) else set()
        if MANIFEST in before:
            guard()
            store.fs.rm_file(store.key(MANIFEST))
        with ThreadPoolExecutor(PARALLEL_UPLOADS.value(), thread_name_prefix="merge-upload") as pool:
            list(pool.map(lambda r: _upload(store, folder, r, digests.get(r), guard, streamed=True), weights))
        with ThreadPoolExecutor(PARALLEL_UPLOADS.value(), thread_name_prefix="merge-upload") as pool:
            list(pool.map(lambda r: _upload(store, folder, r, None, guard), others))
        _upload(store, folder, MANIFEST, None, guard)
        delete_stale(store, before & ours, set(local), guard)
    log.info("published %d files to %s (%s last)", len(local), url, MANIFEST)


def copy_published_in_store(source: str, target: str) -> dict:
    """Copy the complete merged prefix ``source`` to ``target`` in the same store, server-side (no byte passes
    through this process), in ``publish_folder``'s order: the names recorded beside ``target`` and its old
    manifest deleted first, then every file the source manifest lists, the manifest last, then the old
    objects the new one does not name. The source's manifest, as copied."""
    src, dst = location(source), location(target)
    if src.fs.protocol != dst.fs.protocol:
        raise MergeError(None, f"{target}: not in the store of {source}: a server-side copy stays in one store")
    manifest = complete_target(source)
    if manifest is None:
        raise MergeError(None, f"{source}: incomplete: no {MANIFEST}; a merge is still publishing or failed")
    names = set(manifest["files"])
    with asking(target):
        ours = record_publishing(dst, {*names, MANIFEST}, unguarded)
        before = set(_listing(dst)) if dst.fs.exists(dst.path) else set()
        if MANIFEST in before:
            dst.fs.rm_file(dst.key(MANIFEST))
        for name in sorted(names):  # a copy keeps the object's metadata: the sha256 recorded at upload
            src.fs.copy(src.key(name), dst.key(name))
        src.fs.copy(src.key(MANIFEST), dst.key(MANIFEST))
        delete_stale(dst, before & ours, names, unguarded)
    log.info("copied %d files from %s to %s (%s last)", len(names), source, target, MANIFEST)
    return manifest


def invalidate_target(url: str, names: set[str], guard: Callable[[], None] = unguarded) -> None:
    """Before the first byte of a merge reaches ``url``: the ``names`` it will upload first are recorded
    (``record_publishing``), then its old manifest, if any, is deleted, so that no reader takes the prefix for
    complete while new weight files replace old ones (docs/SAFETY.md). ``guard`` confirms the lock before each."""
    store = location(url)
    with asking(url):
        record_publishing(store, names, guard)
        if store.fs.exists(store.key(MANIFEST)):
            log.warning("%s: replacing a merged model: incomplete until the new %s is uploaded", url, MANIFEST)
            guard()
            store.fs.rm_file(store.key(MANIFEST))


# --- which objects under a target prefix this tool wrote --------------------------------------------------

PUBLISHING = ".merge_publishing"  # beside the prefix, as its lock: what a merge publishing into it may leave
_MAX_RECORD_BYTES = 64 * 10**6  # ours list one line per file; a larger one is not ours


def written_names(store: StoreLocation) -> set[str] | None:
    """The names under the prefix this tool wrote: those its manifest names (and the manifest), and those
    recorded by merges that have not finished publishing there; None if there is neither."""
    manifest = _names_in(store, store.key(MANIFEST))
    recorded = _names_in(store, store.path + PUBLISHING)
    if manifest is None and recorded is None:
        return None
    return {*(manifest or ()), *(recorded or ()), *((MANIFEST,) if manifest is not None else ())}


def _names_in(store: StoreLocation, key: str) -> set[str] | None:
    """The file names of our manifest or record at ``key``; None if absent, not JSON or not ours."""
    try:
        data = store.fs.cat_file(key, start=0, end=_MAX_RECORD_BYTES + 1)
        body = json.loads(data) if len(data) <= _MAX_RECORD_BYTES else None
    except (FileNotFoundError, ValueError):
        return None
    if (
        not (isinstance(body, dict) and isinstance(body.get("tool"), dict))
        or body["tool"].get("name") != "merge_pipeline"
    ):
        return None
    files = body.get("files")
    return {name for name in files if isinstance(name, str)} if isinstance(files, (dict, list)) else None


def record_publishing(store: StoreLocation, names: set[str], guard: Callable[[], None]) -> set[str]:
    """Before a merge uploads ``names`` into the prefix: they are recorded beside it with every name this tool
    wrote there before (the manifest being replaced, a killed merge's record), so that once the manifest is
    deleted its names stay known: the next merge counts them as ours, publishing may delete them. What was
    known before."""
    known = written_names(store) or set()
    record = {"tool": {"name": "merge_pipeline"}, "files": sorted(known | names)}
    guard()
    store.fs.pipe_file(store.path + PUBLISHING, json.dumps(record).encode())
    return known


def delete_stale(store: StoreLocation, written: set[str], kept: set[str], guard: Callable[[], None]) -> None:
    """After the manifest: the objects an earlier merge wrote (``written``, listed now) that the new folder
    lacks are deleted, then the record; an object no merge wrote is never deleted."""
    stale = sorted(written - kept)
    guard()
    if stale:
        store.fs.rm([store.key(r) for r in stale])
    store.fs.rm_file(store.path + PUBLISHING)


class UploadSink:
    """Weight files uploaded while the merge writes the next ones: each, once written, fsynced and hashed,
    goes up in parts (``PART_BYTES``, ``PARTS_IN_FLIGHT`` at once) on one of ``PARALLEL_UPLOADS`` threads,
    then its tensor bytes are freed on local disk (a hole punched; the header stays for the blocking
    checks). The writer waits while ``PARALLEL_UPLOADS`` files are written and not yet uploaded: local disk
    holds at most that many weight files, memory at most the parts in flight."""

    def __init__(self, url: str, guard: Callable[[], None] = unguarded):
        self.store, self.guard = location(url), guard
        PART_BYTES.value(), PARTS_IN_FLIGHT.value()  # a bad one is refused now, not after the first weight file
        self.pool = ThreadPoolExecutor(PARALLEL_UPLOADS.value(), thread_name_prefix="merge-upload")
        self.slots = threading.BoundedSemaphore(PARALLEL_UPLOADS.value())
        self.futures = []

    def add(self, folder: Path, relative: str, sha256: str) -> None:
        for future in self.futures:  # an upload that failed stops the merge at its next file
            if future.done() and future.exception() is not None:
                raise future.exception()
        self.slots.acquire()
        future = self.pool.submit(self._upload_and_free, folder, relative, sha256)
        future.add_done_callback(lambda _: self.slots.release())
        self.futures.append(future)

    def _upload_and_free(self, folder: Path, relative: str, sha256: str) -> None:
        with asking(self.store.url_of(relative)):
            _upload(self.store, folder, relative, sha256, self.guard)
        if _digest_metadata(self.store.fs, sha256):  # publishing confirms it by its sha256: no need to keep it
            free_tensor_bytes(folder / relative)

    def close(self) -> None:
        """Wait for every upload; the first failure is raised (after the others ended)."""
        try:
            for future in self.futures:
                future.exception()
            for future in self.futures:
                future.result()
        finally:
            self.pool.shutdown(cancel_futures=True)


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def free_tensor_bytes(path: Path) -> None:
    """Punch a hole over the tensor bytes of an uploaded safetensors file (its size and header stay, so the
    blocking checks, which read headers only, still run on it); a filesystem that cannot punch keeps them."""
    import ctypes

    with open(path, "rb+") as f:
        header = 8 + int.from_bytes(f.read(8), "little")
        start = -(-header // 4096) * 4096
        size = os.fstat(f.fileno()).st_size
        if size <= start:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        fallocate = libc.fallocate
        fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        if fallocate(f.fileno(), _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE, start, size - start) != 0:
            log.debug("%s: cannot punch a hole (errno %d): kept on disk until published", path, ctypes.get_errno())


def _upload(
    store: StoreLocation,
    folder: Path,
    relative: str,
    sha256: str | None,
    guard: Callable[[], None],
    *,
    streamed: bool = False,
) -> None:
    """``streamed``: the file may have been uploaded while the merge wrote (``UploadSink``): say nothing.
    ``guard`` is confirmed before the object is written (in S3, before a multipart upload is completed)."""
    path, key = folder / relative, store.key(relative)
    size = path.stat().st_size
    if sha256 is not None and _uploaded(store, key, size) == sha256:
        if not streamed:
            log.info("%s: kept (uploaded before with the same sha256)", store.url_of(relative))
        return
    if path.stat().st_blocks * 512 < size - 4096:  # its tensor bytes were freed after an upload that is gone
        raise MergeError(None, f"{store.url_of(relative)}: uploaded during the merge, no longer in the store: re-run")
    metadata = _digest_metadata(store.fs, sha256) if sha256 else {}
    guard()
    if is_s3(store.fs) and size >= 2 * PART_BYTES.value():
        _s3_multipart(store.fs, path, key, guard, **metadata)
    else:
        store.fs.put_file(
            str(path), key, chunksize=PART_BYTES.value(), max_concurrency=PARTS_IN_FLIGHT.value(), **metadata
        )


def _s3_multipart(fs, path: Path, key: str, guard: Callable[[], None], **kwargs) -> None:
    """``put_file``'s multipart upload, with ``guard`` confirmed again before it is completed: the parts are
    no object until then, so a merge that lost its lock while they went up replaces nothing (left: the
    milliseconds between that confirmation and the completion)."""
    from fsspec.asyn import sync
    from s3fs.core import calculate_chunksize

    bucket, _, name = key.partition("/")
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=name, **kwargs)
    try:
        with open(path, "rb") as f:
            chunk = calculate_chunksize(path.stat().st_size, chunksize=PART_BYTES.value())
            send = fs._upload_file_part_concurrent
            sent = sync(fs.loop, send, bucket, name, upload, f, chunk, max_concurrency=PARTS_IN_FLIGHT.value())
        guard()
        parts = [{"PartNumber": n, "ETag": part["ETag"]} for n, part in enumerate(sent, 1)]
        fs.call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=name,
            UploadId=upload["UploadId"],
            MultipartUpload={"Parts": parts},
        )
    except BaseException:
        with contextlib.suppress(Exception):  # its parts would be kept (and billed) until aborted
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=name, UploadId=upload["UploadId"])
        raise
    fs.invalidate_cache(key)


def _digest_metadata(fs, sha256: str) -> dict:
    """``put_file`` keywords that keep ``sha256`` as the object's own metadata, in the stores that have it
    (S3's ``x-amz-meta-*``, GCS's custom metadata); elsewhere none, and weight files stay on local disk
    until published, since nothing in the store could vouch for them."""
    if is_s3(fs):
        return {"Metadata": {"sha256": sha256}}
    if _is_gcs(fs):
        return {"metadata": {"sha256": sha256}}
    return {}


def _uploaded(store: StoreLocation, key: str, size: int) -> str | None:
    """The sha256 an object already at ``key`` was uploaded with, if it has ``size`` bytes."""
    try:
        if int(store.fs.info(key, refresh=True)["size"]) != size:
            return None
        return _recorded_sha256(store, key)
    except (FileNotFoundError, AttributeError, NotImplementedError):
        return None


def sha256_uploaded_with(obj: StoreObject) -> str | None:
    """The sha256 a merge uploaded ``obj`` with (``_digest_metadata``), if it is still the object listed;
    None where the store keeps no such metadata or the object is another one now."""
    with asking(obj.url):
        try:
            if ObjectIdentity.of(obj.store.fs.info(obj.key, refresh=True)).etag != obj.identity.etag:
                return None
            return _recorded_sha256(obj.store, obj.key)
        except (FileNotFoundError, AttributeError, NotImplementedError):
            return None


def _recorded_sha256(store: StoreLocation, key: str) -> str | None:
    if _is_gcs(store.fs):
        return (store.fs.info(key, refresh=True).get("metadata") or {}).get("sha256")
    return store.fs.metadata(key, refresh=True).get("sha256")


def local_twin(url: str) -> Path:
    """Where a merge into ``url`` builds its folder before publishing it: a folder of this machine named
    by the URL (``MERGE_PIPELINE_SCRATCH``, else ~/.cache/merge_pipeline/store-targets), so that a killed
    merge's staging folder is found again and resumed, as beside a local target."""
    scratch = SCRATCH.value() or Path.home() / ".cache/merge_pipeline/store-targets"
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return (scratch / f"{Path(url.rstrip('/')).name}-{digest}").absolute()
