"""The code location as `dagster dev -w workspace.yaml` loads it, and the instance dagster.yaml configures."""

from __future__ import annotations

import shutil

import dagster as dg
import yaml

from merge_pipeline.definitions import defs
from merge_pipeline.defs.jobs import HEAVY_TAG
from merge_pipeline_tests.dagster.helpers import PROJECT_ROOT

MERGE_ASSETS = ["checkpoint", "parallel_config", "merged_state_dict", "hf_model"]
CHECKS = ["index_matches_shards", "loads_on_meta_device", "manifest_sha256"]


def test_workspace_loads_the_definitions_module():
    [location] = yaml.safe_load((PROJECT_ROOT / "workspace.yaml").read_text())["load_from"]
    assert location["python_module"] == {"module_name": "merge_pipeline.definitions", "attribute": "defs", "location_name": "merge_pipeline"}


def test_merge_job_runs_the_chain_and_its_checks_in_one_process_one_heavy_run_at_a_time():
    job = defs.resolve_job_def("merge_checkpoint")
    assert set(job.graph.node_dict) == set(MERGE_ASSETS) | {f"hf_model_{c}" for c in CHECKS}
    assert job.tags[HEAVY_TAG] == "merge" and job.executor_def is dg.in_process_executor
    assets = {k.to_user_string(): defs.resolve_assets_def(k) for k in defs.resolve_all_asset_keys() if k.to_user_string() in MERGE_ASSETS}
    assert {a.partitions_def.name for a in assets.values()} == {"checkpoints"}
    assert {name: a.specs_by_key[a.key].group_name for name, a in assets.items()} == dict.fromkeys(MERGE_ASSETS, "merge")
    assert [name for name, a in assets.items() if a.op.pool] == ["merged_state_dict"] and assets["merged_state_dict"].op.pool == "merge"


def test_sensor_is_on_by_default():
    sensor = defs.resolve_sensor_def("new_checkpoint_sensor")
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING and sensor.job_name == "merge_checkpoint"


def test_dagster_yaml_queues_runs_limits_heavy_merges_and_retries_crashes(tmp_path, monkeypatch):
    shutil.copy(PROJECT_ROOT / "dagster.yaml", tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        concurrency = instance.get_concurrency_config()
        assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
        assert concurrency.run_queue_config.tag_concurrency_limits == [{"key": HEAVY_TAG, "limit": 1}]
        assert (concurrency.pool_config.default_pool_limit, concurrency.pool_config.pool_granularity.value) == (1, "op")
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 2 and not instance.run_retries_retry_on_asset_or_op_failure
        assert instance.root_directory == str(tmp_path) and (tmp_path / "history" / "runs.db").exists()
    settings = yaml.safe_load((PROJECT_ROOT / "dagster.yaml").read_text())
    assert settings["telemetry"] == {"enabled": False} and settings["nux"] == {"enabled": False}
