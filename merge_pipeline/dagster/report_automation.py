"""``step_report``'s automation condition and ``step_report_automation``, the sensor that evaluates it: the
step report of every merge, in a run of its own once that merge's blocking checks passed.

The report is not part of the merge run: Dagster plans every asset check of a run when it creates the
run and shows a planned check of a failed run as "Execution failed", so a merge run that selected
``step_report`` would paint its checks for a report that never ran. The condition requests a partition's
report when its ``hf_model`` was materialized since the report was last requested or materialized, and
the three blocking asset checks of that partition passed (a failed merge materializes nothing; a folder
the checkpoint sensor recorded as found was checked by no run of this instance: no report). Dagster keeps
the last evaluation in the sensor's cursor: the first evaluation requests nothing for older history, and
a sensor stopped and started again requests one report per partition merged meanwhile.
"""

from __future__ import annotations

import warnings

import dagster as dg

from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.dagster.sensors import heavy_runs_in_flight
from merge_pipeline.watch.keys import AUTOMATED_BY, HEAVY_TAG


class RoomForHeavyRun(dg.AutomationCondition):
    """True for at most ``limit`` minus the heavy runs of this instance in flight of the candidate
    partitions (a project whose run queue has no limits: a report is not run beside a merge)."""

    def __init__(self, names: Names, limit: int):
        self.names, self.limit = names, limit

    @property
    def name(self) -> str:
        return f"room_for_heavy_run(limit={self.limit})"

    def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        room = self.limit - heavy_runs_in_flight(context.asset_graph_view.instance, self.names)
        candidates = context.candidate_subset
        if room <= 0:
            return dg.AutomationResult(context, context.get_empty_subset())
        chosen = sorted(candidates.expensively_compute_partition_keys())[:room]
        return dg.AutomationResult(context, candidates.compute_intersection_with_partition_keys(set(chosen)))


def step_report_condition(names: Names, max_concurrent_merges: int) -> dg.AutomationCondition:
    """Eager on a new ``hf_model`` materialization of the partition, once its blocking checks passed."""
    condition = (
        dg.AutomationCondition.any_deps_updated().since_last_handled()
        & dg.AutomationCondition.all_deps_blocking_checks_passed()
        & ~dg.AutomationCondition.any_deps_missing()
        & ~dg.AutomationCondition.any_deps_in_progress()
        & ~dg.AutomationCondition.in_progress()
    )
    if max_concurrent_merges:
        condition = condition & RoomForHeavyRun(names, max_concurrent_merges)
    return condition.with_label("after each merge whose blocking checks passed")


def step_report_automation(names: Names, interval_seconds: int) -> dg.AutomationConditionSensorDefinition:
    """Evaluates ``step_report``'s condition; its runs carry the heavy tag the run queue and the sensors count."""
    with warnings.catch_warnings():  # use_user_code_server: beta in Dagster 1.13
        warnings.simplefilter("ignore", dg.BetaWarning)
        return dg.AutomationConditionSensorDefinition(
            names("step_report_automation"),
            target=dg.AssetSelection.assets(names.key("step_report")),
            run_tags={HEAVY_TAG: "report", AUTOMATED_BY: names("step_report_automation")},
            minimum_interval_seconds=interval_seconds,
            default_status=dg.DefaultSensorStatus.RUNNING,
            emit_backfills=False,  # a run per partition, as the heavy tag and RoomForHeavyRun count them
            use_user_code_server=True,  # RoomForHeavyRun is this package's own condition
            description="Requests the step report of each merged step.\n\nAfter each merge whose blocking checks passed (a new hf_model materialization), materializes that partition's step_report in a run of its own.",
        )
