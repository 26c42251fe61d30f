"""One merge at a time into a target prefix in a store, whichever machine runs it.

A local target's lock file only keeps out merges on the machine that holds it; two machines merging
into one ``s3://`` prefix would upload their weight files over each other and one manifest would then
vouch for a mix. The lock is an object beside the prefix (``<target>.merge_lock``) holding its holder's
record and a token of this merge, created only if none exists (a conditional PUT, ``If-None-Match: *``),
refreshed by its holder every ``REFRESH_SECONDS`` (``If-Match`` on its own ETag), and removed by its holder
(``If-Match`` again). A lock not refreshed for ``LEASE_SECONDS`` is a killed merge's: the next merge takes
it over, conditionally on its ETag, so of two takers one wins. So does a merge on the holder's own kernel and
in its PID namespace once that process is gone (a killed merge retried where it ran resumes at once): a host
name alone names two pods with host networking, a pid alone means nothing in another namespace. Its age is
the store's ``LastModified`` against this machine's clock: a skew of a minute is well inside the lease.

Holding it is confirmed, not remembered: every step that changes the target (``LockGuard``: each upload,
each deletion, the manifest) first reads the lock object and finds this merge's token in it, so a holder
that stalled past its lease and was taken over stops at its next step. A conditional write the library
retried after its answer was lost (it may have landed) is recognised by that token too.
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
from dataclasses import dataclass

from merge_pipeline.errors import MergeError, first_line
from merge_pipeline.store.asking import asking, precondition_failed
from merge_pipeline.store.url import StoreLocation, location

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".merge_lock"
LEASE_SECONDS = 300.0
REFRESH_SECONDS = 30.0


@dataclass(frozen=True)
class LockGuard:
    """Confirms that the lock of ``url`` still holds ``token`` (one GET of the lock object), else raises the
    one line that stops the merge; picklable, so workers in other processes confirm it as the lead does."""

    url: str  # the target
    token: str

    def __call__(self) -> None:
        store = location(self.url)
        with asking(self.url + LOCK_SUFFIX):
            try:
                holder = _token(store, _key(store))
            except FileNotFoundError:
                holder = None
        if holder != self.token:
            raise MergeError(
                None,
                f"{self.url}: this merge's lock {self.url}{LOCK_SUFFIX} was "
                f"{'taken over by another merge' if holder else 'removed'} (this merge stalled past its "
                f"{LEASE_SECONDS:.0f} s lease): it stopped before its next upload or deletion; what it uploaded "
                "is left for the merge that holds the target now, which replaces or keeps it",
            )


class StoreTargetLock:
    """A held lock: a thread refreshes it; ``guard`` confirms it before each step that changes the target."""

    def __init__(self, store: StoreLocation, key: str, url: str, etag: str, body: bytes, token: str):
        self.store, self.key, self.url, self.etag, self.body = store, key, url, etag, body
        self.guard = LockGuard(url, token)
        self.lost = False
        self.stopped = threading.Event()
        self.refresher = threading.Thread(target=self._refresh, name="merge-store-lock", daemon=True)
        self.refresher.start()

    def _refresh(self) -> None:
        while not self.stopped.wait(REFRESH_SECONDS):
            try:
                self.etag = _put(self.store, self.key, self.body, IfMatch=self.etag)
            except OSError as exc:
                if not precondition_failed(exc):  # unreachable after the library's retries: next round
                    log.warning("%s%s: not refreshed (%s): trying again", self.url, LOCK_SUFFIX, first_line(exc))
                    continue
                with contextlib.suppress(OSError):
                    if _token(self.store, self.key) == self.guard.token:  # ours still: a new ETag, same body
                        self.etag = _info(self.store, self.key)["ETag"]
                        continue
                self.lost = True  # taken over: the next guard stops the merge
                return

    def confirm(self) -> None:
        self.guard()

    def release(self) -> None:
        self.stopped.set()
        self.refresher.join()
        if self.lost:
            return
        with contextlib.suppress(Exception):  # a lock left behind expires; the merge's outcome stands
            self.store.backend.delete_if(self.key, self.etag)


@contextlib.contextmanager
def locked_store_target(url: str) -> Iterator[StoreTargetLock | None]:
    """Hold ``url``'s lock while the block runs; one line if another merge holds it. A store without
    conditional writes (anything but S3 and S3-compatible ones here) gets none, with a warning."""
    store = location(url)
    if not store.backend.conditional_writes:
        log.warning("%s: no lock across machines in this store: run one merge per target at a time", url)
        yield None
        return
    key, token = _key(store), uuid.uuid4().hex
    body = json.dumps({**_this_process(), "token": token}).encode()
    with asking(url + LOCK_SUFFIX):
        etag = _take(store, key, url, body, token)
    lock = StoreTargetLock(store, key, url, etag, body, token)
    try:
        yield lock
    finally:
        lock.release()


def _key(store: StoreLocation) -> str:
    return store.path.rstrip("/") + LOCK_SUFFIX


def _take(store: StoreLocation, key: str, url: str, body: bytes, token: str) -> str:
    for _ in range(3):  # a lock released between our PUT and our look at it: try again
        try:
            return _put(store, key, body, IfNoneMatch="*")
        except OSError as exc:
            if not precondition_failed(exc):
                raise
        try:
            held = _info(store, key)
            record = _record(store, key)
        except FileNotFoundError:
            continue
        if record.get("token") == token:  # our PUT landed, its answer was lost and the retry refused
            return held["ETag"]
        age = (datetime.datetime.now(datetime.timezone.utc) - held["LastModified"]).total_seconds()
        holder, gone = _holder(record)
        if age < LEASE_SECONDS and not gone:
            raise MergeError(
                None,
                f"{url}: another merge ({holder}) is writing this target right now (its lock {url}{LOCK_SUFFIX} "
                f"was refreshed {age:.0f} s ago; one not refreshed for {LEASE_SECONDS:.0f} s is taken over)",
            )
        try:
            etag = _put(store, key, body, IfMatch=held["ETag"])
        except OSError as exc:
            if not precondition_failed(exc):
                raise
            if _token(store, key) != token:
                raise MergeError(
                    None, f"{url}: another merge took over the stale lock {url}{LOCK_SUFFIX} first"
                ) from None
            etag = _info(store, key)["ETag"]
        log.warning(
            "%s: took over the lock of a merge (%s) %s",
            url,
            holder,
            "that is gone" if gone else f"not heard of for {age:.0f} s",
        )
        return etag
    raise MergeError(None, f"{url}: its lock {url}{LOCK_SUFFIX} keeps changing hands: another merge is starting")


def _put(store: StoreLocation, key: str, body: bytes, **condition: str) -> str:
    """A conditional PUT of the lock; its new ETag, from the answer."""
    return store.backend.put_if(key, body, **condition)


def _info(store: StoreLocation, key: str) -> dict:
    return store.fs.info(key, refresh=True)


def _record(store: StoreLocation, key: str) -> dict:
    """The holder's record in the lock object ({} where unreadable: a holder unknown is never gone)."""
    try:
        record = json.loads(store.fs.cat_file(key, max_concurrency=1))  # one GET (no HEAD for its size first)
    except FileNotFoundError:
        raise
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _token(store: StoreLocation, key: str) -> str | None:
    return _record(store, key).get("token")


def _this_process() -> dict:
    """Who holds a lock: host name and pid to show, and the kernel (its boot id, which every container on
    one host shares and no other host has; /etc/machine-id is copied with images) and PID namespace that
    give the pid its meaning."""
    return {"host": socket.gethostname(), "pid": os.getpid(), **_namespace()}


def _namespace() -> dict:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return {"boot": boot, "pid_ns": os.stat("/proc/self/ns/pid").st_ino}
    except OSError:  # not Linux: no pid of ours can be told gone
        return {}


def _holder(record: dict) -> tuple[str, bool]:
    """Who holds the lock, and whether it is a process that is gone from this kernel and PID namespace (a
    killed merge retried here need not wait for the lease; one of another machine or pod must)."""
    try:
        host, pid = str(record["host"]), int(record["pid"])
    except (KeyError, TypeError, ValueError):
        return "holder unknown", False
    ours = _this_process()
    here = "boot" in ours and all(record.get(k) == ours[k] for k in ("host", "boot", "pid_ns"))
    return f"host {host}, pid {pid}", here and not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
