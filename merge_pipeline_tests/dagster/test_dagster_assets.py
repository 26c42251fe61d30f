"""The asset chain, materialized for real FSDP checkpoints in a real instance, merges bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from merge_pipeline.dagster.metadata import SHA256_SHOWN
from merge_pipeline.engine.publish import staging_path
from merge_pipeline.hf.blocking_checks import BLOCKING_CHECKS, CHECK_NAMES
from merge_pipeline.hf.manifest import MANIFEST, write_manifest
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.inspect import describe
from merge_pipeline.pipeline.prepare import prepare
from merge_pipeline.progress import human_bytes
from merge_pipeline.watch.keys import CHECKED
from merge_pipeline_tests.dagster.helpers import ACTOR, CRITIC, checks_passed, materialize
from merge_pipeline_tests.helpers import load_safetensors_dir, same_bits

SHARDED = {"max_shard_size": "200KB"}  # the 0.8 MB test model in several shards, with an index


@pytest.mark.parametrize(
    "spec, merge_config, dtype",
    [(ACTOR, SHARDED, None), (CRITIC, None, None), (ACTOR, {"dtype": "bfloat16"}, torch.bfloat16)],
    ids=["actor-sharded", "critic", "actor-bf16"],
)
def test_chain_publishes_a_bit_exact_verified_folder(fsdp_checkpoint, roots, instance, spec, merge_config, dtype):
    sample = fsdp_checkpoint(spec)
    roots.drop(sample, "proj/exp/global_step_7", tracker=7)
    key = f"proj/exp/global_step_7/{sample.role_dir.name}"
    settings = roots.settings()

    result = materialize(instance, settings, key, merge_config=merge_config)

    assert result.success
    target = roots.target(key)
    reference = load_file(sample.reference_dir / "model.safetensors")
    merged = load_safetensors_dir(target)
    assert set(merged) == set(reference)
    for name, tensor in reference.items():
        assert same_bits(merged[name], tensor.to(dtype) if dtype else tensor), name
    assert json.loads((target / "config.json").read_text())["dtype"] == str(dtype or torch.float32).removeprefix(
        "torch."
    )
    assert (target / "model.safetensors.index.json").is_file() == (merge_config == SHARDED)
    assert checks_passed(result) == CHECK_NAMES
    assert [(e.check_name, e.passed) for e in result.get_asset_check_evaluations()] == [(n, True) for n in CHECK_NAMES]
    # the manifest names the checks the folder passed before publishing, as the CLI's does
    assert json.loads((target / MANIFEST).read_text())["checks_before_publishing"] == CHECK_NAMES
    assert not staging_path(target).exists()


def test_each_asset_reports_what_a_person_reads(fsdp_checkpoint, roots, instance):
    sample = fsdp_checkpoint(ACTOR)
    roots.drop(sample, "run/global_step_3", tracker=3)
    settings = roots.settings()

    result = materialize(instance, settings, "run/global_step_3/actor", merge_config={**SHARDED, "dtype": "bfloat16"})

    metadata = {
        e.asset_key.to_user_string(): e.materialization.metadata for e in result.get_asset_materialization_events()
    }
    # the checkpoint is the trainer's (the sensor records it); the three stages come from the one merge step
    assert set(metadata) == {"parallel_config", "state_dict", "hf_model"}
    plan, weights, published = metadata["parallel_config"], metadata["state_dict"], metadata["hf_model"]
    sample_dir = roots.checkpoints / "run/global_step_3/actor"
    inspected = describe(sample_dir, MergeOptions())  # `inspect` and parallel_config show the same facts
    assert {k: plan[k].value for k in ("backend", "world_size", "fsdp_version", "architecture", "parameters")} == {
        k: inspected[k] for k in ("backend", "world_size", "fsdp_version", "architecture", "parameters")
    }
    assert (plan["backend"].value, plan["world_size"].value, plan["architecture"].value) == (
        "fsdp",
        2,
        "Qwen2ForCausalLM",
    )
    assert plan["parameters"].value == sum(
        t.numel() for t in load_file(sample.reference_dir / "model.safetensors").values()
    )
    assert plan["dtype"].value == "bfloat16" and plan["tensor dtypes"].value == {"float32 -> bfloat16": 27}
    assert plan["shards"].value == 3 and plan["lora handling"].value == "no LoRA tensors"
    assert weights["tensors"].value == 27 and weights["throughput"].value.endswith("/s")
    assert [k for k in weights if "rss" in k.lower()] == ["peak RSS (whole process)"]  # once, human-readable
    assert (
        weights["peak RSS (whole process)"].value.endswith("B")
        and weights["peak RSS (whole process)"].value[0].isdigit()
    )
    assert published["completeness"].value == "latest_checkpointed_iteration.txt says 3 >= 3"
    assert published["dtype"].value == "bfloat16"  # what was written
    target = roots.target("run/global_step_3/actor")
    assert published["path"].value == weights["path"].value == str(target)
    assert published["source"].value == str(sample_dir) and sample_dir.is_dir()
    for stage in metadata.values():
        assert not any("staging" in str(v.value) for v in stage.values()), (
            "no metadata points at the staging folder, which is gone"
        )
    manifest = json.loads((target / MANIFEST).read_text())["files"]
    assert len(manifest) == 9 and {p.name for p in target.iterdir()} - {MANIFEST} == set(manifest)
    for name, f in manifest.items():  # every sha256 in full, readable in the Markdown table
        shown = f"`{f['sha256'][:SHA256_SHOWN]}…`"
        assert f"| {name} | " in published["files"].value and shown in published["files"].value
        assert (shown in weights["files"].value) == name.endswith(".safetensors")
    # each blocking check an asset check of hf_model, with what it verified and how much it counted
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    looked_at = f"3 weight file(s), 27 tensors; 9 files in the manifest, {human_bytes(sum(f['size'] for f in manifest.values()))}"
    for check in BLOCKING_CHECKS:
        evaluation = evaluations[check.name]
        assert evaluation.passed and evaluation.asset_key.to_user_string() == "hf_model", check.name
        assert evaluation.description == check.passed_text
        assert evaluation.metadata["looked at"].value.startswith(looked_at), evaluation.metadata
    assert not any(CHECKED in stage for stage in metadata.values())  # the Checks tab shows them, not the stages


def test_the_plan_is_built_once_per_run(fsdp_checkpoint, roots, instance, monkeypatch):
    from merge_pipeline.pipeline import merge as merge_sequence

    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_3", tracker=3)
    plans = []
    # the step imports the pipeline when it runs (the code location's load does not import torch)
    monkeypatch.setattr(merge_sequence, "prepare", lambda *a, **k: plans.append(a) or prepare(*a, **k))

    assert materialize(instance, roots.settings(), "run/global_step_3/actor").success
    assert len(plans) == 1


def test_the_manifest_takes_the_weights_digests_from_the_write(fsdp_checkpoint, roots, instance, monkeypatch):
    """The weights are hashed while they are written; the manifest never reads them back."""
    from merge_pipeline.pipeline import folder

    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_4", tracker=4)
    supplied = []

    def recording(folder, body, known=None):
        supplied.append(known)
        return write_manifest(folder, body, known)

    monkeypatch.setattr(folder, "write_manifest", recording)
    assert materialize(instance, roots.settings(), "run/global_step_4/actor", merge_config=SHARDED).success
    files = json.loads((roots.target("run/global_step_4/actor") / MANIFEST).read_text())["files"]
    weights = {name: entry["sha256"] for name, entry in files.items() if name.endswith(".safetensors")}
    assert len(weights) > 1 and supplied == [weights]


@pytest.mark.parametrize(
    "name, parallel",
    [
        ("qwen2_tp2", {"tp": 2, "pp": 1, "sharded_backend": "torch_dist"}),
        ("qwen2_hf_weights", {"weights": "huggingface safetensors"}),
    ],
)
def test_megatron_checkpoints_flow_through_the_same_assets(megatron_samples, roots, instance, name, parallel):
    sample = megatron_samples[name]
    roots.drop(sample, f"{name}/global_step_1", tracker=1)
    key = f"{name}/global_step_1/actor"

    result = materialize(instance, roots.settings(), key)

    assert result.success
    reference = load_file(sample.reference_dir / "model.safetensors")
    merged = load_safetensors_dir(roots.target(key))
    assert set(merged) == set(reference) and all(same_bits(merged[n], t) for n, t in reference.items())
    assert checks_passed(result) == CHECK_NAMES
    [metadata] = [
        e.materialization.metadata
        for e in result.get_asset_materialization_events()
        if e.asset_key.to_user_string() == "parallel_config"
    ]
    assert metadata["backend"].value == "megatron" and {k: metadata[k].value for k in parallel} == parallel
