"""Megatron checkpoints merge byte-identically under torchrun (same plan, whole shards per rank)."""

from __future__ import annotations

import pytest

from merge_pipeline_tests.helpers import run_cli, torchrun, tree_digest

pytestmark = pytest.mark.torchrun


@pytest.mark.parametrize("nproc", [2, 3])
def test_torchrun_megatron_is_byte_identical(capsys, tmp_path, megatron_samples, nproc):
    role_dir = megatron_samples["qwen2_moe_ep2"].role_dir
    code, _, err = run_cli(
        capsys,
        "merge",
        "--backend",
        "megatron",
        "--local_dir",
        role_dir,
        "--target_dir",
        tmp_path / "single",
        "--max-shard-size",
        "100KB",
    )
    assert code == 0, err
    with torchrun(
        nproc,
        "--backend",
        "megatron",
        "--local_dir",
        role_dir,
        "--target_dir",
        tmp_path / "multi",
        "--max-shard-size",
        "100KB",
    ) as run:
        _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    assert tree_digest(tmp_path / "multi") == tree_digest(tmp_path / "single")
    assert len(list((tmp_path / "single").glob("model-*.safetensors"))) > nproc
