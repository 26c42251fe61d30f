"""The safetensors files of a Hugging Face folder: their names, the dtype table, and header reading.

Headers of finished files are read with the ``safetensors`` package (``safe_open`` validates the
header, the offsets and the dtypes); a reader that needs byte offsets parses the header itself.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from merge_pipeline.errors import MergeError
from merge_pipeline.store.sources import ByteSource
from merge_pipeline.store.view import byte_source

# The safetensors library refuses a header over 100 MB, and reserves this name in it for string metadata.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"

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


TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def exact_common_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The narrowest floating dtype holding every value of both floating dtypes exactly (bf16 and fp32: fp32;
    bf16 and fp16: fp32). torch promotes no 8-bit float type: float32 holds each exactly."""
    if a == b:
        return a
    return torch.promote_types(*(torch.float32 if d.itemsize == 1 else d for d in (a, b)))


@contextlib.contextmanager
def open_safetensors(path: Path) -> Iterator:
    """``safe_open`` a finished file; a missing, special or malformed one is one line naming it."""
    source = byte_source(path)  # a local file checked first, as ``open_regular``: safe_open would block on a FIFO
    with contextlib.closing(source), source.opened() as fd:
        if fd is None:  # no local file: an object in a store (``store.view.viewed``), read through ranged GETs
            yield StoredSafetensors(path, source)
            return
        try:
            with safe_open(path, "pt") as f:
                yield f
        except SafetensorError as exc:
            raise MergeError(path, f"not a readable safetensors file ({exc})") from None


class StoredSafetensors:
    """``safe_open``'s reading calls on a safetensors file in a store: the header in two ranged GETs, each
    tensor in one (pinned to the ETag listed, as every read of a store object)."""

    def __init__(self, path: Path, source: ByteSource):
        self.path, self.source = path, source
        length = int.from_bytes(source.read(0, 8), "little")
        self.data_start = 8 + length
        if length > MAX_HEADER_BYTES or self.data_start > source.size:
            raise MergeError(path, "not a readable safetensors file (header length past the end of the file)")
        try:
            header = json.loads(source.read(8, length))
            self.entries = {name: _Entry(e) for name, e in header.items() if name != METADATA_KEY}
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise MergeError(path, f"not a readable safetensors file (header: {exc})") from None
        if any(self.data_start + e.end > source.size for e in self.entries.values()):
            raise MergeError(path, "not a readable safetensors file (a tensor's offsets run past the end of the file)")

    def keys(self) -> list[str]:
        return sorted(self.entries)

    def get_slice(self, name: str) -> _Entry:
        return self.entries[name]

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        data = bytearray(self.source.read(self.data_start + entry.start, entry.end - entry.start))
        if not data:
            return torch.empty(entry.shape, dtype=TORCH_DTYPES[entry.dtype])
        return torch.frombuffer(data, dtype=TORCH_DTYPES[entry.dtype]).view(entry.shape)


class _Entry:
    """One tensor of a stored file's header, answering as ``safe_open``'s slices do."""

    def __init__(self, entry: dict):
        self.dtype, self.shape = entry["dtype"], [int(d) for d in entry["shape"]]
        self.start, self.end = (int(o) for o in entry["data_offsets"])
        if (
            self.dtype not in TORCH_DTYPES
            or self.end - self.start != math.prod(self.shape) * TORCH_DTYPES[self.dtype].itemsize
        ):
            raise ValueError(f"dtype {self.dtype} or offsets {self.start}-{self.end} do not fit shape {self.shape}")

    def get_dtype(self) -> str:
        return self.dtype

    def get_shape(self) -> list[int]:
        return self.shape


def read_header(path: Path) -> dict[str, dict]:
    """name -> dtype (as the header spells it), shape and data bytes of each tensor; ``safe_open`` validates the header."""
    entries = {}
    with open_safetensors(path) as f:
        for name in f.keys():
            entry = f.get_slice(name)
            dtype, shape = entry.get_dtype(), entry.get_shape()
            entries[name] = {"dtype": dtype, "shape": shape, "nbytes": math.prod(shape) * TORCH_DTYPES[dtype].itemsize}
    return entries
