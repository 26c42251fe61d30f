"""The merge, one asset per stage: checkpoint -> parallel_config -> merged_state_dict -> hf_model.

Every asset is partitioned by checkpoint role (``<run_name>/global_step_<N>/<role>``), writes files
under the configured roots, and returns metadata for the UI; nothing large passes through Dagster.
The shards are written into the engine's staging folder beside the target and renamed into place by
``hf_model`` only when the folder is complete, so a failure publishes nothing.
"""

import time
from dataclasses import asdict
from pathlib import Path

import dagster as dg

from merge_pipeline.defs.config import MergeConfig
from merge_pipeline.defs.discovery import completeness
from merge_pipeline.defs.failures import one_line_failure
from merge_pipeline.defs.metadata import table, value
from merge_pipeline.defs.partitions import CheckpointKey, checkpoint_partitions
from merge_pipeline.defs.records import drop_record, read_record, write_record
from merge_pipeline.defs.resources import MergeSettings
from merge_pipeline.defs.weights import WeightJob, write_in_process, write_with_torchrun
from merge_pipeline.engine.hf_folder import copy_side_files
from merge_pipeline.engine.inspect import describe
from merge_pipeline.engine.manifest import MANIFEST
from merge_pipeline.engine.merge import finish_folder, prepare
from merge_pipeline.engine.outputs import MergeOptions, OutputLayout
from merge_pipeline.engine.progress import human_bytes
from merge_pipeline.engine.publish import locked_target
from merge_pipeline.errors import MergeError
from merge_pipeline.formats import detect_backend

GROUP = "merge"
MERGE_POOL = "merge"  # dagster.yaml gives every pool one slot: one heavy merge at a time

_partitioned = dict(partitions_def=checkpoint_partitions, group_name=GROUP)


@dg.asset(**_partitioned, kinds={"pytorch"})
def checkpoint(context: dg.AssetExecutionContext, settings: MergeSettings) -> dg.MaterializeResult:
    """A trainer's role folder, found under a checkpoint root: complete, and in a format we read."""
    with one_line_failure():
        key = CheckpointKey.parse(context.partition_key)
        role_dir = settings.role_dir(key)
        state = completeness(role_dir, key.step, settings.settle_seconds)
        if not state.complete:
            raise MergeError(role_dir, f"incomplete checkpoint: {state.reason}")
        backend = detect_backend(role_dir)
        files = [{"file": p.relative_to(role_dir).as_posix(), "bytes": p.stat().st_size} for p in sorted(role_dir.rglob("*")) if p.is_file()]
        total = sum(f["bytes"] for f in files)
        record = {"path": str(role_dir), "backend": backend, "completeness": state.reason, "written_at": state.newest_change, "files": files}
        write_record(settings, key, "checkpoint", record)
    return dg.MaterializeResult(
        metadata={
            "path": dg.MetadataValue.path(str(role_dir)),
            "backend": backend,
            "role": key.role,
            "step": key.step,
            "completeness": state.reason,
            "size": human_bytes(total),
            "bytes": total,
            "files": table(files, {"file": "string", "bytes": "int"}),
        }
    )


@dg.asset(**_partitioned, deps=[checkpoint], kinds={"pytorch"})
def parallel_config(context: dg.AssetExecutionContext, settings: MergeSettings) -> dg.MaterializeResult:
    """How the checkpoint was sharded (world size, mesh or TP/PP/EP), its dtypes and parameter count.

    Reads every rank's metadata (no tensor data) and checks that the shards add up.
    """
    with one_line_failure():
        key = CheckpointKey.parse(context.partition_key)
        found = read_record(settings, key, "checkpoint")
        info = describe(Path(found["path"]), backend=found["backend"])
        write_record(settings, key, "parallel_config", info)
    facts = {k: v for k, v in info.items() if k not in ("path", "files", "role", "dtypes")}
    return dg.MaterializeResult(
        metadata={
            **{k: value(v) for k, v in facts.items()},
            "dtypes": table([{"dtype": d, "parameters": n} for d, n in info["dtypes"].items()], {"dtype": "string", "parameters": "int"}),
            "size": human_bytes(info["bytes"]),
        }
    )


@dg.asset(**_partitioned, deps=[parallel_config], pool=MERGE_POOL, kinds={"safetensors"})
def merged_state_dict(context: dg.AssetExecutionContext, config: MergeConfig, settings: MergeSettings) -> dg.MaterializeResult:
    """The merged weights, streamed into safetensors shards in a staging folder beside the target."""
    with one_line_failure():
        key = CheckpointKey.parse(context.partition_key)
        source = read_record(settings, key, "parallel_config")
        options = config.options()
        # Under the target's lock, as a CLI merge: a merge running there makes this step fail, not lose its staging.
        with locked_target(settings.target_dir(key), source=source["path"], overwrite=options.overwrite) as locked:
            drop_record(settings, key, "merged_state_dict")
            staging = locked.new_staging()
            try:
                job = WeightJob(Path(source["path"]), source["backend"], staging, options)
                written = write_with_torchrun(context, job, config) if config.launcher == "torchrun" else write_in_process(job)
            except BaseException:
                locked.discard_staging()
                raise
        report = written.report
        record = {"staging": str(staging), "options": asdict(options), "files": report.files, "seconds": report.seconds, "peak_rss_bytes": written.peak_rss_bytes}
        write_record(settings, key, "merged_state_dict", record)
    throughput = report.bytes / max(report.seconds, 1e-9)
    return dg.MaterializeResult(
        metadata={
            "staging": dg.MetadataValue.path(str(staging)),
            "tensors": report.tensors,
            "size": human_bytes(report.bytes),
            "bytes": report.bytes,
            "seconds": round(report.seconds, 3),
            "throughput": f"{human_bytes(throughput)}/s",
            "peak_rss": human_bytes(written.peak_rss_bytes),
            "peak_rss_bytes": written.peak_rss_bytes,
            "dtype": options.dtype,
            "max_shard_size": str(options.max_shard_size),
            "launcher": config.launcher if config.launcher == "inprocess" else f"torchrun x{config.nproc_per_node * config.nnodes}",
            "shards": table(report.files, {"filename": "string", "tensors": "int", "bytes": "int"}),
        }
    )


@dg.asset(**_partitioned, deps=[merged_state_dict], kinds={"huggingface"})
def hf_model(context: dg.AssetExecutionContext, settings: MergeSettings) -> dg.MaterializeResult:
    """The complete Hugging Face folder (weights, index, config, tokenizer, manifest), published atomically."""
    with one_line_failure():
        key = CheckpointKey.parse(context.partition_key)
        source = read_record(settings, key, "parallel_config")
        weights = read_record(settings, key, "merged_state_dict")
        options = MergeOptions(**weights["options"])
        target = settings.target_dir(key)
        with locked_target(target, source=source["path"], overwrite=options.overwrite) as locked:
            try:
                plan, config, layout = prepare(source["path"], options, source["backend"])
                with plan:
                    _check_staged(locked.staging, weights["files"], layout)
                    copy_side_files(config.path.parent, locked.staging, options.max_side_file_size, confine_to=config.confine_to)
                    manifest = finish_folder(plan, config, layout, locked.staging, options)
                locked.publish()
            finally:
                locked.discard_staging()  # gone by rename on success; never half-published
                drop_record(settings, key, "merged_state_dict")
    files = [{"file": name, "bytes": f["size"], "sha256": f["sha256"]} for name, f in manifest["files"].items()]
    total = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    written_at = read_record(settings, key, "checkpoint")["written_at"]
    return dg.MaterializeResult(
        metadata={
            "path": dg.MetadataValue.path(str(target)),
            "size": human_bytes(total),
            "bytes": total,
            "parameters": manifest["parameters"],
            "manifest": dg.MetadataValue.path(str(target / MANIFEST)),
            "seconds_since_checkpoint_written": round(time.time() - written_at, 1),
            "files": table(files, {"file": "string", "bytes": "int", "sha256": "string"}),
        }
    )


def _check_staged(staging: Path, files: list[dict], layout: OutputLayout) -> None:
    """The staging folder holds exactly the shards ``merged_state_dict`` wrote, for this very layout."""
    planned = sorted(f.filename for f in layout.files)
    if sorted(f["filename"] for f in files) != planned:
        raise MergeError(staging, f"holds shards {sorted(f['filename'] for f in files)} but the merge plan now says {planned}: materialize merged_state_dict again")
    for f in files:
        path = staging / f["filename"]
        size = path.stat().st_size if path.is_file() else None
        if size != f["bytes"]:
            raise MergeError(path, f"is {'missing' if size is None else f'{size} bytes'}, merged_state_dict wrote {f['bytes']} bytes: materialize it again")


defs = dg.Definitions(assets=[checkpoint, parallel_config, merged_state_dict, hf_model])
