"""A trainer re-saving the step while we merge it (in place, as ``rsync --inplace`` does, or by a
rename over it) must not give a folder mixing two saves: the merge is refused before publishing.

The rewrite happens between the pipeline's own stages (the weights written, the folder not yet
finished), the same stages the CLI, torchrun rank 0 and the Dagster asset run; and in a torchrun
merge while its ranks write, timed by watching for the staging folder.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from merge_pipeline.engine.publish import staged_output, staging_path
from merge_pipeline.errors import MergeError
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.folder import finish_folder, write_side_files
from merge_pipeline.pipeline.prepare import prepare
from merge_pipeline.workers.writing import write_weights
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import TORCHRUN, error_lines

SPEC = FsdpSpec(world_size=3, with_optimizer=False)
CHANGED = "changed while it was being merged: re-run once the save is complete"


def rewrite_in_place(path) -> None:
    """The same size, other bytes: what a trainer saving the same step again writes."""
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in data[-4096:]).rjust(len(data), b"\0")[: len(data)])


def rename_over(path) -> None:
    """A new file renamed over the old one (the bytes even equal): another inode, another save."""
    fresh = path.with_name(path.name + ".tmp")
    fresh.write_bytes(path.read_bytes())
    os.replace(fresh, path)


@pytest.mark.parametrize("change", [rewrite_in_place, rename_over], ids=["in_place", "renamed_over"])
def test_a_rank_file_rewritten_during_the_merge_is_refused_and_nothing_published(
    tmp_path, fsdp_checkpoint, fresh_copy, change
):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    target, options = tmp_path / "out", MergeOptions()
    rank_file = sample.role_dir / "model_world_size_3_rank_1.pt"
    with pytest.raises(MergeError) as refused:
        with (
            prepare(sample.role_dir, options) as prepared,
            staged_output(target, source=sample.role_dir, overwrite=False) as staging,
        ):
            write_side_files(prepared, staging, options)
            report = write_weights(prepared.outputs, staging, show_progress=False)
            change(rank_file)
            finish_folder(prepared, staging, options, report)
    assert str(refused.value) == f"{rank_file}: {CHANGED}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy_0"], "no target, staging or lock left"


@pytest.mark.torchrun
def test_torchrun_refuses_a_save_rewritten_while_its_ranks_write(tmp_path, fsdp_checkpoint, fresh_copy):
    """Two ranks; the rewrite as soon as the staging folder appears (every rank has planned by then)."""
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    target = tmp_path / "out"
    rank_file = sample.role_dir / "model_world_size_3_rank_2.pt"
    command = [TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "merge_pipeline", "merge", "--no-progress"]
    command += ["--local_dir", str(sample.role_dir), "--target_dir", str(target), "--max-shard-size", "100KB"]
    merging = subprocess.Popen(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not staging_path(target).exists() and merging.poll() is None:
        assert time.monotonic() < deadline, "the merge never started writing"
        time.sleep(0.005)
    rewrite_in_place(rank_file)
    _, err = merging.communicate(timeout=120)

    assert merging.returncode != 0, err
    assert f"{rank_file}: {CHANGED}" in "\n".join(error_lines(err))
    assert not target.exists() and not staging_path(target).exists()
