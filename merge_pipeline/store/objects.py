"""Objects in a store read as input files (``sources.ByteSource``): ranged GETs pinned to the ETag listed
(``If-Match`` where the backend has it), so an object replaced mid-merge fails its next read, and
``check_unchanged`` asks again before publishing; ranges the writer will read next are fetched ahead."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from merge_pipeline.errors import MergeError
from merge_pipeline.settings import PREFETCH_BYTES
from merge_pipeline.store.asking import asking, precondition_failed
from merge_pipeline.store.sources import SourceRange
from merge_pipeline.store.url import StoreLocation


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
                data = self.store.backend.read_range(self.key, offset, end, self.identity.etag)
            except FileNotFoundError:  # listed when the merge was planned: the trainer's rotation took it
                raise MergeError(None, f"{self.url}: deleted while it was being merged") from None
            except OSError as exc:
                if precondition_failed(exc):
                    raise self.changed() from None
                raise
        if len(data) != end - offset:
            raise self.changed()
        return data

    @property
    def size(self) -> int:
        return self.identity.size

    def readv(self, buffers: list[memoryview], offset: int) -> int:
        data = memoryview(self.read(offset, sum(len(b) for b in buffers)))
        done = 0
        for b in buffers:
            piece = data[done : done + len(b)]
            b[: len(piece)] = piece
            done += len(piece)
        return done

    def require_inside(self, folder: Path) -> None:
        """Nothing to refuse: a view holds only the prefix's own objects, no link out of it."""

    def opened(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # no descriptor: its bytes come through ``read``

    def stream(self) -> contextlib.AbstractContextManager[SourceRange]:
        return contextlib.nullcontext(SourceRange(self, 0, self.size))

    def close(self) -> None:
        """Nothing held open: each read is a request."""

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
