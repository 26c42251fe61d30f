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
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from merge_pipeline.checkpoint_name import CheckpointName
from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.engine.publish import staging_path
from merge_pipeline.engine.resume import RECORDS
from merge_pipeline.formats.step_folders import TRACKER
from merge_pipeline.hf.blocking_checks import CHECK_NAMES
from merge_pipeline.watch.location_settings import CHECKPOINT_ROOTS
from merge_pipeline.watch.partitions import checkpoint_key
from merge_pipeline_samples.fsdp_fake_pg import write_fake_pg_checkpoint
from merge_pipeline_tests.dagster.services import Dagster, clean_copy, running_dagster_dev
from merge_pipeline_tests.engine.test_resume import SPEC
from merge_pipeline_tests.helpers import cli_merge_command

pytestmark = pytest.mark.e2e

SHARDS = {"dtype": "bfloat16", "max_shard_size": "1MB"}  # 22 weight files: a kill lands between two of them
LAUNCH = """
mutation Launch($params: ExecutionParams!) {
  launchPipelineExecution(executionParams: $params) { __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } }
}"""
UNITS = {unit: 1024**power for power, unit in enumerate(("B", "KiB", "MiB", "GiB", "TiB"))}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``dagster dev`` on a clean copy of the project, watching a root; and the CLI's uninterrupted merge."""
    base = tmp_path_factory.mktemp("resume")
    settings = MergeSettings(
        checkpoint_roots=[str(base / "checkpoints")], output_root=str(base / "merged"), settle_seconds=3600
    )
    written, reference = write_killable_checkpoint(base)
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


def write_killable_checkpoint(base: Path, *, unsharded: Path | None = None) -> tuple[Path, Path]:
    """A checkpoint whose merge in 22 weight files a test can kill between two of them, and the CLI's
    uninterrupted merge of it with those options; ``unsharded``: keep its weights there too."""
    written = base / "written" / "global_step_1" / "actor"
    write_fake_pg_checkpoint(written, SPEC, reference_dir=unsharded)
    reference = base / "uninterrupted"
    subprocess.run(
        cli_merge_command(written, reference, "--dtype", SHARDS["dtype"], "--max-shard-size", SHARDS["max_shard_size"]),
        check=True,
        capture_output=True,
    )
    return written, reference


def drop_and_wait_for_the_sensors_merge(dagster: Dagster, settings: MergeSettings, written: Path, key: CheckpointName):
    """The checkpoint put in the watched root (hard links: the same files, no disk), its tracker last; the
    sensor's merge (one file) makes the partition."""
    shutil.copytree(written, settings.value(CHECKPOINT_ROOTS)[0] / key.path, copy_function=os.link)
    (settings.value(CHECKPOINT_ROOTS)[0] / key.run / TRACKER).write_text(str(key.step))
    sensor_run = dagster.wait_for("the sensor's merge", lambda: dagster.ended_run(str(key), "merge_checkpoint"))
    assert sensor_run["status"] == "SUCCESS", dagster.log_tail()


def test_a_killed_torchrun_run_is_retried_and_resumes_from_the_finished_files(served):
    """The run's worker and its torchrun ranks killed; an in-process run's worker killed the same way:
    test_dagster_production.py (its instance also retries through the run queue)."""
    dagster, settings, written, reference = served
    launcher = {"launcher": "torchrun", "nproc_per_node": 2}
    key = checkpoint_key(f"resume_{launcher['launcher']}/global_step_1/actor")
    drop_and_wait_for_the_sensors_merge(dagster, settings, written, key)
    # The merge killed below is a re-merge in 22 files.
    params = _materialize(str(key), {"overwrite": True, **SHARDS, **launcher})

    def launch() -> str:
        launched = dagster.graphql(LAUNCH, {"params": params})["launchPipelineExecution"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        return launched["run"]["runId"]

    kill_the_worker_and_check_the_retry_resumes(dagster, launch, settings.target_dir(key), reference)


def kill_the_worker_and_check_the_retry_resumes(
    dagster: Dagster, launch: Callable[[], str], target: Path, reference: Path
) -> str:
    """SIGKILL the worker of the run ``launch`` starts once it finished a weight file: run monitoring marks the
    run failed, the instance retries it, and the retry resumes from the finished files, publishing
    ``reference``'s bytes. A kill that lands after the last file (the others were written before it struck)
    leaves nothing to resume: the retry publishes, and the run is launched again, at most three times. The
    id of the run whose kill was resumed."""
    staging = staging_path(target)
    files = len(list(reference.glob("*.safetensors")))
    for _ in range(3):
        killed_run = launch()
        if (killed := _killed_once(dagster, killed_run, staging, files)) is not None:
            break
    else:
        pytest.fail(f"three kills all landed after the last of {files} weight files")
    kept, inodes, retry = killed
    said = "\n".join(dagster.messages(retry))

    assert f"reusing {len(kept)} weight file(s)" in said, said  # the lead's count, whoever writes the rest
    # The throughput counts the bytes written, not the kept files (it once read 837 GiB/s here).
    rates = [float(n) * UNITS[unit] for n, unit in re.findall(r"([\d.]+) (B|KiB|MiB|GiB|TiB)/s", said)]
    assert max(rates, default=0) < 20 * UNITS["GiB"], rates
    # So does the state_dict page's (it once read 4.91 TiB/s): the files written over the write's seconds.
    shown = dagster.materialized(retry, "state_dict")
    kept_bytes = sum((reference / name).stat().st_size for name in kept)
    written_rate = (shown["bytes"] - kept_bytes) / shown["weights seconds"]
    [(n, unit)] = re.findall(r"^([\d.]+) (B|KiB|MiB|GiB|TiB)/s$", shown["throughput"])
    assert abs(float(n) * UNITS[unit] / written_rate - 1) < 0.1, (shown, kept_bytes)
    assert {name: (target / name).stat().st_ino for name in kept} == inodes  # kept, not written again
    for weights in reference.glob("*.safetensors"):
        assert (target / weights.name).read_bytes() == weights.read_bytes(), weights.name
    assert not staging.exists() and not (target / RECORDS).exists()
    return killed_run


def _killed_once(dagster: Dagster, killed_run: str, staging: Path, files: int) -> tuple[list[str], dict, str] | None:
    """Kill ``killed_run``'s worker once it finished a weight file: the files it finished, their inodes, and the
    instance's retry of it (ended in success). ``None`` when the kill struck after the last file was written,
    once the run's end or its retry's has published the folder."""
    worker = dagster.wait_for("the run worker's pid", lambda: dagster.worker_pid(killed_run), every=0.05)
    finished = dagster.wait_for("a finished weight file", lambda: _records(staging) or None, timeout=120, every=0.01)
    try:
        descendants = psutil.Process(worker).children(recursive=True)  # torchrun and its ranks, if launched
        os.kill(worker, signal.SIGKILL)
    except (psutil.NoSuchProcess, ProcessLookupError):  # the run ended before the kill: nothing to resume
        descendants = []
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert alive == [], f"outlived the run's worker: {alive}"
    kept = _records(staging)  # what the killed run finished (it may have finished more meanwhile; none: published)
    inodes = {name: (staging / name).stat().st_ino for name in kept}
    ended = dagster.wait_for("the killed run ended", lambda: dagster.outcome(killed_run))
    if ended == "FAILURE":
        retry = dagster.wait_for("the instance's retry", lambda: dagster.retry_of(killed_run))
        assert dagster.wait_for("the retry finished", lambda: dagster.outcome(retry)) == "SUCCESS", dagster.log_tail()
    if not kept or len(kept) == files:
        return None
    assert ended == "FAILURE" and 1 <= len(finished) <= len(kept) < files, (ended, finished, kept)
    return kept, inodes, retry


def _materialize(partition: str, config: dict) -> dict:
    """What the UI's Materialize button launches for one partition, with ``config`` for hf_model."""
    return {
        "selector": {
            "repositoryLocationName": "merge_pipeline",
            "repositoryName": "__repository__",
            "pipelineName": "__ASSET_JOB",
            "assetSelection": [{"path": [stage]} for stage in ("parallel_config", "state_dict", "hf_model")],
            # the button selects the checks of the selected assets: hf_model's blocking checks
            "assetCheckSelection": [{"assetKey": {"path": ["hf_model"]}, "name": name} for name in CHECK_NAMES],
        },
        "mode": "default",
        "runConfigData": {"ops": {"hf_model": {"config": config}}},
        "executionMetadata": {"tags": [{"key": "dagster/partition", "value": partition}]},
    }


def _records(staging) -> list[str]:
    # The weight files' records (the folder also holds the job handed to the torchrun ranks).
    return sorted(p.name.removesuffix(".json") for p in (staging / RECORDS).glob("*.safetensors.json"))
