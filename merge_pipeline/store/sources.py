"""Where an input file's bytes come from, behind one interface: a local file (``LocalFile``) or an object in
a store (``objects.StoreObject``), so that ``plan.SourceFile`` and the readers never ask which.

A ``ByteSource`` has a size and an identity (what change detection compares), reads byte ranges, starts
reading ahead, checks it is still what was planned, and opens as a stream; ``opened`` gives the descriptor
of a local file for the writer's kernel copies (``None``: no descriptor, the bytes come through ``read``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from merge_pipeline.errors import MergeError
from merge_pipeline.files.inputs import open_regular_stat, require_opened_inside


class ByteSource(Protocol):
    identity: object  # a dataclass whose equality says "the same bytes": compared again before publishing
    size: int

    def read(self, offset: int, length: int) -> bytes: ...  # fewer at the end
    def readv(self, buffers: list[memoryview], offset: int) -> int: ...  # fills them in turn: bytes read
    def prefetch(self, offset: int, length: int) -> None: ...
    def check_unchanged(self) -> None: ...
    def require_inside(self, folder: Path) -> None: ...  # refuse a link that leads out of the checkpoint
    def opened(self) -> contextlib.AbstractContextManager[int | None]: ...
    def stream(self) -> contextlib.AbstractContextManager[BinaryIO]: ...  # unbuffered, seekable
    def close(self) -> None: ...


@dataclass(frozen=True)
class FileIdentity:
    """Which file, in which state: a rewrite in place changes the times, a save renamed over it the inode."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, found: os.stat_result) -> FileIdentity:
        return cls(found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns)


# At most this many input files are open at once, whatever the world size: a merge of 4096 rank files
# runs under `ulimit -n 256`. Planning opens, reads and closes each file; the writer opens on demand and
# closes the least recently used one when another must open.
MAX_OPEN_FILES = 64


class _OpenFiles:
    """The process's open input descriptors, least recently used first. A descriptor in use (pinned by
    ``LocalFile.opened``, e.g. by the writer thread's kernel copy) is never closed under it."""

    def __init__(self, limit: int):
        self.limit = limit
        self.lock = threading.Lock()
        self.fds: OrderedDict[LocalFile, int] = OrderedDict()
        self.pins: Counter[LocalFile] = Counter()

    def pin(self, file: LocalFile) -> int:
        with self.lock:
            fd = self.fds.get(file)
            if fd is None:
                self._make_room()
                fd = self.fds[file] = file._open()
            self.fds.move_to_end(file)
            self.pins[file] += 1
            return fd

    def held(self, file: LocalFile) -> int | None:
        """The descriptor open on ``file`` now, if any (a deleted file stays readable through it)."""
        with self.lock:
            return self.fds.get(file)

    def unpin(self, file: LocalFile) -> None:
        with self.lock:
            self.pins[file] -= 1
            if not self.pins[file]:
                del self.pins[file]

    def close(self, file: LocalFile) -> None:
        with self.lock:
            fd = self.fds.pop(file, None)
            if fd is not None:
                os.close(fd)

    def _make_room(self) -> None:
        # the least recently used idle ones, looked for from the oldest: at 1024 rank files every open of
        # a grouped read comes here, and a pass over all the open ones each time cost seconds
        victims: list[LocalFile] = []
        excess = len(self.fds) - self.limit + 1
        for f in self.fds:
            if len(victims) >= excess:
                break
            if f not in self.pins:
                victims.append(f)
        for f in victims:
            os.close(self.fds.pop(f))


_OPEN = _OpenFiles(MAX_OPEN_FILES)


class LocalFile:
    """A local input file: checked and measured when made, opened whenever its bytes are read.

    While it stays open (always, for merges of fewer than ``MAX_OPEN_FILES`` files), a trainer that
    deletes the checkpoint folder mid-merge (rotation) cannot pull the bytes away: Linux keeps an
    unlinked open file readable. A file re-opened later must still be the same file, or the merge stops.
    """

    def __init__(self, path: Path):
        self.path = path
        self.identity: FileIdentity | None = None
        with self.opened():  # opened once now: this records its identity
            self.size = self.identity.size

    def _open(self) -> int:
        """The one place an input file is opened (again, after its descriptor was closed to keep the count
        bounded); a re-open must find the very file planned, in the state planned."""
        fd, opened = open_regular_stat(self.path)  # never a FIFO or device: those would block or never end
        found = FileIdentity.of(opened)  # of what was opened, not of a path looked up again
        if self.identity is None:
            self.identity = found
        elif found != self.identity:
            os.close(fd)
            raise changed(self.path)
        return fd

    @contextlib.contextmanager
    def opened(self) -> Iterator[int]:
        """The file's descriptor, kept open while the block runs."""
        fd = _OPEN.pin(self)
        try:
            yield fd
        finally:
            _OPEN.unpin(self)

    def check_unchanged(self) -> None:
        """Refuse a file rewritten or replaced since it was planned: what we read of it may mix two saves.

        The file at the path must still be the one planned, in the state planned. A file deleted
        meanwhile (the trainer's rotation) is fine if the one we hold open is unchanged: deleting it
        changes only its ctime. Run before publishing; every re-open checks the same in ``_open``.
        """
        try:
            now = FileIdentity.of(os.stat(self.path))
        except FileNotFoundError:
            held = _OPEN.held(self)
            if held is None:
                raise changed(self.path) from None
            now = dataclasses.replace(FileIdentity.of(os.fstat(held)), ctime_ns=self.identity.ctime_ns)
        except OSError as exc:
            raise changed(self.path) from exc
        if now != self.identity:
            raise changed(self.path)

    def require_inside(self, folder: Path) -> None:
        """Refuse the file unless it lies inside ``folder`` (``files.inputs.require_opened_inside``)."""
        with self.opened() as fd:
            require_opened_inside(fd, self.path, folder)

    def read(self, offset: int, length: int) -> bytes:
        with self.opened() as fd:
            return os.pread(fd, length, offset)

    def readv(self, buffers: list[memoryview], offset: int) -> int:
        with self.opened() as fd:
            return os.preadv(fd, buffers, offset)

    def prefetch(self, offset: int, length: int) -> None:
        """Ask the kernel to start reading this range into the page cache."""
        with self.opened() as fd:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)

    @contextlib.contextmanager
    def stream(self) -> Iterator[BinaryIO]:
        with self.opened() as fd, os.fdopen(os.dup(fd), "rb", buffering=0) as f:  # the file checked when made
            yield f

    def close(self) -> None:
        _OPEN.close(self)


def changed(path: Path) -> MergeError:
    return MergeError(path, "changed while it was being merged: re-run once the save is complete")


class SourceRange(io.RawIOBase):
    """A read-only, seekable window onto part of a byte source: one chunk's torch.save archive, or a whole
    file read as a stream where it has no descriptor (an object in a store)."""

    def __init__(self, source: ByteSource, offset: int, length: int):
        super().__init__()
        self.source, self.offset, self.length, self.position = source, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = base + position
        return self.position

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.position))
        if n:
            n = self.source.readv([memoryview(buffer)[:n]], self.offset + self.position)
        self.position += n
        return n
