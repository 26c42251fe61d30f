"""The merged folder around the weights: side files first, then index, configs and the manifest,
then the blocking checks (``hf/blocking_checks.py``, the same ones Dagster runs) before it is published.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from merge_pipeline import __version__
from merge_pipeline.engine.hf_folder import copy_side_files, write_configs, write_index
from merge_pipeline.engine.outputs import OutputPlan
from merge_pipeline.engine.publish import published_locked
from merge_pipeline.engine.resume import ResumeLog, keep_finished
from merge_pipeline.errors import naming, shown_path
from merge_pipeline.formats import checkpoint_name
from merge_pipeline.hf.evaluation_result import record_in_manifest
from merge_pipeline.hf.manifest import write_manifest
from merge_pipeline.options import MergeOptions
from merge_pipeline.plan import CheckpointPlan, check_unchanged, dtype_name
from merge_pipeline.workers.writing import Prepared, WriteReport, resume_key

if TYPE_CHECKING:
    from merge_pipeline.hf.blocking_checks import CheckOutcome


log = logging.getLogger("merge_pipeline")


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


def _with_input_names(layout: dict) -> dict:
    """An average's inputs each with the checkpoint it was merged from (run, step), for its model card."""
    if "averaged_inputs" not in layout:
        return layout
    named = [{**one, "checkpoint": asdict(checkpoint_name(Path(one["path"])))} for one in layout["averaged_inputs"]]
    return {**layout, "averaged_inputs": named}


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


def record_evaluation(folder: Path, command: str, metrics: dict[str, float], evaluated: dict) -> None:
    """An evaluation's metrics in the published ``folder``'s manifest (``hf.evaluation_result.record_in_manifest``),
    under the folder's lock: no merge replaces the folder while its manifest is rewritten."""
    with published_locked(folder):
        record_in_manifest(folder, command, metrics, evaluated)
