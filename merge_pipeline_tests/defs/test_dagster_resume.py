"""A Dagster merge whose run worker is SIGKILLed mid-write, under plain ``dagster dev`` with the repo's
dagster.yaml: run monitoring finds the dead worker, the instance retries the run, and the retry resumes
the merge from the weight files the killed run finished (its event log says how many), publishing
the same bytes as an uninterrupted CLI merge."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import psutil
import pytest

from merge_pipeline.defs.partitions import CheckpointKey
from merge_pipeline.defs.resources import MergeSettings
from merge_pipeline.engine.publish import staging_path
from merge_pipeline.engine.resume import RECORDS
from merge_pipeline.formats.step_folders import TRACKER
from merge_pipeline_samples.fsdp_fake_pg import write_fake_pg_checkpoint
from merge_pipeline_tests.defs.services import Dagster, clean_copy, running_dagster_dev
from merge_pipeline_tests.engine.test_resume import SPEC
from merge_pipeline_tests.helpers import cli_merge_command

pytestmark = pytest.mark.e2e

SHARDS = {"dtype": "bfloat16", "max_shard_size": "8MB"}  # 6 weight files: a kill lands between two of them
LAUNCH = """
mutation Launch($params: ExecutionParams!) {
  launchPipelineExecution(executionParams: $params) { __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } }
}"""
RUN = """
query Run($runId: ID!) { runOrError(runId: $runId) { ... on Run { status } } }"""
MESSAGES = """
query Events($runId: ID!) { logsForRun(runId: $runId) { ... on EventConnection { events { ... on MessageEvent { message } } } } }"""
UNITS = {unit: 1024**power for power, unit in enumerate(("B", "KiB", "MiB", "GiB", "TiB"))}
RETRIES = """
query Runs($filter: RunsFilter) { runsOrError(filter: $filter) { ... on Runs { results { runId status } } } }"""


def messages(dagster: Dagster, run_id: str) -> list[str]:
    events = dagster.graphql(MESSAGES, {"runId": run_id})["logsForRun"]["events"]
    return [e["message"] for e in events if e.get("message")]


def wait_for(what: str, found, dagster: Dagster, timeout: float = 240, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := found()) is not None:
            return value
        time.sleep(every)
    pytest.fail(f"{what}: not after {timeout} s\n{dagster.log_tail()}")


def run_status(dagster: Dagster, run_id: str) -> str:
    return dagster.graphql(RUN, {"runId": run_id})["runOrError"]["status"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``dagster dev`` on a clean copy of the project, watching a root; and the CLI's uninterrupted merge."""
    base = tmp_path_factory.mktemp("resume")
    settings = MergeSettings(
        checkpoint_roots=[str(base / "checkpoints")], output_root=str(base / "merged"), settle_seconds=3600
    )
    written = base / "written" / "global_step_1" / "actor"
    write_fake_pg_checkpoint(written, SPEC)
    reference = base / "uninterrupted"
    subprocess.run(
        cli_merge_command(written, reference, "--dtype", "bfloat16", "--max-shard-size", "8MB"),
        check=True,
        capture_output=True,
    )
    project = tmp_path_factory.mktemp("project")
    clean_copy(project)
    env = {
        "PYTHONPATH": str(project),
        "MERGE_PIPELINE_CHECKPOINT_ROOTS": settings.checkpoint_roots[0],
        "MERGE_PIPELINE_OUTPUT_ROOT": settings.output_root,
        "MERGE_PIPELINE_SETTLE_SECONDS": "3600",
        "MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS": "2",
    }
    with running_dagster_dev(project, env, tmp_path_factory.mktemp("logs") / "dagster_dev.log") as dagster:
        yield dagster, settings, written, reference


@pytest.mark.parametrize("launcher", [{"launcher": "inprocess"}, {"launcher": "torchrun", "nproc_per_node": 2}])
def test_a_killed_run_is_retried_and_resumes_from_the_finished_files(served, launcher):
    dagster, settings, written, reference = served
    key = CheckpointKey.parse(f"resume_{launcher['launcher']}/global_step_1/actor")
    shutil.copytree(written, settings.roots[0] / key.path, copy_function=os.link)  # the same files, no disk
    (settings.roots[0] / key.run_name / TRACKER).write_text(str(key.step))
    # The sensor's merge (one file) makes the partition; the merge killed below is a re-merge in 6 files.
    sensor_run = wait_for("the sensor's merge", lambda: _finished(dagster, str(key)), dagster)
    assert sensor_run["status"] == "SUCCESS", dagster.log_tail()
    target = settings.target_dir(key)
    staging = staging_path(target)
    params = _materialize(str(key), {"overwrite": True, **SHARDS, **launcher})
    launched = dagster.graphql(LAUNCH, {"params": params})["launchPipelineExecution"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    killed_run = launched["run"]["runId"]

    worker = wait_for("the run worker's pid", lambda: _worker_pid(dagster, killed_run), dagster, every=0.05)
    finished = wait_for("a finished weight file", lambda: _records(staging) or None, dagster, timeout=120, every=0.01)
    descendants = psutil.Process(worker).children(recursive=True)  # torchrun and its ranks, if launched
    os.kill(worker, signal.SIGKILL)
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert alive == [], f"outlived the run's worker: {alive}"
    kept = _records(staging)  # what the killed run finished (it may have finished one more meanwhile)
    files = len(list(reference.glob("*.safetensors")))
    assert 1 <= len(finished) <= len(kept) < files
    inodes = {name: (staging / name).stat().st_ino for name in kept}

    assert wait_for("the killed run failed", lambda: _outcome(dagster, killed_run), dagster) == "FAILURE"
    retry = wait_for("the instance's retry", lambda: _retry_of(dagster, killed_run), dagster)
    assert wait_for("the retry finished", lambda: _outcome(dagster, retry), dagster) == "SUCCESS", dagster.log_tail()
    said = "\n".join(messages(dagster, retry))

    assert f"reusing {len(kept)} weight file(s)" in said, said  # the lead's count, whoever writes the rest
    # The throughput counts the bytes written, not the kept files (it once read 837 GiB/s here).
    rates = [float(n) * UNITS[unit] for n, unit in re.findall(r"([\d.]+) (B|KiB|MiB|GiB|TiB)/s", said)]
    assert max(rates, default=0) < 20 * UNITS["GiB"], rates
    assert {name: (target / name).stat().st_ino for name in kept} == inodes  # kept, not written again
    for weights in reference.glob("*.safetensors"):
        assert (target / weights.name).read_bytes() == weights.read_bytes(), weights.name
    assert not staging.exists() and not (target / RECORDS).exists()


def _materialize(partition: str, config: dict) -> dict:
    """What the UI's Materialize button launches for one partition, with ``config`` for hf_model."""
    return {
        "selector": {
            "repositoryLocationName": "merge_pipeline",
            "repositoryName": "__repository__",
            "pipelineName": "__ASSET_JOB",
            "assetSelection": [{"path": [stage]} for stage in ("parallel_config", "state_dict", "hf_model")],
            "assetCheckSelection": [],
        },
        "mode": "default",
        "runConfigData": {"ops": {"hf_model": {"config": config}}},
        "executionMetadata": {"tags": [{"key": "dagster/partition", "value": partition}]},
    }


def _finished(dagster: Dagster, key: str) -> dict | None:
    runs = dagster.partition_runs(key, "merge_checkpoint")
    return runs[0] if runs and runs[0]["status"] in ("SUCCESS", "FAILURE", "CANCELED") else None


def _worker_pid(dagster: Dagster, run_id: str) -> int | None:
    for message in messages(dagster, run_id):
        if found := re.match(r"Started process for run \(pid: (\d+)\)", message):
            return int(found[1])
    return None


def _records(staging) -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in (staging / RECORDS).glob("*.json"))


def _outcome(dagster: Dagster, run_id: str) -> str | None:
    status = run_status(dagster, run_id)
    return status if status in ("SUCCESS", "FAILURE", "CANCELED") else None


def _retry_of(dagster: Dagster, run_id: str) -> str | None:
    tags = [{"key": "dagster/parent_run_id", "value": run_id}]
    runs = dagster.graphql(RETRIES, {"filter": {"tags": tags}})["runsOrError"]["results"]
    return runs[0]["runId"] if runs else None
