"""Read what a ``torch.save`` file holds without reading its tensor data.

The file is read as ``torch.load(f, map_location="cpu", weights_only=True, mmap=True)`` reads it,
or refused: a zip archive from byte 0 (``torch.serialization._is_zipfile``: a pre-1.6 stream with a
zip appended is refused, never read as the zip), whose records torch's own zip reader
(``PyTorchFileReader``, miniz) finds at the very offsets ``zipfile`` does -- names compared as raw
bytes, no data before the archive (zipfile's ``concat``), a ``version`` record torch supports --, and
without the records ``torch.load(weights_only=True)`` refuses (``constants.pkl``, an unparsable
``.storage_alignment``). Where each storage's bytes are is taken from the zip's own central directory
and local headers, by record name, never computed from an assumed layout: torch's meta loading
computes offsets as if torch's writer had laid the archive out, which is wrong for a file an
ordinary zip tool re-packed. Every record must be STORED (a plain file range we can copy in pieces)
and exactly as long as the pickle declares its storage; every tensor view must lie inside its
storage. The pickle is read by ``state_dict_pickle`` (what a state dict needs, nothing else), onto
the meta device, before any allocation sized by the file's claims.
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from merge_pipeline.errors import MergeError, first_line
from merge_pipeline.formats.state_dict_pickle import PickleRefused, StateDictUnpickler
from merge_pipeline.plan import ByteRun, SourceFile
from merge_pipeline.store.view import byte_source

_ZIP_START = b"PK\x03\x04"  # what torch.load needs at byte 0 to read a file as a zip archive
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header, as zipfile reads it
# Records whose contents torch.load reads besides the pickle and the storages (a few bytes each).
METADATA_RECORDS = (b"version", b".data/version", b".format_version", b".storage_alignment", b"byteorder")


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


def load_meta_state_dict(path: Path, stand_ins: Mapping[str, type] | None = None) -> dict[str, object]:
    """Unpickle a state dict safely onto the meta device; one-line ``MergeError`` on any problem."""
    with torch_archive(path) as archive:
        return archive.state_dict(stand_ins)


@contextlib.contextmanager
def torch_archive(path: Path) -> Iterator[TorchArchive]:
    """A torch.save file's archive, open while the block runs (its records located, nothing unpickled)."""
    # Unbuffered: the reads are few and exact (directory, one local header per record, the pickle); a
    # buffered stream would read 8 KiB after every seek, ~1 GB for the headers of 1024 rank files.
    source = byte_source(path)  # a local file (never a FIFO or device), or a store object's ranged GETs
    with contextlib.closing(source), source.stream() as stream:
        if stream.seek(0, io.SEEK_END) == 0:
            raise MergeError(path, "file is empty")
        yield TorchArchive(stream, path)


def read_at(stream: BinaryIO, length: int, offset: int) -> bytes:
    """Up to ``length`` bytes at ``offset``: one ``pread`` on a local file, a seek and a read otherwise."""
    if isinstance(stream, io.FileIO):
        return os.pread(stream.fileno(), length, offset)
    stream.seek(offset)
    return stream.read(length)


def load_meta_archive(stream: BinaryIO, path: Path, stand_ins: Mapping[str, type] | None = None) -> object:
    """What ``torch.load(stream, map_location="meta", weights_only=True)`` returns (``TorchArchive.unpickle``)."""
    return TorchArchive(stream, path).unpickle(stand_ins)


class TorchArchive:
    """A torch.save zip archive: its records by raw name and its pickle's bytes, read but not yet unpickled."""

    def __init__(self, stream: BinaryIO, path: Path):
        self.stream, self.path = stream, path
        stream.seek(0)
        if stream.read(len(_ZIP_START)) != _ZIP_START:
            raise MergeError(
                path,
                "not a torch.save zip archive: it does not start with a zip record (truncated, corrupt, or the pre-1.6 legacy format, which is not read)",
            )
        self.records, self.directory_start = _stored_records(stream, path)
        self.prefix = next(iter(self.records)).split(b"/", 1)[0]  # torch names every record <archive>/...
        outside = next((name for name in self.records if not name.startswith(self.prefix + b"/")), None)
        if outside is not None:
            raise MergeError(path, f"record {_shown(outside)} is outside the archive folder {_shown(self.prefix)}/")
        self.offsets = {name: _data_offset(stream, info, path) for name, info in self.records.items()}
        _read_alike_by_torch(stream, path, self)
        if self.record("constants.pkl") is not None:
            raise MergeError(
                path, "a TorchScript archive (it holds constants.pkl): torch.load(weights_only=True) refuses it too"
            )
        alignment = self.record(".storage_alignment")
        if alignment is not None:
            try:
                int(self.read(alignment, limit=64))  # torch.load's own parse
            except ValueError:
                raise MergeError(
                    path, "its .storage_alignment record is not a number: torch.load refuses it too"
                ) from None
        byteorder = self.record("byteorder")
        if byteorder is not None:
            order = self.read(byteorder, limit=16)
            if order != b"little":
                raise MergeError(
                    path,
                    f"records are stored {order.decode(errors='replace')!r}-endian; only little-endian checkpoints can be merged (re-save it on a little-endian machine)",
                )
        pickled = self.record("data.pkl")
        if pickled is None:
            raise MergeError(path, "not a torch.save archive (no data.pkl record)")
        self.pickled = self.read(pickled)

    def record(self, name: str) -> zipfile.ZipInfo | None:
        """The record ``<archive>/<name>``, its name compared as bytes (UTF-8), as torch's reader compares it."""
        try:
            return self.records.get(self.prefix + b"/" + name.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate: torch cannot name it either
            return None

    def read(self, info: zipfile.ZipInfo, limit: int | None = None) -> bytes:
        if limit is not None and info.file_size > limit:
            raise MergeError(
                self.path, f"record {_shown(info.orig_filename)} is {info.file_size} bytes, expected at most {limit}"
            )
        self.stream.seek(self.offsets[_raw_name(info)])
        return self.stream.read(info.file_size)

    def storage_offset(self, key: str, numel: int, dtype: torch.dtype) -> int:
        """Where storage ``data/<key>`` starts in the file, once its record is found to hold ``numel`` x ``dtype``."""
        nbytes = numel * dtype.itemsize
        record = self.record(f"data/{key}")
        if record is None:
            raise MergeError(
                self.path, f"the pickle refers to storage data/{_shown(key)}, which the archive does not hold"
            )
        if record.file_size != nbytes:
            raise MergeError(
                self.path,
                f"storage record data/{key} holds {record.file_size} bytes but the pickle declares {numel} x {dtype} = {nbytes} bytes",
            )
        return self.offsets[_raw_name(record)]

    def state_dict(self, stand_ins: Mapping[str, type] | None = None) -> dict[str, object]:
        state = self.unpickle(stand_ins)
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise MergeError(self.path, f"expected a state dict of name -> tensor, found {type(state).__name__}")
        return state

    def unpickle(self, stand_ins: Mapping[str, type] | None = None) -> object:
        """What ``torch.load(map_location="meta", weights_only=True)`` returns, where the file is one a
        state dict's pickle can be (``state_dict_pickle``), with each storage's ``_checkpoint_offset``
        (data start) read from its record's local header, its declared size (``_checkpoint_nbytes``)
        checked against the record, and its record key (``_checkpoint_key``).

        ``stand_ins``: full global name -> the inert class to build in its place, for this load only
        (a reader's stand-ins for its trainer's plain-data classes)."""
        path = self.path
        storages: dict[str, torch.storage.TypedStorage] = {}

        def persistent_load(saved_id: tuple) -> torch.storage.TypedStorage:
            kind, storage_type, key, location, numel = saved_id if len(saved_id) == 5 else (None,) * 5
            if (
                kind != "storage"
                or type(storage_type) is not torch.serialization.StorageType
                or not (type(key) is str and len(key) <= 64)
                or not (type(location) is str and len(location) <= 64)
                or type(numel) is not int
                or numel < 0
            ):
                kinds = ", ".join(type(v).__name__ for v in saved_id[:6])
                raise MergeError(
                    path,
                    f"malformed storage reference ({kinds}): expected ('storage', a storage type, key, location, element count)",
                )
            dtype = storage_type.dtype
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

        try:
            return StateDictUnpickler(self.pickled, persistent_load, stand_ins).load()
        except PickleRefused as exc:
            raise MergeError(path, f"refused to unpickle (weights_only=True): {exc}") from None


def _shown(name: bytes | str) -> str:
    """A record name or storage key for a message: printable, and cut short."""
    text = name.decode("utf-8", "backslashreplace") if isinstance(name, bytes) else name
    return text if len(text) <= 80 else text[:80] + "..."


def _raw_name(info: zipfile.ZipInfo) -> bytes:
    """A record's name as its bytes in the archive (zipfile decodes names without the UTF-8 flag as cp437)."""
    return info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")


def _stored_records(stream: BinaryIO, path: Path) -> tuple[dict[bytes, zipfile.ZipInfo], int]:
    """Every record by raw name, from the central directory (and where that starts); each must be
    STORED, unencrypted, once."""
    try:
        directory = zipfile.ZipFile(stream)
        infos = directory.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise MergeError(path, f"not a readable zip archive, truncated or corrupt ({first_line(exc)[:160]})") from None
    if not infos:
        raise MergeError(path, "empty zip archive: not a torch.save file")
    records: dict[bytes, zipfile.ZipInfo] = {}
    for info in infos:
        name = _raw_name(info)
        if name in records:
            raise MergeError(path, f"record {_shown(name)} appears twice in the zip directory")
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
            what = "encrypted" if info.flag_bits & 0x1 else f"compressed record (method {info.compress_type})"
            raise MergeError(
                path,
                f"{what}: {_shown(name)}; torch.save writes records uncompressed, so this file was re-packed by a zip tool (re-save it with torch.save)",
            )
        records[name] = info
    return records, directory.start_dir


def _read_alike_by_torch(stream: BinaryIO, path: Path, archive: TorchArchive) -> None:
    """torch.load's own zip reader must accept the archive and find every record where ``zipfile`` did.

    The two parsers differ where a file is crafted to tell them apart: zipfile honours data before
    the archive (``concat``) and decodes names without the UTF-8 flag as cp437; torch's reader takes
    offsets as they are, compares names as bytes and wants a ``version`` record it supports."""
    try:
        stream.seek(0)  # torch's reader takes the stream's position as the archive's start
        reader = torch._C.PyTorchFileReader(stream)
        names = reader.get_all_records()
        found = [(reader.get_record_offset(name), reader.get_record_size(name)) for name in names]
    except Exception as exc:  # torch's reader refuses in its own words (a RuntimeError, a UnicodeDecodeError)
        raise MergeError(path, f"torch.load's zip reader refuses it: {first_line(exc)[:160]}") from None
    start = len(archive.prefix) + 1
    ours = [(archive.offsets[name], info.file_size) for name, info in archive.records.items()]
    if [name.encode("utf-8") for name in names] != [name[start:] for name in archive.records] or found != ours:
        raise MergeError(
            path,
            "torch.load would read other records than its zip directory names (data before the archive, or names that decode two ways): a crafted or damaged archive",
        )


def _data_offset(stream: BinaryIO, info: zipfile.ZipInfo, path: Path) -> int:
    """Where a record's bytes start: after its local header, whose name and extra field lengths
    may differ from the central directory's (zip tools pad and reorder as they like)."""
    name = _raw_name(info)
    end = stream.seek(0, io.SEEK_END)
    stream.seek(info.header_offset)
    header = stream.read(_LOCAL_HEADER.size + len(name))  # one read: a rank file has a hundred records
    if len(header) < _LOCAL_HEADER.size or not header.startswith(_ZIP_START):
        raise MergeError(path, f"record {_shown(name)}: no local zip header at byte {info.header_offset}")
    fields = _LOCAL_HEADER.unpack(header[: _LOCAL_HEADER.size])
    name_length, extra_length = fields[10], fields[11]
    if header[_LOCAL_HEADER.size :] != name or name_length != len(name):
        raise MergeError(path, f"record {_shown(name)}: local header names a different record")
    offset = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    if info.file_size != info.compress_size or offset + info.file_size > end:
        raise MergeError(
            path,
            f"record {_shown(name)}: data ends at byte {offset + info.compress_size} but the file has {end} bytes (truncated)",
        )
    return offset


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
