"""Reader for DeepSpeed ZeRO 1/2/3 checkpoints: ``<save_dir>/latest`` naming ``<save_dir>/<tag>/``.

The tag folder holds ``*_model_states.pt`` (shapes, shared and frozen parameters, buffers) and
one ``*_optim_states.pt`` per data-parallel rank, whose flat fp32 partitions are the master
weights. We rebuild them exactly as DeepSpeed's ``utils/zero_to_fp32.py`` does, but as byte ranges
into those flat tensors (a parameter cut across ranks is several ranges), so nothing is loaded
at planning time and the writer streams one parameter at a time.

- ZeRO 1/2 (``single_partition_of_fp32_groups``): per parameter group, the ranks' partitions
  concatenated are one vector; parameters lie in it in ``param_shapes`` order, each followed by
  its ``param_alignment_paddings`` entry when the file records them.
- ZeRO 3 (``fp32_flat_groups``): each parameter takes ``ceil(numel / world)`` elements at the same
  offset of every rank's flat space (its groups concatenated); the ranks' slices concatenated and
  cut to ``numel`` are the parameter.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from merge_pipeline.errors import MergeError, shown
from merge_pipeline.files.inputs import read_capped
from merge_pipeline.formats import Reader
from merge_pipeline.formats.coalesced_reads import coalesced
from merge_pipeline.formats.step_folders import (
    HF_TRAINER,
    Completeness,
    Quiet,
    StepFolder,
    newest_change,
    written_after,
)
from merge_pipeline.formats.torch_files import load_meta_state_dict, stored_tensor
from merge_pipeline.hf.config import CONFIG, has_value_head
from merge_pipeline.plan import (
    ByteRun,
    CheckpointPlan,
    Computed,
    PlannedTensor,
    SourceFile,
    StoredBytes,
    closed_on_failure,
)

LATEST = "latest"
DEEPSPEED = StepFolder("global_step", "DeepSpeed")  # a tag folder; the save dir beside it holds `latest`
MAX_LATEST_BYTES = 4096  # a tag name ("global_step100"): a file past this names no tag
_MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_STATES = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_TAG = re.compile(r"^[\w.-]+$")


class _ZeroStage(int):
    """Stands in for ``ZeroStageEnum`` (an int enum, pickled as a call with its value)."""


class _PlainRecord:
    """Stands in for a DeepSpeed object pickled as plain attributes; its state is kept, never run."""


# DeepSpeed's own globals that its optimizer-state pickles name, and what is built in their place.
# Nothing else beyond what ``state_dict_pickle`` builds a state dict with is accepted.
ALLOWED_GLOBALS = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": _ZeroStage,  # optimizer_state_dict["zero_stage"]
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _PlainRecord,  # static loss scale (fp32, bf16)
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": _PlainRecord,  # fp16 training
    "deepspeed.utils.tensor_fragment.fragment_address": _PlainRecord,  # ZeRO 1/2 param_slice_mappings
}


def is_tag_name(tag: str) -> bool:
    """Whether what ``latest`` says can name a folder beside it (and nothing above or below it)."""
    return bool(_TAG.match(tag)) and tag not in (".", "..")


def read_latest(latest: Path) -> str:
    """What a ``latest`` file says: one tag name, a few bytes (refused past a cap, never blocking on a FIFO)."""
    text = read_capped(latest, MAX_LATEST_BYTES, f"is larger than {MAX_LATEST_BYTES} bytes: too large to name a tag")
    return text.decode(errors="replace").strip()


def tag_dir(path: Path) -> Path:
    """The folder holding the rank files: ``path`` itself, or the tag its ``latest`` file names."""
    latest = path / LATEST
    if not latest.is_file():
        return path
    tag = read_latest(latest)
    if not is_tag_name(tag):
        raise MergeError(latest, f"names the tag {tag[:80]!r}, which is not a folder name")
    if not (path / tag).is_dir():
        raise MergeError(latest, f"names the tag {tag!r} but there is no folder {tag}/ beside it")
    return path / tag


def is_deepspeed_dir(path: Path) -> bool:
    """A save dir (``latest``) or a tag folder (rank files); the reader checks the rest."""
    return (path / LATEST).is_file() or any(
        _OPTIM_STATES.match(p.name) or _MODEL_STATES.match(p.name) for p in path.iterdir()
    )


def missing_optimizer_states(folder: Path) -> list[str] | None:
    """The ``*_optim_states.pt`` files the model states' ``dp_world_size`` calls for that ``folder``
    (a tag folder) lacks; None when no model state file can be read to tell (not written yet)."""
    try:
        names = [p.name for p in folder.iterdir()]
        model_states = sorted(n for n in names if _MODEL_STATES.match(n))
        world_size = load_meta_state_dict(folder / model_states[0], ALLOWED_GLOBALS).get("dp_world_size")
    except (IndexError, MergeError, OSError):
        return None
    if type(world_size) is not int or world_size < 1:
        return None
    ranks = {int(m.group(1)) for n in names if (m := _OPTIM_STATES.match(n)) and int(m.group(2)) == 0}
    return [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world_size) if r not in ranks]


def plan_deepspeed(path: Path) -> CheckpointPlan:
    folder = tag_dir(path)
    optim_paths = _rank_files(folder)
    files: list[SourceFile] = []
    with closed_on_failure(files):
        optim = []
        for p in optim_paths:
            files.append(SourceFile(p))
            optim.append(_optimizer_state(p))
        stage, world_size = _stage_and_world_size(optim_paths, optim)
        model_paths = (
            [folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world_size)]
            if stage == 3
            else [folder / "mp_rank_00_model_states.pt"]
        )
        models = []
        for p in model_paths:
            if not p.is_file():
                raise MergeError(p, f"missing: a ZeRO-{stage} checkpoint needs it beside the optimizer states")
            files.append(SourceFile(p))
            # Under ZeRO-3 every rank's model state repeats the module's entries and adds only its
            # fragments of frozen parameters: past rank 0 they are read only when there are some
            # (at 512 ranks, unpickling them all took longer than the rest of the plan).
            if not models or models[0].get("frozen_param_shapes"):
                models.append(_model_state(p))
        model_files = files[world_size:]
        tensors = _buffers(model_files[0], models[0])
        tensors += _frozen(model_files, models)
        flat = _flat_partitions(files[:world_size], optim, stage)
        if stage == 3:
            # Every parameter is a piece of each rank's partition: read file by file, a group of parameters at a time.
            tensors += coalesced(
                _zero3_params(files[:world_size], flat, _param_shapes(model_files[0], models[0]), world_size)
            )
        else:
            paddings = optim[0].get("param_alignment_paddings")
            tensors += _zero12_params(files[:world_size], flat, _param_shapes(model_files[0], models[0]), paddings)
        tensors += _shared(model_files[0], models[0], tensors)
        if stage != 3:
            tensors += _unrecorded_frozen(model_files[0], models[0], tensors)
        _check_unique(model_files[0], tensors)
    return CheckpointPlan(
        backend="deepspeed",
        role_dir=path,
        hf_dir=path if (path / CONFIG).is_file() else None,  # the HF Trainer saves it beside `latest`
        tensors=_strip_wrapper_prefix(tensors),
        files=files,
        is_value_model=has_value_head(t.name for t in tensors),
        check_against_architecture=True,  # names of whatever module DeepSpeed wrapped
        layout={
            "zero_stage": stage,
            "dp_world_size": world_size,
            "tag": folder.name,
            "ds_version": models[0]["ds_version"] if isinstance(models[0].get("ds_version"), str) else None,
        },
    )


def _rank_files(folder: Path) -> list[Path]:
    """The ``*_optim_states.pt`` files, by data-parallel rank; ranks 0..N-1, tensor-parallel rank 0 only."""
    ranks: dict[int, Path] = {}
    for p in folder.iterdir():
        if m := _OPTIM_STATES.match(p.name):
            if int(m.group(2)) != 0:
                raise MergeError(p, "model-parallel DeepSpeed checkpoints (mp_rank > 0) are not supported")
            if int(m.group(1)) in ranks:
                raise MergeError(p, f"a second optimizer-state file for rank {m.group(1)}")
            ranks[int(m.group(1))] = p
    if not ranks:
        raise MergeError(folder, "no *_optim_states.pt files: not a DeepSpeed ZeRO checkpoint folder")
    missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
    if missing:
        raise MergeError(folder / f"zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt", "missing")
    return [ranks[r] for r in range(len(ranks))]


def _optimizer_state(path: Path) -> dict:
    state = load_meta_state_dict(path, ALLOWED_GLOBALS).get("optimizer_state_dict")
    if not isinstance(state, dict) or "zero_stage" not in state:
        raise MergeError(path, "not a ZeRO optimizer state (no optimizer_state_dict with zero_stage)")
    return state


def _model_state(path: Path) -> dict:
    state = load_meta_state_dict(path, ALLOWED_GLOBALS)
    for key, kind in (("module", dict), ("param_shapes", list), ("buffer_names", list), ("shared_params", dict)):
        if not isinstance(state.get(key), kind):
            raise MergeError(path, f"not a DeepSpeed model state: {key!r} is not a {kind.__name__}")
    for key in ("frozen_param_shapes", "frozen_param_fragments"):  # absent or None when nothing is frozen
        if not isinstance(state.get(key) or {}, dict):
            raise MergeError(path, f"{key!r} is not a dict")
    if not all(isinstance(name, str) for name in state["buffer_names"]):
        raise MergeError(path, "'buffer_names' holds something other than names")
    return state


def _stage_and_world_size(paths: list[Path], optim: list[dict]) -> tuple[int, int]:
    stage = optim[0]["zero_stage"]
    if type(stage) not in (int, _ZeroStage) or stage not in (1, 2, 3):
        raise MergeError(paths[0], f"ZeRO stage {shown(stage)} is not one this reader knows (1, 2 or 3)")
    counts = optim[0].get("partition_count")
    # ZeRO 2: one count per parameter group (expert groups may differ); the largest is the dp world.
    per_group = counts if isinstance(counts, list) and counts else [counts]
    if not all(type(c) is int and c >= 1 for c in per_group):
        raise MergeError(paths[0], f"partition_count {shown(counts)} is not a positive integer (or a list of them)")
    world_size = max(per_group)
    if world_size != len(paths):
        raise MergeError(
            paths[0].parent,
            f"partition_count says {world_size} data-parallel ranks but there are {len(paths)} *_optim_states.pt files",
        )
    for p, state in zip(paths, optim):
        if state["zero_stage"] != stage or state.get("partition_count") != counts:
            raise MergeError(p, f"ZeRO stage/partition count differ from rank 0's ({stage}, {counts})")
    return int(stage), world_size


def _flat_partitions(files: list[SourceFile], optim: list[dict], stage: int) -> list[list[ByteRun]]:
    """Each rank's fp32 flat tensors (one per parameter group) as file ranges. ZeRO 3 lays every
    parameter at the same offset of each rank's flat space: there all ranks' sizes must agree."""
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flat = []
    for f, state in zip(files, optim):
        groups = state.get(key)
        if not isinstance(groups, list) or not all(isinstance(g, torch.Tensor) for g in groups):
            raise MergeError(f.path, f"{key} is not a list of tensors")
        runs = []
        for i, group in enumerate(groups):
            run = stored_tensor(f.path, f"{key}[{i}]", group, f.size).byte_run(f)
            if group.dtype != torch.float32 or group.dim() != 1 or run is None:
                raise MergeError(f.path, f"{key}[{i}] is not a flat contiguous float32 tensor")
            runs.append(run)
        flat.append(runs)
        same_sizes = [r.length for r in runs] == [r.length for r in flat[0]]
        if len(runs) != len(flat[0]) or (stage == 3 and not same_sizes):
            raise MergeError(
                f.path,
                f"{key} sizes {[r.length // 4 for r in runs]} differ from rank 0's {[r.length // 4 for r in flat[0]]} (a short or mismatched partition)",
            )
    return flat


def _param_shapes(file: SourceFile, model: dict) -> list[dict[str, tuple[int, ...]]]:
    groups = []
    for group in model["param_shapes"]:
        if not isinstance(group, dict):
            raise MergeError(file.path, "param_shapes is not a list of name -> shape dicts")
        groups.append({name: _shape(file, name, shape) for name, shape in group.items()})
    return groups


def _shape(file: SourceFile, name: object, shape: object) -> tuple[int, ...]:
    if not isinstance(name, str) or not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise MergeError(file.path, f"{shown(name)}: shape {shown(shape)} is not a tuple of sizes")
    return tuple(shape)


def _slice(runs: list[ByteRun], start: int, numel: int) -> list[ByteRun]:
    """Elements ``[start, start + numel)`` of the fp32 vector that ``runs`` concatenated make."""
    out, begin, end = [], start * 4, (start + numel) * 4
    position = 0
    for run in runs:
        lo, hi = max(begin, position), min(end, position + run.length)
        if lo < hi:
            out.append(ByteRun(run.file, run.offset + lo - position, hi - lo))
        position += run.length
    return out


def _fp32(name: str, shape: tuple[int, ...], runs: list[ByteRun]) -> PlannedTensor:
    return PlannedTensor(name, shape, torch.float32, StoredBytes(tuple(runs), torch.float32))


def _zero12_params(files, flat, shapes, paddings) -> list[PlannedTensor]:
    world_size = len(files)
    if len(flat[0]) != len(shapes) or not (
        paddings is None or isinstance(paddings, list) and len(paddings) == len(shapes)
    ):
        raise MergeError(
            files[0].path,
            f"{len(flat[0])} fp32 partitions for {len(shapes)} parameter groups in param_shapes (or param_alignment_paddings lacks one list per group)",
        )
    tensors = []
    for g, group in enumerate(shapes):
        vector = [flat[r][g] for r in range(world_size)]  # the group: every rank's partition in rank order
        available = sum(run.length for run in vector) // 4
        group_paddings = paddings[g] if paddings is not None else [0] * len(group)
        if (
            not isinstance(group_paddings, list)
            or len(group_paddings) != len(group)
            or not all(type(p) is int and p >= 0 for p in group_paddings)
        ):
            raise MergeError(
                files[0].path,
                f"param_alignment_paddings[{g}] has {len(group_paddings)} entries but param_shapes lists {len(group)} parameters in group {g} (files of different checkpoints?)",
            )
        offset = 0
        for (name, shape), padding in zip(group.items(), group_paddings):
            numel = math.prod(shape)
            if offset + numel > available:
                raise MergeError(
                    files[-1].path,
                    f"{name}: needs fp32 elements up to {offset + numel} of group {g} but the {world_size} partitions hold {available} (too small for the shapes)",
                )
            tensors.append(_fp32(name, shape, _slice(vector, offset, numel)))
            offset += numel + padding
        # zero_to_fp32's own check: both ends agree once aligned to 2 * world_size (DeepSpeed's padding).
        align = 2 * world_size
        if math.ceil(offset / align) != math.ceil(available / align):
            raise MergeError(
                files[0].path, f"parameter group {g}: the shapes use {offset} of {available} fp32 elements"
            )
    return tensors


def _zero3_params(files, flat, shapes, world_size) -> list[PlannedTensor]:
    rank_numel = sum(run.length for run in flat[0]) // 4
    tensors, offset = [], 0
    for name, shape in ((n, s) for group in shapes for n, s in group.items()):
        numel = math.prod(shape)
        per_rank = math.ceil(numel / world_size)
        if offset + per_rank > rank_numel:
            raise MergeError(
                files[-1].path,
                f"{name}: needs fp32 elements up to {offset + per_rank} of each rank's partition but it holds {rank_numel} (too small for the shapes)",
            )
        runs = [run for r in range(world_size) for run in _slice(flat[r], offset, per_rank)]
        tensors.append(_fp32(name, shape, _cut(runs, numel * 4)))
        offset += per_rank
    if offset != rank_numel:
        raise MergeError(files[0].path, f"the shapes use {offset} of the {rank_numel} fp32 elements of each partition")
    return tensors


def _cut(runs: list[ByteRun], nbytes: int) -> list[ByteRun]:
    """The first ``nbytes`` of the runs: the tail is DeepSpeed's padding."""
    out = []
    for run in runs:
        if nbytes <= 0:
            break
        out.append(ByteRun(run.file, run.offset, min(run.length, nbytes)))
        nbytes -= run.length
    return out


def _stored(file: SourceFile, name: str, tensor: object) -> ByteRun:
    if not isinstance(tensor, torch.Tensor):
        raise MergeError(file.path, f"{name}: expected a tensor, found {type(tensor).__name__}")
    run = stored_tensor(file.path, name, tensor, file.size).byte_run(file)
    if run is None:
        raise MergeError(file.path, f"{name}: tensor is not contiguous in its storage")
    return run


def _buffers(file: SourceFile, model: dict) -> list[PlannedTensor]:
    """Buffers from the module state dict; floating ones as fp32, as zero_to_fp32 restores them."""
    tensors = []
    for name in model["buffer_names"]:
        if name not in model["module"]:
            continue  # non-persistent: not in the state dict, as zero_to_fp32 finds too
        value = model["module"][name]
        run = _stored(file, name, value)
        planned = PlannedTensor(name, tuple(value.shape), value.dtype, StoredBytes((run,), value.dtype))
        if value.is_floating_point() and value.dtype != torch.float32:
            planned = PlannedTensor(name, planned.shape, torch.float32, Computed(lambda p=planned: p.load().float()))
        tensors.append(planned)
    return tensors


def _frozen(files: list[SourceFile], models: list[dict]) -> list[PlannedTensor]:
    """requires_grad=False parameters: whole in the one model file (ZeRO 1/2), or one fragment per
    rank's model file, concatenated and cut to size (ZeRO 3)."""
    shapes = models[0].get("frozen_param_shapes") or {}
    tensors = []
    for name, shape in shapes.items():
        shape = _shape(files[0], name, shape)
        numel = math.prod(shape)
        runs, dtypes = [], set()
        for f, model in zip(files, models):
            fragment = (model.get("frozen_param_fragments") or {}).get(name)
            runs.append(_stored(f, f"frozen_param_fragments[{shown(name)}]", fragment))
            dtypes.add(fragment.dtype)
        if len(dtypes) != 1:
            raise MergeError(files[-1].path, f"frozen parameter {name}: fragments of dtypes {sorted(map(str, dtypes))}")
        dtype = dtypes.pop()
        held, needed = sum(run.length for run in runs), numel * dtype.itemsize
        # ZeRO 1/2 stores the whole tensor; ZeRO 3's fragments may end in padding.
        if held < needed or (len(files) == 1 and held != needed):
            raise MergeError(
                files[-1].path,
                f"frozen parameter {name}: fragments of {held // dtype.itemsize} elements for shape {shape}",
            )
        tensors.append(PlannedTensor(name, shape, dtype, StoredBytes(tuple(_cut(runs, needed)), dtype)))
    return tensors


def _shared(file: SourceFile, model: dict, tensors: list[PlannedTensor]) -> list[PlannedTensor]:
    """Tied parameters DeepSpeed stored once: ``shared_params`` maps each other name to it."""
    by_name = {t.name: t for t in tensors}
    shared = []
    for name, source in model["shared_params"].items():
        if not isinstance(name, str) or not isinstance(source, str):
            raise MergeError(file.path, f"shared_params entry {shown(name)} -> {shown(source)} is not two names")
        if source in by_name:  # as zero_to_fp32: a name tied to nothing saved is left out
            t = by_name[source]
            shared.append(PlannedTensor(name, t.shape, t.dtype, t.source))
    return shared


def _unrecorded_frozen(file: SourceFile, model: dict, tensors: list[PlannedTensor]) -> list[PlannedTensor]:
    """ZeRO 1 saves no ``frozen_param_*`` (DeepSpeed records them only when it partitions gradients),
    so zero_to_fp32 silently leaves frozen parameters out. ZeRO 1/2 keep every parameter whole in the
    module state dict, and a frozen one has no other copy: take what nothing else provides from there."""
    planned = {t.name for t in tensors}
    missing = []
    for name, value in model["module"].items():
        if name not in planned:
            run = _stored(file, name, value)
            missing.append(PlannedTensor(name, tuple(value.shape), value.dtype, StoredBytes((run,), value.dtype)))
    return missing


def _check_unique(file: SourceFile, tensors: list[PlannedTensor]) -> None:
    """A name listed twice (buffer, frozen, trainable, shared) would be two different tensors."""
    seen = set()
    for t in tensors:
        if t.name in seen:
            raise MergeError(
                file.path, f"{t.name} is listed twice among the buffers, frozen, trained and shared parameters"
            )
        seen.add(t.name)


def _strip_wrapper_prefix(tensors: list[PlannedTensor]) -> list[PlannedTensor]:
    """OpenRLHF's Actor wraps the HF model as ``self.model``: its names are ``model.model.*`` and
    ``model.lm_head.*``. Drop that one prefix so the names are the HF model's own."""
    names = [t.name for t in tensors]
    wrapped = all(n.startswith("model.") for n in names) and any(n.startswith("model.model.") for n in names)
    if not wrapped:
        return tensors
    return [PlannedTensor(t.name.removeprefix("model."), t.shape, t.dtype, t.source) for t in tensors]


def holds_a_save(step_dir: Path, stack: StepFolder) -> bool:
    """A tag folder beside ``latest``, or the HF Trainer's ``checkpoint-<N>/`` as a save dir holding it."""
    return (step_dir.parent / LATEST if stack is DEEPSPEED else step_dir / LATEST).is_file()


def completeness(folder: Path, step: int, stack: StepFolder, quiet: Quiet) -> Completeness | None:
    """``latest`` names this tag (or a later one) and every rank's optimizer states are there."""
    if stack is DEEPSPEED:
        return _tag_completeness(folder.parent, folder.name, step, quiet)
    if (folder / LATEST).is_file():  # the HF Trainer's checkpoint-<N>/ as a DeepSpeed save dir
        return _tag_completeness(folder, _named_tag(folder) or "", None, quiet)
    return None


def _tag_completeness(save_dir: Path, tag: str, step: int | None, quiet: Quiet) -> Completeness:
    """``step``: the tag folder's step, for a tag that ``latest`` may have passed already."""
    named = _named_tag(save_dir)
    named_step = DEEPSPEED.name.fullmatch(named) if named else None
    passed = step is not None and named_step is not None and int(named_step.group(1)) > step
    if not named or (named != tag and not passed):
        return quiet.not_yet(
            f"DeepSpeed: {LATEST} names {named or 'nothing'}, not {tag} yet (DeepSpeed writes it after every rank's files)"
        )
    if not is_tag_name(tag) or not (save_dir / tag).is_dir():  # a hostile `latest` leads nowhere else
        return quiet.not_yet(f"DeepSpeed: {LATEST} names {tag!r}, which is no tag folder beside it")
    says = f"DeepSpeed: {LATEST} names {'this tag' if named == tag else f'the later tag {named}'}"
    missing = missing_optimizer_states(save_dir / tag)
    if missing is None:
        return quiet.settled(f"{says}; the model states do not say the dp world size")
    if missing:
        return quiet.not_yet(f"{says}, but {len(missing)} rank file(s) missing: {', '.join(missing[:3])}")
    # an earlier run's `latest` (naming a later tag, or this one) speaks for none of this tag's files written since
    tag_changed = quiet.newest if step is not None else newest_change(save_dir / tag) or quiet.newest
    if not written_after(save_dir / LATEST, tag_changed):
        return quiet.settled(f"{says}, but was written before the tag's last change (an earlier run's?)")
    return quiet.done(f"{says} and every rank's *_optim_states.pt is there")


def _named_tag(save_dir: Path) -> str | None:
    """What ``latest`` names; None when there is none, or it is no small regular file (a FIFO never blocks the tick)."""
    try:
        return read_latest(save_dir / LATEST) or None
    except (MergeError, OSError):
        return None


READER = Reader(
    name="deepspeed",
    looks_for=f"DeepSpeed ZeRO ({LATEST}, *_optim_states.pt)",
    detect=is_deepspeed_dir,
    plan=lambda role_dir, options, config: plan_deepspeed(role_dir),
    weight_suffixes=(".pt",),
    step_folders=(DEEPSPEED, HF_TRAINER),
    saved_in_step_folder=holds_a_save,
    completeness=completeness,
)
