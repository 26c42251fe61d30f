"""One merge at a time into a target prefix in a store, whichever machine runs it.

A local target's lock file only keeps out merges on the machine that holds it; two machines merging
into one ``s3://`` prefix would upload their weight files over each other and one manifest would then
vouch for a mix. The lock is an object beside the prefix (``<target>.merge_lock``), created only if none
exists (a conditional PUT, ``If-None-Match: *``), refreshed by its holder every ``REFRESH_SECONDS``
(``If-Match`` on its own ETag, so a holder whose lock was taken over finds out), and removed by its holder
(``If-Match`` again). A lock not refreshed for ``LEASE_SECONDS`` is a killed merge's: the next merge takes
it over, conditionally on its ETag, so of two takers one wins; so does a merge on the lock holder's own
machine once that process is gone (a killed merge retried where it ran resumes at once). Its age is the
store's ``LastModified`` against this machine's clock: a skew of a minute is well inside the lease.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator

from merge_pipeline.errors import MergeError
from merge_pipeline.storage import StoreLocation, asking, is_s3, location, precondition_failed

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".merge_lock"
LEASE_SECONDS = 300.0
REFRESH_SECONDS = 30.0


class StoreTargetLock:
    """A held lock; ``check`` before publishing raises if it was lost (not refreshed in time, taken over)."""

    def __init__(self, store: StoreLocation, key: str, url: str, etag: str, body: bytes):
        self.store, self.key, self.url, self.etag, self.body = store, key, url, etag, body
        self.lost: str | None = None
        self.stopped = threading.Event()
        self.refresher = threading.Thread(target=self._refresh, name="merge-store-lock", daemon=True)
        self.refresher.start()

    def _refresh(self) -> None:
        while not self.stopped.wait(REFRESH_SECONDS):
            try:
                self.store.fs.pipe_file(self.key, self.body, IfMatch=self.etag)
                self.etag = _info(self.store, self.key)["ETag"]
            except Exception as exc:  # refused (taken over) or the store unreachable: either way, not ours now
                self.lost = f"lost while merging ({exc}): another merge may have taken it over"
                return

    def check(self) -> None:
        if self.lost:
            raise MergeError(
                None, f"{self.url}: this merge's lock {self.url}{LOCK_SUFFIX} was {self.lost}; nothing published"
            )

    def release(self) -> None:
        self.stopped.set()
        self.refresher.join()
        if self.lost:
            return
        bucket, _, name = self.key.partition("/")
        with contextlib.suppress(Exception):  # a lock left behind expires; the merge's outcome stands
            self.store.fs.call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=self.etag)


@contextlib.contextmanager
def locked_store_target(url: str) -> Iterator[StoreTargetLock | None]:
    """Hold ``url``'s lock while the block runs; one line if another merge holds it. A store without
    conditional writes (anything but S3 and S3-compatible ones here) gets none, with a warning."""
    store = location(url)
    if not is_s3(store.fs):
        log.warning("%s: no lock across machines in this store: run one merge per target at a time", url)
        yield None
        return
    key = store.path.rstrip("/") + LOCK_SUFFIX
    body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex}).encode()
    with asking(url + LOCK_SUFFIX):
        etag = _take(store, key, url, body)
    lock = StoreTargetLock(store, key, url, etag, body)
    try:
        yield lock
    finally:
        lock.release()


def _take(store: StoreLocation, key: str, url: str, body: bytes) -> str:
    for _ in range(3):  # a lock released between our PUT and our look at it: try again
        try:
            store.fs.pipe_file(key, body, IfNoneMatch="*")
            return _info(store, key)["ETag"]
        except OSError as exc:
            if not precondition_failed(exc):
                raise
        try:
            held = _info(store, key)
        except FileNotFoundError:
            continue
        age = (datetime.datetime.now(datetime.timezone.utc) - held["LastModified"]).total_seconds()
        holder, gone = _holder(store, key)
        if age < LEASE_SECONDS and not gone:
            raise MergeError(
                None,
                f"{url}: another merge ({holder}) is writing this target right now (its lock {url}{LOCK_SUFFIX} "
                f"was refreshed {age:.0f} s ago; one not refreshed for {LEASE_SECONDS:.0f} s is taken over)",
            )
        try:
            store.fs.pipe_file(key, body, IfMatch=held["ETag"])
        except OSError as exc:
            if precondition_failed(exc):
                raise MergeError(
                    None, f"{url}: another merge took over the stale lock {url}{LOCK_SUFFIX} first"
                ) from None
            raise
        log.warning(
            "%s: took over the lock of a merge (%s) %s",
            url,
            holder,
            "that is gone" if gone else f"not heard of for {age:.0f} s",
        )
        return _info(store, key)["ETag"]
    raise MergeError(None, f"{url}: its lock {url}{LOCK_SUFFIX} keeps changing hands: another merge is starting")


def _info(store: StoreLocation, key: str) -> dict:
    return store.fs.info(key, refresh=True)


def _holder(store: StoreLocation, key: str) -> tuple[str, bool]:
    """Who holds the lock, and whether it is a process of this machine that is gone (a killed merge retried
    here need not wait for the lease; one of another machine must)."""
    try:
        held = json.loads(store.fs.cat_file(key))
        host, pid = str(held["host"]), int(held["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown", False
    return f"host {host}, pid {pid}", host == socket.gethostname() and not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
