"""``averaged_model``, switched on in a component's defs.yaml, in a real instance: nothing to
average after two merged steps; when the third lands (and no merge of the instance is in flight), its
sensor requests the run's average, which is published beside the steps, bit for bit the float32 average of the three merged folders;
then ``hub_averaged_model`` uploads that folder, byte for byte, to its run's repo on a test Hub (the real huggingface_hub client)."""

from __future__ import annotations

import dataclasses
import re

import dagster as dg
import torch
import yaml

from merge_pipeline.hf.blocking_checks import CHECK_NAMES
from merge_pipeline.hf.manifest import read_manifest
from merge_pipeline.watch.keys import PASSED
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.engine.test_average import weighted_sum
from merge_pipeline_tests.helpers import assert_bit_exact, load_safetensors_dir
from merge_pipeline_tests.hub.conftest import hub  # noqa: F401 (the test Hub on 127.0.0.1)

STEP = FsdpSpec(with_optimizer=False)  # the engine's averaging tests' steps: written once per session
RUN = "proj/exp"


def load_component(tmp_path, monkeypatch, roots) -> dg.Definitions:
    """A dg project whose one component instance has ``averaging`` set in its defs.yaml."""
    project = tmp_path / "project"
    # A root module of its own: dg imports the project's modules by name, and Python keeps them for the
    # session (another test's "clusters" project would answer otherwise).
    root = "averaging_" + re.sub(r"\W", "_", tmp_path.name)
    defs_dir = project / "src" / root / "defs" / "cluster"
    defs_dir.mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "{root}"\nversion = "0.1.0"\n\n[tool.dg]\ndirectory_type = "project"\n\n'
        f'[tool.dg.project]\nroot_module = "{root}"\n'
    )
    for package in (project / "src" / root, project / "src" / root / "defs"):
        (package / "__init__.py").touch()
    attributes = {
        "checkpoint_roots": [str(roots.checkpoints)],
        "output_root": str(roots.output),
        "averaging": {"last_k": 3, "scheme": "uniform"},
        "hub": {"organization": "org"},  # with averaging: hub_averaged_model (token: $HF_TOKEN, the Hub's writer)
    }
    (defs_dir / "defs.yaml").write_text(
        yaml.safe_dump({"type": "merge_pipeline.MergeCheckpoints", "attributes": attributes})
    )
    monkeypatch.syspath_prepend(str(project / "src"))
    return dg.load_from_defs_folder(path_within_project=project)


def land(defs, instance, roots, sample, step: int) -> str:
    """The trainer saves a step; the checkpoint sensor requests its merge, which runs and publishes it."""
    roots.drop(sample, f"{RUN}/global_step_{step}", tracker=step)
    ticked = defs.resolve_sensor_def("cluster__new_checkpoint_sensor")(
        dg.build_sensor_context(instance=instance, resources=defs.resources)
    )
    [request] = ticked.run_requests
    instance.add_dynamic_partitions("cluster__checkpoints", [request.partition_key])
    merged = defs.resolve_job_def("cluster__merge_checkpoint").execute_in_process(
        partition_key=request.partition_key, instance=instance
    )
    assert merged.success
    return request.partition_key


def averaging_tick(defs, instance, cursor=None) -> dg.SensorResult:
    return defs.resolve_sensor_def("cluster__averaged_model_sensor")(
        dg.build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources)
    )


def test_the_third_merged_step_gets_the_run_averaged_and_published(
    tmp_path,
    monkeypatch,
    roots,
    instance,
    fsdp_checkpoint,
    hub,  # noqa: F811 - the fixture imported above
):
    defs = load_component(tmp_path, monkeypatch, roots)
    samples = [fsdp_checkpoint(dataclasses.replace(STEP, seed=seed)) for seed in range(3)]
    keys = [land(defs, instance, roots, samples[0], 1), land(defs, instance, roots, samples[1], 2)]

    waiting = averaging_tick(defs, instance)
    assert not waiting.run_requests
    assert waiting.skip_reason.skip_message == f"waiting for more merged steps: {RUN}/actor (2 of 3 merged steps)"

    keys.append(land(defs, instance, roots, samples[2], 3))
    # max_concurrent_merges (1, the default): no average beside a merge of the instance (NOT_STARTED: a request)
    merging = instance.create_run_for_job(
        defs.resolve_job_def("cluster__merge_checkpoint"), tags={"dagster/partition": keys[-1]}
    )
    held = averaging_tick(defs, instance, waiting.cursor)
    assert not held.run_requests and held.cursor == waiting.cursor  # read again once the merge ended
    instance.report_run_canceled(merging)
    ticked = averaging_tick(defs, instance, waiting.cursor)
    [request] = ticked.run_requests
    [added] = ticked.dynamic_partitions_requests
    assert request.partition_key == f"{RUN}/actor" and list(added.partition_keys) == [f"{RUN}/actor"]
    instance.add_dynamic_partitions(added.partitions_def_name, list(added.partition_keys))
    averaged = defs.resolve_job_def("cluster__average_run").execute_in_process(
        partition_key=request.partition_key, instance=instance
    )

    assert averaged.success
    [event] = averaged.get_asset_materialization_events()
    metadata = event.materialization.metadata
    target = roots.output / RUN / "averaged" / "actor"
    assert event.asset_key.to_user_string() == "cluster/averaged_model" and metadata["path"].value == str(target)
    assert metadata["steps"].value == [1, 2, 3]
    for key in keys:
        assert f"| `{key}` | 0.333333 |" in metadata["inputs"].value
    assert set(metadata[PASSED].value) == set(CHECK_NAMES)
    assert 0 < metadata["largest change vs newest step"].value
    merged = [load_safetensors_dir(roots.target(key)) for key in keys]
    assert_bit_exact(target, weighted_sum(merged, (1 / 3,) * 3, torch.float32))
    inputs = read_manifest(target)["source"]["layout"]["averaged_inputs"]
    assert [i["path"] for i in inputs] == [str(roots.target(key)) for key in keys]
    # nothing new: no second average of the same steps
    assert not averaging_tick(defs, instance, ticked.cursor).run_requests

    hub_averaged = defs.resolve_assets_def(dg.AssetKey(["cluster", "hub_averaged_model"]))
    instance.add_dynamic_partitions(added.partitions_def_name, ["proj/other/actor"])
    unaveraged = dg.materialize(
        [hub_averaged], partition_key="proj/other/actor", instance=instance, raise_on_error=False
    )
    assert not unaveraged.success and not hub.repos  # nothing averaged yet: one line, nothing sent
    failure = next(e for e in unaveraged.all_events if e.is_step_failure).step_failure_data.error
    assert f"{roots.output}/proj/other/averaged/actor: has no merge_manifest.json: materialize averaged_model" in (
        failure.message
    )

    published = dg.materialize(
        [hub_averaged],
        partition_key=request.partition_key,
        instance=instance,  # the resources: the component's, bound to the asset
    )

    assert published.success
    [event] = published.get_asset_materialization_events()
    metadata = event.materialization.metadata
    # the run's role repo (where its steps go), on the branch of the last-3 average
    assert (metadata["repo"].value, metadata["revision"].value) == ("org/proj-exp-actor", "averaged-last-3")
    on_hub = hub.tree("org/proj-exp-actor", "averaged-last-3")
    card = on_hub.pop("README.md").decode()
    on_hub.pop(".gitattributes")
    assert on_hub == {p.name: p.read_bytes() for p in target.iterdir()}
    assert "The weighted average of 3 checkpoints, accumulated in float32" in card
    for key in keys:
        assert f"| `{roots.target(key)}` | hf | 0.333333 |" in card
    assert "| run | `exp` |" in card and "| steps | 1, 2, 3 |" in card  # its inputs' run (folder) and steps
    assert set(hub.repos[("model", "org/proj-exp-actor")].branches) == {"main", "averaged-last-3"}
