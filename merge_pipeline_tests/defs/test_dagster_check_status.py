"""A failed merge paints no check, in a real instance.

Dagster 1.13 records a PLANNED evaluation for every asset check a run selects when it creates the run,
and resolves it as "Execution failed" once that run fails (``AssetCheckExecutionRecord.resolve_status``).
The merge job and the UI's Materialize of the merge step select no check: the blocking checks are part
of the step, and the step report (whose checks are asset checks) runs in a run of its own, requested by
``step_report_sensor`` only after a successful merge.
"""

from __future__ import annotations

import dagster as dg

from merge_pipeline.definitions import defs
from merge_pipeline_tests.defs.helpers import ACTOR, materialize

KEY = "run/global_step_3/actor"
ROOTS_VAR, OUTPUT_VAR = "MERGE_PIPELINE_CHECKPOINT_ROOTS", "MERGE_PIPELINE_OUTPUT_ROOT"
new_checkpoint_sensor, step_report_sensor = (
    defs.resolve_sensor_def(s) for s in ("new_checkpoint_sensor", "step_report_sensor")
)


def test_a_failed_merge_leaves_no_check_record_of_any_asset(roots, instance, monkeypatch):
    monkeypatch.setenv(ROOTS_VAR, str(roots.checkpoints))  # as .env sets them for `dagster dev`
    monkeypatch.setenv(OUTPUT_VAR, str(roots.output))
    instance.add_dynamic_partitions("checkpoints", [KEY])

    # nothing saved there: the merge fails, as the sensor's job and as the UI's Materialize of the step
    sensor_run = defs.resolve_job_def("merge_checkpoint").execute_in_process(
        instance=instance, partition_key=KEY, raise_on_error=False
    )
    ui_run = materialize(instance, roots.settings(), KEY)

    assert not sensor_run.success and not ui_run.success
    check_keys = defs.resolve_asset_graph().asset_check_keys
    assert {k.name for k in check_keys} == {"weights_changed", "finite"}  # the step report's: the only checks
    for check_key in check_keys:  # no PLANNED record, so nothing Dagster could call "Execution failed"
        assert instance.event_log_storage.get_asset_check_execution_history(check_key, limit=10) == [], check_key
    assert all(run.asset_check_selection in (None, frozenset()) for run in instance.get_runs())
    # and no step report is requested for a merge that did not happen
    assert step_report_sensor(dg.build_sensor_context(instance=instance)).run_requests == []


def test_a_folder_found_already_merged_gets_no_step_report(roots, instance, fsdp_checkpoint, monkeypatch):
    """The checkpoint sensor records such a folder as hf_model "found": no check of this instance looked at it."""
    monkeypatch.setenv(ROOTS_VAR, str(roots.checkpoints))
    monkeypatch.setenv(OUTPUT_VAR, str(roots.output))
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_3", tracker=3, link=True)
    roots.target(KEY).mkdir(parents=True)  # merged before, e.g. with the CLI
    tick = new_checkpoint_sensor(dg.build_sensor_context(instance=instance, resources=defs.resources))
    instance.add_dynamic_partitions("checkpoints", [KEY])
    [found] = tick.asset_events
    instance.report_runless_asset_event(found)  # as the daemon stores the tick's events

    assert step_report_sensor(dg.build_sensor_context(instance=instance)).run_requests == []
