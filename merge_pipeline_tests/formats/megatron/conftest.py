"""Megatron-Core sample checkpoints beyond the suite's ``megatron_samples`` (merge_pipeline_tests/conftest.py).

The cached folders are shared: never modify them. A test that damages a checkpoint works on
``fresh_megatron(name)``, a private copy of the role folder.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from merge_pipeline_samples.megatron import (
    MegatronSample,
    Variant,
    _finish_v2,
)
from merge_pipeline_tests.helpers import write_with_release


@pytest.fixture
def fresh_megatron(megatron_samples, tmp_path):
    """``fresh_megatron(name) -> MegatronSample`` whose role folder this test may change."""

    def copy(name: str) -> MegatronSample:
        sample = megatron_samples[name]
        role_dir = tmp_path / name / "global_step_1" / "actor"
        shutil.copytree(sample.role_dir, role_dir)
        return replace(sample, role_dir=role_dir)

    return copy


@pytest.fixture(scope="session")
def megatron_fsdp_sample(tmp_path_factory) -> MegatronSample:
    """verl's Megatron-FSDP role folder, written by Megatron-FSDP itself (megatron-core 0.18.2's, in the
    bridge venv: ``merge_pipeline_samples/megatron_fsdp_save.py``) on 3 gloo ranks: one DCP of uneven
    row-sharded DTensors in ``model/dist_ckpt/``, no HF files in the checkpoint; the reference and the
    trainer's model folder are the Qwen3 it loaded. Read only."""
    root = write_with_release(".venv-bridge", "megatron_fsdp_save.py", tmp_path_factory.mktemp("megatron_fsdp"))
    variant = Variant("qwen3_megatron_fsdp", "qwen3")
    _finish_v2(root / "actor", "dist", variant)
    return MegatronSample(variant, root / "actor", root / "hf", root / "hf")
