"""``merge_pipeline.MergeCheckpoints`` in another Dagster project: scaffolded with ``dg`` twice (two
training clusters), loaded by ``dg check defs`` / ``dg list defs`` under their own prefixes, and a
prefixed instance merging a checkpoint without touching the other's partitions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml
from safetensors.torch import load_file

from merge_pipeline.hf.blocking_checks import CHECK_NAMES
from merge_pipeline_tests.dagster.helpers import ACTOR, PROJECT_ROOT
from merge_pipeline_tests.helpers import load_safetensors_dir, same_bits

BIN = Path(sys.executable).parent
CLUSTERS = ("cluster_a", "cluster_b")
STAGES = ("checkpoint", "parallel_config", "state_dict", "hf_model", "step_report", "hub_model")
DEFINITIONS_PY = """\
from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
"""


def dg_command(project: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"} | {
        "PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), str(project / "src")]),
        "PATH": os.pathsep.join([str(BIN), os.environ["PATH"]]),
        "HOME": str(project.parent / "home"),
        "DAGSTER_DISABLE_TELEMETRY": "1",
    }
    return subprocess.run([str(BIN / "dg"), *args], cwd=project, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A fresh `dg` project (pyproject with [tool.dg], src/clusters/defs/) and the component scaffolded
    into it twice, as a user would: `dg scaffold defs merge_pipeline.MergeCheckpoints <name>`."""
    project = tmp_path_factory.mktemp("component") / "clusters"
    (project / "src" / "clusters" / "defs").mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        '[project]\nname = "clusters"\nversion = "0.1.0"\n\n[tool.dg]\ndirectory_type = "project"\n\n'
        '[tool.dg.project]\nroot_module = "clusters"\n'
    )
    (project / "src" / "clusters" / "__init__.py").touch()
    (project / "src" / "clusters" / "defs" / "__init__.py").touch()
    (project / "src" / "clusters" / "definitions.py").write_text(DEFINITIONS_PY)
    said = []
    for name in CLUSTERS:
        scaffolded = dg_command(project, "scaffold", "defs", "merge_pipeline.MergeCheckpoints", name)
        assert scaffolded.returncode == 0, scaffolded.stderr[-3000:]
        said.append(scaffolded.stdout + scaffolded.stderr)
    # the first writes the instance settings where `dg dev` reads them and says so; the second keeps them
    assert f"wrote {project / 'dagster.yaml'}: merge_pipeline's instance settings" in said[0], said[0]
    assert "dagster.yaml kept as it is" in said[1], said[1]
    return project


def test_the_scaffolder_writes_the_instance_settings_a_new_project_lacks(project, tmp_path):
    from merge_pipeline.dagster.scaffolder import INSTANCE_SETTINGS

    assert (project / "dagster.yaml").read_text() == INSTANCE_SETTINGS.read_text()
    assert (PROJECT_ROOT / "dagster.yaml").resolve() == INSTANCE_SETTINGS.resolve()  # this repo's is the same file
    shutil.copy(project / "dagster.yaml", tmp_path)  # an instance folder of its own: the project stays clean
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        assert instance.python_log_level == "INFO" and instance.run_monitoring_enabled
        assert instance.run_retries_enabled and type(instance.run_launcher).__name__ == "MonitoredRunLauncher"


def test_the_scaffolded_yaml_the_docs_table_and_the_resources_come_from_one_schema(project):
    from merge_pipeline.dagster.alerts import AlertWebhook
    from merge_pipeline.dagster.component import HubPublishing, MergeCheckpoints
    from merge_pipeline.dagster.hub_model import HuggingFaceHub
    from merge_pipeline.dagster.resources import MergeSettings
    from merge_pipeline.watch.location_settings import SETTINGS, attributes, docs_table, of_resource

    text = (project / "src/clusters/defs/cluster_a/defs.yaml").read_text()
    written = yaml.safe_load(text)["attributes"]
    for setting in SETTINGS:  # each setting named in the YAML with its description, set or left out
        assert f"# {setting.description[:40]}" in text, setting.name
        section = written[setting.under] if setting.under else written
        if setting.secret:  # a token: its variable only, never an attribute
            assert setting.name not in section and f"# {setting.name}:" not in text, setting.name
        else:
            assert setting.name in section or f"  # {setting.name}:" in text, setting.name
    assert {"checkpoint_roots", "output_root", "settle_seconds"} <= set(written)
    # the resources' fields and the component's attributes, one per setting, described alike
    resources = {"settings": MergeSettings, "alert_webhook": AlertWebhook, "hub": HuggingFaceHub}
    for resource, model in resources.items():
        fields = model.model_fields
        assert list(fields) == [s.name for s in of_resource(resource)], resource
        assert [f.description for f in fields.values()] == [s.description for s in of_resource(resource)]
    assert {s.name for s in attributes()} <= set(MergeCheckpoints.model_fields)
    assert {s.name for s in attributes("hub")} | {"schedule"} == set(HubPublishing.model_fields)
    assert attributes() + attributes("hub") == tuple(s for s in SETTINGS if not s.secret)
    assert {s.name for s in SETTINGS} == {f for m in resources.values() for f in m.model_fields} | {
        s.name for s in SETTINGS if s.at_load
    }
    # the docs show the generated table and the scaffolded YAML (of the instance named cluster_a)
    docs = (PROJECT_ROOT / "docs" / "DAGSTER.md").read_text()
    assert docs_table() in docs, "docs/DAGSTER.md: paste `python -m merge_pipeline.watch.location_settings`"
    assert f"```yaml\n{text}```" in docs, "docs/DAGSTER.md: paste the scaffolded cluster_a/defs.yaml"


def test_two_scaffolded_instances_load_with_dg_under_their_own_prefixes(project):
    written = yaml.safe_load((project / "src/clusters/defs/cluster_a/defs.yaml").read_text())
    assert written["type"] == "merge_pipeline.MergeCheckpoints"
    assert written["attributes"]["prefix"] == "cluster_a" and written["attributes"]["pin_steps"] is False

    checked = dg_command(project, "check", "defs")
    assert checked.returncode == 0, checked.stderr[-3000:]
    listed = dg_command(project, "list", "defs", "--json")
    assert listed.returncode == 0, listed.stderr[-3000:]

    found = json.loads(listed.stdout)
    assets = {a["asset_key"] for a in found["assets"]}
    assert assets == {f"{c}/{s}" for c in CLUSTERS for s in (*STAGES, "evaluation", "promoted_model")}
    assert {s["name"] for s in found["sensors"]} == {
        f"{c}__{s}"
        for c in CLUSTERS
        for s in ("new_checkpoint_sensor", "step_report_automation", "merge_failure_webhook")
    }
    assert {s["name"] for s in found["schedules"]} == {f"{c}__publish_latest_steps" for c in CLUSTERS}
    assert {j["name"] for j in found["jobs"]} == {
        f"{c}__{j}"
        for c in CLUSTERS
        for j in ("merge_checkpoint", "report_merged_step", "publish_to_hub", "evaluate_merged_step", "promote_step")
    }
    assert {c["key"] for c in found["asset_checks"]} == {
        *(f"{c}/step_report:{check}" for c in CLUSTERS for check in ("weights_changed", "finite")),
        *(f"{c}/hf_model:{check}" for c in CLUSTERS for check in CHECK_NAMES),
    }


def test_a_prefixed_instance_merges_bit_exact_and_leaves_the_other_alone(
    project, tmp_path, fsdp_checkpoint, roots, instance, monkeypatch
):
    copy = tmp_path / "clusters"
    shutil.copytree(project, copy)
    other = tmp_path / "cluster_b_checkpoints"
    other.mkdir()
    for name, attributes in {
        "cluster_a": {"checkpoint_roots": [str(roots.checkpoints)], "output_root": str(roots.output)},
        "cluster_b": {"checkpoint_roots": [str(other)], "output_root": str(tmp_path / "cluster_b_merged")},
    }.items():
        defs_yaml = copy / "src/clusters/defs" / name / "defs.yaml"
        component = yaml.safe_load(defs_yaml.read_text())
        component["attributes"].update(attributes)
        defs_yaml.write_text(yaml.safe_dump(component))
    monkeypatch.syspath_prepend(str(copy / "src"))
    defs = dg.load_from_defs_folder(path_within_project=copy)
    sample = fsdp_checkpoint(ACTOR)
    roots.drop(sample, "run/global_step_1", tracker=1)
    key = "run/global_step_1/actor"

    ticked = defs.resolve_sensor_def("cluster_a__new_checkpoint_sensor")(
        dg.build_sensor_context(instance=instance, resources=defs.resources)
    )
    [request] = ticked.run_requests
    [added] = ticked.dynamic_partitions_requests
    assert (request.partition_key, added.partitions_def_name) == (key, "cluster_a__checkpoints")
    instance.add_dynamic_partitions("cluster_a__checkpoints", [key])
    # cluster_b's sensor watches another root: cluster_a's partition is none of its business
    ticked_b = defs.resolve_sensor_def("cluster_b__new_checkpoint_sensor")(
        dg.build_sensor_context(instance=instance, resources=defs.resources)
    )
    assert ticked_b.dynamic_partitions_requests == []

    # the report automations run (their first tick: nothing for the history before it)
    automations = {c: defs.resolve_sensor_def(f"{c}__step_report_automation") for c in CLUSTERS}
    started = {c: automations[c](dg.build_sensor_context(instance=instance, definitions=defs)) for c in CLUSTERS}
    assert not any(t.run_requests for t in started.values())
    merged = defs.resolve_job_def("cluster_a__merge_checkpoint").execute_in_process(
        partition_key=key, instance=instance
    )

    assert merged.success
    assert {(e.asset_key.to_user_string(), e.check_name, e.passed) for e in merged.get_asset_check_evaluations()} == {
        ("cluster_a/hf_model", name, True) for name in CHECK_NAMES
    }
    assert {e.asset_key.to_user_string() for e in merged.get_asset_materialization_events()} == {
        f"cluster_a/{s}" for s in ("parallel_config", "state_dict", "hf_model")
    }

    # the step report follows in a run of its own, requested by this instance's report automation once
    def tick(cluster: str, cursor: str | None) -> dg.SensorResult:
        return automations[cluster](dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs))

    first = tick("cluster_a", started["cluster_a"].cursor)
    [report_request] = first.run_requests
    assert report_request.partition_key == key
    report = defs.resolve_job_def("cluster_a__report_merged_step").execute_in_process(
        partition_key=key, instance=instance
    )
    assert report.success and {
        (e.asset_key.to_user_string(), e.passed) for e in report.get_asset_check_evaluations()
    } == {("cluster_a/step_report", True)}
    assert tick("cluster_a", first.cursor).run_requests == []  # reported: not again
    assert tick("cluster_b", started["cluster_b"].cursor).run_requests == []
    reference = load_file(sample.reference_dir / "model.safetensors")
    weights = load_safetensors_dir(roots.output / key)
    assert set(weights) == set(reference) and all(same_bits(weights[n], t) for n, t in reference.items())
    assert instance.get_dynamic_partitions("cluster_b__checkpoints") == []
    assert instance.get_dynamic_partitions("checkpoints") == []  # nor this project's own location's
