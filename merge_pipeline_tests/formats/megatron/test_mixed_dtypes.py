"""A Megatron-Core checkpoint storing several dtypes (the local layer spec keeps its RMSNorm weights in
fp32 beside bf16 weights): ``--dtype auto`` keeps every stored dtype, config.json names the narrowest
dtype holding them all (float32), and the CLI, torchrun and the sensor's run publish the same folder."""

from __future__ import annotations

import json

import dagster as dg
import pytest
import torch
from safetensors.torch import load_file

from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.definitions import defs
from merge_pipeline.hf.blocking_checks import CHECK_NAMES
from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline_samples.megatron import arrange_v2
from merge_pipeline_tests.dagster.conftest import instance, roots  # noqa: F401 - fixtures: a real instance, watched roots
from merge_pipeline_tests.dagster.helpers import LOCATION, checks_passed
from merge_pipeline_tests.helpers import (
    assert_loads_every_stored_value,
    load_safetensors_dir,
    merge_ok,
    run_cli,
    same_bits,
    tree_digest,
)

new_checkpoint_sensor = LOCATION.resolve_sensor_def("new_checkpoint_sensor")
ROOTS_VAR, OUTPUT_VAR = "MERGE_PIPELINE_CHECKPOINT_ROOTS", "MERGE_PIPELINE_OUTPUT_ROOT"

MIXED = "llama_tied_pp2"  # megatron-core 0.16, local spec, params_dtype bf16: RMSNorm weights stay fp32
KEY = "run/global_step_1/actor"


@pytest.fixture(params=["v1", "v2"])
def mixed_role_dir(request, megatron_samples, tmp_path):
    """The mixed checkpoint as legacy verl (``dist_ckpt/`` + ``huggingface/``) and verl 0.9 (schema v2, the
    shards in ``model/dist_ckpt/``, config in ``model/huggingface/``) lay it out."""
    sample = megatron_samples[MIXED]
    if request.param == "v1":
        return sample.role_dir
    return arrange_v2(sample, tmp_path / "v2" / "global_step_1" / "actor", "hybrid").role_dir


def test_auto_keeps_every_stored_dtype_and_transformers_loads_each_value_unaltered(
    capsys, megatron_samples, mixed_role_dir, tmp_path
):
    reference = load_file(megatron_samples[MIXED].reference_dir / "model.safetensors")
    assert {t.dtype for t in reference.values()} == {torch.bfloat16, torch.float32}  # really mixed
    capsys.readouterr()  # what writing the v2 sample printed
    code, out, err = run_cli(capsys, "inspect", mixed_role_dir, "--json")
    assert code == 0, err
    assert json.loads(out)["config_dtype"] == "float32"

    merge_ok(capsys, mixed_role_dir, tmp_path / "out")

    merged = load_safetensors_dir(tmp_path / "out")
    assert set(merged) == set(reference) and all(same_bits(merged[k], reference[k]) for k in reference)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["decisions"]["tensor_dtypes"] == {"bfloat16 -> bfloat16": 29, "float32 -> float32": 9}
    assert manifest["checks_before_publishing"] == CHECK_NAMES
    assert_loads_every_stored_value(tmp_path / "out")


def test_an_asked_cast_is_written_and_recorded(capsys, megatron_samples, tmp_path):
    role_dir = megatron_samples[MIXED].role_dir
    code, out, _ = run_cli(capsys, "inspect", role_dir, "--json", "--dtype", "bfloat16")
    assert code == 0 and json.loads(out)["config_dtype"] == "bfloat16"

    merge_ok(capsys, role_dir, tmp_path / "out", "--dtype", "bfloat16")

    assert {t.dtype for t in load_safetensors_dir(tmp_path / "out").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    decisions = json.loads((tmp_path / "out" / MANIFEST).read_text())["decisions"]
    assert decisions["tensor_dtypes"] == {"bfloat16 -> bfloat16": 29, "float32 -> bfloat16": 9}
    assert_loads_every_stored_value(tmp_path / "out")


def test_the_sensors_run_publishes_it_and_the_cli_writes_the_same_bytes(
    capsys,
    megatron_samples,
    roots,  # noqa: F811 - the fixture imported above
    instance,  # noqa: F811 - the fixture imported above
    monkeypatch,
    tmp_path,
):
    role_dir = arrange_v2(megatron_samples[MIXED], roots.checkpoints / KEY, "hybrid").role_dir
    monkeypatch.setenv(ROOTS_VAR, str(roots.checkpoints))  # as .env sets them for `dagster dev`
    monkeypatch.setenv(OUTPUT_VAR, str(roots.output))

    tick = new_checkpoint_sensor(dg.build_sensor_context(instance=instance, resources={"settings": MergeSettings()}))
    [request] = tick.run_requests
    [added] = tick.dynamic_partitions_requests  # applied as the daemon does before launching the run
    assert request.partition_key == KEY and added.partition_keys == [KEY]
    instance.add_dynamic_partitions(added.partitions_def_name, added.partition_keys)
    run = defs.resolve_job_def(new_checkpoint_sensor.job_name).execute_in_process(
        instance=instance, partition_key=KEY, run_config=request.run_config, tags=request.tags
    )

    assert run.success
    assert checks_passed(run) == CHECK_NAMES  # the blocking ones, passed before publishing
    published = roots.target(KEY)
    assert json.loads((published / "config.json").read_text())["dtype"] == "float32"
    assert_loads_every_stored_value(published)
    merge_ok(capsys, role_dir, tmp_path / "cli")
    assert tree_digest(tmp_path / "cli") == tree_digest(published)  # the manifest included: nothing differs
