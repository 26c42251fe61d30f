"""The merge, start to end: the only module that uses both the readers (``formats``) and the writer (``engine``).

prepare   open and validate the checkpoint, decide every output file (no tensor data read)
write     side files, then the weights, into a staging folder
finish    index, configs and the manifest (reusing the digests computed while writing)
check     the blocking checks (``hf/blocking_checks.py``), the same ones Dagster runs
publish   ``staged_output``: the one staging folder + target lock, renamed into place on success
merge     THE sequence of the above, written once: the CLI, torchrun ranks, the Dagster step and its
          launchers all run ``merge`` and differ only in the ``Workers`` they pass (``workers``: who
          writes which weight files, how workers agree); so every one of them resumes a killed merge.
describe / compare   for ``inspect`` and ``test``
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from merge_pipeline import __version__
from merge_pipeline.engine.averaging import AveragedInput, average_plan
from merge_pipeline.engine.fp8 import fp8_outputs
from merge_pipeline.engine.hf_folder import copy_side_files, write_configs, write_index
from merge_pipeline.engine.lora import model_tensors
from merge_pipeline.engine.outputs import DTYPES, OutputPlan, config_dtype_for, plan_outputs
from merge_pipeline.engine.publish import check_target
from merge_pipeline.engine.publish import published_locked as published_locked  # an evaluation's manifest entry
from merge_pipeline.engine.publish import staged_output as staged_output  # the one staging + lock API
from merge_pipeline.engine.publish import staging_path as staging_path
from merge_pipeline.engine.quantize import quantized_outputs
from merge_pipeline.engine.resume import ResumeLog, keep_finished
from merge_pipeline.engine.resume import forget as forget_finished
from merge_pipeline.engine.verify import Comparison, compare_with_reference
from merge_pipeline.errors import MergeError, naming, printable, shown_path
from merge_pipeline.formats import BACKENDS as BACKENDS

# The sensor's questions, answered by the readers: which folders are step folders, whether one holds
# a save itself, and whether a save is complete (and why not).
from merge_pipeline.formats import Completeness as Completeness
from merge_pipeline.formats import checkpoint_name, open_checkpoint
from merge_pipeline.formats import completeness as completeness
from merge_pipeline.formats import newest_change as newest_change
from merge_pipeline.formats import saved_in_step_folder as saved_in_step_folder
from merge_pipeline.formats import step_folder as step_folder
from merge_pipeline.formats import step_folders as step_folders
from merge_pipeline.formats.base_model import with_base_weights
from merge_pipeline.hf.config import CheckpointConfig, ModelConfig
from merge_pipeline.hf.fp8 import refuse_quantized
from merge_pipeline.hf.lora import has_lora_tensors, is_adapter_only
from merge_pipeline.hf.manifest import write_manifest
from merge_pipeline.options import MergeOptions
from merge_pipeline.plan import CheckpointPlan, check_unchanged, dtype_name
from merge_pipeline.progress import human_bytes
from merge_pipeline.storage import (
    invalidate_target,
    is_store_url,
    local_twin,
    publish_folder,
    viewed,
)
from merge_pipeline.store_lock import StoreTargetLock, locked_store_target
from merge_pipeline.store_uploads import abort_incomplete_uploads
from merge_pipeline.target_rules import check_store_target, refuse_overlap
from merge_pipeline.workers.in_process import IN_PROCESS, Workers
from merge_pipeline.workers.writing import Prepared, WeightJob, WriteReport, Written, resume_key

if TYPE_CHECKING:
    from merge_pipeline.hf.architecture import ExpectedTensors
    from merge_pipeline.hf.blocking_checks import CheckOutcome

log = logging.getLogger("merge_pipeline")


@dataclass
class MergeResult:
    target_dir: Path | str  # a path, or the store URL published to
    prepared: Prepared  # closed: the plan's metadata and decisions, no open file
    written: Written
    manifest: dict
    checks: list[CheckOutcome]  # the blocking checks, all passed on the published folder
    seconds: float

    @property
    def parameters(self) -> int:
        return self.prepared.plan.parameter_count

    @property
    def tensors(self) -> int:
        return self.written.report.tensors

    @property
    def tensor_bytes(self) -> int:  # bytes of tensor data written (file sizes add the headers)
        return self.prepared.outputs.total_bytes


def prepare(local_dir: str | Path, options: MergeOptions) -> Prepared:
    """Open and validate the checkpoint and decide every output file, reading no tensor data.

    The model config is resolved here, once: the readers that need it to plan ask the same one.
    With ``options.average_inputs``: the plan of their average (``_prepare_average``). ``local_dir`` and
    ``options.hf_model_path`` may be store URLs: read through local views, kept while the plan is
    (``CheckpointPlan.views``)."""
    if options.average_inputs:
        return _prepare_average(local_dir, options)
    return _prepare_one(local_dir, options)


def _prepare_one(local_dir: str | Path, options: MergeOptions, *, merged: bool = False) -> Prepared:
    views = contextlib.ExitStack()
    try:
        local_dir = views.enter_context(viewed(local_dir))
        if options.hf_model_path and is_store_url(options.hf_model_path):
            options = replace(options, hf_model_path=str(views.enter_context(viewed(options.hf_model_path))))
        configs = CheckpointConfig.of(local_dir, options)
        plan = open_checkpoint(local_dir, options, configs, merged=merged)
    except BaseException:
        views.close()
        raise
    plan.views.enter_context(views)
    try:
        if options.hf_model_path and is_adapter_only(plan.tensors):
            plan = with_base_weights(plan, Path(options.hf_model_path).absolute())
        config = configs.load(plan.hf_dir)
        if options.dtype == "fp8":
            refuse_quantized(plan.tensors, plan.role_dir)  # said before the architecture check names the scales
        expected = _architecture_tensors(plan, config, options) if plan.check_against_architecture else None
        if expected is not None:
            plan = _with_inert_tensors(plan, expected)
        outputs = plan_outputs(plan, config, options)
        if expected is not None:
            _check_against_architecture(outputs, expected, config)
        if options.dtype == "fp8":
            outputs = fp8_outputs(outputs, options.fp8_block_size, options.max_shard_size, plan.role_dir)
        if options.quantize:
            outputs = _quantized(outputs, options, plan.role_dir)
    except BaseException:
        plan.close()
        raise
    return Prepared(plan, config, outputs)


def _prepare_average(local_dir: str | Path, options: MergeOptions) -> Prepared:
    """Averaging: each input (a role folder or a merged HF folder) planned as a merge of it
    alone, then one plan whose tensors are their weighted average, computed while written; ``local_dir``,
    one of the inputs, gives the config and the side files. The merge sequence runs on it unchanged."""
    # the cast and the quantization come after the sum
    alone = replace(options, average_inputs=(), average_weights=(), dtype="auto", quantize=None, quantize_ignore=())
    inputs: list[AveragedInput] = []
    configs: dict[Path, ModelConfig] = {}
    try:
        for path, weight in zip(options.average_inputs, options.average_weights, strict=True):
            one = _prepare_one(path, alone, merged=True)
            inputs.append(AveragedInput(one.plan, one.outputs, weight))
            configs[one.plan.role_dir] = one.config
        # local_dir names one of the inputs: its folder as planned (a store input's is its local view)
        named, wanted = [_named_folder(path) for path in options.average_inputs], _named_folder(local_dir)
        reference = inputs[named.index(wanted)].plan.role_dir if wanted in named else Path(local_dir).absolute()
        plan, outputs = average_plan(
            inputs,
            reference,
            dtype=DTYPES.get(options.dtype),
            accumulate=options.average_accumulate,
            max_shard_size=options.max_shard_size,
        )
        if options.dtype == "fp8":  # the average, quantized
            outputs = fp8_outputs(outputs, options.fp8_block_size, options.max_shard_size, reference)
        if options.quantize:  # the average, quantized
            outputs = _quantized(outputs, options, reference)
    except BaseException:
        for one in inputs:
            one.plan.close()
        raise
    for one in inputs:  # a store input's view lives as long as the average's plan reads through it
        plan.views.enter_context(one.plan.views.pop_all())
    return Prepared(plan, configs[reference], outputs)


def _named_folder(location: str | Path) -> str:
    """A folder as its name is compared: a store URL as written, a local path made absolute."""
    return str(location).rstrip("/") if is_store_url(location) else str(Path(location).absolute())


# Imported in the functions below: hf.architecture imports transformers (~1.3 s, ~35 MB), which FSDP never needs.


def _architecture_tensors(plan: CheckpointPlan, config: ModelConfig, options: MergeOptions) -> ExpectedTensors:
    """The tensors (names, shapes) of the architecture config.json describes."""
    from merge_pipeline.hf.architecture import expected_tensors

    return expected_tensors(
        config.path.parent, value_model=plan.writes_value_model(options), trust_remote_code=options.trust_remote_code
    )


def _with_inert_tensors(plan: CheckpointPlan, expected: ExpectedTensors) -> CheckpointPlan:
    """The plan with the expected tensors no checkpoint stores because they cannot change the output
    (e.g. a zero-width shared expert), as zeros: so from_pretrained misses nothing."""
    from merge_pipeline.hf.architecture import inert_absent_tensors

    inert = inert_absent_tensors(model_tensors(plan.tensors), expected)
    return replace(plan, tensors=plan.tensors + inert) if inert else plan


def _check_against_architecture(outputs: OutputPlan, expected: ExpectedTensors, config: ModelConfig) -> None:
    """Key set and every shape against the architecture, so nothing is dropped silently and nothing
    the model needs is left out."""
    from merge_pipeline.hf.architecture import check_plan_against_architecture

    check_plan_against_architecture(outputs.planned_tensors, expected, config.path)


def write_side_files(prepared: Prepared, out_dir: Path, options: MergeOptions) -> None:
    """Tokenizer and friends, first: a trainer deleting the checkpoint mid-merge cannot take them away.

    Every entry point calls this once, just before the weights: the blocking checks' worker starts here
    (``hf/check_worker.py``: it imports transformers in its own process while the weights are written)."""
    from merge_pipeline.hf.check_worker import start_beside

    config = prepared.config
    copy_side_files(config.path.parent, out_dir, options.max_side_file_size, confine_to=config.confine_to)
    start_beside(config.raw, out_dir)


def resume_killed(prepared: Prepared, staging: Path, options: MergeOptions) -> ResumeLog:
    """The lead, before any writing: what a killed merge of the same inputs and options finished in
    ``staging`` (checked), the rest removed."""
    return keep_finished(staging, resume_key(prepared, options), prepared.outputs.files)


def finish_folder(prepared: Prepared, out_dir: Path, options: MergeOptions, written: WriteReport) -> dict:
    """Index, configs and manifest: everything but the weights and the side files.

    ``written``: the report of the weights written into ``out_dir``; the manifest takes their sha256
    from it rather than reading the weights again. Last, every input file is checked to be still the
    one planned, unchanged: a trainer re-saving the step meanwhile would leave a folder mixing two saves.
    Every writer (the CLI, torchrun rank 0 once all ranks wrote, the Dagster asset) publishes only after.
    """
    plan, config, outputs = prepared
    with naming(out_dir):
        write_index(outputs, out_dir)
        write_configs(config, outputs, out_dir)
        known = {f["filename"]: f["sha256"] for f in written.files}
        manifest = write_manifest(out_dir, manifest_body(plan, outputs, options), known)
    check_unchanged(plan.files)
    return manifest


def manifest_body(plan: CheckpointPlan, outputs: OutputPlan, options: MergeOptions) -> dict:
    # Imported here, as the checks: they import transformers (~1 s), which inspect and test of FSDP never need.
    from merge_pipeline.hf.blocking_checks import CHECK_NAMES

    name = checkpoint_name(Path(shown_path(plan.role_dir)))  # a store's checkpoint by its URL, not its view
    return {
        "tool": {"name": "merge_pipeline", "version": __version__},
        "source": {
            "backend": plan.backend,
            "role_dir": shown_path(plan.role_dir),
            "role": name.role,
            "checkpoint": asdict(name),
            "layout": _with_input_names(plan.layout),
            "inputs": [{"path": shown_path(f.path), "size": f.size} for f in plan.files],
        },
        "options": asdict(options),
        "decisions": {
            "config_dtype": dtype_name(outputs.config_dtype),
            "tensor_dtypes": _dtype_decisions(outputs),
            "tied_word_embeddings": outputs.tied,
            "dropped_tensors": outputs.dropped,
            "value_model": outputs.is_value_model,
            "lora": {
                "r": outputs.lora.r,
                "lora_alpha": outputs.lora.lora_alpha,
                "merged": options.merge_lora,
                "target_modules": outputs.lora_targets,
            }
            if outputs.lora
            else None,
            **({"fp8": outputs.fp8.summary()} if outputs.fp8 else {}),
            **({"quantization": outputs.quantization.summary()} if outputs.quantization else {}),
        },
        "parameters": plan.parameter_count,
        "tensors": sum(len(f.tensors) for f in outputs.files),
        # Written before they run: the folder is published only if all of them passed on it.
        "checks_before_publishing": CHECK_NAMES,
    }


def check_before_publishing(staging: Path, target: Path, written: WriteReport) -> list[CheckOutcome]:
    """The blocking checks, on the complete staging folder, for the CLI and Dagster's ``hf_model`` alike:
    any failure is one line (``BlockingChecksFailed``, carrying every outcome); when all passed, their outcomes
    (Dagster records them as the asset checks of ``hf_model``).

    ``written``: the report of the weights written into ``staging`` (its digests: no weight byte is read again)."""
    from merge_pipeline.hf.blocking_checks import CHECK_NAMES, BlockingChecksFailed
    from merge_pipeline.hf.check_worker import checks_on

    started = time.monotonic()
    outcomes = checks_on(staging, written.by_file)
    if not all(o.passed for o in outcomes):
        raise BlockingChecksFailed(target, outcomes)
    log.info("blocking checks passed (%s) in %.1f s", ", ".join(CHECK_NAMES), time.monotonic() - started)
    return outcomes


def _dtype_decisions(outputs: OutputPlan) -> dict[str, int]:
    """Counts of ``source -> output`` dtype pairs, so a lossy cast is visible in the manifest."""
    counts = Counter(
        f"{dtype_name(t.planned.dtype)} -> {dtype_name(t.dtype)}" for f in outputs.files for t in f.tensors
    )
    return dict(counts)


def merge(
    local_dir: str | Path,
    target_dir: str | Path,
    options: MergeOptions | None = None,
    *,
    workers: Workers = IN_PROCESS,
    show_progress: bool = True,
) -> MergeResult | None:
    """The merge sequence: check the target, plan, lock and stage (resuming a killed merge), side files,
    weights, folder, blocking checks, publish. The lead returns the result, other workers ``None``.

    Every worker runs the same steps in the same order (the collectives of a distributed ``workers``)."""
    started = time.monotonic()
    options = options or MergeOptions()
    # A target in a store is built in a folder of this machine named by its URL (the same lock, staging,
    # resume and checks as a local target), then uploaded with the manifest last (``storage.publish_folder``).
    store_target = str(target_dir).rstrip("/") if is_store_url(target_dir) else None
    target = local_twin(store_target) if store_target else Path(target_dir).absolute()
    overwrite = options.overwrite or store_target is not None  # the twin is ours; the store's target is checked
    source = local_dir if is_store_url(local_dir) else Path(local_dir)
    inputs = (source, *options.average_inputs, *([options.hf_model_path] if options.hf_model_path else []))

    def checked_and_prepared() -> Prepared:  # the target rules (``target_rules``), before any work
        refuse_overlap(store_target or target, inputs)
        if store_target:
            check_store_target(store_target, overwrite=options.overwrite)
        check_target(target, source=source, overwrite=overwrite)  # a store target's: its local twin
        return prepare(source, options)

    prepared = workers.everywhere(checked_and_prepared)
    merged_from = _merged_from(prepared, options)  # while a store's view is open: its URL
    job = WeightJob(source, staging_path(target), options, upload_to=store_target)
    store_lock: list[StoreTargetLock | None] = []  # the lead's, once taken
    with prepared, contextlib.ExitStack() as store_locked, contextlib.ExitStack() as publishing:

        def open_staging() -> tuple[dict[str, dict], str | None]:
            if store_target:  # held until the upload ends: the local twin's lock keeps out this machine only
                store_lock.append(store_locked.enter_context(locked_store_target(store_target)))
                abort_incomplete_uploads(store_target)  # a killed merge's: no live merge holds the lock
            token = store_lock[0].guard.token if store_lock and store_lock[0] else None
            publishing.enter_context(staged_output(target, source=source, overwrite=overwrite, keep_killed=True))
            kept = resume_killed(prepared, job.staging, options).finished
            if store_target:  # before the first upload
                names = {f.filename for f in prepared.outputs.files}
                invalidate_target(store_target, names, replace(job, lock_token=token).guard())
            write_side_files(prepared, job.staging, options)
            return kept, token

        kept, token = workers.share(workers.on_lead(open_staging))
        job = replace(job, kept=kept, lock_token=token)
        written = workers.write(job, prepared, show_progress=show_progress)

        def finish_and_publish() -> tuple[dict, list[CheckOutcome]]:
            forget_finished(job.staging)
            manifest = finish_folder(prepared, job.staging, options, written.report)
            checks = check_before_publishing(job.staging, target, written.report)
            publishing.close()  # leaves staged_output cleanly: the rename into place happens here
            if store_target:
                publish_folder(target, store_target, manifest, guard=job.guard())
                shutil.rmtree(target)  # the twin: uploaded, no longer needed
            return manifest, checks

        finished = workers.on_lead(finish_and_publish)
    if not workers.lead:
        return None
    manifest, checks = finished
    result = MergeResult(store_target or target, prepared, written, manifest, checks, time.monotonic() - started)
    log.info(
        "%s -> %s: %d tensors, %s of safetensors files in %.1f s",
        merged_from,
        result.target_dir,
        result.tensors,
        human_bytes(written.report.bytes),
        result.seconds,
    )
    return result


def _with_input_names(layout: dict) -> dict:
    """An average's inputs each with the checkpoint it was merged from (run, step), for its model card."""
    if "averaged_inputs" not in layout:
        return layout
    named = [{**one, "checkpoint": asdict(checkpoint_name(Path(one["path"])))} for one in layout["averaged_inputs"]]
    return {**layout, "averaged_inputs": named}


def _merged_from(prepared: Prepared, options: MergeOptions) -> str:
    """What the log says was merged, as the user named it: a store's URL, every input of an average."""
    if options.average_inputs:
        return f"averaged {', '.join(map(printable, options.average_inputs))}"
    return f"merged {printable(shown_path(prepared.plan.role_dir))}"


def describe(local_dir: str | Path, options: MergeOptions) -> dict:
    """``inspect``: what a checkpoint holds, from metadata only."""
    with viewed(local_dir) as folder:
        configs = CheckpointConfig.of(folder, options)
        with open_checkpoint(folder, options, configs) as plan:
            try:
                config = configs.load(plan.hf_dir)
            except MergeError as exc:  # a checkpoint without a config is still described
                config = exc
            return checkpoint_facts(plan, options, config)


def checkpoint_facts(plan: CheckpointPlan, options: MergeOptions, config: ModelConfig | MergeError) -> dict:
    """What an opened checkpoint is: ``inspect`` prints these, Dagster's ``parallel_config`` shows them.

    ``config``: the config the merge resolved, or why there is none."""
    dtypes = Counter()
    for t in plan.tensors:
        dtypes[dtype_name(t.dtype)] += t.numel
    if isinstance(config, MergeError):
        architecture, tied, config = f"unknown ({config.problem})", None, None
    else:
        architecture, tied = config.architecture, config.tie_word_embeddings
    return {
        "backend": plan.backend,
        "role": checkpoint_name(plan.role_dir).role,
        "path": shown_path(plan.role_dir),
        **plan.layout,
        "architecture": architecture,
        "parameters": plan.parameter_count,
        "tensors": len(plan.tensors),
        "dtypes": dict(dtypes),
        "config_dtype": dtype_name(config_dtype_for(plan.tensors, options)),  # what --dtype writes to config.json
        "bytes": sum(t.nbytes() for t in plan.tensors),
        "lora": has_lora_tensors(plan.tensors),
        "value_model": plan.is_value_model,
        "tied_word_embeddings": tied,
        "files": [{"path": shown_path(f.path), "size": f.size} for f in plan.files],
        **({"fp8": _fp8_plan(plan, config, options)} if options.dtype == "fp8" and config else {}),
        **({"quantization": _quantization_plan(plan, config, options)} if options.quantize and config else {}),
    }


def _quantized(outputs: OutputPlan, options: MergeOptions, where: Path) -> OutputPlan:
    return quantized_outputs(outputs, options.quantize, options.quantize_ignore, options.max_shard_size, where)


def _quantization_plan(plan: CheckpointPlan, config: ModelConfig, options: MergeOptions) -> dict:
    """``inspect --quantize``: what a merge would quantize and keep (after LoRA folding and tying)."""
    return _quantized(plan_outputs(plan, config, options), options, plan.role_dir).quantization.summary()


def _fp8_plan(plan: CheckpointPlan, config: ModelConfig, options: MergeOptions) -> dict:
    """``inspect --dtype fp8``: what a merge would quantize and keep (after LoRA folding and tying)."""
    outputs = fp8_outputs(
        plan_outputs(plan, config, options), options.fp8_block_size, options.max_shard_size, plan.role_dir
    )
    return outputs.fp8.summary()


def compare(
    local_dir: str | Path, reference_dir: str | Path, options: MergeOptions, *, atol: float = 0.0
) -> Comparison:
    """``test``: what the checkpoint merges to, tensor by tensor against a reference HF folder (or a merged
    folder in a store, refused while its ``merge_manifest.json`` is missing)."""
    with viewed(reference_dir, merged=True) as reference, prepare(local_dir, options) as prepared:
        return compare_with_reference(prepared.outputs, reference.absolute(), atol=atol)
