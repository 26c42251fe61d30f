"""DCP saved in Hugging Face storage and not consolidated: each rank's DTensor shards as safetensors.

torch's ``HuggingFaceStorageWriter(save_distributed=True)`` writes, per rank r (1-based) and output
file k of N, ``shard-<r>-model-<k>-of-<N>.safetensors``: plain safetensors of the rank's local pieces
under their HF names, whose ``__metadata__`` records ``DCP_SHARDING_INFO`` (JSON: per name, the
piece's ``saved_offsets`` in the full tensor). No ``.metadata`` and no global shape is written: the
full shape is where the pieces end, and ``check_tiling`` proves they cover it exactly once (a lost
last rank shrinks it: the merge's check against config.json's architecture refuses that).

    NeMo-Automodel (``model_save_format: safetensors``, sharded)   <checkpoint>/model/
    torchtitan's ``last_save_in_hf`` before its consolidation ran  step-N/sharded/

The consolidated form (an index and ``model-*.safetensors``) is an HF folder (``--backend hf``). The
pieces are DCP chunks, so they are planned with the DCP reader's machinery (``formats/dcp_files.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from merge_pipeline.errors import MergeError
from merge_pipeline.formats.dcp_files import DcpChunk, DcpTensor, check_tiling, plan_tensor
from merge_pipeline.formats.output_specs import whole
from merge_pipeline.formats.safetensors_files import header_entries, json_without_duplicates
from merge_pipeline.plan import CheckpointPlan, SourceFile, closed_on_failure

SHARD_FILE = re.compile(r"shard-\d{5,}-model-\d{5,}-of-\d{5,}\.safetensors")  # torch's SHARDED_FILE_NAME
SHARDING_INFO = "DCP_SHARDING_INFO"  # torch's _hf_utils.CUSTOM_METADATA_KEY
SAVED_OFFSETS = "saved_offsets"
# Where the writers put the per-rank files inside the folder a user points at.
# (NeMo-RL's Automodel-based policy: NeMo-Automodel's model/ inside its policy/weights/).
_PLACES = ("model", "sharded", "weights/model")
# NeMo-Automodel writes the model's config.json beside its shards in this folder (its ConsolidatedHFAddon).
_AUTOMODEL_METADATA = ".hf_metadata"


def shard_files(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if SHARD_FILE.fullmatch(p.name) and p.is_file())
    except OSError:
        return []


def find_hf_storage_dir(role_dir: Path) -> Path | None:
    """The folder of per-rank HF-storage files: ``role_dir`` itself, or NeMo-Automodel's / torchtitan's place."""
    return next((d for d in (role_dir, *(role_dir / p for p in _PLACES)) if shard_files(d)), None)


def plan_hf_storage(role_dir: Path, shards_dir: Path) -> CheckpointPlan:
    """Every full tensor of the per-rank files as byte ranges of its pieces; ``MergeError`` on bad input."""
    files: list[SourceFile] = []
    with closed_on_failure(files):
        tensors = _full_tensors(shards_dir, files)
        planned = [plan_tensor(whole(key, key, t.shape[0]), tensors) for key, t in sorted(tensors.items())]
    return CheckpointPlan(
        "dcp",
        role_dir,
        next(
            (d for d in (shards_dir, shards_dir / _AUTOMODEL_METADATA, role_dir) if (d / "config.json").is_file()),
            role_dir / "huggingface",
        ),
        planned,
        files,
        layout={
            "dcp_source": "DCP in Hugging Face storage (HuggingFaceStorageWriter, not consolidated)",
            "dcp_folder": str(shards_dir.relative_to(role_dir)),
            "stored_tensors": len(tensors),
            "chunks": sum(len(t.chunks) for t in tensors.values()),
            "files": len(files),
        },
    )


def _full_tensors(shards_dir: Path, files: list[SourceFile]) -> dict[str, DcpTensor]:
    pieces: dict[str, list[tuple[Path, tuple[int, ...], object]]] = {}
    for path in shard_files(shards_dir):
        file = SourceFile(path)
        files.append(file)
        metadata, stored = header_entries(file)
        offsets_of = _saved_offsets(path, metadata)
        for tensor in stored:
            if not tensor.shape:
                raise MergeError(path, f"{tensor.name}: a scalar tensor is not a model weight")
            entry = offsets_of.get(tensor.name) if isinstance(offsets_of, dict) else None
            offsets = entry.get(SAVED_OFFSETS) if isinstance(entry, dict) else None
            if (
                not isinstance(offsets, list)
                or len(offsets) != len(tensor.shape)
                or not all(type(o) is int and o >= 0 for o in offsets)
            ):
                raise MergeError(
                    path,
                    f"{tensor.name}: {SHARDING_INFO} gives {SAVED_OFFSETS} {offsets!r:.80}, not one offset >= 0 per dimension of {tensor.shape}",
                )
            pieces.setdefault(tensor.name, []).append((path, tuple(offsets), tensor))
    if not pieces:
        raise MergeError(shards_dir, "its shard-*.safetensors files hold no tensors")
    tensors = {}
    for key, found in pieces.items():
        dtypes = {t.dtype for _, _, t in found}
        if len(dtypes) > 1:
            raise MergeError(shards_dir, f"{key}: pieces stored in several dtypes {sorted(map(str, dtypes))}")
        shape = tuple(max(o[d] + t.shape[d] for _, o, t in found) for d in range(len(found[0][2].shape)))
        check_tiling(key, shape, [ChunkStorageMetadata(o, t.shape) for _, o, t in found], shards_dir)
        chunks = tuple(DcpChunk(o, t.shape, t.source.runs[0]) for _, o, t in found)
        tensors[key] = DcpTensor(key, shape, dtypes.pop(), chunks)
    return tensors


def _saved_offsets(path: Path, metadata: object) -> object:
    """The writer's per-name record, parsed from the header's ``__metadata__``."""
    raw = metadata.get(SHARDING_INFO) if isinstance(metadata, dict) else None
    if not isinstance(raw, str):
        raise MergeError(path, f"no {SHARDING_INFO} in its header: not written by HuggingFaceStorageWriter")
    return json_without_duplicates(raw, path, SHARDING_INFO, "the tensor")
