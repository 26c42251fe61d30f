"""The blocking checks are asset checks of hf_model, one result per partition, in a real instance.

A merged step shows the three as passed for its partition, each evaluating the materialization its run
published. A merge that failed before any check ran (a truncated rank file) leaves the checks its run
planned without a result: Dagster resolves such a check as "Execution failed"
(``AssetCheckExecutionRecord.resolve_status``), its way of saying the check did not run; never "passed".
The records are read through the instance's API, as the UI reads them.
"""

from __future__ import annotations

import asyncio

import dagster as dg
from dagster._core.loader import LoadingContextForTest
from dagster._core.storage.asset_check_execution_record import (
    AssetCheckExecutionRecord,
    AssetCheckExecutionRecordStatus,
    AssetCheckExecutionResolvedStatus,
)

from merge_pipeline.definitions import defs
from merge_pipeline.hf.blocking_checks import CHECK_NAMES
from merge_pipeline_tests.dagster.helpers import ACTOR, materialize

KEY, BROKEN = "run/global_step_3/actor", "run/global_step_4/actor"
ROOTS_VAR, OUTPUT_VAR = "MERGE_PIPELINE_CHECKPOINT_ROOTS", "MERGE_PIPELINE_OUTPUT_ROOT"
HF_MODEL_CHECKS = [dg.AssetCheckKey(dg.AssetKey("hf_model"), name) for name in CHECK_NAMES]
new_checkpoint_sensor, step_report_automation = (
    defs.resolve_sensor_def(s) for s in ("new_checkpoint_sensor", "step_report_automation")
)


def report_tick(instance, cursor: str | None = None) -> dg.SensorResult:
    return step_report_automation(dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs))


def executions(instance, check_key: dg.AssetCheckKey, partition: str) -> list[AssetCheckExecutionRecord]:
    """The check's executions for one partition, newest first."""
    history = instance.event_log_storage.get_asset_check_execution_history(check_key, limit=100)
    return [r for r in history if r.partition == partition]


def shown_as(instance, record: AssetCheckExecutionRecord) -> AssetCheckExecutionResolvedStatus:
    """The status the UI shows for an execution record (Dagster's own resolution)."""
    return asyncio.run(record.resolve_status(LoadingContextForTest(instance)))


def test_a_merged_step_shows_three_passed_checks_and_a_failed_merge_none(roots, instance, fsdp_checkpoint, monkeypatch):
    monkeypatch.setenv(ROOTS_VAR, str(roots.checkpoints))  # as .env sets them for `dagster dev`
    monkeypatch.setenv(OUTPUT_VAR, str(roots.output))
    sample = fsdp_checkpoint(ACTOR)
    roots.drop(sample, "run/global_step_3", link=True)
    rank_file = roots.drop(sample, "run/global_step_4") / "model_world_size_2_rank_1.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:100])  # cut short: the merge fails before any check runs
    roots.track(rank_file.parent, 4)
    instance.add_dynamic_partitions("checkpoints", [KEY, BROKEN])
    job = defs.resolve_job_def("merge_checkpoint")  # the sensor's runs
    started = report_tick(instance)  # the report automation runs

    merged = job.execute_in_process(instance=instance, partition_key=KEY, raise_on_error=False)
    sensor_run = job.execute_in_process(instance=instance, partition_key=BROKEN, raise_on_error=False)
    ui_run = materialize(instance, roots.settings(), BROKEN)  # the UI's Materialize of the step

    assert merged.success and not sensor_run.success and not ui_run.success
    [published] = [
        e.event_specific_data.materialization
        for e in merged.get_asset_materialization_events()
        if e.asset_key == dg.AssetKey("hf_model")
    ]
    records = instance.event_log_storage.get_latest_asset_check_execution_by_key(HF_MODEL_CHECKS)
    assert set(records) == set(HF_MODEL_CHECKS)
    for check_key in HF_MODEL_CHECKS:
        [passed] = executions(instance, check_key, KEY)
        evaluation = passed.event.dagster_event.asset_check_evaluation_data
        assert passed.status == AssetCheckExecutionRecordStatus.SUCCEEDED and evaluation.passed, check_key
        assert passed.run_id == merged.run_id and evaluation.blocking
        assert evaluation.target_materialization_data.run_id == merged.run_id  # the folder this run published
        assert "looked at" in evaluation.metadata and published.partition == KEY
        # the failed merges: planned by their runs, never evaluated; shown as "Execution failed"
        not_run = executions(instance, check_key, BROKEN)
        assert {r.run_id for r in not_run} == {sensor_run.run_id, ui_run.run_id}, check_key
        for record in not_run:
            assert record.status == AssetCheckExecutionRecordStatus.PLANNED
            assert shown_as(instance, record) == AssetCheckExecutionResolvedStatus.EXECUTION_FAILED
    # and no step report is requested for the merge that did not happen
    assert [r.partition_key for r in report_tick(instance, started.cursor).run_requests] == [KEY]


def test_a_folder_found_already_merged_gets_no_step_report(roots, instance, fsdp_checkpoint, monkeypatch):
    """The checkpoint sensor records such a folder as hf_model "found": no check of this instance looked at it."""
    monkeypatch.setenv(ROOTS_VAR, str(roots.checkpoints))
    monkeypatch.setenv(OUTPUT_VAR, str(roots.output))
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_3", tracker=3, link=True)
    roots.target(KEY).mkdir(parents=True)  # merged before, e.g. with the CLI
    started = report_tick(instance)  # the report automation runs
    tick = new_checkpoint_sensor(dg.build_sensor_context(instance=instance, resources=defs.resources))
    instance.add_dynamic_partitions("checkpoints", [KEY])
    [found] = tick.asset_events
    instance.report_runless_asset_event(found)  # as the daemon stores the tick's events

    assert report_tick(instance, started.cursor).run_requests == []
    assert not any(executions(instance, check_key, KEY) for check_key in HF_MODEL_CHECKS)
