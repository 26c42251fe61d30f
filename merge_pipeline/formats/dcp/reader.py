"""Plan the merge of a plain torch.distributed.checkpoint folder (``.metadata`` + ``__<rank>_<k>.distcp``).

Trainers that save the model with ``dcp.save`` differ only in where the folder is and how they name
the model's entries; the bytes are read the same way (``formats/dcp_files.py``), from metadata alone:

    accelerate FSDP SHARDED_STATE_DICT  <checkpoint>/pytorch_model_fsdp_0/   "model." + HF names
    NeMo-RL                             <step>/policy/weights/               "model." + HF names
    NeMo-Automodel                      <checkpoint>/model/ (DCP format)     HF names
    DCP in HF storage, not consolidated  model/ or sharded/ shard-*.safetensors  (formats/dcp/hf_storage.py)
    torchtitan, verl's torchtitan engine <folder>/step-N/                    torchtitan names, beside
                                         "optimizer.", "lr_scheduler.", "dataloader.", "train_state"

Entries that are not the model's (optimizer, scheduler, data loader and train state, RoPE tables)
are skipped. torchtitan names are mapped to HF names as the family's own HF state-dict adapter (``to_hf``) does
(``formats/dcp/torchtitan_names.py``, from the family's record in ``families.py``: llama3's q/k row permutation,
grouped MoE experts split per expert):
the stored rows stream in their order and each block of whole heads is permuted as it passes (``formats/rotary_rows.py``). None of these folders has to hold a config: ``--hf_model_path`` supplies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from merge_pipeline.errors import MergeError
from merge_pipeline.formats import Reader
from merge_pipeline.formats.dcp.hf_storage import find_hf_storage_dir, plan_hf_storage
from merge_pipeline.formats.dcp.torchtitan_names import torchtitan_outputs
from merge_pipeline.formats.dcp_files import (
    METADATA,
    plan_specs,
    read_dcp_metadata,
)
from merge_pipeline.formats.output_specs import whole
from merge_pipeline.formats.step_folders import HF_TRAINER, Completeness, Quiet, StepFolder
from merge_pipeline.hf.config import CONFIG, CheckpointConfig, has_value_head
from merge_pipeline.plan import CheckpointPlan

# Where trainers put the model's DCP folder inside the folder a user points at.
ACCELERATE_DIR = "pytorch_model_fsdp_0"  # accelerate's save_fsdp_model, model_index 0
NEMO_RL_DIR = "weights"  # NeMo-RL's policy/weights (policy/optimizer holds the optimizer)
NEMO_AUTOMODEL_DIR = "model"  # NeMo-Automodel's <checkpoint>/model/ in DCP format (optim/ beside it)
TORCHTITAN = StepFolder("step-", "torchtitan")  # step-<N>/ is a DCP folder
NEMO_RL = StepFolder("step_", "NeMo-RL", ("policy",), in_step_folder=False)  # step_<N>/policy/weights/ is one
_WRAPPED = "model."  # accelerate and NeMo-RL save {"model": state_dict}: DCP flattens it to "model.<name>"
# torchtitan's checkpoint keeps these beside the model (torch's dcp_to_torch_save excludes the same ones).
_TRAINING_STATE = ("optimizer", "lr_scheduler", "dataloader", "train_state")
_ROPE_TABLE = "freqs_cis"  # torchtitan's precomputed rotary table: HF recomputes it from the config


def find_dcp_dir(role_dir: Path) -> Path | None:
    """The DCP folder holding the model: ``role_dir`` itself, or where accelerate / NeMo-RL put it
    (NeMo-RL's Automodel-based policy saves through NeMo-Automodel into ``weights/model/``)."""
    for folder in (
        role_dir,
        role_dir / ACCELERATE_DIR,
        role_dir / NEMO_RL_DIR,
        role_dir / NEMO_AUTOMODEL_DIR,
        role_dir / NEMO_RL_DIR / NEMO_AUTOMODEL_DIR,
    ):
        if (folder / METADATA).is_file():
            return folder
    return None


def is_dcp_dir(role_dir: Path) -> bool:
    return find_dcp_dir(role_dir) is not None or find_hf_storage_dir(role_dir) is not None


@dataclass(frozen=True)
class _Source:
    name: str  # for inspect and the manifest
    key_prefix: str  # in front of every model key in the DCP


def plan_dcp(role_dir: Path, config: CheckpointConfig) -> CheckpointPlan:
    """Describe every HF tensor of a DCP folder; ``MergeError`` naming the file on bad input."""
    role_dir = Path(role_dir)
    dcp_dir = find_dcp_dir(role_dir)
    if dcp_dir is None and (shards_dir := find_hf_storage_dir(role_dir)) is not None:
        return plan_hf_storage(role_dir, shards_dir)
    if dcp_dir is None:
        raise MergeError(
            role_dir / METADATA,
            f"missing: not a DCP folder (nor are its {ACCELERATE_DIR}/, {NEMO_RL_DIR}/, {NEMO_AUTOMODEL_DIR}/)",
        )
    metadata_path = dcp_dir / METADATA
    metadata = read_dcp_metadata(metadata_path)
    source = _source(dcp_dir, metadata)
    stored = _model_tensors(metadata, source, metadata_path)
    # The config: the checkpoint's own (beside the DCP folder or in it), else --hf_model_path.
    hf_dir = next((d for d in (dcp_dir, role_dir) if (d / CONFIG).is_file()), role_dir / "huggingface")
    if source.name == "torchtitan":
        if not (hf_dir / CONFIG).is_file() and config.hf_model_path is None:
            raise MergeError(
                role_dir,
                "a torchtitan checkpoint holds no Hugging Face config: pass --hf_model_path with the model's HF folder (config.json, tokenizer)",
            )
        model = config.load(hf_dir)
        sizes = {key: tuple(meta.size) for key, meta in stored.items()}
        specs = torchtitan_outputs(sizes, model.raw, model.path, metadata_path)
    else:
        specs = [whole(key, key, tuple(meta.size)[0]) for key, meta in stored.items()]

    tensors, planned, files = plan_specs(dcp_dir, specs, stored, metadata, source.key_prefix)
    return CheckpointPlan(
        "dcp",
        role_dir,
        hf_dir,
        planned,
        files,
        is_value_model=has_value_head(t.name for t in planned),
        layout={
            "dcp_source": source.name,
            "dcp_folder": str(dcp_dir.relative_to(role_dir)),
            "stored_tensors": len(tensors),
            "skipped_entries": len(metadata.state_dict_metadata) - len(stored),
            "chunks": sum(len(t.chunks) for t in tensors.values()),
            "files": len(files),
        },
    )


def _source(dcp_dir: Path, metadata: Metadata) -> _Source:
    """Which trainer wrote the folder, from its place and its keys."""
    keys = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
    if "tok_embeddings.weight" in keys:  # every torchtitan family's embedding
        return _Source("torchtitan", "")
    # Wrapped: every key under "model.", and below it the HF model's own top modules (model.*, lm_head).
    unwrapped = [k.removeprefix(_WRAPPED) for k in keys if k.startswith(_WRAPPED)]
    if len(unwrapped) == len(keys) and any(k.startswith(_WRAPPED) or k.startswith("lm_head.") for k in unwrapped):
        where = {ACCELERATE_DIR: "accelerate FSDP SHARDED_STATE_DICT", NEMO_RL_DIR: "NeMo-RL"}
        return _Source(where.get(dcp_dir.name, "DCP of HF names under 'model.'"), _WRAPPED)
    return _Source("NeMo-Automodel" if dcp_dir.name == NEMO_AUTOMODEL_DIR else "DCP of HF names", "")


def _model_tensors(metadata: Metadata, source: _Source, metadata_path: Path) -> dict[str, TensorStorageMetadata]:
    """The model's tensors by their unprefixed names; training state and non-tensor entries skipped."""
    stored = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata) or not key.startswith(source.key_prefix):
            continue
        if key.split(".", 1)[0] in _TRAINING_STATE or key.rsplit(".", 1)[-1] == _ROPE_TABLE:
            continue
        if not tuple(meta.size):
            raise MergeError(metadata_path, f"{key}: a scalar tensor is not a model weight")
        stored[key.removeprefix(source.key_prefix)] = meta
    if not stored:
        raise MergeError(metadata_path, f"holds no model tensors (a {source.name} checkpoint of training state only?)")
    return stored


def holds_a_save(step_dir: Path, stack: StepFolder) -> bool:
    """torchtitan's step folder is the DCP folder; the HF Trainer's holds accelerate's."""
    return stack is TORCHTITAN or (step_dir / ACCELERATE_DIR).is_dir()


def completeness(folder: Path, step: int, stack: StepFolder, quiet: Quiet) -> Completeness:
    """dcp.save's coordinator writes ``.metadata`` after every rank's data; then the settle time."""
    if find_dcp_dir(folder) is None and find_hf_storage_dir(folder) is not None:
        return quiet.settled("DCP in HF storage: the writer leaves no marker of a finished save")
    if find_dcp_dir(folder) is None:
        return quiet.not_yet("DCP: no .metadata yet (dcp.save's coordinator writes it after every rank's data)")
    return quiet.settled("DCP: .metadata present (dcp.save's coordinator writes it after every rank's data)")


READER = Reader(
    name="dcp",
    looks_for=f"a DCP folder (.metadata in it or in {ACCELERATE_DIR}/, {NEMO_RL_DIR}/, {NEMO_AUTOMODEL_DIR}/; or shard-*-model-*.safetensors)",
    detect=is_dcp_dir,
    plan=lambda role_dir, options, config: plan_dcp(role_dir, config),
    weight_suffixes=(".distcp", ".safetensors"),
    step_folders=(TORCHTITAN, HF_TRAINER, NEMO_RL),
    saved_in_step_folder=holds_a_save,
    completeness=completeness,
)
