"""Publishing a merged folder into a store prefix.

The merge writes its staging folder locally as for a local target (the same lock, resume and blocking
checks); ``publish_folder`` then uploads it in the order ``docs/SAFETY.md`` describes: weights, then index,
configs and side files, ``merge_manifest.json`` last as the commit marker. A target prefix without that
manifest is incomplete to every reader (``complete_target``). ``UploadSink`` uploads weight files while the
merge writes the next ones.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.settings import PARALLEL_UPLOADS, PART_BYTES, PARTS_IN_FLIGHT
from merge_pipeline.store.asking import asking
from merge_pipeline.store.object_upload import free_tensor_bytes, upload_file
from merge_pipeline.store.record import MANIFEST, delete_stale, record_publishing
from merge_pipeline.store.url import StoreLocation, location
from merge_pipeline.store.view import listed

log = logging.getLogger("merge_pipeline")

# Uploads: parts of PART_BYTES, PARALLEL_UPLOADS files at once, each with PARTS_IN_FLIGHT parts in flight; the
# bytes in flight are bounded by their product. Each is read where it is used (merge_pipeline.settings).


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

    ``guard`` (``store.lock.LockGuard``) confirms the target's lock before each deletion and upload, the
    manifest's included, and raises once it is lost: the merge stops there.
    """
    store = location(url)
    digests = {name: f["sha256"] for name, f in manifest["files"].items()}
    local = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    weights = [r for r in local if r.endswith(".safetensors")]
    others = [r for r in local if r not in weights and r != MANIFEST]
    with asking(url):
        ours, before = _opened(store, {*local, MANIFEST}, guard)
        with ThreadPoolExecutor(PARALLEL_UPLOADS.value(), thread_name_prefix="merge-upload") as pool:
            list(pool.map(lambda r: upload_file(store, folder, r, digests.get(r), guard, streamed=True), weights))
        with ThreadPoolExecutor(PARALLEL_UPLOADS.value(), thread_name_prefix="merge-upload") as pool:
            list(pool.map(lambda r: upload_file(store, folder, r, None, guard), others))
        upload_file(store, folder, MANIFEST, None, guard)
        delete_stale(store, before & ours, set(local), guard)
    log.info("published %d files to %s (%s last)", len(local), url, MANIFEST)


def copy_published_in_store(source: str, target: str, *, guard: Callable[[], None] = unguarded) -> dict:
    """Copy the complete merged prefix ``source`` to ``target`` in the same store, server-side (no byte passes
    through this process), in ``publish_folder``'s order: the names recorded beside ``target`` and its old
    manifest deleted first, then every file the source manifest lists, the manifest last, then the old
    objects the new one does not name. ``guard`` (``store.lock.LockGuard``) confirms the target's lock before
    each deletion and copy. The source's manifest, as copied."""
    src, dst = location(source), location(target)
    if src.fs.protocol != dst.fs.protocol:
        raise MergeError(None, f"{target}: not in the store of {source}: a server-side copy stays in one store")
    manifest = complete_target(source)
    if manifest is None:
        raise MergeError(None, f"{source}: incomplete: no {MANIFEST}; a merge is still publishing or failed")
    names = set(manifest["files"])
    with asking(target):
        ours, before = _opened(dst, {*names, MANIFEST}, guard)
        for name in sorted(names):  # a copy keeps the object's metadata: the sha256 recorded at upload
            guard()
            src.fs.copy(src.key(name), dst.key(name))
        guard()
        src.fs.copy(src.key(MANIFEST), dst.key(MANIFEST))
        delete_stale(dst, before & ours, names, guard)
    log.info("copied %d files from %s to %s (%s last)", len(names), source, target, MANIFEST)
    return manifest


def _opened(store: StoreLocation, names: set[str], guard: Callable[[], None]) -> tuple[set[str], set[str]]:
    """The start of a publish into ``store``: ``names`` recorded as ours, then the old manifest deleted, so no
    reader takes the prefix for complete from here on. The names recorded as ours (earlier merges' too) and the
    objects listed before."""
    ours = record_publishing(store, names, guard)
    before = set(listed(store)) if store.fs.exists(store.path) else set()
    if MANIFEST in before:
        guard()
        store.fs.rm_file(store.key(MANIFEST))
    return ours, before


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
            upload_file(self.store, folder, relative, sha256, self.guard)
        if self.store.backend.digest_metadata(sha256):  # publishing confirms it by its sha256: no need to keep it
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
