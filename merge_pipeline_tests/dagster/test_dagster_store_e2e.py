"""End to end with object storage, as a user runs it: plain ``dagster dev`` whose ``.env`` names an
``s3://`` checkpoint root and an ``s3://`` output root on the real S3 server of ``object_store.py``
(credentials and endpoint from the standard AWS variables); a verl step uploaded to the bucket is merged
by the sensor into the bucket, bit for bit the source model, and its step report reads it there.
"""

from __future__ import annotations

import time

import pytest

from merge_pipeline.watch.keys import HEAVY_TAG
from merge_pipeline_tests.dagster.helpers import ACTOR
from merge_pipeline_tests.dagster.services import clean_copy, running_dagster_dev
from merge_pipeline_tests.dagster.test_dagster_e2e import wait_for_run
from merge_pipeline_tests.dagster.test_dagster_store import KEY, put_step
from merge_pipeline_tests.helpers import assert_bit_exact

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_dagster_dev_merges_a_step_from_the_bucket_into_the_bucket(bucket, fsdp_checkpoint, tmp_path, record_property):
    fs, b = bucket
    sample = fsdp_checkpoint(ACTOR)
    project = tmp_path / "project"
    project.mkdir()
    clean_copy(project)
    (project / ".env").write_text(
        (project / ".env.example")
        .read_text()
        .replace("MERGE_PIPELINE_CHECKPOINT_ROOTS=demo/checkpoints", f"MERGE_PIPELINE_CHECKPOINT_ROOTS=s3://{b}/ckpts")
        .replace("MERGE_PIPELINE_OUTPUT_ROOT=demo/merged", f"MERGE_PIPELINE_OUTPUT_ROOT=s3://{b}/merged")
        .replace("MERGE_PIPELINE_SETTLE_SECONDS=60", "MERGE_PIPELINE_SETTLE_SECONDS=3600")  # the tracker decides
        .replace("MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS=10", "MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS=2")
    )
    # the AWS variables the bucket fixture set (what a user exports) reach dagster dev through the environment
    with running_dagster_dev(project, {"PYTHONPATH": str(project)}, tmp_path / "dagster_dev.log") as dagster:
        dagster.wait_for_sensor_tick("new_checkpoint_sensor")
        put_step(fs, b, sample, KEY, tracker=1)
        uploaded = time.monotonic()
        run = wait_for_run(dagster, KEY, "merge_checkpoint")
        latency = time.monotonic() - uploaded
        assert run["status"] == "SUCCESS", dagster.log_tail()
        published = dagster.materialized(run["runId"], "hf_model")
        report = wait_for_run(dagster, KEY, None, tags={HEAVY_TAG: "report"})  # the step report reads the bucket too
        assert report["status"] == "SUCCESS", dagster.log_tail()

    fs.get(f"{b}/merged/{KEY}/", str(tmp_path / "merged") + "/", recursive=True)
    assert_bit_exact(tmp_path / "merged", sample.reference_dir)
    assert (tmp_path / "merged" / "merge_manifest.json").is_file()
    assert published["completeness"] == "latest_checkpointed_iteration.txt says 1 >= 1", published
    run_seconds = run["endTime"] - run["startTime"]
    record_property("store_uploaded_to_published_seconds", round(latency, 1))
    record_property("store_sensor_run_seconds", round(run_seconds, 1))
    print(f"step uploaded -> merged folder published in the bucket: {latency:.1f} s; the run took {run_seconds:.1f} s")
