"""torch.distributed.checkpoint (DCP) folders read from their metadata alone.

A DCP folder holds ``.metadata`` (a pickle: every tensor's global shape and dtype and, per saved chunk,
which ``.distcp`` file holds it at which byte range) and the ``.distcp`` files. Each chunk is a
``torch.save`` archive whose pickle we read onto the meta device to find where its raw bytes start.
That describes every tensor as file ranges with no process group and no tensor data read: the
Megatron-Core reader (``formats/megatron/reader.py``) and the plain DCP reader (``formats/dcp/reader.py``)
both plan from here, and ``check_tiling`` is the one check that saved pieces cover a tensor exactly once.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import pickle
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from merge_pipeline.errors import MergeError, shown
from merge_pipeline.files.inputs import read_capped
from merge_pipeline.formats.added_one import AddedOne
from merge_pipeline.formats.expert_matrices import ExpertMatrices, hf_shape
from merge_pipeline.formats.output_specs import OutputSpec, Piece
from merge_pipeline.formats.rotary_rows import RotaryRows
from merge_pipeline.formats.torch_files import load_meta_archive, stored_tensor
from merge_pipeline.plan import (
    READ_PIECE_BYTES,
    ByteRun,
    FileRange,
    PlannedTensor,
    SourceFile,
    StoredBytes,
    closed_on_failure,
)

METADATA = ".metadata"

# ---- metadata -------------------------------------------------------------------------------------


_ABSENT = object()


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` with only the classes torch writes there: a checkpoint file
    must never be able to run code (torch's own reader uses plain ``pickle.load``)."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.planner": {
            "SavePlan",
            "WriteItem",
            "WriteItemType",
            "TensorWriteData",
            "BytesIOWriteData",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "collections": {"OrderedDict"},
        "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id of a single-process save
    }

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.classes: dict[type, dict] = {}  # each class the pickle named -> its attributes before the load

    def find_class(self, module: str, name: str) -> object:
        if name in self._ALLOWED.get(module, ()):
            found = super().find_class(module, name)
            if not isinstance(found, type):  # BUILD could set a function's __defaults__: hand it a stand-in
                return lambda *args, call=found: call(*args)
            self.classes.setdefault(found, dict(vars(found)))
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}")

    def changed_classes(self) -> list[str]:
        """``Class.attribute`` for each attribute a BUILD on the class itself changed (``pickle`` sets a state
        tuple's second half with ``setattr``: torch's own reader refuses BUILD on anything but an instance),
        each put back as it was."""
        changed = []
        for cls, before in self.classes.items():
            after = dict(vars(cls))
            for attribute in sorted(before.keys() | after.keys()):
                if before.get(attribute, _ABSENT) is after.get(attribute, _ABSENT):
                    continue
                changed.append(f"{cls.__name__}.{attribute}")
                if attribute in before:
                    setattr(cls, attribute, before[attribute])
                else:
                    delattr(cls, attribute)
        return changed


# ``.metadata`` holds an entry per tensor and per chunk each rank saved: it scales with tensors x ranks,
# so its cap does too (the ``.distcp`` files beside it count the ranks). Unpickled, it takes ~10x its size.
_METADATA_BASE_BYTES = 64 * 2**20
_METADATA_BYTES_PER_FILE = 4 * 2**20


def read_dcp_metadata(path: Path) -> Metadata:
    if not path.is_file():
        raise MergeError(path, "missing: a torch_dist checkpoint needs its .metadata file")
    with os.scandir(path.parent) as entries:
        files = sum(1 for e in entries if e.name.endswith(".distcp"))
    cap = _METADATA_BASE_BYTES + _METADATA_BYTES_PER_FILE * files
    raw = read_capped(
        path, cap, f"is larger than {cap:,} bytes, more than DCP metadata for {files} .distcp files takes"
    )
    unpickler = _MetadataUnpickler(io.BytesIO(raw))
    try:
        metadata = unpickler.load()
    except Exception as exc:  # any unpickling failure means the same thing: not readable metadata
        raise MergeError(path, f"corrupt DCP metadata ({type(exc).__name__}: {exc})") from None
    finally:
        changed = unpickler.changed_classes()
    if changed:
        raise MergeError(path, f"corrupt DCP metadata: it sets {changed[0]} on the class itself, as no save does")
    if (
        not isinstance(metadata, Metadata)
        or not isinstance(metadata.state_dict_metadata, dict)
        or not isinstance(metadata.storage_data, dict)
    ):
        raise MergeError(
            path,
            f"corrupt DCP metadata: expected a torch.distributed.checkpoint Metadata, found {type(metadata).__name__}",
        )
    return metadata


# ---- where each chunk's bytes are ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DcpChunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: ByteRun  # the chunk's row-major bytes


@dataclass(frozen=True)
class DcpTensor:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[DcpChunk, ...]
    # index length -> index -> the chunks holding it, built on first use (chunks_at)
    _by_index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def chunks_at(self, index: tuple[int, ...]) -> Sequence[DcpChunk]:
        """The chunks holding element ``index`` of the leading dimensions (all of them for ``()``).

        Looked up, not searched: an output per layer (and expert) of a stacked Megatron tensor
        saved at TP x PP (x EP) would otherwise scan every chunk of the tensor, outputs x chunks.
        The table has an entry per index per chunk holding it, so it is no larger than that scan."""
        if not index:
            return self.chunks
        table = self._by_index.get(len(index))
        if table is None:
            table = self._by_index[len(index)] = {}
            for chunk in self.chunks:
                spans = (range(o, o + n) for o, n in zip(chunk.offsets[: len(index)], chunk.sizes))
                for at in itertools.product(*spans):
                    table.setdefault(at, []).append(chunk)
        return table.get(tuple(index), ())


def locate_tensors(
    dist_dir: Path,
    stored: dict[str, TensorStorageMetadata],
    metadata: Metadata,
    files: dict[str, SourceFile],
    key_prefix: str = "",
) -> dict[str, DcpTensor]:
    """Where each chunk of each tensor (``key`` stored as ``key_prefix + key``) lies; opens its files into ``files``."""
    places = {key: _chunk_places(dist_dir, key, meta, metadata, files, key_prefix) for key, meta in stored.items()}
    # The archives are read file by file, in file order: a folder of more rank files than descriptors
    # kept open (plan.MAX_OPEN_FILES) would otherwise re-open a file for every chunk.
    order = sorted((p.file_name, p.offset, key, i) for key, chunks in places.items() for i, p in enumerate(chunks))
    archives = ChunkArchives()
    runs: dict[str, list] = {key: [None] * len(chunks) for key, chunks in places.items()}
    for _, _, key, i in order:
        place = places[key][i]
        dtype = stored[key].properties.dtype
        runs[key][i] = archives.data(place.file, place.offset, place.length, key, place.sizes, dtype)
    del order  # ~100k entries at 1024 ranks: freed before the tensors are built
    # A scalar (Gemma 4's audio tower's clipping bounds) is read as one row of one element: its spec declares ().
    return {
        key: DcpTensor(
            key,
            tuple(stored[key].size) or (1,),
            stored[key].properties.dtype,
            tuple(DcpChunk(p.offsets or (0,), p.sizes or (1,), run) for p, run in zip(places.pop(key), runs.pop(key))),
        )
        for key in list(places)
    }


@dataclass(frozen=True, slots=True)  # one per chunk: ~100k at 1024 ranks
class _ChunkPlace:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file_name: str  # as .metadata names it
    file: SourceFile
    offset: int  # of the chunk's torch.save archive in ``file``
    length: int


def _chunk_places(
    dist_dir: Path,
    key: str,
    meta: TensorStorageMetadata,
    metadata: Metadata,
    files: dict[str, SourceFile],
    key_prefix: str,
) -> list[_ChunkPlace]:
    """Each chunk of ``key``: which archive in which file, checked against the tensor and the file."""
    metadata_path = dist_dir / METADATA
    check_tiling(key, tuple(meta.size), meta.chunks, metadata_path)
    places = []
    for chunk in meta.chunks:
        info = metadata.storage_data.get(MetadataIndex(key_prefix + key, chunk.offsets))
        if info is None:
            raise MergeError(metadata_path, f"{key}: chunk at {tuple(chunk.offsets)} has no storage entry")
        if getattr(info, "transform_descriptors", None):
            raise MergeError(
                metadata_path,
                f"{key}: chunk stored with transforms {info.transform_descriptors} (compressed DCP is not supported)",
            )
        relative_path, offset, length = (getattr(info, name, None) for name in ("relative_path", "offset", "length"))
        if not isinstance(relative_path, str) or relative_path not in files:  # each file's name checked once
            path = _chunk_file(dist_dir, relative_path, key)
            if not path.is_file():
                raise MergeError(path, f"missing: .metadata stores chunks of {key} in it")
            files[relative_path] = SourceFile(path)
        file = files[relative_path]
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise MergeError(
                metadata_path,
                f"{key}: chunk at {tuple(chunk.offsets)} has byte range offset {shown(offset)}, length {shown(length)}",
            )
        if offset + length > file.size:
            raise MergeError(
                file.path, f"{key}: chunk ends at byte {offset + length} but the file has {file.size} bytes (truncated)"
            )
        places.append(_ChunkPlace(chunk.offsets, chunk.sizes, relative_path, file, offset, length))
    return places


def _chunk_file(dist_dir: Path, relative_path: object, key: str) -> Path:
    """The file .metadata names for a chunk; it must stay inside ``dist_ckpt/``, symlinks resolved."""
    metadata_path = dist_dir / METADATA
    if not isinstance(relative_path, str) or not relative_path or "\0" in relative_path:
        raise MergeError(metadata_path, f"{key}: chunk file name {shown(relative_path)} is not a file name")
    relative = Path(relative_path)
    if relative.is_absolute() or ".." in relative.parts:
        raise MergeError(metadata_path, f"{key}: chunk file {relative_path!r} lies outside {dist_dir.name}/")
    path = dist_dir / relative
    if not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(dist_dir)):
        raise MergeError(path, f"{key}: chunk file is a symlink out of {dist_dir.name}/ (to {os.path.realpath(path)})")
    return path


def check_no_shared_bytes(tensors: Iterable[DcpTensor], metadata_path: Path) -> None:
    """Two chunks reading the same bytes of a file means corrupt metadata, not a model."""
    runs: dict[Path, list[tuple[int, int, str]]] = {}
    for tensor in tensors:
        for chunk in tensor.chunks:
            runs.setdefault(chunk.data.file.path, []).append(
                (chunk.data.offset, chunk.data.offset + chunk.data.length, tensor.key)
            )
    for path, ranges in runs.items():
        ranges.sort()
        for (_, end, key), (start, _, other) in zip(ranges, ranges[1:]):
            if start < end:
                raise MergeError(metadata_path, f"{key} and {other}: chunks share bytes {start}..{end} of {path.name}")


def _chunk_bytes(
    file: SourceFile, offset: int, length: int, key: str, sizes: tuple[int, ...], dtype: torch.dtype
) -> ByteRun:
    """Find the raw bytes inside one chunk's ``torch.save`` archive (reads its pickle only)."""
    try:
        meta = load_meta_archive(io.BufferedReader(FileRange(file, offset, length)), file.path)
    except MergeError as exc:
        raise MergeError(file.path, f"{key}: chunk at byte {offset}: {exc.problem}") from None
    if not isinstance(meta, torch.Tensor) or tuple(meta.shape) != sizes or meta.dtype != dtype:
        found = f"{tuple(meta.shape)} {meta.dtype}" if isinstance(meta, torch.Tensor) else type(meta).__name__
        raise MergeError(file.path, f"{key}: chunk at byte {offset} holds {found}, .metadata says {sizes} {dtype}")
    run = stored_tensor(file.path, key, meta, length).byte_run(file)
    if run is None:
        raise MergeError(file.path, f"{key}: chunk at byte {offset} is not stored contiguously")
    return ByteRun(file, offset + run.offset, run.length)


class ChunkArchives:
    """Where each chunk's raw bytes start in its ``torch.save`` archive, parsed once per kind of chunk.

    ``dcp.save`` writes every chunk as its own archive, so a folder saved by 1024 ranks holds ~1024
    archives per tensor; unpickling each took ~1 ms, minutes at that size. Archives of chunks of the
    same shape, dtype and length are the same bytes up to their data (records, pickle, the data's
    local header: only the data and what follows it differ). So one archive of each kind is parsed in
    full (``_chunk_bytes``) and every other one is read up to its data, one ``pread``, and must equal
    it byte for byte; one that differs is parsed in full, so no archive is trusted unread.
    """

    def __init__(self):
        self.kinds: dict[tuple, tuple[bytes, int]] = {}  # (dtype, sizes, length) -> (head, data's run)

    def data(self, file: SourceFile, offset: int, length: int, key: str, sizes: tuple, dtype: torch.dtype) -> ByteRun:
        kind = (dtype, sizes, length)
        known = self.kinds.get(kind)
        if known is not None:
            head, data_length = known
            found = bytearray(len(head))
            file.read_into(memoryview(found), offset)
            if found == head:
                return ByteRun(file, offset + len(head), data_length)
        run = _chunk_bytes(file, offset, length, key, sizes, dtype)
        if known is None:
            head = bytearray(run.offset - offset)
            file.read_into(memoryview(head), offset)
            self.kinds[kind] = (bytes(head), run.length)
        return run


def check_tiling(key: str, shape: tuple[int, ...], chunks: list, metadata_path: Path) -> None:
    """The chunks must cover the global tensor exactly once: each inside its bounds, no two
    overlapping (garbage would win), and their sizes adding up to the whole (no gap). Pairs are
    compared in a sweep along dim 0, so a crafted chunk list costs no more than a real one."""
    if not all(type(n) is int and n >= 0 for n in shape):
        raise MergeError(metadata_path, f"{key}: invalid shape {shape}")
    if not isinstance(chunks, list):
        raise MergeError(metadata_path, f"{key}: chunk list is a {type(chunks).__name__}")
    boxes = []
    for c in chunks:
        offsets, sizes = getattr(c, "offsets", None), getattr(c, "sizes", None)
        if not all(
            isinstance(v, tuple) and len(v) == len(shape) and all(type(i) is int for i in v) for v in (offsets, sizes)
        ):
            plain = [tuple(v) if isinstance(v, tuple) else v for v in (offsets, sizes)]  # torch.Size prints long
            raise MergeError(
                metadata_path,
                f"{key}: chunk at {shown(plain[0])} of size {shown(plain[1])} is not a block of a tensor of shape {shape}",
            )
        offsets, sizes = tuple(offsets), tuple(sizes)
        if any(o < 0 or n < 0 or o + n > total for o, n, total in zip(offsets, sizes, shape)):
            raise MergeError(
                metadata_path, f"{key}: chunk at {offsets} of size {sizes} lies outside the tensor's shape {shape}"
            )
        boxes.append((offsets, sizes))
    overlap = _overlapping(sorted(boxes), 0)
    if overlap is not None:
        raise MergeError(metadata_path, f"{key}: saved chunks overlap at {overlap}")
    if sum(math.prod(sizes) for _, sizes in boxes) != math.prod(shape):
        raise MergeError(metadata_path, f"{key}: saved chunks do not cover the whole tensor {shape}")


def _overlapping(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], dim: int) -> tuple[int, ...] | None:
    """The offsets of a box (of sorted boxes) that shares elements with another one, else None.

    Boxes of the same extent along ``dim`` can only meet on a later dimension, so they are compared
    there; boxes of different extents that overlap along ``dim`` are compared pairwise, in a sweep
    by start. A grid (a Megatron tensor: one chunk per layer x expert x TP block, thousands sharing a
    layer) then costs O(n log n), not a comparison of every two chunks of a layer."""
    if len(boxes) < 2:
        return None
    if dim == len(boxes[0][0]):  # the same non-empty extent along every dimension
        return boxes[1][0]
    extents: dict[tuple[int, int], list] = {}
    for box in boxes:
        extents.setdefault((box[0][dim], box[1][dim]), []).append(box)
    for (_, size), group in extents.items():
        overlap = _overlapping(group, dim + 1) if size else None
        if overlap is not None:
            return overlap
    spans = sorted(extents)
    for i, (start, size) in enumerate(spans):
        for other in spans[i + 1 :]:
            if other[0] >= start + size:
                break  # sorted by start: no later extent reaches back into this one
            for offsets, sizes in extents[start, size]:
                for other_offsets, other_sizes in extents[other]:
                    if all(
                        min(a + n, b + m) > max(a, b) for a, n, b, m in zip(offsets, sizes, other_offsets, other_sizes)
                    ):
                        return other_offsets
    return None


# ---- HF tensors as file ranges -------------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """The bytes one chunk contributes to a piece: rows ``rows`` (piece-relative), columns ``columns``."""

    rows: tuple[int, int]
    columns: tuple[slice, ...]  # over the dimensions after the row dimension
    run: ByteRun


def _parts(tensor: DcpTensor, piece: Piece) -> list[_Part]:
    k = len(piece.index)
    lo, hi = piece.rows
    parts = []
    for chunk in tensor.chunks_at(tuple(piece.index)):
        start, stop = max(lo, chunk.offsets[k]), min(hi, chunk.offsets[k] + chunk.sizes[k])
        if start >= stop:
            continue
        # In the chunk, dims before k are fixed and dims after k are the chunk's whole extent, so
        # the selected rows are one contiguous byte range.
        position = (
            [piece.index[d] - chunk.offsets[d] for d in range(k)]
            + [start - chunk.offsets[k]]
            + [0] * (len(tensor.shape) - k - 1)
        )
        element = _flat_index(position, chunk.sizes)
        row_elements = math.prod(chunk.sizes[k + 1 :])
        item = tensor.dtype.itemsize
        columns = tuple(
            slice(chunk.offsets[d], chunk.offsets[d] + chunk.sizes[d]) for d in range(k + 1, len(tensor.shape))
        )
        run = ByteRun(chunk.data.file, chunk.data.offset + element * item, (stop - start) * row_elements * item)
        parts.append(_Part((start - lo, stop - lo), columns, run))
    parts.sort(key=lambda p: (p.rows[0], tuple(s.start for s in p.columns)))
    return parts


def _flat_index(position: list[int], sizes: tuple[int, ...]) -> int:
    flat = 0
    for p, n in zip(position, sizes):
        flat = flat * n + p
    return flat


def plan_specs(
    dist_dir: Path,
    specs: list[OutputSpec],
    stored: dict[str, TensorStorageMetadata],
    metadata: Metadata,
    key_prefix: str = "",
) -> tuple[dict[str, DcpTensor], list[PlannedTensor], list[SourceFile]]:
    """Each output of ``specs`` as byte ranges into the chunks it reads, once every stored tensor they
    read (``stored``: by unprefixed name) is located and no two chunks share bytes. Returns the located
    tensors, the planned outputs and the files opened (all closed again if anything fails)."""
    opened: dict[str, SourceFile] = {}
    with closed_on_failure(opened.values()):
        read = sorted({p.key for spec in specs for p in spec.pieces})
        tensors = locate_tensors(dist_dir, {key: stored[key] for key in read}, metadata, opened, key_prefix)
        check_no_shared_bytes(tensors.values(), dist_dir / METADATA)
        planned = [plan_tensor(spec, tensors) for spec in specs]
    return tensors, planned, list(opened.values())


def plan_tensor(spec: OutputSpec, tensors: dict[str, DcpTensor]) -> PlannedTensor:
    first = tensors[spec.pieces[0].key]
    trailing = first.shape[len(spec.pieces[0].index) + 1 :]
    shape = (sum(p.rows[1] - p.rows[0] for p in spec.pieces),) + trailing
    pieces = [(p, _parts(tensors[p.key], p)) for p in spec.pieces]
    whole_rows = all(
        s.start == 0 and s.stop == n for _, parts in pieces for part in parts for s, n in zip(part.columns, trailing)
    )
    declared = shape if spec.shape is None else spec.shape  # both stream the row-major bytes of ``shape``
    if whole_rows:
        source = StoredBytes(tuple(part.run for _, parts in pieces for part in parts), first.dtype)
    else:
        source = _RowBlocks(shape, first.dtype, pieces)
    if spec.rotary_heads:
        source = RotaryRows(source, shape, first.dtype, spec.rotary_heads)
    if spec.add_one:
        source = AddedOne(source)
    if spec.experts:
        source = ExpertMatrices(source, shape, first.dtype, spec.experts, spec.interleave_halves, spec.transpose)
        declared = spec.shape or hf_shape(shape, spec.experts, spec.transpose)  # one matrix: its own shape
    return PlannedTensor(spec.name, declared, first.dtype, source)


class _RowBlocks:
    """A tensor whose rows are split by columns across chunks (row-parallel layers under TP).

    Streamed in blocks of whole rows, each filled from every chunk's slice of those rows, so memory
    stays at two blocks whatever the tensor's size.
    """

    block_bytes = READ_PIECE_BYTES

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pieces: list[tuple[Piece, list[_Part]]]):
        self.shape, self.dtype = shape, dtype
        self.parts: list[tuple[int, _Part]] = []  # (first output row of the part, part)
        row = 0
        for piece, parts in pieces:
            self.parts.extend((row + part.rows[0], part) for part in parts)
            row += piece.rows[1] - piece.rows[0]

    def byte_runs(self) -> None:
        return None

    def pieces(self) -> Iterator[torch.Tensor]:
        rows, trailing = self.shape[0], self.shape[1:]
        row_bytes = math.prod(trailing) * self.dtype.itemsize
        step = max(1, self.block_bytes // max(row_bytes, 1))
        block = torch.empty((min(step, rows), *trailing), dtype=self.dtype)
        scratch = torch.empty(block.numel() * self.dtype.itemsize, dtype=torch.uint8)
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            for first, part in self.parts:
                count = part.rows[1] - part.rows[0]
                lo, hi = max(start, first), min(stop, first + count)
                if lo >= hi:
                    continue
                widths = [s.stop - s.start for s in part.columns]
                part_row_bytes = math.prod(widths) * self.dtype.itemsize
                view = memoryview(scratch.numpy())[: (hi - lo) * part_row_bytes]
                part.run.file.read_into(view, part.run.offset + (lo - first) * part_row_bytes)
                rows_read = torch.frombuffer(view, dtype=self.dtype).view(hi - lo, *widths)
                block[(slice(lo - start, hi - start), *part.columns)] = rows_read
            yield block[: stop - start].reshape(-1)
