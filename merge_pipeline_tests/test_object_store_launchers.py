"""Object storage with the launchers: torchrun ranks and Ray tasks read a checkpoint from the store
and upload their weight files to a target in the store, as one process does."""

from __future__ import annotations

from pathlib import Path

import pytest

from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline import merge
from merge_pipeline.ray_settings import RaySettings
from merge_pipeline.ray_tasks import RayTasks
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import assert_bit_exact, torchrun
from merge_pipeline_tests.object_store import download, upload, weights_and_index
from merge_pipeline_tests.ray_cluster import local_cluster

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
