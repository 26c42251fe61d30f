"""End to end, as a user runs it: a clean copy of the project, a `.env` made from `.env.example`, plain
`dagster dev` with no DAGSTER_HOME; a checkpoint dropped into the watched root gets merged by the sensor,
a re-merge launched the way the UI's Materialize button does runs about as fast (and the time from its
launch to STARTED is printed), each merge gets its step report in a run of its own and its three blocking
checks passed on hf_model's partition, a broken checkpoint fails in one line with those checks not executed
(Dagster's "Execution failed"), and headless Chromium shows the asset graph, a partition, the checks and the
failed run.

One `dagster dev` serves the module: starting it costs most of the time here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.formats.step_folders import TRACKER
from merge_pipeline.hf.blocking_checks import CHECK_NAMES
from merge_pipeline.watch.keys import HEAVY_TAG
from merge_pipeline.watch.location_settings import CHECKPOINT_ROOTS
from merge_pipeline.watch.partitions import checkpoint_key
from merge_pipeline_tests.dagster import browser
from merge_pipeline_tests.dagster.helpers import ACTOR
from merge_pipeline_tests.dagster.services import Dagster, clean_copy, running_dagster_dev
from merge_pipeline_tests.helpers import load_safetensors_dir, same_bits

pytestmark = pytest.mark.e2e

KEY = "e2e_run/global_step_1/actor"
BROKEN = "e2e_run/global_step_2/actor"
RUN_TIMEOUT = 240
FINISHED = ("SUCCESS", "FAILURE", "CANCELED")
REPORT_CHECKS = ("finite", "weights_changed")  # step_report's
STAGES = ("parallel_config", "state_dict", "hf_model")  # one step: the UI's Materialize selects all three
MERGE_JOBS = ("merge_checkpoint", "__ASSET_JOB")  # the sensor's, the UI's
REPORT = {HEAVY_TAG: "report"}  # step_report's runs: its automation's (__ASSET_JOB) and report_merged_step's
LAUNCH = """
mutation Launch($params: ExecutionParams!) {
  launchPipelineExecution(executionParams: $params) { __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } }
}"""
CHECKS = """
query Checks($asset: AssetKeyInput!) { assetNodeOrError(assetKey: $asset) { ... on AssetNode {
  assetChecksOrError { ... on AssetChecks { checks { name blocking } } } } } }"""
RUN_EVENTS = """
query Events($runId: ID!) { logsForRun(runId: $runId) { ... on EventConnection { events { __typename ... on MessageEvent { timestamp } } } } }"""
CHECK_PARTITIONS = """
query Checks($asset: AssetKeyInput!) { assetNodeOrError(assetKey: $asset) { ... on AssetNode {
  assetChecksOrError { ... on AssetChecks { checks { name partitionStatuses { ... on AssetCheckDefaultPartitionStatuses {
    succeededPartitions failedPartitions executionFailedPartitions skippedPartitions inProgressPartitions } } } } } } } }"""
# Click -> STARTED: the run worker loads the code location (it imports no torch), then Dagster marks
# the run started. ~2 s on an idle machine; the bound holds on 2 cores shared with other test suites.
START_BOUND_SECONDS = 40
SENSOR = """
query Sensor($sensor: SensorSelector!) { sensorOrError(sensorSelector: $sensor) { ... on Sensor { sensorState { ticks(limit: 1) { skipReason } } } } }"""


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> MergeSettings:
    base = tmp_path_factory.mktemp("e2e")
    (base / "checkpoints").mkdir()
    return MergeSettings(
        checkpoint_roots=[str(base / "checkpoints")], output_root=str(base / "merged"), settle_seconds=3600
    )


@pytest.fixture(scope="module")
def dagster(settings, tmp_path_factory):
    project = tmp_path_factory.mktemp("project")
    clean_copy(project)
    assert not list(project.glob(".tmp_dagster_home_*")) and (project / "dagster.yaml").is_file()
    example = (project / ".env.example").read_text()
    (project / ".env").write_text(  # what a user does: copy .env.example and set the roots; Dagster loads it
        example.replace(
            "MERGE_PIPELINE_CHECKPOINT_ROOTS=demo/checkpoints",
            f"MERGE_PIPELINE_CHECKPOINT_ROOTS={settings.checkpoint_roots[0]}",
        )
        .replace("MERGE_PIPELINE_OUTPUT_ROOT=demo/merged", f"MERGE_PIPELINE_OUTPUT_ROOT={settings.output_root}")
        .replace(
            "MERGE_PIPELINE_SETTLE_SECONDS=60", f"MERGE_PIPELINE_SETTLE_SECONDS={settings.settle_seconds:g}"
        )  # only the tracker completes a step
        .replace("MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS=10", "MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS=2")
    )
    with running_dagster_dev(
        project, {"PYTHONPATH": str(project)}, tmp_path_factory.mktemp("logs") / "dagster_dev.log"
    ) as served:
        served.wait_for_sensor_tick("new_checkpoint_sensor")
        assert list(project.glob(".tmp_dagster_home_*")), "the instance lives in dagster dev's own folder"
        yield served


def wait_for_run(dagster: Dagster, key: str, job: str | None, *, after: int = 0, tags: dict | None = None) -> dict:
    """The newest run of ``job`` (and ``tags``) for partition ``key`` once it finished, when more than ``after`` such runs exist."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while time.monotonic() < deadline:
        runs = dagster.partition_runs(key, job, tags)
        if len(runs) > after and runs[0]["status"] in FINISHED:
            return runs[0]
        time.sleep(0.5)
    pytest.fail(f"no finished {job or tags} run for {key} after {RUN_TIMEOUT} s\n{dagster.log_tail()}")


def drop(settings: MergeSettings, sample, key: str) -> None:
    """A checkpoint saved the way verl saves one: the role folder, then the tracker."""
    parsed = checkpoint_key(key)
    shutil.copytree(
        sample.role_dir, settings.value(CHECKPOINT_ROOTS)[0] / parsed.path, copy_function=shutil.copy
    )  # fresh mtimes
    (settings.value(CHECKPOINT_ROOTS)[0] / parsed.run / TRACKER).write_text(str(parsed.step))


@pytest.fixture(scope="module")
def merged(dagster, settings, fsdp_checkpoint):
    sample = fsdp_checkpoint(ACTOR)
    drop(settings, sample, KEY)
    dropped = time.monotonic()
    run = wait_for_run(dagster, KEY, "merge_checkpoint")
    return sample, run, time.monotonic() - dropped


def run_seconds(run: dict) -> float:
    return run["endTime"] - run["startTime"]


def test_sensor_merges_a_dropped_checkpoint_bit_exact(merged, dagster, settings, record_property):
    sample, run, latency = merged

    assert run["status"] == "SUCCESS", dagster.log_tail()
    reference = load_file(sample.reference_dir / "model.safetensors")
    output = load_safetensors_dir(settings.target_dir(checkpoint_key(KEY)))
    assert set(output) == set(reference) and all(same_bits(output[n], t) for n, t in reference.items())
    record_property("checkpoint_to_published_seconds", round(latency, 1))
    record_property("sensor_run_seconds", round(run_seconds(run), 1))
    print(
        f"checkpoint dropped -> merged folder published: {latency:.1f} s; the sensor's run took {run_seconds(run):.1f} s"
    )
    assert latency < 120


def test_a_run_launched_like_the_ui_materialize_button_is_as_fast_as_the_sensors(
    merged, dagster, settings, record_property
):
    """The UI's Materialize (one partition, overwrite in the Launchpad) launches the implicit asset job."""
    _, sensor_run, _ = merged
    wait_for_report(dagster)  # the first merge's report run: the click meets an idle queue
    params = {
        "selector": {
            "repositoryLocationName": "merge_pipeline",
            "repositoryName": "__repository__",
            "pipelineName": "__ASSET_JOB",
            "assetSelection": [{"path": [stage]} for stage in STAGES],
            # the checks of the selected assets, as the button selects them: hf_model's blocking checks
            "assetCheckSelection": [{"assetKey": {"path": ["hf_model"]}, "name": name} for name in CHECK_NAMES],
        },
        "mode": "default",
        "runConfigData": {"ops": {"hf_model": {"config": {"overwrite": True, "dtype": "bfloat16"}}}},
        "executionMetadata": {"tags": [{"key": "dagster/partition", "value": KEY}]},
    }
    clicked = time.time()
    launched = dagster.graphql(LAUNCH, {"params": params})["launchPipelineExecution"]
    assert launched["__typename"] == "LaunchRunSuccess", launched

    run = wait_for_run(dagster, KEY, "__ASSET_JOB")
    phases = run_phases(dagster, run["runId"], clicked)
    record_property("ui_launch_phases_seconds", phases)
    record_property("ui_launch_to_started_seconds", phases["RunStartEvent"])
    print(f"UI launch -> {', '.join(f'{event} {seconds:.1f} s' for event, seconds in phases.items())}")
    print(f"UI launch (GraphQL, as the Materialize click) -> STARTED: {phases['RunStartEvent']:.1f} s")
    # queued -> its worker launched: dagster.yaml's 1 s dequeue interval, not a 5 s default, holds it up
    assert phases["RunStartingEvent"] - phases["RunEnqueuedEvent"] < 5, phases
    assert phases["RunStartEvent"] < START_BOUND_SECONDS, phases  # the worker imports no torch before it starts

    assert run["status"] == "SUCCESS" and run["runId"] == launched["run"]["runId"], dagster.log_tail()
    merged_again = load_safetensors_dir(settings.target_dir(checkpoint_key(KEY)))
    assert {str(t.dtype) for t in merged_again.values()} == {"torch.bfloat16"}
    ui, sensor = run_seconds(run), run_seconds(sensor_run)
    record_property("ui_run_seconds", round(ui, 1))
    print(f"run time: UI-launched {ui:.1f} s, sensor-launched {sensor:.1f} s")
    assert ui < max(2 * sensor, sensor + 15), (
        ui,
        sensor,
    )  # one process: no per-step torch import (was 40-53 s vs ~5 s)


def queue(dagster: Dagster, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "merge_pipeline", "queue", *args, "--url", dagster.url]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_merge_pipeline_queue_puts_a_merge_in_the_queue_of_the_running_instance(merged, dagster, settings):
    """The shell command docs/DAGSTER.md gives for a merge by hand: through the webserver, into the queue of the
    instance the sensor fills (no DAGSTER_HOME needed), the run config applied; each mistake is one line."""
    wait_for_report(dagster)
    before = len(dagster.partition_runs(KEY, "merge_checkpoint"))
    config = '{"ops": {"hf_model": {"config": {"overwrite": true, "dtype": "bfloat16"}}}}'
    queued = queue(dagster, KEY, "--config-json", config)
    assert queued.returncode == 0, queued.stderr
    run_id = queued.stdout.strip().rsplit("/", 1)[-1]
    assert queued.stdout.strip() == f"queued: {dagster.url}/runs/{run_id}"

    run = wait_for_run(dagster, KEY, "merge_checkpoint", after=before)
    assert run["runId"] == run_id and run["status"] == "SUCCESS", dagster.log_tail()
    events = {e["__typename"] for e in dagster.graphql(RUN_EVENTS, {"runId": run_id})["logsForRun"]["events"]}
    assert {"RunEnqueuedEvent", "RunStartingEvent"} <= events  # the queue, not the caller's process
    merged_again = load_safetensors_dir(settings.target_dir(checkpoint_key(KEY)))
    assert {str(t.dtype) for t in merged_again.values()} == {"torch.bfloat16"}

    mistakes = {
        "run/global_step_9/actor": "has no partition 'run/global_step_9/actor' in this instance",
        "--job=nope": "no single job nope here (merge jobs: merge_checkpoint)",
        '--config-json={"ops": {"hf_model": {"config": {"dtype": 7}}}}': "not queued: RunConfigValidationInvalid",
    }
    for argument, words in mistakes.items():
        refused = queue(dagster, *([argument] if argument.startswith("run/") else [KEY, argument]))
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1 and words in refused.stderr, refused.stderr
    assert len(dagster.partition_runs(KEY, "merge_checkpoint")) == before + 1  # the mistakes queued nothing


def run_phases(dagster: Dagster, run_id: str, clicked: float) -> dict[str, float]:
    """Seconds from the click to each step of a run's start: queued, dequeued and its worker process
    launched (starting), started (the worker has imported the code location), ended."""
    events = dagster.graphql(RUN_EVENTS, {"runId": run_id})["logsForRun"]["events"]
    wanted = ("RunEnqueuedEvent", "RunStartingEvent", "RunStartEvent", "RunSuccessEvent")
    return {
        e["__typename"]: round(int(e["timestamp"]) / 1000 - clicked, 1) for e in events if e["__typename"] in wanted
    }


def test_hf_model_has_the_blocking_checks_and_the_step_report_its_own(dagster):
    """The blocking checks are asset checks of hf_model, blocking; the other stages have none."""
    for asset in STAGES:
        checks = dagster.graphql(CHECKS, {"asset": {"path": [asset]}})["assetNodeOrError"]["assetChecksOrError"]
        expected = sorted((name, True) for name in CHECK_NAMES) if asset == "hf_model" else []
        assert sorted((c["name"], c["blocking"]) for c in checks["checks"]) == expected, asset
    checks = dagster.graphql(CHECKS, {"asset": {"path": ["step_report"]}})["assetNodeOrError"]["assetChecksOrError"]
    assert sorted((c["name"], c["blocking"]) for c in checks["checks"]) == [(name, False) for name in REPORT_CHECKS]


def wait_for_report(dagster: Dagster) -> dict:
    """The step report of the partition's latest merge, in a run of its own that its automation requested."""
    merges = [
        r
        for job in MERGE_JOBS
        for r in dagster.partition_runs(KEY, job)
        if r["status"] == "SUCCESS" and {"key": HEAVY_TAG, "value": "report"} not in r["tags"]
    ]
    run = wait_for_run(dagster, KEY, None, after=len(merges) - 1, tags=REPORT)
    assert run["status"] == "SUCCESS", dagster.log_tail()
    return run


@pytest.fixture(scope="module")
def failed(merged, dagster, settings, fsdp_checkpoint):
    """A checkpoint whose rank file was cut short: the sensor's run fails in one line."""
    sample = fsdp_checkpoint(ACTOR)
    parsed = checkpoint_key(BROKEN)
    shutil.copytree(sample.role_dir, settings.value(CHECKPOINT_ROOTS)[0] / parsed.path, copy_function=shutil.copy)
    rank_file = settings.value(CHECKPOINT_ROOTS)[0] / parsed.path / "model_world_size_2_rank_1.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:100])
    (settings.value(CHECKPOINT_ROOTS)[0] / parsed.run / TRACKER).write_text(str(parsed.step))
    return wait_for_run(dagster, BROKEN, "merge_checkpoint"), rank_file


def test_a_broken_checkpoint_fails_in_one_line_and_the_sensor_says_so(failed, dagster, settings):
    run, rank_file = failed
    assert run["status"] == "FAILURE"
    assert not settings.target_dir(checkpoint_key(BROKEN)).exists()
    selector = {
        "repositoryLocationName": "merge_pipeline",
        "repositoryName": "__repository__",
        "sensorName": "new_checkpoint_sensor",
    }
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        [last] = dagster.graphql(SENSOR, {"sensor": selector})["sensorOrError"]["sensorState"]["ticks"]
        if last["skipReason"] and "last merge failed" in last["skipReason"]:
            break
        time.sleep(1)
    assert f"last merge failed for 1: {BROKEN}" in last["skipReason"]


def test_a_failed_merge_shows_its_checks_not_executed(merged, failed, dagster):
    """Dagster 1.13 plans every check a run selects and resolves a planned check of a failed run as
    "Execution failed": the broken partition's blocking checks never ran, the merged one's passed; a failed
    merge gets no step report run."""
    wait_for_report(dagster)
    checks = dagster.graphql(CHECK_PARTITIONS, {"asset": {"path": ["hf_model"]}})["assetNodeOrError"]
    statuses = {c["name"]: c["partitionStatuses"] for c in checks["assetChecksOrError"]["checks"]}
    assert set(statuses) == set(CHECK_NAMES)
    for name, status in statuses.items():
        assert status["succeededPartitions"] == [KEY] and status["executionFailedPartitions"] == [BROKEN], (
            name,
            status,
        )
        assert not status["failedPartitions"] and not status["skippedPartitions"], (name, status)
    checks = dagster.graphql(CHECK_PARTITIONS, {"asset": {"path": ["step_report"]}})["assetNodeOrError"]
    statuses = {c["name"]: c["partitionStatuses"] for c in checks["assetChecksOrError"]["checks"]}
    assert set(statuses) == set(REPORT_CHECKS)
    for name, status in statuses.items():
        assert status["succeededPartitions"] == [KEY], (name, status)  # the merged partition's report
        assert not any(status[s] for s in ("failedPartitions", "executionFailedPartitions", "skippedPartitions")), (
            name,
            status,
        )
    assert dagster.partition_runs(BROKEN, tags=REPORT) == []


def test_the_ui_shows_the_graph_a_partition_the_checks_and_the_failed_run(merged, failed, dagster, tmp_path):
    run, rank_file = failed
    wait_for_report(dagster)
    graph = f"{dagster.url}/locations/merge_pipeline/asset-groups/merge"

    dom = browser.dump_dom_showing(graph, ">hf_model<", "2 partitions", "1 failed", "Passed")
    summaries = sorted(set(re.findall(r"\d+ / \d+ Passed|\d+ failed|Execution failed", dom)))
    print("graph after the failed merge:", summaries)
    browser.screenshot(graph, tmp_path / "asset_graph.png")
    partition = browser.dump_dom_showing(f"{dagster.url}/assets/hf_model?view=partitions&partition={KEY}", BROKEN)
    checks = browser.dump_dom_showing(f"{dagster.url}/assets/step_report?view=checks", *REPORT_CHECKS)
    blocking = browser.dump_dom_showing(f"{dagster.url}/assets/hf_model?view=checks", *CHECK_NAMES)
    browser.screenshot(f"{dagster.url}/assets/hf_model?view=checks", tmp_path / "hf_model_checks.png")
    stages = {  # every stage a person can open, and the step report with its plot and checks
        stage: browser.dump_dom_showing(f"{dagster.url}/assets/{stage}?partition={KEY}", KEY, *shows)
        for stage, shows in {**dict.fromkeys(STAGES, ()), "step_report": ("plot", "summary", "NaN")}.items()
    }
    run_page = browser.dump_dom_showing(f"{dagster.url}/runs/{run['runId']}", "not a readable zip archive")

    assert all(f">{asset}<" in dom for asset in ("checkpoint", *STAGES, "step_report")) and "2 partitions" in dom
    assert "1 failed" in dom  # the failed merge, on hf_model's partitions
    # hf_model's checks summed up by their newest executions, the failed merge's, which never ran: "0 / 3 Passed"
    # (per partition, the merged one's passed: test_a_failed_merge_shows_its_checks_not_executed); the step
    # report's two passed for the one merged partition
    passed = sorted(tuple(map(int, m)) for m in re.findall(r"(\d+) / (\d+) Passed", dom))
    assert passed == [(0, 3), (2, 2)], summaries
    assert "Execution failed" not in checks
    # hf_model's Checks tab: the three, blocking, the newest execution (the failed merge's) not run
    assert all(name in blocking for name in CHECK_NAMES) and "blocking" in blocking, blocking
    assert "Execution failed" in blocking and (tmp_path / "hf_model_checks.png").stat().st_size > 20_000
    assert all(KEY in page for page in stages.values())
    assert all(text in stages["step_report"] for text in ("plot", "summary", "NaN"))  # its metadata
    assert (tmp_path / "asset_graph.png").stat().st_size > 20_000
    assert KEY in partition and BROKEN in partition
    assert all(name in checks for name in REPORT_CHECKS)
    assert str(rank_file) in run_page and "not a readable zip archive" in run_page
