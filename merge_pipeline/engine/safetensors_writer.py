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
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from merge_pipeline.engine.plan import READ_PIECE_BYTES, PlannedTensor, SourceFile
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

# copy_file_range moves at most this much per call; the kernel copies, no user-space buffer.
_COPY_CHUNK = 1 << 30
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
) -> int:
    """Write ``tensors`` to ``path``; return the file size. ``on_bytes`` reports progress."""
    casts: dict[torch.dtype, torch.Tensor] = {}  # one output buffer per dtype, reused by every cast
    with naming(path), open(path, "wb") as out:
        out.write(build_header(tensors))
        for t in tensors:
            written = _write_tensor(out, t, on_bytes, casts)
            if written != t.nbytes:
                raise RuntimeError(f"{t.planned.name}: source gave {written} bytes, expected {t.nbytes}")
        out.flush()
        os.fsync(out.fileno())
        return out.tell()


def _write_tensor(out, t: OutputTensor, on_bytes: Callable[[int], None], casts: dict[torch.dtype, torch.Tensor]) -> int:
    source = t.planned.source
    runs = source.byte_runs() if t.dtype == t.planned.dtype else None
    written = 0
    if runs is not None:
        out.flush()
        for run in runs:
            written += _copy_run(run.file, run.offset, run.length, out.fileno(), on_bytes)
        out.seek(0, os.SEEK_END)
        return written
    for piece in source.pieces():
        piece = piece.reshape(-1)
        if piece.dtype != t.dtype:
            # Fresh pages cost more than the cast itself: keep the largest buffer seen so far.
            if t.dtype not in casts or casts[t.dtype].numel() < piece.numel():
                casts[t.dtype] = torch.empty(piece.numel(), dtype=t.dtype)
            piece = casts[t.dtype][: piece.numel()].copy_(piece)
        data = piece.view(torch.uint8).numpy()
        out.write(memoryview(data))
        written += data.nbytes
        on_bytes(data.nbytes)
    return written


def _copy_run(source: SourceFile, offset: int, length: int, out_fd: int, on_bytes: Callable[[int], None]) -> int:
    """Copy a file range into ``out_fd`` at its current end, inside the kernel where the filesystems allow."""
    done = 0
    out_pos = os.lseek(out_fd, 0, os.SEEK_END)
    while done < length:
        try:
            n = os.copy_file_range(source.fd, out_fd, min(_COPY_CHUNK, length - done), offset + done, out_pos + done)
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
            # E.g. EXDEV: the target is on another filesystem. Copy the rest through a buffer.
            done += _copy_through_buffer(source, offset + done, length - done, out_fd, out_pos + done, on_bytes)
            break
        if n == 0:
            raise MergeError(source.path, f"file ends at byte {offset + done}, expected data up to byte {offset + length}")
        done += n
        on_bytes(n)
    os.lseek(out_fd, out_pos + done, os.SEEK_SET)
    return done


def _copy_through_buffer(source: SourceFile, offset: int, length: int, out_fd: int, out_pos: int, on_bytes: Callable[[int], None]) -> int:
    buffer = memoryview(bytearray(min(READ_PIECE_BYTES, length)))
    done = 0
    while done < length:
        piece = buffer[: min(len(buffer), length - done)]
        source.read_into(piece, offset + done)
        written = 0
        while written < len(piece):
            written += os.pwrite(out_fd, piece[written:], out_pos + done + written)
        done += len(piece)
        on_bytes(len(piece))
    return done
