"""FSDP at a world size far beyond the file limit: 1024 rank files written by torch's fake process group
(one process plays every rank, see merge_pipeline_samples/fsdp_fake_pg.py), merged by the CLI under
RLIMIT_NOFILE 128, bit for bit. Most ranks hold one row of a tensor, many none (trailing empty shards).
The benchmark runs world size 4096 under 256 (docs/BENCHMARKS.md)."""

from __future__ import annotations

import resource
import subprocess
from dataclasses import replace

import pytest

from merge_pipeline_samples.fsdp_fake_pg import write_fake_pg_checkpoint
from merge_pipeline_tests.helpers import TINY_LLAMA, assert_bit_exact, cli_merge_command

pytestmark = pytest.mark.slow

WORLD_SIZE = 1024
OPEN_FILES = 128
SPEC = replace(TINY_LLAMA, world_size=WORLD_SIZE, with_tokenizer=False)


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


def test_world_size_1024_merges_bit_exact_under_a_small_file_limit(tmp_path):
    role_dir = tmp_path / "global_step_1" / "actor"
    write_fake_pg_checkpoint(role_dir, SPEC, reference_dir=tmp_path / "reference")
    assert len(list(role_dir.glob("model_world_size_*_rank_*.pt"))) == WORLD_SIZE > OPEN_FILES
    target = tmp_path / "out"

    merged = subprocess.run(
        cli_merge_command(role_dir, target), capture_output=True, text=True, preexec_fn=_limit_open_files
    )

    assert merged.returncode == 0, merged.stderr
    assert_bit_exact(target, tmp_path / "reference")
