"""The code location as `dagster dev` / `dg` load it, and the instance dagster.yaml configures."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, a dependency of dagster's
    import tomli as tomllib

import dagster as dg
import pytest
import yaml

from merge_pipeline.definitions import defs
from merge_pipeline.hf.blocking_checks import CHECK_NAMES
from merge_pipeline.watch.keys import HEAVY_TAG
from merge_pipeline_tests.dagster.helpers import PROJECT_ROOT
from merge_pipeline_tests.dagster.services import LOCATIONS_QUERY, running_dagster_dev

DG = os.path.join(os.path.dirname(sys.executable), "dg")


def test_workspace_and_dg_load_the_definitions_module():
    [location] = yaml.safe_load((PROJECT_ROOT / "workspace.yaml").read_text())["load_from"]
    assert location["python_module"] == {
        "module_name": "merge_pipeline.definitions",
        "attribute": "defs",
        "location_name": "merge_pipeline",
    }
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["dg"]
    assert (
        project["directory_type"] == "project"
        and project["project"]["code_location_target_module"] == "merge_pipeline.definitions"
    )


@pytest.mark.e2e
def test_dg_check_and_list_defs_work_in_the_project_root(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"} | {
        "DAGSTER_DISABLE_TELEMETRY": "1",
        "HOME": str(tmp_path),
    }
    checked = subprocess.run(
        [DG, "check", "defs"], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert checked.returncode == 0, checked.stderr[-3000:]
    listed = subprocess.run(
        [DG, "list", "defs", "--json"], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert listed.returncode == 0, listed.stderr[-3000:]
    for name in (
        "checkpoint",
        "parallel_config",
        "state_dict",
        "hf_model",
        "step_report",
        "merge_checkpoint",
        "report_merged_step",
        "new_checkpoint_sensor",
        "step_report_automation",
        "merge_failure_webhook",
    ):
        assert name in listed.stdout, name


@pytest.mark.e2e
def test_dg_dev_serves_the_location_from_the_project_root(tmp_path):
    with running_dagster_dev(
        PROJECT_ROOT, {"DAGSTER_DISABLE_TELEMETRY": "1"}, tmp_path / "dg_dev.log", command="dg"
    ) as served:
        [entry] = served.graphql(LOCATIONS_QUERY, {})["workspaceOrError"]["locationEntries"]
    assert entry == {"name": "merge_pipeline", "locationOrLoadError": {"__typename": "RepositoryLocation"}}


def test_every_job_runs_in_one_process_and_the_merge_job_is_hf_model_with_its_blocking_checks():
    job = defs.resolve_job_def("merge_checkpoint")
    assert set(job.graph.node_dict) == {"hf_model"} and job.tags[HEAVY_TAG] == "merge"
    report = defs.resolve_job_def("report_merged_step")
    assert set(report.graph.node_dict) == {"step_report"} and report.tags[HEAVY_TAG] == "report"
    # the UI's Materialize button, backfills and `dg launch --assets` run the implicit asset job
    for every in (job, report, defs.resolve_implicit_global_asset_job_def(), defs.resolve_job_def("publish_to_hub")):
        assert every.executor_def is dg.in_process_executor, every.name
    hf_model = defs.resolve_assets_def("hf_model")
    # the blocking checks: asset checks of hf_model, blocking, partitioned as it is, run by its step
    assert {k.name for k in hf_model.check_keys} == set(CHECK_NAMES)
    assert all(s.blocking and s.partitions_def == hf_model.partitions_def for s in hf_model.check_specs)
    assert {k.name for k in defs.resolve_assets_def("step_report").check_keys} == {"weights_changed", "finite"}
    # one step for the three stages: the plan built once, the checks on the staged folder
    assert not hf_model.can_subset and {k.to_user_string() for k in hf_model.keys} == {
        "parallel_config",
        "state_dict",
        "hf_model",
    }
    assert hf_model.op.pool == "merge" and hf_model.partitions_def.name == "checkpoints"


@pytest.mark.parametrize("prefix", ["", "cluster_a"])
def test_job_descriptions_name_sensors_that_exist(prefix):
    from merge_pipeline.dagster.component import MergeCheckpoints
    from merge_pipeline.dagster.instance_names import Names

    built = MergeCheckpoints(prefix=prefix).definitions(Names(prefix))
    sensors = {s.name for s in built.sensors}
    named = {
        name
        for job in built.resolve_all_job_defs()
        for name in re.findall(r"\w+_(?:sensor|automation)\b", job.description or "")
    }
    assert named and named <= sensors, named - sensors


def test_assets_carry_owners_kinds_tags_code_references_and_a_freshness_policy():
    specs = {s.key.to_user_string(): s for s in defs.resolve_all_asset_specs()}
    for name in ("checkpoint", "parallel_config", "state_dict", "hf_model", "step_report"):
        assert (
            specs[name].owners == ["team:training-infra"]
            and specs[name].group_name == "merge"
            and specs[name].tags["stage"]
        )
    assert {"safetensors", "huggingface"} <= specs["hf_model"].kinds and "pytorch" in specs["checkpoint"].kinds
    assert "dagster/code_references" in specs["hf_model"].metadata
    assert specs["hf_model"].freshness_policy.fail_window.to_timedelta().total_seconds() == 30 * 60
    assert not defs.resolve_assets_def("checkpoint").is_executable  # the trainer writes it
    assert "new_checkpoint_sensor" in specs["checkpoint"].description  # which stacks: test_descriptions.py


@pytest.mark.slow
def test_sensors_run_by_default_and_the_hub_schedule_only_with_an_organization(tmp_path):
    for sensor in ("new_checkpoint_sensor", "step_report_automation"):
        assert defs.resolve_sensor_def(sensor).default_status == dg.DefaultSensorStatus.RUNNING
    assert "Off until MERGE_PIPELINE_HUB_ORG is set" in defs.resolve_schedule_def("publish_latest_steps").description
    assert (
        defs.resolve_sensor_def("merge_failure_webhook").default_status == dg.DefaultSensorStatus.RUNNING
    )  # inert without a URL
    code = "from merge_pipeline.definitions import defs; print(defs.resolve_schedule_def('publish_latest_steps').default_status.value)"
    statuses = {}
    for org in ("", "my-org"):
        env = {**os.environ, "MERGE_PIPELINE_HUB_ORG": org, "PYTHONPATH": str(PROJECT_ROOT)}
        statuses[org] = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120
        ).stdout.strip()
    assert statuses == {"": "STOPPED", "my-org": "RUNNING"}


def test_dagster_yaml_queues_runs_limits_heavy_merges_and_retries_crashes(tmp_path, monkeypatch):
    shutil.copy(PROJECT_ROOT / "dagster.yaml", tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        concurrency = instance.get_concurrency_config()
        assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
        assert instance.run_coordinator.dequeue_interval_seconds == 1  # a UI launch leaves the queue within ~1 s
        assert concurrency.run_queue_config.tag_concurrency_limits == [{"key": HEAVY_TAG, "limit": 1}]
        # run granularity: a run holding hf_model waits in the queue for the pool's one slot, whoever launched it
        assert (concurrency.pool_config.default_pool_limit, concurrency.pool_config.pool_granularity.value) == (
            1,
            "run",
        )
        assert (
            instance.run_retries_enabled
            and instance.run_retries_max_retries == 2
            and not instance.run_retries_retry_on_asset_or_op_failure
        )
        assert instance.root_directory == str(tmp_path) and (tmp_path / "history" / "runs.db").exists()
    settings = yaml.safe_load((PROJECT_ROOT / "dagster.yaml").read_text())
    assert settings["telemetry"] == {"enabled": False} and settings["nux"] == {"enabled": False}
    assert (
        "storage" not in settings
    )  # Dagster's default, in the instance folder: plain `dagster dev` needs no DAGSTER_HOME


def test_env_example_lists_every_setting_the_code_reads():
    example = (PROJECT_ROOT / ".env.example").read_text()
    source = "".join(p.read_text() for p in (PROJECT_ROOT / "merge_pipeline" / "dagster").glob("*.py"))
    read = set(re.findall(r"\b(MERGE_PIPELINE_[A-Z_]+)\b", source)) - {"MERGE_PIPELINE_DIST_TIMEOUT"}
    assert read and all(re.search(rf"^#? ?{name}=", example, re.M) for name in read), read


@pytest.mark.e2e
def test_dg_launch_merges_one_partition(fsdp_checkpoint, roots, instance, tmp_path):
    from safetensors.torch import load_file

    from merge_pipeline_tests.dagster.helpers import ACTOR
    from merge_pipeline_tests.helpers import load_safetensors_dir, same_bits

    sample = fsdp_checkpoint(ACTOR)
    roots.drop(sample, "run/global_step_1", tracker=1)
    key = "run/global_step_1/actor"
    instance.add_dynamic_partitions("checkpoints", [key])
    env = {
        **os.environ,
        "DAGSTER_DISABLE_TELEMETRY": "1",
        "HOME": str(tmp_path),
        "MERGE_PIPELINE_CHECKPOINT_ROOTS": str(roots.checkpoints),
        "MERGE_PIPELINE_OUTPUT_ROOT": str(roots.output),
    }

    launched = subprocess.run(
        [
            DG,
            "launch",
            "--job",  # the merge step's three stages go together (it cannot be subset), then the step report
            "merge_checkpoint",
            "--partition",
            key,
            "--config-json",
            '{"ops": {"hf_model": {"config": {"max_shard_size": "200KB"}}}}',
        ],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert launched.returncode == 0, launched.stderr[-3000:]
    merged, reference = load_safetensors_dir(roots.target(key)), load_file(sample.reference_dir / "model.safetensors")
    assert set(merged) == set(reference) and all(same_bits(merged[n], t) for n, t in reference.items())
    assert (roots.target(key) / "model.safetensors.index.json").is_file()
    # What docs/DAGSTER.md says: dg launch executes the run in its own process, past the run queue
    [run] = instance.get_runs()
    assert run.status == dg.DagsterRunStatus.SUCCESS
    assert not instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_ENQUEUED)


@pytest.mark.e2e
def test_dagster_job_launch_queues_the_merge(roots, instance, tmp_path):
    """The shell command docs/DAGSTER.md gives for a queued merge: the run waits in the queue (here, with
    no daemon, for ever) under the heavy tag, with the partition and the run config given."""
    key = "run/global_step_1/actor"
    instance.add_dynamic_partitions("checkpoints", [key])
    config = '{"ops": {"hf_model": {"config": {"overwrite": true, "dtype": "bfloat16"}}}}'
    launched = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "dagster"),
            "job",
            "launch",
            "-j",
            "merge_checkpoint",
            "--tags",
            json.dumps({"dagster/partition": key}),
            "--config-json",
            config,
        ],
        cwd=PROJECT_ROOT,
        env=os.environ | {"DAGSTER_DISABLE_TELEMETRY": "1", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert launched.returncode == 0, launched.stderr[-3000:]
    [run] = instance.get_runs()
    assert run.status == dg.DagsterRunStatus.QUEUED and run.job_name == "merge_checkpoint"
    assert run.tags["dagster/partition"] == key and run.tags[HEAVY_TAG] == "merge"
    assert run.run_config == json.loads(config)
    assert instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_ENQUEUED)
    assert not roots.output.exists()
