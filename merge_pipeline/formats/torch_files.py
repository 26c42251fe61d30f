"""Read what a ``torch.save`` file holds without reading its tensor data.

The pickle is read with torch's own allow-list (the globals ``torch.load(weights_only=True)``
accepts: no arbitrary globals, ever) onto the meta device, by the C unpickler: torch's
weights-only unpickler is pure Python and costs ~70 ms per rank file, which at world size 1024
was most of a merge; the C one with the same ``find_class`` allow-list takes a fifth of that. Where each storage's bytes are is taken
from the zip's own central directory and local headers, by record name, never computed from an
assumed layout: torch's meta loading computes offsets as if torch's writer had laid the archive
out, which is wrong for a file an ordinary zip tool re-packed. Every record must be STORED (a
plain file range we can copy in pieces) and exactly as long as the pickle declares its storage;
every tensor view must lie inside its storage. A ``torch.load`` that would read other bytes, or
refuse the file, is matched by a refusal here, before any allocation sized by the file's claims.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
import torch.distributed.tensor  # noqa: F401  (puts DTensor and its placements on the safe list)
from torch._weights_only_unpickler import _get_allowed_globals, _get_user_allowed_globals

from merge_pipeline.errors import MergeError
from merge_pipeline.input_files import open_regular
from merge_pipeline.plan import ByteRun, SourceFile

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header, as zipfile reads it
_LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass(frozen=True)
class StoredTensor:
    """A tensor inside a torch.save file: its meta view and where its storage begins."""

    meta: torch.Tensor  # on the meta device: shape, stride, dtype, storage offset
    storage_file_offset: int

    def byte_run(self, file: SourceFile) -> ByteRun | None:
        """The file range holding the tensor, or ``None`` if it is not contiguous in storage."""
        if not self.meta.is_contiguous():
            return None
        item = self.meta.element_size()
        return ByteRun(file, self.storage_file_offset + self.meta.storage_offset() * item, self.meta.numel() * item)


class _QuietDeviceMesh(logging.Filter):
    # Unpickling a DeviceMesh outside its process group logs a torch.compile warning per tensor.
    def filter(self, record: logging.LogRecord) -> bool:
        return "pickling/unpickling of the DeviceMesh" not in record.getMessage()


logging.getLogger("torch.distributed.device_mesh").addFilter(_QuietDeviceMesh())


def load_meta_state_dict(path: Path, allowed_globals: Mapping[str, object] | None = None) -> dict[str, object]:
    """Unpickle a state dict safely onto the meta device; one-line ``MergeError`` on any problem."""
    with torch_archive(path) as archive:
        return archive.state_dict(allowed_globals)


@contextlib.contextmanager
def torch_archive(path: Path) -> Iterator[TorchArchive]:
    """A torch.save file's archive, open while the block runs (its records located, nothing unpickled)."""
    # Unbuffered: the reads are few and exact (directory, one local header per record, the pickle); a
    # buffered stream would read 8 KiB after every seek, ~1 GB for the headers of 1024 rank files.
    with os.fdopen(open_regular(path), "rb", buffering=0) as stream:  # never a FIFO or device
        if os.fstat(stream.fileno()).st_size == 0:
            raise MergeError(path, "file is empty")
        if not zipfile.is_zipfile(stream):
            raise MergeError(path, "not a torch.save zip archive (truncated, corrupt, or the pre-1.6 legacy format)")
        yield TorchArchive(stream, path)


def load_meta_archive(stream: BinaryIO, path: Path, allowed_globals: Mapping[str, object] | None = None) -> object:
    """What ``torch.load(stream, map_location="meta", weights_only=True)`` returns (``TorchArchive.unpickle``)."""
    return TorchArchive(stream, path).unpickle(allowed_globals)


class TorchArchive:
    """A torch.save zip archive: its records by name and its pickle's bytes, read but not yet unpickled."""

    def __init__(self, stream: BinaryIO, path: Path):
        self.stream, self.path = stream, path
        self.records, self.directory_start = _stored_records(stream, path)
        self.prefix = next(iter(self.records)).split("/", 1)[0]  # torch names every record <archive>/...
        byteorder = self.records.get(f"{self.prefix}/byteorder")
        if byteorder is not None:
            order = _read_record(stream, byteorder, path, limit=16)
            if order != b"little":
                raise MergeError(
                    path,
                    f"records are stored {order.decode(errors='replace')!r}-endian; only little-endian checkpoints can be merged (re-save it on a little-endian machine)",
                )
        pickled = self.records.get(f"{self.prefix}/data.pkl")
        if pickled is None:
            raise MergeError(path, "not a torch.save archive (no data.pkl record)")
        self.pickled = _read_record(stream, pickled, path)

    def storage_offset(self, key: str, numel: int, dtype: torch.dtype) -> int:
        """Where storage ``data/<key>`` starts in the file, once its record is found to hold ``numel`` x ``dtype``."""
        nbytes = numel * dtype.itemsize
        record = self.records.get(f"{self.prefix}/data/{key}")
        if record is None:
            raise MergeError(self.path, f"the pickle refers to storage data/{key}, which the archive does not hold")
        if record.file_size != nbytes:
            raise MergeError(
                self.path,
                f"storage record data/{key} holds {record.file_size} bytes but the pickle declares {numel} x {dtype} = {nbytes} bytes",
            )
        return _data_offset(self.stream, record, self.path)

    def data_offset(self, record: zipfile.ZipInfo) -> int:
        """Where ``record``'s bytes start, after its local header (checked)."""
        return _data_offset(self.stream, record, self.path)

    def state_dict(self, allowed_globals: Mapping[str, object] | None = None) -> dict[str, object]:
        state = self.unpickle(allowed_globals)
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise MergeError(self.path, f"expected a state dict of name -> tensor, found {type(state).__name__}")
        return state

    def unpickle(self, allowed_globals: Mapping[str, object] | None = None) -> object:
        """What ``torch.load(map_location="meta", weights_only=True)`` returns, with each storage's
        ``_checkpoint_offset`` (data start) read from its record's local header, its declared size
        (``_checkpoint_nbytes``) checked against the record, and its record key (``_checkpoint_key``).

        ``allowed_globals``: full global name -> the object to build in its place, added to torch's
        allow-list for this load only (a reader's inert stand-ins for its trainer's plain-data classes)."""
        path = self.path
        storages: dict[str, torch.storage.TypedStorage] = {}

        def persistent_load(saved_id: tuple) -> torch.storage.TypedStorage:
            kind, storage_type, key, _location, numel = saved_id
            dtype = getattr(storage_type, "dtype", None)
            if (
                kind != "storage"
                or not isinstance(dtype, torch.dtype)
                or not isinstance(key, str)
                or type(numel) is not int
                or numel < 0
            ):
                raise MergeError(path, f"malformed storage reference {saved_id!r:.100}")
            nbytes = numel * dtype.itemsize
            if key not in storages:
                storage = torch.UntypedStorage(nbytes, device="meta")
                storage._checkpoint_offset = self.storage_offset(key, numel, dtype)
                storage._checkpoint_nbytes = nbytes  # a view's set_() may grow a meta storage: keep the true size
                storage._checkpoint_key = key
                storages[key] = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
            elif storages[key]._untyped_storage._checkpoint_nbytes != nbytes:
                raise MergeError(path, f"storage data/{key} is declared with two different sizes")
            return storages[key]

        allowed = {
            **_get_allowed_globals(),
            **_get_user_allowed_globals(),
            "torch._utils._rebuild_tensor_v2": _rebuild_meta_tensor,
            **(allowed_globals or {}),
        }
        unpickler = _AllowListUnpickler(io.BytesIO(self.pickled), allowed, encoding="utf-8")
        unpickler.persistent_load = persistent_load
        try:
            return unpickler.load()
        except MergeError:
            raise
        except Exception as exc:  # a hostile pickle can raise anything; it must still be one line
            raise MergeError(path, _unpickling_problem(exc)) from None


def _rebuild_meta_tensor(
    storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None
):
    """``torch._utils._rebuild_tensor_v2`` for meta storages: the same view, without its search for a
    fake-tensor mode on every tensor (a third of the unpickling time) or the training-only attributes."""
    return torch.empty((0,), dtype=storage.dtype, device="meta").set_(
        storage._untyped_storage, storage_offset, size, stride
    )


class _AllowListUnpickler(pickle.Unpickler):
    """Every global the pickle names (GLOBAL, STACK_GLOBAL, EXT) comes through ``find_class``, so
    every object it builds or calls is one of ``allowed``: exactly what torch's weights-only unpickler
    lets a pickle reach."""

    def __init__(self, stream: BinaryIO, allowed: Mapping[str, object], **kwargs):
        super().__init__(stream, **kwargs)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> object:
        found = self.allowed.get(f"{module}.{name}")
        if found is None:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not an allowed global")
        return found


def _unpickling_problem(exc: Exception) -> str:
    """One line naming what was refused; torch's own wording spans lines and may carry colour codes."""
    message = _ANSI_ESCAPE.sub("", str(exc)).strip()
    first_line = message.splitlines()[0] if message else type(exc).__name__
    if refused := re.search(r"GLOBAL (\S+)", message):
        return f"refused to unpickle (weights_only=True): the file names the global {refused[1].rstrip('.')}, which is not allowed"
    if isinstance(exc, pickle.UnpicklingError):
        return f"refused to unpickle (weights_only=True): {first_line}"
    return f"unreadable torch.save pickle ({type(exc).__name__}: {first_line})"


def _stored_records(stream: BinaryIO, path: Path) -> tuple[dict[str, zipfile.ZipInfo], int]:
    """Every record by name, from the central directory (and where that starts); each must be STORED,
    unencrypted, once."""
    try:
        directory = zipfile.ZipFile(stream)
        infos = directory.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise MergeError(path, f"not a readable zip archive ({exc})") from None
    if not infos:
        raise MergeError(path, "empty zip archive: not a torch.save file")
    records: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        if info.filename in records:
            raise MergeError(path, f"record {info.filename} appears twice in the zip directory")
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
            what = "encrypted" if info.flag_bits & 0x1 else f"compressed record (method {info.compress_type})"
            raise MergeError(
                path,
                f"{what}: {info.filename}; torch.save writes records uncompressed, so this file was re-packed by a zip tool (re-save it with torch.save)",
            )
        records[info.filename] = info
    return records, directory.start_dir


def _data_offset(stream: BinaryIO, info: zipfile.ZipInfo, path: Path) -> int:
    """Where a record's bytes start: after its local header, whose name and extra field lengths
    may differ from the central directory's (zip tools pad and reorder as they like)."""
    name = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
    end = stream.seek(0, io.SEEK_END)
    stream.seek(info.header_offset)
    header = stream.read(_LOCAL_HEADER.size + len(name))  # one read: a rank file has a hundred records
    if len(header) < _LOCAL_HEADER.size or not header.startswith(_LOCAL_HEADER_SIGNATURE):
        raise MergeError(path, f"record {info.filename}: no local zip header at byte {info.header_offset}")
    fields = _LOCAL_HEADER.unpack(header[: _LOCAL_HEADER.size])
    name_length, extra_length = fields[10], fields[11]
    if header[_LOCAL_HEADER.size :] != name or name_length != len(name):
        raise MergeError(path, f"record {info.filename}: local header names a different record")
    offset = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    if info.file_size != info.compress_size or offset + info.file_size > end:
        raise MergeError(
            path,
            f"record {info.filename}: data ends at byte {offset + info.compress_size} but the file has {end} bytes (truncated)",
        )
    return offset


def _read_record(stream: BinaryIO, info: zipfile.ZipInfo, path: Path, limit: int | None = None) -> bytes:
    if limit is not None and info.file_size > limit:
        raise MergeError(path, f"record {info.filename} is {info.file_size} bytes, expected at most {limit}")
    stream.seek(_data_offset(stream, info, path))
    return stream.read(info.file_size)


def stored_tensor(path: Path, name: str, tensor: torch.Tensor, file_size: int) -> StoredTensor:
    """Where ``tensor``'s storage is in the file, once its view is checked to lie inside it."""
    storage = tensor.untyped_storage()
    offset = getattr(storage, "_checkpoint_offset", None)
    nbytes = getattr(storage, "_checkpoint_nbytes", None)
    if offset is None or nbytes is None:
        raise MergeError(path, f"{name}: cannot locate the tensor's bytes in the archive")
    item = tensor.element_size()
    if any(s < 0 for s in tensor.stride()) or tensor.storage_offset() < 0:
        raise MergeError(
            path, f"{name}: negative stride {tuple(tensor.stride())} or storage offset {tensor.storage_offset()}"
        )
    if tensor.numel():
        last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
        if (last + 1) * item > nbytes:
            raise MergeError(
                path,
                f"{name}: view (shape {tuple(tensor.shape)}, stride {tuple(tensor.stride())}, offset {tensor.storage_offset()}) reaches element {last} but its storage holds {nbytes // item}",
            )
        # A view with more elements than its storage repeats bytes (stride 0): torch.load would
        # accept it, but no trainer saves weights so, and its output would be bounded by nothing.
        if tensor.numel() * item > nbytes:
            raise MergeError(
                path,
                f"{name}: view of {tensor.numel()} elements overlaps itself in a storage of {nbytes // item} (stride {tuple(tensor.stride())})",
            )
    if offset + nbytes > file_size:
        raise MergeError(
            path, f"{name}: data ends at byte {offset + nbytes} but the file has {file_size} bytes (truncated)"
        )
    return StoredTensor(tensor, offset)
