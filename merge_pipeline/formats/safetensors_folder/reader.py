"""Plan a role folder whose weights are consolidated Hugging Face safetensors (``--backend hf``).

verl's Megatron bridge (the default) saves the model this way, in ``model/huggingface/`` (layout v2)
or ``huggingface/`` (v1): one ``model.safetensors`` without an index, or shards with one. The
NeMo-Automodel engine saves consolidated HF safetensors in ``<role>/model/``; torchtitan's
``last_save_in_hf`` leaves an index and its shards in ``step-N/`` itself (config from ``--hf_model_path``); the base model of a
LoRA-only checkpoint is an HF folder too. Nothing needs converting: each tensor is one byte range of
a safetensors file, found by reading the file headers only. The headers and the index are checked,
since a bad one would otherwise become a bad output.

With LoRA the bridge exports a PEFT adapter to ``adapter/`` beside (or instead of) the base
weights; the base then comes from the original model (``--hf_model_path``), which LoRA training
leaves unchanged. The plan names tensors as a PEFT-wrapped model does, so the engine writes base
weights plus ``lora_adapter/``, or merges them, exactly as for FSDP.
"""

from __future__ import annotations

from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.files.json_files import read_json_object
from merge_pipeline.formats import Reader
from merge_pipeline.formats.safetensors_files import header_entries
from merge_pipeline.hf.config import VALUE_HEAD, CheckpointConfig, has_value_head
from merge_pipeline.hf.file_names import INDEX, SINGLE_FILE, WEIGHT_SUFFIXES
from merge_pipeline.hf.lora import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    OUTPUT_ADAPTER_DIR,
    PEFT_PREFIX,
    lora_module,
    peft_base_names,
)
from merge_pipeline.options import MergeOptions
from merge_pipeline.plan import (
    CheckpointPlan,
    LoraInfo,
    PlannedTensor,
    SourceFile,
    closed_on_failure,
    dtype_name,
)

NEMO_MODEL_DIR = "model"  # NeMo-Automodel: consolidated HF safetensors + config in <role>/model/
TORCHTITAN_SHARDS = "sharded"  # torchtitan's HuggingFaceStorageWriter: per-rank files before consolidation
BRIDGE_ADAPTER_DIR = "adapter"  # verl: model/huggingface/adapter/, Megatron-Bridge's PEFT export


def has_hf_weights(hf_dir: Path) -> bool:
    return (hf_dir / INDEX).is_file() or (hf_dir / SINGLE_FILE).is_file()


def plan_hf_safetensors(
    role_dir: Path,
    hf_dir: Path,
    *,
    is_value_model: bool | None = None,
    hf_model_path: str | Path | None = None,
    layout: dict | None = None,
    backend: str,
) -> CheckpointPlan:
    """Plan the safetensors weights in ``hf_dir`` (plus a PEFT adapter in ``hf_dir/adapter``)."""
    role_dir, hf_dir = Path(role_dir), Path(hf_dir)
    adapter_dir = hf_dir / BRIDGE_ADAPTER_DIR
    lora = adapter_dir / ADAPTER_CONFIG if (adapter_dir / ADAPTER_CONFIG).is_file() else None
    weights_dir = hf_dir
    if not has_hf_weights(hf_dir):
        if lora is None:
            raise MergeError(
                hf_dir,
                f"no model weights: no {SINGLE_FILE} or {INDEX} here and no model tensors in the checkpoint's dist_ckpt",
            )
        if hf_model_path is None:
            raise MergeError(
                hf_dir,
                f"holds a LoRA adapter ({BRIDGE_ADAPTER_DIR}/) but no base weights: pass --hf_model_path with the original model folder",
            )
        weights_dir = Path(hf_model_path)
        if not has_hf_weights(weights_dir):
            raise MergeError(
                weights_dir,
                f"--hf_model_path has no {SINGLE_FILE} or {INDEX}: the LoRA base weights must be safetensors",
            )

    files: list[SourceFile] = []
    with closed_on_failure(files):
        planned = _plan_weight_files(weights_dir, files)
        info = None
        if lora is not None:
            info, adapter = _plan_adapter(lora, files)
            planned = _peft_names(planned, adapter, info, lora)
        value_model = has_value_head(t.name for t in planned)
        if is_value_model and not value_model:
            raise MergeError(hf_dir, f"value model requested but the weights have no {VALUE_HEAD}")
    facts = {
        **(layout or {}),
        "weights": "huggingface safetensors",
        "files": len(files),
        "dtypes": sorted({dtype_name(t.dtype) for t in planned}),
    }
    if lora is not None:
        facts["lora_adapter"] = str(lora.parent)
        facts["base_weights"] = str(weights_dir)
    return CheckpointPlan(
        backend, role_dir, hf_dir, planned, files, is_value_model=value_model, lora=info, layout=facts
    )


def _plan_model_folder(folder: Path) -> CheckpointPlan:
    """An HF model folder (a merge's output, a released model) as an input to averaging: its tensors
    under their own names (a merge's output names: tying and LoRA folding already decided), its config beside them."""
    adapter = folder / OUTPUT_ADAPTER_DIR
    if adapter.is_dir():
        raise MergeError(
            adapter,
            "a LoRA adapter beside the base weights: averaging takes folded weights (merge the checkpoint with --merge-lora)",
        )
    plan = plan_hf_safetensors(folder, folder, backend="hf")
    plan.check_against_architecture = False  # the names are the model's own, as a merge checked them
    return plan


def read_hf_weights(folder: Path) -> tuple[list[PlannedTensor], list[SourceFile]]:
    """Every tensor of an HF folder's safetensors weights (one file, or shards with an index), from the headers."""
    if not has_hf_weights(folder):
        raise MergeError(folder, f"no model weights: no {SINGLE_FILE} or {INDEX} here")
    files: list[SourceFile] = []
    with closed_on_failure(files):
        return _plan_weight_files(folder, files), files


def _plan_weight_files(folder: Path, files: list[SourceFile]) -> list[PlannedTensor]:
    index_path = folder / INDEX
    weight_map = _read_index(index_path) if index_path.is_file() else None
    planned: list[PlannedTensor] = []
    for filename in sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]:
        path = folder / filename
        if not path.is_file():
            raise MergeError(path, f"missing: {INDEX} lists tensors in it")
        file = SourceFile(path)
        files.append(file)
        planned.extend(_header_tensors(file))
    _check_names(planned, weight_map, index_path)
    return planned


# PEFT settings that change what an adapter computes beyond W + (alpha / r) * B @ A.
_UNSUPPORTED_LORA = ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern", "bias", "modules_to_save")


def _plan_adapter(config_path: Path, files: list[SourceFile]) -> tuple[LoraInfo, list[PlannedTensor]]:
    config = read_json_object(config_path)
    if config.get("peft_type", "LORA") != "LORA":
        raise MergeError(config_path, f"peft_type {config.get('peft_type')!r}: only LoRA adapters can be merged")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise MergeError(
            config_path, f"needs a positive integer r and a number lora_alpha, found r={r!r}, lora_alpha={alpha!r}"
        )
    for key in _UNSUPPORTED_LORA:
        if config.get(key) and config.get(key) != "none":
            raise MergeError(
                config_path,
                f"{key}={config[key]!r} is not supported: only plain LoRA (W + lora_alpha / r * B @ A) merges exactly",
            )
    weights = config_path.parent / ADAPTER_FILE
    if not weights.is_file():
        raise MergeError(weights, f"missing: {ADAPTER_CONFIG} is beside it but the adapter weights are not")
    file = SourceFile(weights)
    files.append(file)
    return LoraInfo(r, alpha, config.get("task_type") or "CAUSAL_LM"), _header_tensors(file)


def _peft_names(
    base: list[PlannedTensor], adapter: list[PlannedTensor], info: LoraInfo, config_path: Path
) -> list[PlannedTensor]:
    """Name base and adapter tensors as a PEFT-wrapped model's state dict does; check that each
    adapter pair fits the weight it adapts (A: r x in, B: out x r)."""
    shapes = {t.name: t.shape for t in base}
    weights_file = config_path.parent / ADAPTER_FILE
    targets = set()
    for t in adapter:
        found = lora_module(t.name)
        if found is None or not found[0].startswith(PEFT_PREFIX):
            raise MergeError(
                weights_file, f"{t.name} is not a PEFT LoRA tensor name ({PEFT_PREFIX}<module>.lora_A/B.weight)"
            )
        module, which = found[0].removeprefix(PEFT_PREFIX), found[1]
        base_shape = shapes.get(f"{module}.weight")
        if base_shape is None or len(base_shape) != 2:
            raise MergeError(weights_file, f"{t.name}: the base weights have no 2-D {module}.weight")
        expected = (info.r, base_shape[1]) if which == "A" else (base_shape[0], info.r)
        if tuple(t.shape) != expected:
            raise MergeError(
                weights_file,
                f"{t.name}: shape {tuple(t.shape)}, expected {expected} for r={info.r} and {module}.weight {tuple(base_shape)}",
            )
        targets.add(module)
    return peft_base_names(base, targets) + adapter


def _read_index(path: Path) -> dict[str, str]:
    weight_map = read_json_object(path).get("weight_map")
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    ):
        raise MergeError(path, "no 'weight_map' of tensor name -> file name")
    for filename in set(weight_map.values()):
        if Path(filename).name != filename or not filename.endswith(".safetensors"):
            raise MergeError(path, f"weight_map names {filename!r}, not a .safetensors file in this folder")
    return weight_map


def _header_tensors(file: SourceFile) -> list[PlannedTensor]:
    return header_entries(file)[1]


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


def weights_dir(role_dir: Path) -> Path | None:
    """NeMo-Automodel's ``model/`` (with its config), or torchtitan's ``last_save_in_hf`` step folder:
    the index and consolidated shards beside the writer's per-rank ``sharded/`` (no config:
    ``--hf_model_path``). Other folders with an index (an HF Trainer's, beside DeepSpeed's) are not claimed."""
    model_dir = role_dir / NEMO_MODEL_DIR
    if (model_dir / "config.json").is_file() and has_hf_weights(model_dir):  # not its sharded DCP save
        return model_dir
    return role_dir if (role_dir / INDEX).is_file() and (role_dir / TORCHTITAN_SHARDS).is_dir() else None


def _plan(role_dir: Path, options: MergeOptions, config: CheckpointConfig) -> CheckpointPlan:
    return plan_hf_safetensors(
        role_dir,
        weights_dir(role_dir) or role_dir / NEMO_MODEL_DIR,
        is_value_model=options.is_value_model or None,
        hf_model_path=options.hf_model_path,
        backend="hf",
    )


# A role folder holding consolidated HF safetensors (NeMo-Automodel, torchtitan's HF save); verl's
# bridge output is Megatron's. No step folder of its own: the trainers' step folders hold other formats too.
READER = Reader(
    name="hf",
    looks_for=f"consolidated HF weights ({NEMO_MODEL_DIR}/*.safetensors, or {INDEX} beside {TORCHTITAN_SHARDS}/)",
    detect=lambda role_dir: weights_dir(role_dir) is not None,
    plan=_plan,
    weight_suffixes=WEIGHT_SUFFIXES,
    plan_model_folder=_plan_model_folder,
)
