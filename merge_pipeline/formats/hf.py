"""Plan a role folder whose weights are already Hugging Face safetensors in ``huggingface/``.

verl's Megatron default saves the model this way (``dist_ckpt/`` then holds only optimizer and RNG
state); the NeMo-Automodel engine saves consolidated HF safetensors in ``<role>/model/``; the base
model of a LoRA-only checkpoint is an HF folder too. Nothing needs converting: each tensor is one
byte range of a safetensors file, found by reading the file headers only. The headers and the index are checked, since a bad one would
otherwise become a bad output.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from merge_pipeline.engine.plan import ByteRun, CheckpointPlan, PlannedTensor, SourceFile, StoredBytes
from merge_pipeline.engine.safetensors_writer import SAFETENSORS_DTYPES
from merge_pipeline.errors import MergeError
from merge_pipeline.json_files import read_json_object

INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# The safetensors format caps the header at 100 MB; a larger length field means a damaged file.
_MAX_HEADER = 100_000_000
_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def plan_hf_safetensors(role_dir: Path, *, is_value_model: bool | None = None, weights_dir: Path | None = None, backend: str = "megatron") -> CheckpointPlan:
    """``weights_dir``: where the weights and config are (default ``<role_dir>/huggingface``)."""
    role_dir = Path(role_dir)
    hf_dir = weights_dir or role_dir / "huggingface"
    if not has_hf_weights(hf_dir):
        raise MergeError(hf_dir, f"no model weights: no model tensors in {role_dir.name}/dist_ckpt and no {SINGLE_FILE} or {INDEX} here")
    planned, files = read_hf_weights(hf_dir)
    names = {t.name for t in planned}
    value_model = "score.weight" in names
    if is_value_model and not value_model:
        for f in files:
            f.close()
        raise MergeError(hf_dir, "value model requested but the weights have no score.weight")
    layout = {
        "weights": "huggingface safetensors",
        "files": len(files),
        "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in planned}),
    }
    return CheckpointPlan(backend, role_dir, hf_dir, planned, files, is_value_model=value_model, layout=layout)


def has_hf_weights(hf_dir: Path) -> bool:
    return (hf_dir / INDEX).is_file() or (hf_dir / SINGLE_FILE).is_file()


def read_hf_weights(hf_dir: Path) -> tuple[list[PlannedTensor], list[SourceFile]]:
    """Every tensor of an HF folder's safetensors weights (one file, or shards with an index), from the headers."""
    index_path = hf_dir / INDEX
    if index_path.is_file():
        weight_map = _read_index(index_path)
        filenames = sorted(set(weight_map.values()))
    elif (hf_dir / SINGLE_FILE).is_file():
        weight_map = None
        filenames = [SINGLE_FILE]
    else:
        raise MergeError(hf_dir, f"no model weights: no {SINGLE_FILE} or {INDEX} here")

    files: list[SourceFile] = []
    planned: list[PlannedTensor] = []
    try:
        for filename in filenames:
            path = hf_dir / filename
            if not path.is_file():
                raise MergeError(path, f"missing: {INDEX} lists tensors in it")
            file = SourceFile(path)
            files.append(file)
            planned.extend(_header_tensors(file))
        _check_names(planned, weight_map, index_path)
    except BaseException:
        for f in files:
            f.close()
        raise
    return planned, files


def _read_index(path: Path) -> dict[str, str]:
    weight_map = read_json_object(path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise MergeError(path, "no 'weight_map' of tensor name -> file name")
    for filename in set(weight_map.values()):
        if Path(filename).name != filename or not filename.endswith(".safetensors"):
            raise MergeError(path, f"weight_map names {filename!r}, not a .safetensors file in this folder")
    return weight_map


def _header_tensors(file: SourceFile) -> list[PlannedTensor]:
    """One ``PlannedTensor`` per header entry; the header is validated against the file size."""
    if file.size < 8:
        raise MergeError(file.path, f"{file.size} bytes is too short for a safetensors file")
    length_field = bytearray(8)
    file.read_into(memoryview(length_field), 0)
    (header_length,) = struct.unpack("<Q", length_field)
    if header_length > min(_MAX_HEADER, file.size - 8):
        raise MergeError(file.path, f"header length {header_length} does not fit the file ({file.size} bytes): truncated or not safetensors")
    raw = bytearray(header_length)
    file.read_into(memoryview(raw), 8)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MergeError(file.path, f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise MergeError(file.path, "header is not a JSON object")
    data_start = 8 + header_length
    data_size = file.size - data_start
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(file.path, name, entry, data_size)
        tensors.append((begin, PlannedTensor(name, shape, dtype, StoredBytes((ByteRun(file, data_start + begin, end - begin),), dtype))))
    tensors.sort(key=lambda item: item[0])
    previous_end = 0
    for begin, tensor in tensors:
        if begin < previous_end:
            raise MergeError(file.path, f"{tensor.name}: data overlaps the previous tensor")
        previous_end = begin + tensor.nbytes()
    return [t for _, t in tensors]


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


def _check_names(planned: list[PlannedTensor], weight_map: dict[str, str] | None, index_path: Path) -> None:
    where: dict[str, Path] = {}
    for tensor in planned:
        source = tensor.source.runs[0].file.path
        if tensor.name in where:
            raise MergeError(source, f"{tensor.name} is also in {where[tensor.name].name}")
        where[tensor.name] = source
        if weight_map is not None and weight_map.get(tensor.name) != source.name:
            listed = weight_map.get(tensor.name)
            raise MergeError(index_path, f"{tensor.name} is in {source.name} but the index says {listed or 'nothing'}")
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(where))
        if absent:
            raise MergeError(index_path, f"{len(absent)} tensor(s) listed but in no file: {', '.join(absent[:5])}")
