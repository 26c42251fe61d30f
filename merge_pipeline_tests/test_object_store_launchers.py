"""A store with the launchers: torchrun ranks and Ray tasks read a checkpoint from the store
and upload their weight files to a target in the store, as one process does."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

from local_servers.ray_cluster import local_cluster
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.merge import merge
from merge_pipeline.ray_settings import RaySettings
from merge_pipeline.workers.ray_tasks import RayTasks
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import assert_bit_exact, run_cli, torchrun
from merge_pipeline_tests.object_store import SECRET_KEY, download, upload, weights_and_index

pytestmark = pytest.mark.slow

SHARDS = "60KB"  # several weight files: something to spread over ranks and tasks


def _stored_checkpoint(fs, b: str, fsdp_checkpoint) -> tuple[str, Path]:
    sample = fsdp_checkpoint(FsdpSpec(world_size=3))
    root = sample.role_dir.parent.parent
    return upload(fs, root, f"{b}/ckpt") + "/" + sample.role_dir.relative_to(root).as_posix(), sample.reference_dir


def _one_process(source: str, tmp_path: Path) -> Path:
    merge(source, tmp_path / "one_process", MergeOptions(max_shard_size=SHARDS), show_progress=False)
    return tmp_path / "one_process"


@pytest.mark.torchrun
def test_torchrun_ranks_merge_store_to_store_as_one_process(bucket, fsdp_checkpoint, tmp_path):
    fs, b = bucket
    source, reference = _stored_checkpoint(fs, b, fsdp_checkpoint)
    target = f"s3://{b}/merged"
    with torchrun(2, "--local_dir", source, "--target_dir", target, "--max-shard-size", SHARDS, "--no-progress") as run:
        out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    published = download(fs, target, tmp_path / "downloaded")
    assert weights_and_index(published) == weights_and_index(_one_process(source, tmp_path))
    assert_bit_exact(published, reference)


def test_ray_tasks_merge_store_to_store_as_one_process(bucket, fsdp_checkpoint, tmp_path):
    fs, b = bucket
    source, reference = _stored_checkpoint(fs, b, fsdp_checkpoint)
    target = f"s3://{b}/merged"
    with local_cluster(workers=2) as cluster:  # started with the store's variables set, as a cluster's nodes have them
        workers = RayTasks(RaySettings(address=cluster.address))
        merge(source, target, MergeOptions(max_shard_size=SHARDS), workers=workers, show_progress=False)
    published = download(fs, target, tmp_path / "downloaded")
    assert weights_and_index(published) == weights_and_index(_one_process(source, tmp_path))
    assert_bit_exact(published, reference)
    assert len({r.node_id for r in workers.results}) == 2


def test_ray_nodes_started_without_the_store_variables_get_the_drivers(
    bucket, fsdp_checkpoint, tmp_path, monkeypatch, capsys, caplog
):
    """A cluster's nodes started apart from the driver have none of its AWS_* variables: the write tasks get
    the driver's (their values never shown)."""
    caplog.set_level(logging.INFO, logger="merge_pipeline")
    fs, b = bucket
    source, reference = _stored_checkpoint(fs, b, fsdp_checkpoint)
    target = f"s3://{b}/merged"
    drivers = {name: value for name, value in os.environ.items() if name.startswith("AWS_")}
    for name in drivers:
        monkeypatch.delenv(name)
    with local_cluster(workers=2) as cluster:  # its raylets and workers inherit no AWS_* variable
        for name, value in drivers.items():
            monkeypatch.setenv(name, value)
        code, out, err = run_cli(
            capsys, "merge", "--local_dir", source, "--target_dir", target, "--max-shard-size", SHARDS,
            "--no-progress", "--ray-address", cluster.address,
        )  # fmt: skip

    assert code == 0, err
    assert_bit_exact(download(fs, target, tmp_path / "downloaded"), reference)
    [given] = re.findall(r"Ray: the write tasks get (.*) from this process's environment", caplog.text)
    assert set(given.split(", ")) == set(drivers)  # by name
    assert SECRET_KEY not in out + err + caplog.text
