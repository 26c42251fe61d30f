"""Plan the merge of a Megatron-Core role folder from checkpoint metadata alone.

verl writes the model either as Megatron-Core shards (a torch.distributed.checkpoint folder, backend
``torch_dist``) or, with its bridge (the default), as Hugging Face safetensors. Where each lives
depends on the layout schema (``find_layout``):

    v2 (verl 0.9): <role>/ckpt_contents.json says where; model/dist_ckpt/, model/huggingface/
    v1 (legacy):   <role>/dist_ckpt/, <role>/huggingface/

The DCP ``.metadata`` gives every tensor's global shape and dtype and, per saved chunk, which
``.distcp`` file holds it at which offset. Each chunk is a ``torch.save`` archive whose pickle we read
onto the meta device to find where its raw bytes start. That is enough to describe every HF tensor
as file ranges: no Megatron model, no process group, no GPU, and no tensor data read at planning time.
HF safetensors weights are planned by ``formats/hf.py``.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from merge_pipeline.errors import MergeError
from merge_pipeline.formats.hf import ADAPTER_DIR, plan_hf_safetensors
from merge_pipeline.formats.megatron_names import KeyMapper, OutputSpec, Piece, model_shape
from merge_pipeline.formats.torch_files import load_meta_archive, stored_tensor
from merge_pipeline.hf.config import load_model_config
from merge_pipeline.hf.lora import ADAPTER_CONFIG
from merge_pipeline.json_files import read_json_object
from merge_pipeline.options import MergeOptions
from merge_pipeline.plan import ByteRun, CheckpointPlan, Computed, PlannedTensor, SourceFile, StoredBytes, dtype_name

MANIFEST = "ckpt_contents.json"
VALUE_ROLES = ("critic", "reward")
DIST_FORMAT, HF_FORMAT = "megatron_dist_checkpoint", "huggingface"
# Tensors that are training state, not model weights.
_NOT_MODEL = re.compile(r"^optimizer\.|\._extra_state")


@dataclass(frozen=True)
class MegatronLayout:
    """Where one role folder keeps its model weights and its Hugging Face files."""

    schema: str  # "v2" (ckpt_contents.json), "v2 without ckpt_contents.json", "v1"
    weights: str | None  # DIST_FORMAT or HF_FORMAT as the manifest states it; None: probe dist_dir, then hf_dir
    dist_dir: Path  # Megatron-Core shards, when weights are (or may be) there
    hf_dir: Path  # config, tokenizer; the weights too when they are HF files
    role: str  # as the manifest records it, else the role folder's name

    def describe(self) -> dict:
        return {
            "layout_schema": self.schema,
            "model_weights": str(self.dist_dir if self.weights == DIST_FORMAT else self.hf_dir),
        }


def is_megatron_dir(role_dir: Path) -> bool:
    """A folder verl's Megatron checkpoint manager wrote, in any layout schema."""
    v2 = (
        (role_dir / MANIFEST).is_file()
        or (role_dir / "model" / "dist_ckpt").is_dir()
        or (role_dir / "model" / "huggingface").is_dir()
    )
    return v2 or (role_dir / "dist_ckpt").is_dir() or any((role_dir / "huggingface").glob("*.safetensors"))


def find_layout(role_dir: Path) -> MegatronLayout:
    """Read ``ckpt_contents.json`` when present; otherwise recognise v2 by its ``model/`` folder."""
    manifest = role_dir / MANIFEST
    if manifest.is_file():
        return _layout_from_manifest(role_dir, manifest)
    if (role_dir / "model" / "dist_ckpt").is_dir() or (role_dir / "model" / "huggingface").is_dir():
        return MegatronLayout(
            "v2 without ckpt_contents.json",
            None,
            role_dir / "model" / "dist_ckpt",
            role_dir / "model" / "huggingface",
            role_dir.name,
        )
    return MegatronLayout("v1", None, role_dir / "dist_ckpt", role_dir / "huggingface", role_dir.name)


def _layout_from_manifest(role_dir: Path, manifest: Path) -> MegatronLayout:
    data = read_json_object(manifest)
    if data.get("schema_version") != 2:
        raise MergeError(
            manifest, f"schema_version {data.get('schema_version')!r}: only verl's layout schema 2 is known"
        )
    contents = data.get("contents")
    model = contents.get("model") if isinstance(contents, dict) else None
    if not isinstance(model, dict):
        raise MergeError(
            manifest,
            f"no contents.model entry: this checkpoint saved no model weights (save_contents {data.get('save_contents')})",
        )
    weights = model.get("format")
    if weights not in (DIST_FORMAT, HF_FORMAT):
        raise MergeError(manifest, f"contents.model.format {weights!r} is not {DIST_FORMAT!r} or {HF_FORMAT!r}")
    model_dir = _manifest_path(role_dir, manifest, "model", model)
    hf_config = contents.get("hf_config")
    if weights == HF_FORMAT:
        hf_dir = model_dir
    elif isinstance(hf_config, dict):
        hf_dir = _manifest_path(role_dir, manifest, "hf_config", hf_config)
    else:  # shards only, no HF export: there may be no config at all (then --hf_model_path)
        hf_dir = role_dir / "model" / "huggingface"
    role = data.get("role") if isinstance(data.get("role"), str) else role_dir.name
    return MegatronLayout(
        "v2", weights, model_dir if weights == DIST_FORMAT else role_dir / "model" / "dist_ckpt", hf_dir, role
    )


def _manifest_path(role_dir: Path, manifest: Path, name: str, entry: dict) -> Path:
    relative = entry.get("path")
    if not isinstance(relative, str) or not relative or Path(relative).is_absolute() or ".." in Path(relative).parts:
        raise MergeError(manifest, f"contents.{name}.path {relative!r} is not a folder inside the checkpoint")
    return role_dir / relative


def plan_megatron(
    role_dir: Path,
    *,
    is_value_model: bool | None,
    tie_word_embedding: bool | None,
    trust_remote_code: bool,
    hf_model_path: str | Path | None = None,
) -> CheckpointPlan:
    """Describe every HF tensor of a Megatron role folder; ``MergeError`` naming the file on bad input.

    ``is_value_model`` / ``tie_word_embedding``: ``None`` means decide from the checkpoint
    (``output_layer`` of one row) and from config.json (``tie_word_embeddings``).
    ``trust_remote_code`` lets transformers read a remote-code config; ``hf_model_path`` is the
    original model folder, for the config when the checkpoint has none.
    """
    role_dir = Path(role_dir)
    layout = find_layout(role_dir)
    if is_value_model is None and layout.role in VALUE_ROLES:
        is_value_model = True  # as verl decides: its critic and reward roles are value models
    dist_dir = layout.dist_dir
    # An empty folder is normal: verl creates model/dist_ckpt/ even when the bridge saved HF files.
    checkpoint = _read_dist_checkpoint(dist_dir) if layout.weights != HF_FORMAT and _holds_files(dist_dir) else None
    stored = _model_tensors(checkpoint, dist_dir / ".metadata") if checkpoint else {}
    _refuse_unexported_adapter(role_dir, layout, stored)
    if not stored:
        if layout.weights == DIST_FORMAT:
            raise MergeError(dist_dir, f"{MANIFEST} says the model weights are here, but it holds no model tensors")
        # The bridge's HF files (verl's default); any dist checkpoint holds optimizer and RNG state only.
        return plan_hf_safetensors(
            role_dir,
            layout.hf_dir,
            is_value_model=is_value_model,
            hf_model_path=hf_model_path,
            layout=layout.describe(),
            backend="megatron",
        )
    model_config = load_model_config(
        layout.hf_dir, trust_remote_code=trust_remote_code, role_dir=role_dir, hf_model_path=hf_model_path
    )
    return _plan_dist_checkpoint(
        role_dir,
        layout,
        checkpoint,
        stored,
        model_config.raw,
        model_config.path,
        is_value_model,
        model_config.tie_word_embeddings if tie_word_embedding is None else tie_word_embedding,
    )


# Megatron LoRA parameters: Megatron-Bridge's ``.adapter.linear_in/out``, or ``lora_`` names.
_ADAPTER_KEY = re.compile(r"\.adapter\.|(^|\.)lora_")


def _refuse_unexported_adapter(role_dir: Path, layout: MegatronLayout, stored: dict) -> None:
    """A LoRA adapter kept only as Megatron shards cannot be converted exactly: the shards do not
    record lora_alpha (the scale) nor which HF modules a fused projection's adapter maps to."""
    if (layout.hf_dir / ADAPTER_DIR / ADAPTER_CONFIG).is_file():
        return
    where = None
    if (role_dir / "adapter_checkpoint").is_dir():
        where = role_dir / "adapter_checkpoint"
    elif any(_ADAPTER_KEY.search(key) for key in stored) or (
        layout.weights == HF_FORMAT and _manifest_says_peft(role_dir)
    ):
        where = layout.dist_dir
    if where is not None:
        raise MergeError(
            where,
            f"holds a LoRA adapter only as Megatron shards and there is no PEFT export in {layout.hf_dir.relative_to(role_dir)}/{ADAPTER_DIR}/: lora_alpha and the target modules are not recorded, so it cannot be converted exactly (export it with verl's bridge, or merge a checkpoint saved with it)",
        )


def _manifest_says_peft(role_dir: Path) -> bool:
    backend = read_json_object(role_dir / MANIFEST).get("backend")
    return isinstance(backend, dict) and backend.get("peft") is True


def _holds_files(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def _plan_dist_checkpoint(
    role_dir: Path,
    layout: MegatronLayout,
    checkpoint: _DistCheckpoint,
    stored: dict[str, TensorStorageMetadata],
    config: dict,
    config_path: Path,
    is_value_model: bool | None,
    tied: bool,
) -> CheckpointPlan:
    dist_dir = layout.dist_dir
    metadata_path = dist_dir / ".metadata"
    shapes = {k: tuple(v.size) for k, v in stored.items()}
    lm = "language_model." if "text_config" in config else ""
    value_model = _decide_value_model(shapes.get(f"{lm}output_layer.weight"), is_value_model, metadata_path)
    if not value_model and not tied and f"{lm}output_layer.weight" not in shapes:
        raise MergeError(
            metadata_path,
            f"no {lm}output_layer.weight and {config_path.name} does not tie word embeddings (pass --tie-word-embedding if they are tied)",
        )
    try:
        specs = KeyMapper(
            shapes, model_shape(config, config_path, value_model=value_model), config_path, metadata_path
        ).outputs()
    except MergeError as exc:
        if checkpoint.key_prefix and exc.path == metadata_path:  # name the layout the keys came from
            raise MergeError(exc.path, f"Megatron-FSDP checkpoint (one DCP of DTensors): {exc.problem}") from None
        raise

    files: dict[str, SourceFile] = {}
    try:
        tensors = {
            key: _locate(dist_dir, key, stored[key], checkpoint, files)
            for key in sorted({p.key for s in specs for p in s.pieces})
        }
        _check_no_shared_bytes(tensors.values(), dist_dir / ".metadata")
        planned = [_planned(spec, tensors) for spec in specs]
        if value_model and f"{lm}output_layer.bias" not in shapes:
            planned.append(_zero_score_bias(tensors[f"{lm}output_layer.weight"].dtype))
    except BaseException:
        for f in files.values():
            f.close()
        raise
    planned.sort(key=lambda t: _natural_key(t.name))
    facts = {**layout.describe(), **_layout(role_dir, checkpoint, tensors.values(), files, tied)}
    return CheckpointPlan(
        "megatron", role_dir, layout.hf_dir, planned, list(files.values()), is_value_model=value_model, layout=facts
    )


# ---- metadata -------------------------------------------------------------------------------------


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

    def find_class(self, module: str, name: str) -> object:
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}")


@dataclass(frozen=True)
class _DistCheckpoint:
    metadata: Metadata
    backend: str  # for inspect and the manifest
    key_prefix: str  # in front of every model key in the DCP (Megatron-FSDP nests them under "model")


# Megatron-FSDP saves the model state dict under "model" with plain torch DCP (no metadata.json),
# beside the optimizer ("optimizer.") and RNG state ("rng_state.") in the same checkpoint.
_MEGATRON_FSDP_PREFIX = "model."


def _read_dist_checkpoint(dist_dir: Path) -> _DistCheckpoint:
    if not (dist_dir / "metadata.json").is_file() and (dist_dir / ".metadata").is_file():
        metadata = read_dcp_metadata(dist_dir / ".metadata")
        if any(key.startswith(_MEGATRON_FSDP_PREFIX) for key in metadata.state_dict_metadata):
            return _DistCheckpoint(metadata, "megatron_fsdp (torch DCP of DTensors)", _MEGATRON_FSDP_PREFIX)
    _check_backend(dist_dir / "metadata.json")
    return _DistCheckpoint(read_dcp_metadata(dist_dir / ".metadata"), "torch_dist", "")


def _model_tensors(checkpoint: _DistCheckpoint, metadata_path: Path) -> dict[str, TensorStorageMetadata]:
    """Model weights only, by their Megatron names: not optimizer state, not ``_extra_state`` / RNG entries."""
    prefix = checkpoint.key_prefix
    stored = {
        k.removeprefix(prefix): v
        for k, v in checkpoint.metadata.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata) and not _NOT_MODEL.search(k)
    }
    for key, meta in stored.items():
        if not tuple(meta.size):
            raise MergeError(metadata_path, f"{prefix}{key}: a scalar tensor is not a model weight")
    return stored


def read_dcp_metadata(path: Path) -> Metadata:
    if not path.is_file():
        raise MergeError(path, "missing: a torch_dist checkpoint needs its .metadata file")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as exc:  # any unpickling failure means the same thing: not readable metadata
        raise MergeError(path, f"corrupt DCP metadata ({type(exc).__name__}: {exc})") from None
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


def _check_backend(path: Path) -> None:
    """megatron-core's metadata.json names the sharded backend; only torch_dist is a DCP folder."""
    if not path.is_file():
        raise MergeError(path, "missing: a Megatron dist checkpoint has a metadata.json naming its backend")
    backend = read_json_object(path).get("sharded_backend")
    if backend != "torch_dist":
        raise MergeError(
            path,
            f"sharded_backend is {backend!r}; only 'torch_dist' checkpoints can be read (re-save with the torch_dist backend)",
        )


def _decide_value_model(output_shape: tuple[int, ...] | None, requested: bool | None, metadata_path: Path) -> bool:
    one_row = output_shape is not None and output_shape[0] == 1
    if requested is None:
        return one_row
    if requested and not one_row:
        found = "no output_layer" if output_shape is None else f"output_layer.weight has {output_shape[0]} rows"
        raise MergeError(metadata_path, f"value model requested but {found}; a value head has one row")
    if not requested and one_row:
        raise MergeError(
            metadata_path,
            "output_layer.weight has one row (a value head) but the merge was told this is not a value model",
        )
    return requested


# ---- where each chunk's bytes are ----------------------------------------------------------------


@dataclass(frozen=True)
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: ByteRun  # the chunk's row-major bytes


@dataclass(frozen=True)
class _StoredTensor:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[_Chunk, ...]


class _FileRange(io.RawIOBase):
    """A read-only, seekable window onto part of an open file: one chunk's torch.save archive."""

    def __init__(self, file: SourceFile, offset: int, length: int):
        super().__init__()
        self.file, self.offset, self.length, self.position = file, offset, length, 0

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
            self.file.read_into(memoryview(buffer)[:n], self.offset + self.position)
        self.position += n
        return n


def _locate(
    dist_dir: Path, key: str, meta: TensorStorageMetadata, checkpoint: _DistCheckpoint, files: dict[str, SourceFile]
) -> _StoredTensor:
    metadata_path = dist_dir / ".metadata"
    metadata = checkpoint.metadata
    shape, dtype = tuple(meta.size), meta.properties.dtype
    _check_tiling(key, shape, meta.chunks, metadata_path)
    chunks = []
    for chunk in meta.chunks:
        info = metadata.storage_data.get(MetadataIndex(checkpoint.key_prefix + key, chunk.offsets))
        if info is None:
            raise MergeError(metadata_path, f"{key}: chunk at {tuple(chunk.offsets)} has no storage entry")
        if getattr(info, "transform_descriptors", None):
            raise MergeError(
                metadata_path,
                f"{key}: chunk stored with transforms {info.transform_descriptors} (compressed DCP is not supported)",
            )
        relative_path, offset, length = (getattr(info, name, None) for name in ("relative_path", "offset", "length"))
        path = _chunk_file(dist_dir, relative_path, key)
        if relative_path not in files:
            if not path.is_file():
                raise MergeError(path, f"missing: .metadata stores chunks of {key} in it")
            files[relative_path] = SourceFile(path)
        file = files[relative_path]
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise MergeError(
                metadata_path,
                f"{key}: chunk at {tuple(chunk.offsets)} has byte range offset {offset!r:.40}, length {length!r:.40}",
            )
        if offset + length > file.size:
            raise MergeError(
                file.path, f"{key}: chunk ends at byte {offset + length} but the file has {file.size} bytes (truncated)"
            )
        chunks.append(
            _Chunk(
                tuple(chunk.offsets),
                tuple(chunk.sizes),
                _chunk_bytes(file, offset, length, key, tuple(chunk.sizes), dtype),
            )
        )
    return _StoredTensor(key, shape, dtype, tuple(chunks))


def _chunk_file(dist_dir: Path, relative_path: object, key: str) -> Path:
    """The file .metadata names for a chunk; it must stay inside ``dist_ckpt/``, symlinks resolved."""
    metadata_path = dist_dir / ".metadata"
    if not isinstance(relative_path, str) or not relative_path or "\0" in relative_path:
        raise MergeError(metadata_path, f"{key}: chunk file name {relative_path!r:.80} is not a file name")
    relative = Path(relative_path)
    if relative.is_absolute() or ".." in relative.parts:
        raise MergeError(metadata_path, f"{key}: chunk file {relative_path!r} lies outside {dist_dir.name}/")
    path = dist_dir / relative
    if not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(dist_dir)):
        raise MergeError(path, f"{key}: chunk file is a symlink out of {dist_dir.name}/ (to {os.path.realpath(path)})")
    return path


def _check_no_shared_bytes(tensors: Iterable[_StoredTensor], metadata_path: Path) -> None:
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
        meta = load_meta_archive(io.BufferedReader(_FileRange(file, offset, length)), file.path)
    except MergeError as exc:
        raise MergeError(file.path, f"{key}: chunk at byte {offset}: {exc.problem}") from None
    if not isinstance(meta, torch.Tensor) or tuple(meta.shape) != sizes or meta.dtype != dtype:
        found = f"{tuple(meta.shape)} {meta.dtype}" if isinstance(meta, torch.Tensor) else type(meta).__name__
        raise MergeError(file.path, f"{key}: chunk at byte {offset} holds {found}, .metadata says {sizes} {dtype}")
    run = stored_tensor(file.path, key, meta, length).byte_run(file)
    if run is None:
        raise MergeError(file.path, f"{key}: chunk at byte {offset} is not stored contiguously")
    return ByteRun(file, offset + run.offset, run.length)


def _check_tiling(key: str, shape: tuple[int, ...], chunks: list, metadata_path: Path) -> None:
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
            shown = [tuple(v) if isinstance(v, tuple) else v for v in (offsets, sizes)]  # torch.Size prints long
            raise MergeError(
                metadata_path,
                f"{key}: chunk at {shown[0]!r:.80} of size {shown[1]!r:.80} is not a block of a tensor of shape {shape}",
            )
        offsets, sizes = tuple(offsets), tuple(sizes)
        if any(o < 0 or n < 0 or o + n > total for o, n, total in zip(offsets, sizes, shape)):
            raise MergeError(
                metadata_path, f"{key}: chunk at {offsets} of size {sizes} lies outside the tensor's shape {shape}"
            )
        boxes.append((offsets, sizes))
    boxes.sort()
    for i, (offsets, sizes) in enumerate(boxes):
        for other, other_sizes in boxes[i + 1 :]:
            if other[0] >= offsets[0] + sizes[0]:
                break  # sorted by dim-0 start: no later chunk reaches back into this one
            if all(min(a + n, b + m) > max(a, b) for a, n, b, m in zip(offsets, sizes, other, other_sizes)):
                raise MergeError(metadata_path, f"{key}: saved chunks overlap at {other}")
    if sum(math.prod(sizes) for _, sizes in boxes) != math.prod(shape):
        raise MergeError(metadata_path, f"{key}: saved chunks do not cover the whole tensor {shape}")


# ---- HF tensors as file ranges -------------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """The bytes one chunk contributes to a piece: rows ``rows`` (piece-relative), columns ``columns``."""

    rows: tuple[int, int]
    columns: tuple[slice, ...]  # over the dimensions after the row dimension
    run: ByteRun


def _parts(tensor: _StoredTensor, piece: Piece) -> list[_Part]:
    k = len(piece.index)
    lo, hi = piece.rows
    parts = []
    for chunk in tensor.chunks:
        if any(not chunk.offsets[d] <= piece.index[d] < chunk.offsets[d] + chunk.sizes[d] for d in range(k)):
            continue
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


def _planned(spec: OutputSpec, tensors: dict[str, _StoredTensor]) -> PlannedTensor:
    first = tensors[spec.pieces[0].key]
    trailing = first.shape[len(spec.pieces[0].index) + 1 :]
    shape = (sum(p.rows[1] - p.rows[0] for p in spec.pieces),) + trailing
    pieces = [(p, _parts(tensors[p.key], p)) for p in spec.pieces]
    whole_rows = all(
        s.start == 0 and s.stop == n for _, parts in pieces for part in parts for s, n in zip(part.columns, trailing)
    )
    if whole_rows:
        return PlannedTensor(
            spec.name,
            shape,
            first.dtype,
            StoredBytes(tuple(part.run for _, parts in pieces for part in parts), first.dtype),
        )
    return PlannedTensor(spec.name, shape, first.dtype, Computed(lambda: _assemble(shape, first.dtype, pieces)))


def _assemble(shape: tuple[int, ...], dtype: torch.dtype, pieces: list[tuple[Piece, list[_Part]]]) -> torch.Tensor:
    """Build a tensor whose rows are split by columns across chunks (row-parallel layers)."""
    out = torch.empty(shape, dtype=dtype)
    row = 0
    for piece, parts in pieces:
        for part in parts:
            rows = part.rows[1] - part.rows[0]
            buffer = bytearray(part.run.length)
            part.run.file.read_into(memoryview(buffer), part.run.offset)
            block = torch.frombuffer(buffer, dtype=dtype).view(rows, *(s.stop - s.start for s in part.columns))
            out[(slice(row + part.rows[0], row + part.rows[1]), *part.columns)] = block
        row += piece.rows[1] - piece.rows[0]
    return out


def _zero_score_bias(dtype: torch.dtype) -> PlannedTensor:
    # verl's value head is a bias-free Linear; HF's token-classification ``score`` has a bias, and a
    # zero bias computes exactly what the trained head computed.
    return PlannedTensor("score.bias", (1,), dtype, Computed(lambda: torch.zeros(1, dtype=dtype)))


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _layout(
    role_dir: Path,
    checkpoint: _DistCheckpoint,
    tensors: Iterable[_StoredTensor],
    files: dict[str, SourceFile],
    tied: bool,
) -> dict:
    """Facts for ``inspect`` and the manifest (language model only); parallel sizes from
    transformer_config.json when present."""
    tensors = [t for t in tensors if not t.key.startswith("vision_model.")]
    parallel = {}
    transformer_config = role_dir / "transformer_config.json"
    if transformer_config.is_file():
        settings = read_json_object(transformer_config)
        names = {
            "tp": "tensor_model_parallel_size",
            "pp": "pipeline_model_parallel_size",
            "ep": "expert_model_parallel_size",
            "vpp": "virtual_pipeline_model_parallel_size",
        }
        parallel = {short: settings.get(long) for short, long in names.items()}
    layers = {int(m[1]) for t in tensors for m in [re.search(r"decoder\.layers\.(\d+)\.", t.key)] if m}
    stacked = [t.shape[0] for t in tensors if re.search(r"(^|\.)decoder\.layers\.[a-z]", t.key)]
    return {
        "sharded_backend": checkpoint.backend,
        **parallel,
        "num_layers": max(stacked + [max(layers) + 1 if layers else 0]),
        "layer_keys": "per-layer" if layers else "stacked",
        "dtypes": sorted({dtype_name(t.dtype) for t in tensors}),
        "stored_tensors": len(tensors),
        "chunks": sum(len(t.chunks) for t in tensors),
        "files": len(files),
        "tie_word_embeddings": tied,
    }


class _MegatronReader:
    name = "megatron"
    looks_for = "a Megatron checkpoint (ckpt_contents.json, model/dist_ckpt/, model/huggingface/, or legacy dist_ckpt/)"

    def detect(self, role_dir: Path) -> bool:
        return is_megatron_dir(role_dir)

    def plan(self, role_dir: Path, options: MergeOptions) -> CheckpointPlan:
        return plan_megatron(
            role_dir,
            is_value_model=options.is_value_model or None,
            tie_word_embedding=options.tie_word_embedding or None,
            trust_remote_code=options.trust_remote_code,
            hf_model_path=options.hf_model_path,
        )


READER = _MegatronReader()
