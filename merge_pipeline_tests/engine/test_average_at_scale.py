"""``average`` of three ~200 MB checkpoints: memory stays a few read pieces per input above a single
merge's, never a model; a killed average resumes with the files it finished, as a merge does."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from merge_pipeline.plan import READ_PIECE_BYTES
from merge_pipeline_samples.fsdp_fake_pg import write_fake_pg_checkpoint
from merge_pipeline_tests.engine.test_resume import SPEC, killed_and_resumed  # three of its ~200 MB checkpoints
from merge_pipeline_tests.helpers import cli_merge_command

pytestmark = pytest.mark.slow

FLAGS = ("--dtype", "bfloat16", "--max-shard-size", "8MB")  # 12 files: a kill lands between two


def average_command(inputs: list[Path], target: Path) -> list[str]:
    inputs = [str(p) for p in inputs]
    return [sys.executable, "-m", "merge_pipeline", "average", "--inputs", *inputs, "--target_dir", str(target)] + [
        "--no-progress",
        *FLAGS,
    ]


def peak_rss(command: list[str]) -> int:
    """Run ``command`` to its end; its own peak RSS (``wait4``: this child's, not every child's)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, process.stderr.read().decode()[-2000:]
    process.stderr.close()
    process.returncode = 0
    return usage.ru_maxrss * 1024


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Three steps of one run, and their average written uninterrupted (with its peak RSS)."""
    root = tmp_path_factory.mktemp("run")
    inputs = [root / f"global_step_{step}" / "actor" for step in (1, 2, 3)]
    for seed, role_dir in enumerate(inputs):
        write_fake_pg_checkpoint(role_dir, dataclasses.replace(SPEC, seed=seed))
    target = root / "uninterrupted"
    return inputs, target, peak_rss(average_command(inputs, target))


def test_peak_rss_is_a_few_read_pieces_per_input_above_one_merge(run, tmp_path):
    inputs, _, averaged = run
    single = peak_rss(cli_merge_command(inputs[-1], tmp_path / "single", *FLAGS))

    # per input: its unit buffer and its source's read piece; two accumulator units; never a whole
    # tensor (the 65 MB embedding), let alone a model (192 MB each)
    assert averaged - single < len(inputs) * 4 * READ_PIECE_BYTES, (averaged, single)


def test_a_killed_average_resumes_with_the_files_it_finished(run, tmp_path):
    inputs, reference, _ = run
    target = tmp_path / "out"
    killed_and_resumed(average_command(inputs, target), target, reference)
