"""A streaming safetensors writer.

``safetensors.torch.save_file`` needs every tensor in memory at once; this writer knows every
name, dtype and shape up front (from the plan), writes the header first and then streams each
tensor's bytes, so memory stays bounded by one piece of one tensor.

Format: 8-byte little-endian header length N, N bytes of JSON (padded with spaces to a multiple
of 8 so the data is aligned), then the tensors' bytes in header order.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from merge_pipeline.engine.plan import READ_PIECE_BYTES, ByteRun, Computed, PlannedTensor, SourceFile
from merge_pipeline.errors import MergeError, naming

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

# copy_file_range moves at most this much per call (the kernel copies, no user-space buffer);
# small enough that the hasher re-reads each piece from the page cache while the next is copied.
_COPY_CHUNK = 64 << 20
# copy_file_range errors that mean "not between these files" (another filesystem, an old kernel), not "failed".
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of an output file: the plan entry and the dtype it is written in."""

    planned: PlannedTensor
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.planned.nbytes(self.dtype)


def build_header(tensors: Sequence[OutputTensor], metadata: dict[str, str] | None = None) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.planned.name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.planned.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(
    path: Path,
    tensors: Sequence[OutputTensor],
    on_bytes: Callable[[int], None] = lambda n: None,
    *,
    digest: Any = None,
) -> int:
    """Write ``tensors`` to ``path``; return the file size. ``on_bytes`` reports progress.

    A reader thread reads and casts the next pieces while this thread writes, and ``digest`` (if
    given, e.g. ``hashlib.sha256()``) is fed every byte of the file, in order, by a third thread:
    bytes from user-space buffers directly, kernel copies re-read from the page cache just after
    they land. hashlib, torch casts and the system calls release the GIL, so the three overlap.
    """
    header = build_header(tensors)
    with naming(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            with _Hasher(fd, digest) as hasher, _Reader(tensors) as reader:
                _pwrite_all(fd, memoryview(header), 0)
                hasher.add_bytes(memoryview(header), 0)
                position = len(header)
                for item in reader:
                    if isinstance(item, ByteRun):
                        position += _copy_run(item.file, item.offset, item.length, fd, position, on_bytes, hasher)
                    else:
                        _pwrite_all(fd, item, position)
                        hasher.add_bytes(item, position)
                        position += len(item)
                        on_bytes(len(item))
                os.fsync(fd)  # while the hasher finishes the tail
            return position
        finally:
            os.close(fd)


# Bytes move between the threads in chunks of at most this size: large writes, bounded memory.
_CHUNK_BYTES = 8 << 20
# Chunks waiting between reader and writer, and between writer and hasher.
_QUEUED = 2
# Reader-owned buffers, reused round-robin: a buffer is refilled only after the chunk that used it
# was hashed, since at most 2 * _QUEUED queued + 1 being written + 1 being hashed are still in use.
_BUFFERS = 2 * _QUEUED + 3
_END = object()


class _Worker:
    """A daemon thread whose exception is re-raised in the thread that reads its results."""

    def __init__(self, name: str):
        self.queue: queue.Queue = queue.Queue(maxsize=_QUEUED)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def _put(self, item) -> bool:
        """Hand ``item`` on; False once the consumer gave up (then the worker stops)."""
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


class _Reader(_Worker):
    """Yields, in file order, each tensor's bytes: a ``ByteRun`` for a kernel copy, else chunks."""

    def __init__(self, tensors: Sequence[OutputTensor]):
        super().__init__("merge-reader")
        self.tensors = tensors
        self.buffers = [torch.empty(_CHUNK_BYTES, dtype=torch.uint8) for _ in range(_BUFFERS)]
        self.next_buffer = 0

    def __enter__(self) -> _Reader:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def __iter__(self):
        while (item := self.queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def _run(self) -> None:
        try:
            for index, t in enumerate(self.tensors):
                if index == 0:
                    _read_ahead(t)
                if index + 1 < len(self.tensors):
                    _read_ahead(self.tensors[index + 1])  # the disk reads the next tensor while we copy this one
                produced = 0
                for item in self._items(t):
                    produced += item.length if isinstance(item, ByteRun) else len(item)
                    if not self._put(item):
                        return
                if produced != t.nbytes:
                    raise RuntimeError(f"{t.planned.name}: source gave {produced} bytes, expected {t.nbytes}")
            self._put(_END)
        except BaseException as exc:  # handed to the writer, which raises it
            self._put(exc)

    def _items(self, t: OutputTensor):
        runs = t.planned.source.byte_runs() if t.dtype == t.planned.dtype else None
        if runs is not None:
            yield from runs
            return
        for piece in t.planned.source.pieces():
            piece = piece.reshape(-1)
            if piece.dtype == t.dtype and isinstance(t.planned.source, Computed):
                # A built tensor is fresh memory (a read buffer is not): hand on views of it, no copy.
                data = piece.view(torch.uint8).numpy()
                for start in range(0, len(data), _CHUNK_BYTES):
                    yield memoryview(data[start : start + _CHUNK_BYTES])
                continue
            # Cast (or copy out of a reused read buffer) into one of our buffers, a chunk at a time.
            per_chunk = _CHUNK_BYTES // torch.empty((), dtype=t.dtype).element_size()
            for start in range(0, piece.numel(), per_chunk):
                part = piece[start : start + per_chunk]
                buffer = self.buffers[self.next_buffer]
                self.next_buffer = (self.next_buffer + 1) % len(self.buffers)
                out = buffer.view(t.dtype)[: part.numel()].copy_(part)
                yield memoryview(out.view(torch.uint8).numpy())


def _read_ahead(t: OutputTensor) -> None:
    """Ask the kernel to start reading ``t``'s stored bytes into the page cache (it returns at once)."""
    for run in t.planned.source.byte_runs() or ():
        os.posix_fadvise(run.file.fd, run.offset, run.length, os.POSIX_FADV_WILLNEED)


class _Hasher(_Worker):
    """Takes each written range in file order: feeds it to ``digest`` (if any), then starts its writeback."""

    def __init__(self, fd: int, digest):
        super().__init__("merge-hasher")
        self.fd = fd
        self.digest = digest
        self.error: BaseException | None = None

    def __enter__(self) -> _Hasher:
        self.thread.start()
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is not None:
            self.stop.set()
        else:
            self.queue.put(_END)
        self.thread.join()
        if self.error is not None and exc_type is None:
            raise self.error

    def add_bytes(self, data: memoryview, position: int) -> None:
        """Bytes written from this buffer, which stays untouched until hashed."""
        self.queue.put((position, len(data), data))

    def add_written(self, position: int, length: int) -> None:
        """Bytes that went file to file inside the kernel: hashed from the page cache."""
        self.queue.put((position, length, None))

    def _run(self) -> None:
        buffer = None
        while not self.stop.is_set():
            try:
                item = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is _END:
                return
            if self.error is not None:
                continue  # keep draining so the writer never blocks; the error is raised at exit
            position, length, data = item
            try:
                if self.digest is not None and data is not None:
                    self.digest.update(data)
                elif self.digest is not None:
                    buffer = buffer if buffer is not None else memoryview(bytearray(_CHUNK_BYTES))
                    for start in range(0, length, _CHUNK_BYTES):
                        view = buffer[: min(_CHUNK_BYTES, length - start)]
                        _pread_all(self.fd, view, position + start)
                        self.digest.update(view)
                # On dirty pages DONTNEED only starts their writeback (Python has no sync_file_range):
                # the disk writes while we read on, and the final fsync has little left to wait for.
                os.posix_fadvise(self.fd, position, length, os.POSIX_FADV_DONTNEED)
            except BaseException as exc:
                self.error = exc


def _pwrite_all(fd: int, data: memoryview, position: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], position + done)


def _pread_all(fd: int, view: memoryview, position: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], position + done)
        if n == 0:
            raise RuntimeError(f"output ends at byte {position + done} while hashing")
        done += n


def _copy_run(source: SourceFile, offset: int, length: int, out_fd: int, out_pos: int, on_bytes: Callable[[int], None], hasher: _Hasher) -> int:
    """Copy a file range to ``out_pos`` of ``out_fd``, inside the kernel where the filesystems allow."""
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(source.fd, out_fd, min(_COPY_CHUNK, length - done), offset + done, out_pos + done)
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
            # E.g. EXDEV: the target is on another filesystem. Copy the rest through a buffer.
            done += _copy_through_buffer(source, offset + done, length - done, out_fd, out_pos + done, on_bytes, hasher)
            break
        if n == 0:
            raise MergeError(source.path, f"file ends at byte {offset + done}, expected data up to byte {offset + length}")
        hasher.add_written(out_pos + done, n)
        done += n
        on_bytes(n)
    return done


def _copy_through_buffer(source: SourceFile, offset: int, length: int, out_fd: int, out_pos: int, on_bytes: Callable[[int], None], hasher: _Hasher) -> int:
    buffer = memoryview(bytearray(min(READ_PIECE_BYTES, length)))
    done = 0
    while done < length:
        piece = buffer[: min(len(buffer), length - done)]
        source.read_into(piece, offset + done)
        _pwrite_all(out_fd, piece, out_pos + done)
        hasher.add_written(out_pos + done, len(piece))  # the buffer is refilled next: hash the file
        done += len(piece)
        on_bytes(len(piece))
    return done
