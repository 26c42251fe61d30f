"""Shared fixtures: real verl-style FSDP, DCP, DeepSpeed and Megatron checkpoints, each written once per test session.

The cached folders are shared by every test that asks for the same spec: never modify them.
A test that changes, deletes or adds files works on ``fresh_copy(sample)`` instead.
"""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from merge_pipeline_samples.dcp import DcpSpec, write_dcp_checkpoint
from merge_pipeline_samples.deepspeed import write_deepspeed_checkpoints
from merge_pipeline_samples.fsdp import FsdpSpec, write_fsdp_checkpoint
from merge_pipeline_samples.megatron import VARIANTS as MEGATRON_VARIANTS
from merge_pipeline_samples.megatron import MegatronSample, write_megatron_samples
from merge_pipeline_tests.helpers import DCP_FOLDERS, VARIANTS, DcpSample, run_cli

# The tiers (README "The two commands"): a test is slow when its body or a fixture it uses writes a sample
# checkpoint or starts a process, read from their code (tiers.py); the fast tier fails a test that does so unseen.
from merge_pipeline_tests.tiers import pytest_collection_modifyitems, pytest_runtest_call, pytest_runtest_setup  # noqa: F401

# The S3 server (SeaweedFS) and a bucket per test, for every test that asks for them (started only then).
pytest_plugins = ["merge_pipeline_tests.object_store", "merge_pipeline_tests.fault_proxy"]


@dataclass(frozen=True)
class SampleCheckpoint:
    role_dir: Path  # <root>/global_step_1/actor (or critic; the SFT trainer: global_step_1): what verl wrote
    reference_dir: Path  # model.safetensors + config.json: the unsharded model it was sharded from
    spec: FsdpSpec


@pytest.fixture(autouse=True)
def no_ambient_dagster_state_storage():
    """Each test starts with no Dagster definitions-state storage in its context: an instance sets one while
    it is entered, and one left behind by an earlier test names an instance that is gone (Dagster's
    ``Attempted to resolve undefined DagsterInstance weakref`` at the next definitions load)."""
    from dagster._core.storage.defs_state.base import set_defs_state_storage

    with set_defs_state_storage(None):
        yield


@pytest.fixture(scope="session")
def fsdp_checkpoint(tmp_path_factory):
    """``fsdp_checkpoint(spec) -> SampleCheckpoint``, written on first use of each spec. Read only."""
    cache: dict[FsdpSpec, SampleCheckpoint] = {}

    def get(spec: FsdpSpec) -> SampleCheckpoint:
        if spec not in cache:
            root = tmp_path_factory.mktemp("fsdp")
            step_dir = root / "checkpoints" / "global_step_1"
            role_dir = step_dir if spec.layout == "sft" else step_dir / ("critic" if spec.critic else "actor")
            write_fsdp_checkpoint(role_dir, spec, reference_dir=root / "reference")
            cache[spec] = SampleCheckpoint(role_dir, root / "reference", spec)
        return cache[spec]

    return get


def copy_checkpoint(sample: SampleCheckpoint, dst: Path) -> SampleCheckpoint:
    """Copy the role folder to ``dst`` (created); the reference stays shared and read only."""
    shutil.copytree(sample.role_dir, dst)
    return replace(sample, role_dir=dst)


@pytest.fixture
def fresh_copy(tmp_path):
    """``fresh_copy(sample) -> SampleCheckpoint`` whose role folder this test may change."""
    numbers = itertools.count()
    return lambda sample: copy_checkpoint(sample, tmp_path / f"copy_{next(numbers)}" / sample.role_dir.name)


@pytest.fixture
def good_target(capsys, tmp_path, fsdp_checkpoint):
    """A published merge of a 3-rank FSDP checkpoint, for tests that check a failing merge leaves it as it was."""
    target = tmp_path / "targets" / "published"
    code, _, err = run_cli(
        capsys,
        "merge",
        "--local_dir",
        fsdp_checkpoint(FsdpSpec(world_size=3, with_optimizer=False)).role_dir,
        "--target_dir",
        target,
        "--no-progress",
    )
    assert code == 0, err
    return target


@pytest.fixture(scope="session")
def dcp_sample(tmp_path_factory):
    """``dcp_sample(source) -> DcpSample``, written on first use of each source. Read only."""
    cache: dict[str, DcpSample] = {}

    def get(source: str) -> DcpSample:
        if source not in cache:
            root = tmp_path_factory.mktemp(source)
            folder = root / DCP_FOLDERS[source]
            model_dir = write_dcp_checkpoint(folder, DcpSpec(source=source), reference_dir=root / "original")
            cache[source] = DcpSample(folder, model_dir, root / "original")
        return cache[source]

    return get


@pytest.fixture(scope="session")
def deepspeed_checkpoints(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """variant (``helpers.VARIANTS``) -> (save dir holding ``latest``, reference dir). Written by one torchrun. Read only."""
    root = tmp_path_factory.mktemp("deepspeed")
    folders = {name: (root / name / "ckpt", root / name / "reference") for name in VARIANTS}
    write_deepspeed_checkpoints([(*folders[name], spec) for name, spec in VARIANTS.items()])
    return folders


@pytest.fixture(scope="session")
def megatron_samples(tmp_path_factory) -> dict[str, MegatronSample]:
    """Every variant of ``VARIANTS``: real megatron-core checkpoints plus the hand-built layouts, in one torchrun
    job (the formats' tests and the Dagster assets' share it). Read only: ``fresh_megatron(name)`` copies one."""
    return write_megatron_samples(tmp_path_factory.mktemp("megatron"), MEGATRON_VARIANTS.values(), timeout=600)


@pytest.fixture(scope="session")
def megatron_lm_sample(tmp_path_factory) -> MegatronSample:
    """Megatron-LM's ``--save`` folder (``role_dir``: ``iter_0000100/`` and its tracker), written by megatron-core
    (TP=2); ``original_dir`` the HF model (config, tokenizer) it needs. Read only."""
    root = tmp_path_factory.mktemp("megatron_lm")
    variant = MEGATRON_VARIANTS["qwen2_tp2"]
    return write_megatron_samples(root, [variant], timeout=600, layout="megatron_lm")[variant.name]


@pytest.fixture(scope="session")
def megatron_v2_sample(tmp_path_factory) -> MegatronSample:
    """A real layout-v2 checkpoint: megatron-core writes ``model/dist_ckpt/`` directly, and, as verl
    with ``use_dist_checkpointing`` and no ``hf_model``, the checkpoint holds no HF files at all
    (``original_dir`` is the trainer's model folder). Read only."""
    root = tmp_path_factory.mktemp("megatron_v2")
    return write_megatron_samples(root, [MEGATRON_VARIANTS["qwen2_tp2"]], timeout=600, layout="v2")["qwen2_tp2"]
