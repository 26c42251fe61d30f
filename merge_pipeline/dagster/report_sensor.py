"""``step_report_sensor``: the step report of every merge, in a run of its own once that merge succeeded.

The report is not part of the merge run: Dagster plans every asset check of a run when it creates the
run and shows a planned check of a failed run as "Execution failed", so a merge run that selected
``step_report`` would paint its checks for a report that never ran. Each tick reads ``hf_model``'s
materializations newer than the cursor (a storage id). Each is a merge that passed the blocking checks
and was published (a failed merge materializes nothing); its partition gets a report run unless a
report newer than that merge exists (``run_key`` = partition@storage id: once per merge). A folder the
checkpoint sensor recorded as found was merged by no run of this instance: it gets no report.
"""

from __future__ import annotations

import dagster as dg

from merge_pipeline.dagster.checks import passed_every_check
from merge_pipeline.dagster.jobs import report_job
from merge_pipeline.dagster.names import Names
from merge_pipeline.dagster.records import latest_materialization
from merge_pipeline.dagster.sensors import heavy_runs_in_flight

BATCH = 200  # merges looked at per tick; the cursor moves on, so a longer backlog takes a few ticks


def step_report_sensor_definition(
    names: Names, interval_seconds: int, max_concurrent_merges: int = 0
) -> dg.SensorDefinition:
    """``max_concurrent_merges``: no report requested while this many merge or report runs of this
    instance are queued or running (0: leave it to the instance's run queue)."""

    @dg.sensor(
        name=names("step_report_sensor"),
        job=report_job(names),
        minimum_interval_seconds=interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Requests the step report of each merged step.\n\nAfter each successful merge (a new hf_model materialization), materializes that partition's step_report in a run of its own.",
    )
    def step_report_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        return _tick(context.instance, context.cursor, names, max_concurrent_merges)

    return step_report_sensor


def _tick(
    instance: dg.DagsterInstance, cursor: str | None, names: Names, max_concurrent_merges: int
) -> dg.SensorResult:
    room = BATCH
    if max_concurrent_merges:  # a project without a run queue's limits: a report is not run beside a merge
        room = max_concurrent_merges - heavy_runs_in_flight(instance, names)
        if room <= 0:  # the cursor stays: the next tick reads these merges again
            return dg.SensorResult(skip_reason="a merge or report of this instance is queued or running", cursor=cursor)
    merges = instance.fetch_materializations(
        dg.AssetRecordsFilter(names.key("hf_model"), after_storage_id=int(cursor) if cursor else None),
        limit=BATCH,
        ascending=True,
    ).records
    newest = {m.partition_key: m for m in merges if passed_every_check(m.asset_materialization.metadata)}
    requests = []
    for partition, merge in newest.items():
        report = latest_materialization(instance, names.key("step_report"), partition)
        if report is None or report.storage_id < merge.storage_id:
            requests.append(dg.RunRequest(run_key=f"{partition}@{merge.storage_id}", partition_key=partition))
    moved = str(merges[-1].storage_id) if merges else cursor
    if len(requests) > room:  # the rest by later ticks: the cursor stays, and a run key is launched once
        requests, moved = requests[:room], cursor
    if requests:
        return dg.SensorResult(run_requests=requests, cursor=moved)
    return dg.SensorResult(
        skip_reason=f"no new merge to report on ({len(merges)} hf_model event(s) read)", cursor=moved
    )
