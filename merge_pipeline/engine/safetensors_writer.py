"""A streaming safetensors writer.

``safetensors.torch.save_file`` needs every tensor in memory at once; this writer knows every
name, dtype and shape up front (from the plan), writes the header first and then streams each
tensor's bytes, so memory stays bounded by one piece of one tensor.

Format: 8-byte little-endian header length N, N bytes of JSON (padded with spaces to a multiple
of 8 so the data is aligned), then the tensors' bytes in header order.
"""

from __future__ import annotations

import errno
import itertools
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

from merge_pipeline.engine.narrowing import OutOfRange, check_cast, may_overflow, refusal
from merge_pipeline.errors import MergeError, naming
from merge_pipeline.hf.safetensors import METADATA_KEY, SAFETENSORS_DTYPES
from merge_pipeline.plan import READ_PIECE_BYTES, ByteRun, PlannedTensor, SourceFile
from merge_pipeline.store.sources import MAX_OPEN_FILES

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
    header: dict[str, object] = {METADATA_KEY: metadata or {"format": "pt"}}
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

    Three threads overlap: this one reads and casts the next pieces, a writer thread writes (or has
    the kernel copy) the previous ones, and a hasher thread feeds ``digest`` (if given, e.g.
    ``hashlib.sha256()``) every byte of the file in order: user-space buffers directly, kernel
    copies re-read from the page cache just after they land. Reads, casts, writes and hashlib
    release the GIL. Big allocations stay on this thread, so freed memory is reused (glibc gives
    each thread its own arena) and peak RSS stays at one tensor plus a few chunks.
    """
    header = build_header(tensors)
    with naming(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            with _Hasher(fd, digest) as hasher:
                with _Writer(fd, hasher, on_bytes) as writer:
                    writer.put(memoryview(header))
                    chunks = _Chunks()
                    _read_ahead(tensors[:1])
                    for index, t in enumerate(tensors):
                        _read_ahead(tensors[index + 1 : index + 2])  # the disk reads the next tensor meanwhile
                        produced = 0
                        for item in _tensor_items(t, chunks):
                            writer.put(item)
                            produced += item.length if isinstance(item, ByteRun) else len(item)
                        if produced != t.nbytes:
                            raise RuntimeError(f"{t.planned.name}: source gave {produced} bytes, expected {t.nbytes}")
                os.fsync(fd)  # while the hasher finishes the tail
            return writer.position
        finally:
            os.close(fd)


# Bytes move between the threads in chunks of at most this size: large writes, bounded memory.
_CHUNK_BYTES = 2 << 20
# Items waiting for the writer, and for the hasher.
_QUEUED = 2
# Chunk buffers, reused round-robin: one is refilled only after the chunk it held was hashed, since
# at most 2 * _QUEUED are queued, 1 is being written and 1 hashed while the next is filled.
_BUFFERS = 2 * _QUEUED + 3
# What the writer holds beside the tensor being written: the chunk ring and the hasher's read-back buffer.
BUFFERED_BYTES = (_BUFFERS + 1) * _CHUNK_BYTES
_END = object()


class _Chunks:
    """Casts or copies tensors into a ring of chunk buffers: a source reuses its read buffer, and a
    built tensor (up to a whole embedding) must not stay alive while the pipeline drains."""

    def __init__(self):
        self.buffers = [torch.empty(_CHUNK_BYTES, dtype=torch.uint8) for _ in range(_BUFFERS)]
        self.next = 0

    def of(self, piece: torch.Tensor, dtype: torch.dtype, checked: bool):
        """``piece`` cast to ``dtype``, chunk by chunk; ``checked``: each cast chunk is checked to hold
        no inf or NaN its source did not (``narrowing.check_cast``)."""
        piece = piece.reshape(-1)
        per_chunk = _CHUNK_BYTES // dtype.itemsize
        for start in range(0, piece.numel(), per_chunk):
            part = piece[start : start + per_chunk]
            buffer = self.buffers[self.next]
            self.next = (self.next + 1) % len(self.buffers)
            cast = buffer.view(dtype)[: part.numel()].copy_(part)
            if checked:
                check_cast(part, cast)
            yield memoryview(cast.view(torch.uint8).numpy())


def _tensor_items(t: OutputTensor, chunks: _Chunks):
    """``t``'s bytes in order: ``ByteRun``s for the kernel to copy, or chunks of our buffers."""
    runs = t.planned.source.byte_runs() if t.dtype == t.planned.dtype else None
    if runs is not None:
        yield from runs
        return
    checked = may_overflow(t.planned.dtype, t.dtype)
    pieces = iter(t.planned.source.pieces())
    for piece in pieces:
        try:
            yield from chunks.of(piece, t.dtype, checked)
        except OutOfRange:
            raise refusal(t.planned.name, t.planned.dtype, t.dtype, itertools.chain([piece], pieces)) from None
        del piece  # a built tensor is freed before the source builds the next one


def _read_ahead(tensors: Sequence[OutputTensor]) -> None:
    """Ask the kernel to start reading these tensors' stored bytes into the page cache (returns at once)."""
    for t in tensors:
        runs = t.planned.source.byte_runs() or ()
        if len({run.file for run in runs}) > MAX_OPEN_FILES:
            # the read would open each file again (fewer are kept open): twice the opens at ws1024, for a
            # read-ahead that a warm cache does not need (a group of small pieces is not read ahead either)
            continue
        for run in runs:
            run.file.advise_will_need(run.offset, run.length)


class _Stage:
    """A thread that handles queued items in order. Its first error is raised to the producer (on
    its next ``put`` or at exit) and the rest of the queue is drained, so the producer never blocks."""

    def __init__(self, name: str):
        self.queue: queue.Queue = queue.Queue(maxsize=_QUEUED)
        self.error: BaseException | None = None
        self.cancelled = False  # the producer failed: what is still queued is skipped
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        self.cancelled = exc_type is not None
        self.queue.put(_END)
        self.thread.join()
        if exc_type is None and self.error is not None:
            raise self.error

    def put(self, item) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put(item)

    def _run(self) -> None:
        while (item := self.queue.get()) is not _END:
            if self.error is None and not self.cancelled:
                try:
                    self.handle(item)
                except BaseException as exc:
                    self.error = exc

    def handle(self, item) -> None:
        raise NotImplementedError


class _Writer(_Stage):
    """Appends chunks (``pwrite``) and byte runs (``copy_file_range``) to the file, in order."""

    def __init__(self, fd: int, hasher: _Hasher, on_bytes: Callable[[int], None]):
        super().__init__("merge-writer")
        self.fd, self.hasher, self.on_bytes = fd, hasher, on_bytes
        self.position = 0

    def handle(self, item) -> None:
        if isinstance(item, ByteRun):
            self.position += _copy_run(
                item.file, item.offset, item.length, self.fd, self.position, self.on_bytes, self.hasher
            )
            return
        _pwrite_all(self.fd, item, self.position)
        self.hasher.put((self.position, len(item), item))
        self.position += len(item)
        self.on_bytes(len(item))


class _Hasher(_Stage):
    """Takes each written range in file order: feeds it to ``digest`` (if any), then starts its writeback.

    Items are ``(position, length, bytes or None)``; ``None``: bytes the kernel copied, re-read here
    from the page cache.
    """

    def __init__(self, fd: int, digest):
        super().__init__("merge-hasher")
        self.fd, self.digest = fd, digest
        self.buffer: memoryview | None = None

    def handle(self, item) -> None:
        position, length, data = item
        if self.digest is not None and data is not None:
            self.digest.update(data)
        elif self.digest is not None:
            self.buffer = self.buffer or memoryview(bytearray(_CHUNK_BYTES))
            for start in range(0, length, _CHUNK_BYTES):
                view = self.buffer[: min(_CHUNK_BYTES, length - start)]
                _pread_all(self.fd, view, position + start)
                self.digest.update(view)
        # On dirty pages DONTNEED only starts their writeback (Python has no sync_file_range):
        # the disk writes while we read on, and the final fsync has little left to wait for.
        os.posix_fadvise(self.fd, position, length, os.POSIX_FADV_DONTNEED)


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


def _copy_run(
    source: SourceFile,
    offset: int,
    length: int,
    out_fd: int,
    out_pos: int,
    on_bytes: Callable[[int], None],
    hasher: _Hasher,
) -> int:
    """Copy a file range to ``out_pos`` of ``out_fd``, inside the kernel where the filesystems allow."""
    with source.opened() as source_fd:
        if source_fd is None:  # no descriptor (an object in a store): its bytes come through ranged GETs
            return _copy_through_buffer(source, offset, length, out_fd, out_pos, on_bytes, hasher)
        return _copy_range(source, source_fd, offset, length, out_fd, out_pos, on_bytes, hasher)


def _copy_range(source, source_fd, offset, length, out_fd, out_pos, on_bytes, hasher) -> int:
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(source_fd, out_fd, min(_COPY_CHUNK, length - done), offset + done, out_pos + done)
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
            # E.g. EXDEV: the target is on another filesystem. Copy the rest through a buffer.
            done += _copy_through_buffer(source, offset + done, length - done, out_fd, out_pos + done, on_bytes, hasher)
            break
        if n == 0:
            raise MergeError(
                source.path, f"file ends at byte {offset + done}, expected data up to byte {offset + length}"
            )
        hasher.put((out_pos + done, n, None))
        done += source.counted(n)
        on_bytes(n)
    return done


def _copy_through_buffer(
    source: SourceFile,
    offset: int,
    length: int,
    out_fd: int,
    out_pos: int,
    on_bytes: Callable[[int], None],
    hasher: _Hasher,
) -> int:
    buffer = memoryview(bytearray(min(READ_PIECE_BYTES, length)))
    done = 0
    while done < length:
        piece = buffer[: min(len(buffer), length - done)]
        source.read_into(piece, offset + done)
        _pwrite_all(out_fd, piece, out_pos + done)
        hasher.put((out_pos + done, len(piece), None))  # the buffer is refilled next: hash from the file
        done += len(piece)
        on_bytes(len(piece))
    return done
