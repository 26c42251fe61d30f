"""Safetensors files read by their headers alone: every tensor one byte range, the header checked.

The hf reader (``formats/safetensors_folder/``) plans consolidated folders of them, the DCP reader
(``formats/dcp/hf_storage.py``) per-rank files of DCP shards saved in Hugging Face storage.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.hf.safetensors import MAX_HEADER_BYTES, METADATA_KEY, SAFETENSORS_DTYPES
from merge_pipeline.plan import ByteRun, PlannedTensor, SourceFile, StoredBytes

_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class _DuplicateName(Exception):
    pass


def _refuse_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """``json.loads`` keeps the last of two equal keys; in a header that would pick one of two tensors."""
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateName(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return found


def json_without_duplicates(raw: bytes | str, path: Path, what: str, entry: str) -> object:
    """``raw`` parsed; a name given twice is refused (the safetensors library refuses such a header: we must not pick one)."""
    try:
        return json.loads(raw, object_pairs_hook=_refuse_duplicates)
    except _DuplicateName as exc:
        raise MergeError(path, f"{what} names {entry} {exc.args[0]!r} twice") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise MergeError(path, f"{what} is not valid JSON ({exc})") from None


def header_entries(file: SourceFile) -> tuple[object, list[PlannedTensor]]:
    """The header's ``__metadata__`` (None when absent) and one ``PlannedTensor`` per tensor entry, in
    file order; the header is validated against the file size."""
    if file.size < 8:
        raise MergeError(file.path, f"{file.size} bytes is too short for a safetensors file")
    length_field = bytearray(8)
    file.read_into(memoryview(length_field), 0)
    (header_length,) = struct.unpack("<Q", length_field)
    if header_length > min(MAX_HEADER_BYTES, file.size - 8):  # past the library's cap: a damaged file
        raise MergeError(
            file.path,
            f"header length {header_length} does not fit the file ({file.size} bytes): truncated or not safetensors",
        )
    raw = bytearray(header_length)
    file.read_into(memoryview(raw), 8)
    header = json_without_duplicates(raw, file.path, "header", "the tensor")
    if not isinstance(header, dict):
        raise MergeError(file.path, "header is not a JSON object")
    data_start = 8 + header_length
    data_size = file.size - data_start
    tensors = []
    for name, entry in header.items():
        if name == METADATA_KEY:
            continue
        dtype, shape, begin, end = _entry(file.path, name, entry, data_size)
        tensors.append(
            (
                begin,
                PlannedTensor(
                    name, shape, dtype, StoredBytes((ByteRun(file, data_start + begin, end - begin),), dtype)
                ),
            )
        )
    tensors.sort(key=lambda item: item[0])
    previous_end = 0
    for begin, tensor in tensors:
        if begin < previous_end:
            raise MergeError(file.path, f"{tensor.name}: data overlaps the previous tensor")
        previous_end = begin + tensor.nbytes()
    return header.get(METADATA_KEY), [t for _, t in tensors]


def _entry(path: Path, name: str, entry: object, data_size: int):
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
        found = entry.get("dtype") if isinstance(entry, dict) else entry
        raise MergeError(path, f"{name}: unsupported or missing dtype {found!r}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise MergeError(path, f"{name}: invalid shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets):
        raise MergeError(path, f"{name}: invalid data_offsets {offsets!r}")
    dtype = _DTYPES[entry["dtype"]]
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise MergeError(path, f"{name}: data_offsets {offsets} lie outside the {data_size} data bytes (truncated?)")
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise MergeError(path, f"{name}: {end - begin} bytes for shape {shape} of {entry['dtype']}")
    return dtype, tuple(shape), begin, end
