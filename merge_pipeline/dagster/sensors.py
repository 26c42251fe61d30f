"""``new_checkpoint_sensor``: one merge run per complete checkpoint folder (each reader's ``step_folders``) under the watched roots.

Each tick lists the roots (a few directory listings, however many steps there are), skips every key
the cursor already holds, and looks closer only at new folders: already merged -> remembered and
skipped; complete -> a partition and a run (``run_key`` = partition key, so a run is never requested
twice); partial -> left for a later tick. Keys whose folders the trainer deleted leave the cursor.
What cannot be watched (a missing or unreadable root, a step folder whose name does not map to a
partition, an output root inside a checkpoint root) is logged every tick and leads the skip reason,
and partitions whose last merge failed are listed in it.

A partition whose checkpoint the trainer's rotation deleted before it was merged is removed (there is
nothing left to merge); one that was merged keeps its partition, and its merged folder is never
touched. Nothing is removed while a root cannot be read: an unmounted disk is not a rotation.

With ``pin_steps``, a complete step is hard-linked into its pin when its merge is requested, so the
rotation cannot take it first (``pins``); pins of this deployment that no queued or running run will
read are removed (another deployment's pins on the same root are its own).
"""

from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg

from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.dagster.jobs import merge_checkpoint_job
from merge_pipeline.dagster.pins import ACTIVE_RUNS, pin, stale_pins, unpin
from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.store.listing import published
from merge_pipeline.watch.cursor import cursor_keys, sensor_cursor
from merge_pipeline.watch.keys import AUTOMATED_BY
from merge_pipeline.watch.location_settings import PIN_STEPS, SETTLE_SECONDS
from merge_pipeline.watch.partitions import checkpoint_key

if TYPE_CHECKING:
    from merge_pipeline.watch.discovery import Completeness, FoundCheckpoint

SOURCE_TAG = "merge_pipeline/source"


def checkpoint_sensor(names: Names, interval_seconds: int, max_concurrent_merges: int = 0) -> dg.SensorDefinition:
    """Its runs carry no config: hf_model's defaults are the component's ``merge_config``.
    ``max_concurrent_merges``: at most this many runs of this instance's merge and report jobs queued or
    running at once, the rest of the complete steps held back for later ticks (0: request every complete
    step at once, for an instance whose run queue limits them, as this project's ``dagster.yaml`` does)."""

    @dg.sensor(
        name=names("new_checkpoint_sensor"),
        job=merge_checkpoint_job(names),
        minimum_interval_seconds=interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        required_resource_keys={names("settings")},
        description="Merges each complete checkpoint once.\n\nWatches the settings' checkpoint roots (MERGE_PIPELINE_CHECKPOINT_ROOTS) for complete checkpoint folders, in the step folders every format reader declares (each checkpoint event names its stack), and merges each once.",
    )
    def new_checkpoint_sensor(context: dg.SensorEvaluationContext, **_called_with: object) -> dg.SensorResult:
        # (called directly, as in tests, Dagster passes the resources as arguments too; the daemon does not)
        return _tick(context, getattr(context.resources, names("settings")), names, max_concurrent_merges)

    return new_checkpoint_sensor


def _tick(
    context: dg.SensorEvaluationContext, settings: MergeSettings, names: Names, max_concurrent_merges: int
) -> dg.SensorResult:
    # discovery imports the pipeline (torch): imported by a tick, not by the location's load (a run worker's included)
    from merge_pipeline.watch.discovery import completeness

    checkpoint_partitions = names.partitions
    seen = cursor_keys(context.cursor)  # requested (with the step's newest change then) or already merged
    present, complete, requests, waiting, saved, found_merged = set(), [], [], [], [], []
    partitions = context.instance.get_dynamic_partitions(checkpoint_partitions.name)
    failed = _failed_partitions(context.instance, partitions, names)
    scan = settings.find_checkpoints()
    for note in scan.not_watched:
        context.log.warning(note)
    for found in scan.found:
        key = str(found.key)
        present.add(key)
        requested_before = key in seen
        if requested_before and key not in failed:
            continue
        if published(settings.target_dir(found.key)):
            seen.setdefault(key, None)  # merged before (by an earlier run, or by hand with the CLI)
            if key not in partitions:  # e.g. a fresh instance: show it as merged, marked as found
                found_merged.append(key)
                saved.append(_found_merged(found, settings.target_dir(found.key), names))
            continue
        state = completeness(found.role_dir, found.key.step, settings.value(SETTLE_SECONDS))
        if requested_before and seen[key] in (None, state.newest_change):
            seen[key] = state.newest_change  # its merge failed on what is there now: asked again once it changes
            continue
        if not state.complete:
            waiting.append(f"{key} ({state.reason})")
            continue
        complete.append((found, state))
    room = len(complete)
    if max_concurrent_merges:  # a project without a run queue's limits: the sensor keeps the limit itself
        room = max(0, max_concurrent_merges - heavy_runs_in_flight(context.instance, names))
        complete.sort(key=lambda c: (c[0].key.run, c[0].key.step, c[0].key.role))  # the oldest steps first
    held = [str(found.key) for found, _ in complete[room:]]  # not in the cursor: looked at again next tick
    for found, state in complete[:room]:
        key = str(found.key)
        seen[key] = state.newest_change
        # A re-requested step's pin is made again: pin() keeps a pin only if it holds the step's current files.
        # a step in a store is not pinned: objects are immutable, a deleted one fails its merge's next read
        if (
            settings.value(PIN_STEPS)
            and isinstance(found.role_dir, Path)
            and (not_pinned := pin(found.role_dir, settings.pin_space_of(found.role_dir), found.key))
        ):
            context.log.warning(not_pinned)
        requests.append(
            dg.RunRequest(
                run_key=f"{key}@{state.newest_change}",  # one run per step and save: a changed step is merged again
                partition_key=key,
                tags={SOURCE_TAG: str(found.role_dir)},
            )
        )
        saved.append(_checkpoint_saved(found, state, names))
    rotated = (
        [
            k
            for k in partitions
            if k not in present
            and not published(settings.target_dir(checkpoint_key(k)))
            and not settings.pinned(checkpoint_key(k))  # its merge reads the pin
        ]
        if scan.all_roots_read
        else []
    )
    for space, key in stale_pins(context.instance, settings.pin_spaces, {r.partition_key for r in requests}):
        context.log.info(f"removing the pin of {key}: no run of it is queued or running")
        unpin(space, key)
    changes = []
    if rotated:
        context.log.info(
            f"removing {len(rotated)} partition(s) whose checkpoint was deleted before it was merged: {', '.join(rotated[:5])}"
        )
        changes.append(checkpoint_partitions.build_delete_request(rotated))
    if requests or found_merged:
        changes.append(checkpoint_partitions.build_add_request([r.partition_key for r in requests] + found_merged))
    held_back = (
        f"{len(held)} complete checkpoint(s) held back: at most {max_concurrent_merges} merge or report run(s) "
        f"queued or running at once (max_concurrent_merges): {', '.join(held[:5])}"
        if held
        else ""
    )
    if held:
        context.log.info(held_back)
    if requests:
        keys = [r.partition_key for r in requests]
        requested = f"requested {len(keys)} merge(s): {', '.join(keys[:5])}" + (f" | {held_back}" if held else "")
        return dg.SensorResult(
            run_requests=requests,
            dynamic_partitions_requests=changes,
            asset_events=saved,
            cursor=sensor_cursor(_kept(seen, present), requested),
        )
    reason = (
        f"waiting for {len(waiting)} partial checkpoint(s): {'; '.join(waiting[:5])}"
        if waiting
        else f"no new checkpoints ({len(present)} known)"
    )
    if held:
        reason = f"{held_back} | {reason}" if waiting else held_back
    failed = [k for k in failed if k not in rotated]
    if failed:
        reason = f"{reason} | last merge failed for {len(failed)}: {', '.join(failed[:5])} (see Runs; re-execute or backfill them)"
    if scan.not_watched:  # a missing root must not read as "nothing new"
        reason = f"not watched: {'; '.join(scan.not_watched[:5])} | {reason}"
    return dg.SensorResult(
        skip_reason=reason,
        cursor=sensor_cursor(_kept(seen, present), reason),
        dynamic_partitions_requests=changes,
        asset_events=saved,
    )


def heavy_runs_in_flight(instance: dg.DagsterInstance, names: Names) -> int:
    """Runs of this instance's merge, report and average jobs (the sensors', retries, backfills, ``dagster job
    launch``) and its step report automation's queued or running: all read or write every weight."""
    automated = instance.get_runs_count(
        dg.RunsFilter(tags={AUTOMATED_BY: names("step_report_automation")}, statuses=ACTIVE_RUNS)
    )
    return automated + sum(
        instance.get_runs_count(dg.RunsFilter(job_name=names(job), statuses=ACTIVE_RUNS))
        for job in ("merge_checkpoint", "report_merged_step", "average_run")
    )


def _kept(seen: dict[str, float | None], present: set[str]) -> dict[str, float | None]:
    """The cursor's keys whose folders are still there: those the trainer deleted leave it."""
    return {k: v for k, v in seen.items() if k in present}


def _checkpoint_saved(found: "FoundCheckpoint", state: "Completeness", names: Names) -> dg.AssetMaterialization:
    """The trainer's save of this checkpoint, as the external ``checkpoint`` asset's event."""
    metadata = {
        "path": dg.MetadataValue.path(str(found.role_dir)),
        "role": found.key.role,
        "step": found.key.step,
        "stack": found.key.writer,  # as the readers declare the step folder
        "completeness": state.reason,
    }
    return dg.AssetMaterialization(
        asset_key=names.key("checkpoint"),
        partition=str(found.key),
        metadata={**metadata, "written_at": dg.MetadataValue.timestamp(state.newest_change)},
    )


def _found_merged(found: "FoundCheckpoint", target, names: Names) -> dg.AssetMaterialization:
    """A merged folder that was there before this instance knew its checkpoint, recorded as found: not
    merged or checked by this instance, so it shows as materialized rather than missing."""
    return dg.AssetMaterialization(
        asset_key=names.key("hf_model"),
        partition=str(found.key),
        description="found already merged (by an earlier Dagster instance or the CLI); not checked by this instance",
        metadata={
            "path": dg.MetadataValue.path(str(target)),
            "source": dg.MetadataValue.path(str(found.role_dir)),
            "found": True,
        },
    )


def _failed_partitions(instance: dg.DagsterInstance, keys: list[str], names: Names) -> list[str]:
    if not keys:
        return []
    status = instance.get_status_by_partition(names.key("hf_model"), keys, names.partitions) or {}
    return sorted(k for k, s in status.items() if s == dg.AssetPartitionStatus.FAILED)
