"""torchrun merges are byte-identical to one process; a dead rank publishes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest
import torch

from merge_pipeline.engine.outputs import ShardFile
from merge_pipeline.engine.resume import RECORDS
from merge_pipeline.engine.safetensors_writer import OutputTensor
from merge_pipeline.plan import Computed, PlannedTensor
from merge_pipeline.workers.writing import assign_shards
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import TORCHRUN, run_cli, torchrun, tree_digest

SPEC = FsdpSpec(
    world_size=4, hidden_size=256, num_layers=4, vocab_size=8000, intermediate_size=512, with_optimizer=False
)


@pytest.mark.torchrun
@pytest.mark.parametrize("nproc", [2, 3])
def test_torchrun_output_is_byte_identical(capsys, tmp_path, fsdp_checkpoint, nproc):
    role_dir = fsdp_checkpoint(SPEC).role_dir
    code, _, err = run_cli(
        capsys,
        "merge",
        "--local_dir",
        role_dir,
        "--target_dir",
        tmp_path / "single",
        "--max-shard-size",
        "2MB",
        "--dtype",
        "bfloat16",
    )
    assert code == 0, err
    with torchrun(
        nproc,
        "--local_dir",
        role_dir,
        "--target_dir",
        tmp_path / "multi",
        "--max-shard-size",
        "2MB",
        "--dtype",
        "bfloat16",
    ) as run:
        _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    assert f"rank {nproc - 1}/{nproc} writes" in err
    assert tree_digest(tmp_path / "multi") == tree_digest(tmp_path / "single")
    assert len(list((tmp_path / "single").glob("model-*.safetensors"))) > nproc


@pytest.mark.torchrun
def test_killed_rank_publishes_nothing_and_a_rerun_recovers(tmp_path, fsdp_checkpoint):
    role_dir = fsdp_checkpoint(SPEC).role_dir
    target, staging = tmp_path / "out", tmp_path / ".out.staging"
    with torchrun(2, "--local_dir", role_dir, "--target_dir", target, "--max-shard-size", "256KB") as run:
        deadline = time.monotonic() + 120
        while not (staging.is_dir() and any(staging.glob("model-*.safetensors"))):
            assert run.poll() is None and time.monotonic() < deadline, "merge ended before a rank could be killed"
            time.sleep(0.01)
        [rank1] = [p for p in psutil.Process(run.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
        rank1.send_signal(signal.SIGKILL)
        run.communicate(timeout=120)
    assert run.returncode != 0
    assert not target.exists(), "nothing may be published when a rank dies"
    with torchrun(2, "--local_dir", role_dir, "--target_dir", target, "--max-shard-size", "256KB") as rerun:
        _, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "the rerun cleans the dead merge's staging"


# A failure every rank agrees on while the lead still has cleaning up to do (its staging folder to remove).
_FAILING_RANKS = """
import sys, time
from merge_pipeline.workers.torchrun import TorchrunRanks, _process_group
from merge_pipeline.errors import MergeError

def refuse():
    raise MergeError(None, "the input changed")

with _process_group(60) as (rank, world):
    ranks = TorchrunRanks(rank, world)
    try:
        ranks.everywhere(refuse if rank == 1 else lambda: None)
    finally:
        if ranks.lead:
            time.sleep(2)
            open(sys.argv[1], "w").write("cleaned up")
"""


@pytest.mark.torchrun
def test_ranks_failing_together_wait_for_the_lead_to_clean_up(tmp_path):
    """torchrun SIGTERMs the other ranks as soon as one exits non-zero: the lead must have finished by then."""
    script, marker = tmp_path / "ranks.py", tmp_path / "cleaned"
    script.write_text(_FAILING_RANKS)
    command = [TORCHRUN, "--standalone", "--nproc_per_node", "2", str(script), str(marker)]
    run = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert run.returncode != 0
    assert "the input changed" in run.stderr
    assert marker.read_text() == "cleaned up", run.stderr[-2000:]


@pytest.mark.torchrun
def test_a_killed_torchrun_merge_resumes_bit_identical(capsys, tmp_path, fsdp_checkpoint):
    """torchrun and all its ranks SIGKILLed once some weight files are finished: the rerun reuses them,
    and its folder is byte-identical to one process's uninterrupted merge."""
    role_dir = fsdp_checkpoint(SPEC).role_dir
    target, staging = tmp_path / "out", tmp_path / ".out.staging"
    with torchrun(2, "--local_dir", role_dir, "--target_dir", target, "--max-shard-size", "256KB") as run:
        deadline = time.monotonic() + 120
        while not (staging.is_dir() and any((staging / RECORDS).glob("*.safetensors.json"))):
            assert run.poll() is None and time.monotonic() < deadline, "merge ended before it could be killed"
            time.sleep(0.01)
        agent = psutil.Process(run.pid)
        for process in [*agent.children(recursive=True), agent]:  # every rank, then torchrun: none cleans up
            process.send_signal(signal.SIGKILL)
        run.communicate(timeout=120)
    assert not target.exists()
    with torchrun(2, "--local_dir", role_dir, "--target_dir", target, "--max-shard-size", "256KB") as rerun:
        _, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err
    assert "files reused from a killed merge" in err
    single = tmp_path / "single"
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", role_dir, "--target_dir", single, "--max-shard-size", "256KB"
    )
    assert code == 0, err
    assert tree_digest(target) == tree_digest(single)  # every file, the manifest included


def test_shard_assignment_balances_bytes():
    def shard(name: str, numel: int) -> ShardFile:
        planned = PlannedTensor(name, (numel,), torch.float32, Computed(lambda: torch.zeros(numel)))
        return ShardFile(name, (OutputTensor(planned, torch.float32),))

    files = [shard("f0", 50), shard("f1", 40), shard("f2", 30), shard("f3", 20), shard("f4", 10)]
    assigned = assign_shards(files, 2)
    assert [sorted(f.filename for f in rank) for rank in assigned] == [["f0", "f3", "f4"], ["f1", "f2"]]
    assert sorted(f.filename for rank in assign_shards(files, 7) for f in rank) == [f.filename for f in files]
