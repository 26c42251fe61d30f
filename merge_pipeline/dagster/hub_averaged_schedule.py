"""``publish_averaged_models``: the schedule that puts each run's newest average on the Hub, as
``publish_latest_steps`` does a run's newest step.

At each tick, for every ``averaged_runs`` partition (``<run_name>/<role>``) whose latest ``averaged_model``
materialization passed every blocking check (they run before the average is published; its metadata
lists them), it requests ``hub_averaged_model`` once per such materialization (``run_key``: the run and
that average), so each new average goes up once. The component defines it with ``hub_averaged_model``,
that is when both ``averaging:`` and ``hub: organization:`` are set, running by default then, on the
cron of ``hub: schedule:``.
"""

from __future__ import annotations

import dagster as dg

from merge_pipeline.dagster.averaged_model import averaged_partitions
from merge_pipeline.dagster.checks import passed_every_check
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.dagster.records import latest_materialization


def publish_averaged_schedule(names: Names, cron: str) -> dg.ScheduleDefinition:
    """The schedule, with its job (``publish_averaged_to_hub``: ``hub_averaged_model`` alone)."""
    job = dg.define_asset_job(
        names("publish_averaged_to_hub"),
        selection=dg.AssetSelection.assets(names.key("hub_averaged_model")),
        description="Upload a run's averaged model to the Hub and verify it.\n\nTo its branch averaged-last-<K>.",
    )

    @dg.schedule(
        name=names("publish_averaged_models"),
        cron_schedule=cron,
        job=job,
        default_status=dg.DefaultScheduleStatus.RUNNING,  # defined only where Hub publishing is configured
        description="Publishes each run's latest averaged model to the Hub.\n\nOnce its blocking checks passed, once per average.",
    )
    def publish_averaged_models(context: dg.ScheduleEvaluationContext, **_called_with: object):
        return _averages_to_publish(context, names)

    return publish_averaged_models


def _averages_to_publish(context: dg.ScheduleEvaluationContext, names: Names):
    instance = context.instance
    runs = instance.get_dynamic_partitions(averaged_partitions(names).name)
    requests = []
    for run in runs:
        averaged = latest_materialization(instance, names.key("averaged_model"), run)
        if averaged is None:
            continue
        if not passed_every_check(averaged.asset_materialization.metadata):
            context.log.info(f"{run}: not published: its latest average records no passed blocking checks")
            continue
        published = latest_materialization(instance, names.key("hub_averaged_model"), run)
        if published is None or published.storage_id < averaged.storage_id:
            requests.append(dg.RunRequest(run_key=f"{run}@{averaged.storage_id}", partition_key=run))
    return requests or dg.SkipReason(f"no new average to publish from {len(runs)} averaged run(s)")
