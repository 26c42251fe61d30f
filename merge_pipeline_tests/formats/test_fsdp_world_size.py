"""FSDP at a world size far beyond the file limit: 1024 rank files written by torch's fake process group
(one process plays every rank, see sample_checkpoints/fsdp_fake_pg.py), merged by the CLI under
RLIMIT_NOFILE 128, bit for bit. Most ranks hold one row of a tensor, many none (trailing empty shards).
The benchmark runs world size 4096 under 256 (docs/BENCHMARKS.md)."""

from __future__ import annotations

import resource
import subprocess

import pytest

from merge_pipeline.sample_checkpoints.fsdp import FsdpSpec
from merge_pipeline.sample_checkpoints.fsdp_fake_pg import write_fake_pg_checkpoint
from merge_pipeline_tests.helpers import cli_merge_command, load_safetensors_dir, same_bits

pytestmark = pytest.mark.slow

WORLD_SIZE = 1024
OPEN_FILES = 128
SPEC = FsdpSpec(
    arch="llama",
    world_size=WORLD_SIZE,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    vocab_size=1003,
    num_attention_heads=2,
    num_key_value_heads=1,
    with_optimizer=False,
    with_tokenizer=False,
)


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
    expected = load_safetensors_dir(tmp_path / "reference")
    got = load_safetensors_dir(target)
    assert got.keys() == expected.keys()
    assert all(same_bits(got[name], expected[name]) for name in expected)
