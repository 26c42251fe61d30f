"""``promote_best_steps``: with ``promote_best_by`` set, the sensor that promotes each run's best evaluated step.

At each tick, for every run (its partitions grouped by run and role, as promotion's ``promoted/<run>/<role>``
and the Hub's repo group them), it takes the steps whose latest ``evaluation`` is newer than their latest
merge (one whose blocking checks passed), reported the metric, and met ``evaluation_threshold`` where one is
set; the best value wins, a tie goes to the newest step. It requests ``promote_step`` for that partition
once per evaluation (``run_key``: the partition and the evaluation's storage id), unless the step is
already the run's promoted one (the latest ``promoted_model`` materialization among the run's partitions).
It waits until ``hub_model`` published the step's latest merge (promotion commits that upload to ``main``; the
component defines the sensor only with a Hub organization), and does not fall back to a lesser step meanwhile.
"""

from __future__ import annotations

from collections import defaultdict

import dagster as dg

from merge_pipeline.checkpoint_name import CheckpointName
from merge_pipeline.dagster.checks import passed_every_check
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.dagster.records import latest_materialization
from merge_pipeline.hf.evaluation_result import BestBy
from merge_pipeline.watch.keys import THRESHOLD_MET
from merge_pipeline.watch.partitions import checkpoint_key


def promote_best_sensor(
    names: Names, job: dg.UnresolvedAssetJobDefinition, best_by: BestBy, gated: bool, interval_seconds: int
) -> dg.SensorDefinition:
    """The sensor (defined only with ``promote_best_by``); ``gated``: an evaluation threshold is set."""

    @dg.sensor(
        name=names("promote_best_steps"),
        job=job,
        minimum_interval_seconds=interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,  # defined only when a user asked for it
        description=f"Promotes each run's best evaluated step by {best_by}.\n\n"
        "Once per evaluation that makes a step the best of its run (ties: the newest step), unless it is "
        "already the promoted one; never a step whose evaluation missed the threshold.",
    )
    def promote_best_steps(context: dg.SensorEvaluationContext):
        return _best_steps(context, names, best_by, gated)

    return promote_best_steps


def _best_steps(context: dg.SensorEvaluationContext, names: Names, best_by: BestBy, gated: bool):
    instance = context.instance
    runs: dict[tuple[str, str], list[CheckpointName]] = defaultdict(list)
    for partition in instance.get_dynamic_partitions(names.partitions.name):
        key = checkpoint_key(partition)
        runs[(key.run, key.role)].append(key)
    requests = []
    for steps in runs.values():
        best = _best_of(instance, names, best_by, gated, steps)
        if best is None:
            continue
        key, evaluated, merged = best
        if _promoted(instance, names, steps) == str(key):
            continue
        published = latest_materialization(instance, names.key("hub_model"), str(key))
        if published is None or published.storage_id < merged.storage_id:
            context.log.info(f"{key}: the best by {best_by}, promoted once hub_model published its latest merge")
            continue
        requests.append(dg.RunRequest(run_key=f"{key}@{evaluated.storage_id}", partition_key=str(key)))
    return requests or dg.SkipReason(f"no step to promote from {len(runs)} run(s)")


def _best_of(
    instance: dg.DagsterInstance, names: Names, best_by: BestBy, gated: bool, steps: list[CheckpointName]
) -> tuple[CheckpointName, dg.EventLogRecord, dg.EventLogRecord] | None:
    """The step with the best metric among those evaluated since their latest checked merge, with the two records."""
    candidates = []
    for key in steps:
        merged = latest_materialization(instance, names.key("hf_model"), str(key))
        evaluated = latest_materialization(instance, names.key("evaluation"), str(key))
        if merged is None or evaluated is None or evaluated.storage_id < merged.storage_id:
            continue
        if not passed_every_check(merged.asset_materialization.metadata):
            continue
        metadata = evaluated.asset_materialization.metadata
        met = metadata.get(THRESHOLD_MET)
        if best_by.metric not in metadata or (gated and not (met and met.value)):
            continue
        candidates.append((best_by.rank(metadata[best_by.metric].value), key.step or 0, key, evaluated, merged))
    if not candidates:
        return None
    *_, key, evaluated, merged = max(candidates, key=lambda c: c[:2])
    return key, evaluated, merged


def _promoted(instance: dg.DagsterInstance, names: Names, steps: list[CheckpointName]) -> str | None:
    """The run's promoted step: the partition of the latest promoted_model materialization among its steps."""
    records = [latest_materialization(instance, names.key("promoted_model"), str(key)) for key in steps]
    latest = max((r for r in records if r is not None), key=lambda r: r.storage_id, default=None)
    return latest.partition_key if latest else None
