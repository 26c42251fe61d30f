"""Plan the merge of a Megatron-Core role folder from checkpoint metadata alone.

verl writes the model either as Megatron-Core shards (a torch.distributed.checkpoint folder, backend
``torch_dist``) or, with its bridge (the default), as Hugging Face safetensors. Where each lives
depends on the layout schema (``find_layout``):

    v2 (verl 0.9): <role>/ckpt_contents.json says where; model/dist_ckpt/, model/huggingface/
    v1 (legacy):   <role>/dist_ckpt/, <role>/huggingface/
    Megatron-LM:   <save>/iter_0000100/ (itself the dist checkpoint), or <save>/ with its tracker
                   latest_checkpointed_iteration.txt (``formats/megatron/lm_save.py``); no HF files

The DCP ``.metadata`` gives every tensor's global shape and dtype and, per saved chunk, which
``.distcp`` file holds it at which offset; ``formats/dcp_files.py`` reads it and locates each chunk's
raw bytes. That is enough to describe every HF tensor as file ranges: no Megatron model, no process
group, no GPU, and no tensor data read at planning time.
HF safetensors weights are planned by ``formats/safetensors_folder/reader.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from merge_pipeline.errors import MergeError
from merge_pipeline.files.json_files import read_json_object
from merge_pipeline.formats import Reader
from merge_pipeline.formats.dcp_files import (
    METADATA,
    DcpTensor,
    plan_specs,
    read_dcp_metadata,
)
from merge_pipeline.formats.megatron.lm_save import (
    BRIDGE_HF_EXPORT,
    MEGATRON_LM_STEPS,
    holds_an_iteration,
    is_megatron_lm_save,
    iteration_folder,
)
from merge_pipeline.formats.megatron.names import KeyMapper, megatron_family, model_shape
from merge_pipeline.formats.megatron.vocab import drop_vocab_padding
from merge_pipeline.formats.safetensors_folder.reader import BRIDGE_ADAPTER_DIR, plan_hf_safetensors
from merge_pipeline.formats.step_folders import VERL, Completeness, Quiet, StepFolder, tracker_vouches
from merge_pipeline.hf.config import CheckpointConfig, model_section
from merge_pipeline.hf.lora import ADAPTER_CONFIG
from merge_pipeline.plan import CheckpointPlan, Computed, PlannedTensor, SourceFile, dtype_name

MANIFEST = "ckpt_contents.json"  # verl's layout v2: rank 0 writes it last, atomically
_V2_FOLDERS = ("model/dist_ckpt", "model/huggingface", "optimizer/dist_ckpt", "extra/dist_ckpt")
VALUE_ROLES = ("critic", "reward")
DIST_FORMAT, HF_FORMAT = "megatron_dist_checkpoint", "huggingface"
MEGATRON_LM = "megatron-lm"  # the layout schema of Megatron-LM's own save folders
# Tensors that are training state, not model weights.
_NOT_MODEL = re.compile(r"^optimizer\.|\._extra_state")


@dataclass(frozen=True)
class MegatronLayout:
    """Where one role folder keeps its model weights and its Hugging Face files."""

    schema: str  # "v2" (ckpt_contents.json), "v2 without ckpt_contents.json", "v1", MEGATRON_LM
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
    """A folder verl's Megatron checkpoint manager wrote, in any layout schema, or Megatron-LM's save."""
    if is_megatron_lm_save(role_dir):
        return True
    v2 = (
        (role_dir / MANIFEST).is_file()
        or (role_dir / "model" / "dist_ckpt").is_dir()
        or (role_dir / "model" / "huggingface").is_dir()
    )
    return v2 or (role_dir / "dist_ckpt").is_dir() or any((role_dir / "huggingface").glob("*.safetensors"))


def find_layout(role_dir: Path) -> MegatronLayout:
    """Read ``ckpt_contents.json`` when present; otherwise recognise v2 by its ``model/`` folder."""
    if is_megatron_lm_save(role_dir):
        iteration = iteration_folder(role_dir)
        # Megatron-LM saves no HF files (--hf_model_path); Megatron-Bridge's also_save_hf_checkpoint
        # exports the model into iter_N/hf/ (config, tokenizer, weights): its config is used.
        hf_dir = iteration / BRIDGE_HF_EXPORT if (iteration / BRIDGE_HF_EXPORT / "config.json").is_file() else iteration
        return MegatronLayout(MEGATRON_LM, DIST_FORMAT, iteration, hf_dir, iteration.name)
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
    config: CheckpointConfig,
    *,
    is_value_model: bool | None,
    tie_word_embedding: bool | None,
) -> CheckpointPlan:
    """Describe every HF tensor of a Megatron role folder; ``MergeError`` naming the file on bad input.

    ``is_value_model`` / ``tie_word_embedding``: ``None`` means decide from the checkpoint
    (``output_layer`` of one row) and from config.json (``tie_word_embeddings``); ``config`` is
    read only for Megatron shards (their names and shapes need it).
    """
    role_dir = Path(role_dir)
    layout = find_layout(role_dir)
    if is_value_model is None and layout.role in VALUE_ROLES:
        is_value_model = True  # as verl decides: its critic and reward roles are value models
    dist_dir = layout.dist_dir
    # An empty folder is normal: verl creates model/dist_ckpt/ even when the bridge saved HF files.
    checkpoint = _read_dist_checkpoint(dist_dir) if layout.weights != HF_FORMAT and _holds_files(dist_dir) else None
    stored = _model_tensors(checkpoint) if checkpoint else {}
    _refuse_unexported_adapter(role_dir, layout, stored)
    if not stored:
        if layout.schema == MEGATRON_LM:
            raise MergeError(dist_dir / METADATA, "holds no model tensors (a Megatron-LM save of the optimizer only?)")
        if layout.weights == DIST_FORMAT:
            raise MergeError(dist_dir, f"{MANIFEST} says the model weights are here, but it holds no model tensors")
        # The bridge's HF files (verl's default); any dist checkpoint holds optimizer and RNG state only.
        return _plan_bridge_export(role_dir, layout, config, is_value_model)
    if layout.schema == MEGATRON_LM and not config.hf_model_path and not (layout.hf_dir / "config.json").is_file():
        raise MergeError(
            dist_dir,
            "a Megatron-LM checkpoint holds no Hugging Face config: pass --hf_model_path with a Hugging Face folder of this model (its config.json and tokenizer)",
        )
    model_config = config.load(layout.hf_dir)
    try:
        megatron_family(model_config.raw, model_config.path)  # an architecture not mapped: before any other read
    except MergeError:
        if not any(layout.hf_dir.glob("*.safetensors")):
            raise
        # verl's hybrid save: the bridge's HF export beside shards of an architecture not mapped here.
        return _plan_bridge_export(role_dir, layout, config, is_value_model)
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


def _plan_bridge_export(
    role_dir: Path, layout: MegatronLayout, config: CheckpointConfig, is_value_model: bool | None
) -> CheckpointPlan:
    return plan_hf_safetensors(
        role_dir,
        layout.hf_dir,
        is_value_model=is_value_model,
        hf_model_path=config.hf_model_path,
        layout=layout.describe(),
        backend="megatron",
    )


# Megatron LoRA parameters: Megatron-Bridge's ``.adapter.linear_in/out``, or ``lora_`` names.
_ADAPTER_KEY = re.compile(r"\.adapter\.|(^|\.)lora_")


def _refuse_unexported_adapter(role_dir: Path, layout: MegatronLayout, stored: dict) -> None:
    """A LoRA adapter kept only as Megatron shards cannot be converted exactly: the shards do not
    record lora_alpha (the scale) nor which HF modules a fused projection's adapter maps to."""
    if (layout.hf_dir / BRIDGE_ADAPTER_DIR / ADAPTER_CONFIG).is_file():
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
            f"holds a LoRA adapter only as Megatron shards and there is no PEFT export in {layout.hf_dir.relative_to(role_dir)}/{BRIDGE_ADAPTER_DIR}/: lora_alpha and the target modules are not recorded, so it cannot be converted exactly (export it with verl's bridge, or merge a checkpoint saved with it)",
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
    metadata_path = dist_dir / METADATA
    # A scalar (Gemma 4's audio tower's clipping bounds) is mapped as one row and written as the scalar it is.
    scalars = {k for k, v in stored.items() if not tuple(v.size)}
    shapes = {k: tuple(v.size) or (1,) for k, v in stored.items()}
    # The language model's keys: under language_model. in a multimodal model, under thinker. in an Omni one's.
    lm = ("thinker." if "thinker_config" in config else "") + (
        "language_model." if "text_config" in model_section(config) else ""
    )
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
        specs = drop_vocab_padding(specs, config, config_path, metadata_path)
        specs = [replace(spec, shape=()) if spec.pieces[0].key in scalars else spec for spec in specs]
    except MergeError as exc:
        if checkpoint.key_prefix and exc.path == metadata_path:  # name the layout the keys came from
            raise MergeError(exc.path, f"Megatron-FSDP checkpoint (one DCP of DTensors): {exc.problem}") from None
        raise

    tensors, planned, files = plan_specs(dist_dir, specs, stored, checkpoint.metadata, checkpoint.key_prefix)
    if value_model and f"{lm}output_layer.bias" not in shapes:  # the value head's weight is among the outputs
        planned.append(_zero_score_bias(tensors[f"{lm}output_layer.weight"].dtype))
    planned.sort(key=lambda t: _natural_key(t.name))
    facts = {**layout.describe(), **_layout(role_dir, layout, checkpoint, tensors.values(), files, tied)}
    return CheckpointPlan("megatron", role_dir, layout.hf_dir, planned, files, is_value_model=value_model, layout=facts)


# ---- metadata -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _DistCheckpoint:
    metadata: Metadata
    backend: str  # for inspect and the manifest
    key_prefix: str  # in front of every model key in the DCP (Megatron-FSDP nests them under "model")


# Megatron-FSDP saves the model state dict under "model" with plain torch DCP (no metadata.json),
# beside the optimizer ("optimizer.") and RNG state ("rng_state.") in the same checkpoint.
_MEGATRON_FSDP_PREFIX = "model."
# ...each key behind one "module." per wrapper it came through: megatron-core's FSDP adapter
# delegates its state dict to MegatronFSDP (whose child is the model), and bf16 / fp16 add a Float16Module.
_WRAPPER = "module."


def _read_dist_checkpoint(dist_dir: Path) -> _DistCheckpoint:
    if not (dist_dir / "metadata.json").is_file() and (dist_dir / ".metadata").is_file():
        metadata = read_dcp_metadata(dist_dir / ".metadata")
        model_keys = [key for key in metadata.state_dict_metadata if key.startswith(_MEGATRON_FSDP_PREFIX)]
        if model_keys:
            prefix = _MEGATRON_FSDP_PREFIX
            while all(key.startswith(prefix + _WRAPPER) for key in model_keys):
                prefix += _WRAPPER
            return _DistCheckpoint(metadata, "megatron_fsdp (torch DCP of DTensors)", prefix)
    _check_backend(dist_dir / "metadata.json")
    return _DistCheckpoint(read_dcp_metadata(dist_dir / ".metadata"), "torch_dist", "")


def _model_tensors(checkpoint: _DistCheckpoint) -> dict[str, TensorStorageMetadata]:
    """Model weights only, by their Megatron names: not optimizer state, not ``_extra_state`` / RNG entries."""
    prefix = checkpoint.key_prefix
    return {
        k.removeprefix(prefix): v
        for k, v in checkpoint.metadata.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata) and not _NOT_MODEL.search(k)
    }


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


def _zero_score_bias(dtype: torch.dtype) -> PlannedTensor:
    # verl's value head is a bias-free Linear; HF's token-classification ``score`` has a bias, and a
    # zero bias computes exactly what the trained head computed.
    return PlannedTensor("score.bias", (1,), dtype, Computed(lambda: torch.zeros(1, dtype=dtype)))


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _layout(
    role_dir: Path,
    layout: MegatronLayout,
    checkpoint: _DistCheckpoint,
    tensors: Iterable[DcpTensor],
    files: list[SourceFile],
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
    elif layout.schema == MEGATRON_LM and checkpoint.backend == "torch_dist":
        # Megatron-LM records its parallel sizes only in common.pt's pickled args; the embedding is
        # vocabulary-parallel, so its row chunks in .metadata are the tensor-parallel ranks.
        embedding = [t for t in tensors if t.key.endswith("embedding.word_embeddings.weight")]
        parallel = {"tp": len({c.offsets[0] for c in embedding[0].chunks})} if embedding else {}
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


def completeness(folder: Path, step: int, stack: StepFolder, quiet: Quiet) -> Completeness | None:
    """verl writes its layout v2's manifest last; a v2 folder without it is not finished (unless the
    tracker says so, written after the folder's last change). A legacy folder leaves no marker: the
    tracker or the settle time decides."""
    if (folder / MANIFEST).is_file():
        return quiet.done(f"{MANIFEST} present (verl writes it last)")
    vouched, _ = tracker_vouches(folder, step, stack, quiet.newest)
    if not vouched and any((folder / v2).is_dir() for v2 in _V2_FOLDERS):
        # A quiet folder proves nothing here: the bridge may gather weights for minutes before writing.
        return quiet.not_yet(f"Megatron layout v2 without {MANIFEST}: verl writes it last, the save is not finished")
    return None


READER = Reader(
    name="megatron",
    looks_for="a Megatron checkpoint (ckpt_contents.json, model/dist_ckpt/, model/huggingface/, legacy dist_ckpt/, or Megatron-LM's iter_N/ or latest_checkpointed_iteration.txt)",
    detect=is_megatron_dir,
    plan=lambda role_dir, options, config: plan_megatron(
        role_dir,
        config,
        is_value_model=options.is_value_model or None,
        tie_word_embedding=options.tie_word_embedding or None,
    ),
    weight_suffixes=(".distcp", ".pt"),
    step_folders=(VERL, MEGATRON_LM_STEPS),
    saved_in_step_folder=holds_an_iteration,
    completeness=completeness,
)
