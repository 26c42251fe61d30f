"""End to end: the real webserver and daemon; a checkpoint dropped into a watched root gets merged by the sensor.

One set of servers serves the module: starting them costs most of the time here.
"""

from __future__ import annotations

import shutil
import time

import pytest
from safetensors.torch import load_file

from merge_pipeline.defs.discovery import TRACKER
from merge_pipeline.defs.partitions import CheckpointKey
from merge_pipeline.defs.resources import MergeSettings
from merge_pipeline_tests.dagster import browser
from merge_pipeline_tests.dagster.helpers import ACTOR, PROJECT_ROOT
from merge_pipeline_tests.dagster.services import running_dagster
from merge_pipeline_tests.helpers import load_safetensors_dir, same_bits

KEY = "e2e_run/global_step_1/actor"
RUN_TIMEOUT = 240


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> MergeSettings:
    """The roots the servers watch and write to, as the code location will read them from the environment."""
    base = tmp_path_factory.mktemp("e2e")
    (base / "checkpoints").mkdir()
    return MergeSettings(checkpoint_roots=[str(base / "checkpoints")], output_root=str(base / "merged"), settle_seconds=3600)


@pytest.fixture(scope="module")
def dagster(settings, tmp_path_factory):
    home = tmp_path_factory.mktemp("dagster_home")
    shutil.copy(PROJECT_ROOT / "dagster.yaml", home)
    env = {
        "MERGE_PIPELINE_CHECKPOINT_ROOTS": settings.checkpoint_roots[0],
        "MERGE_PIPELINE_OUTPUT_ROOT": settings.output_root,
        "MERGE_PIPELINE_SETTLE_SECONDS": str(settings.settle_seconds),  # only the trainer's tracker may complete a step
        "MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS": "2",
    }
    with running_dagster(home, env) as served:
        served.wait_for_sensor_tick("new_checkpoint_sensor")
        yield served


@pytest.fixture(scope="module")
def merged(dagster, settings, fsdp_checkpoint):
    """Drop a checkpoint the way verl saves one (role folder, then the tracker) and wait for its run."""
    sample = fsdp_checkpoint(ACTOR)
    key = CheckpointKey.parse(KEY)
    shutil.copytree(sample.role_dir, settings.roots[0] / key.path, copy_function=shutil.copy)  # fresh mtimes, as if just saved
    (settings.roots[0] / key.run_name / TRACKER).write_text(str(key.step))
    dropped = time.monotonic()
    target = settings.target_dir(key)
    published = None
    while time.monotonic() - dropped < RUN_TIMEOUT:
        if published is None and target.exists():
            published = time.monotonic() - dropped
        runs = dagster.partition_runs(KEY)
        if runs and runs[0]["status"] in ("SUCCESS", "FAILURE", "CANCELED"):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"no finished run for {KEY} after {RUN_TIMEOUT} s: {runs}\n{dagster.log_tail()}")
    return sample, target, runs, published


def test_sensor_merges_a_dropped_checkpoint_bit_exact(merged, dagster, record_property):
    sample, target, runs, latency = merged

    assert [r["status"] for r in runs] == ["SUCCESS"], dagster.log_tail()
    reference = load_file(sample.reference_dir / "model.safetensors")
    output = load_safetensors_dir(target)
    assert set(output) == set(reference) and all(same_bits(output[n], t) for n, t in reference.items())
    record_property("checkpoint_to_published_seconds", round(latency, 1))
    print(f"checkpoint dropped -> merged folder published: {latency:.1f} s")
    assert latency < 120


def test_asset_graph_page_shows_the_assets_and_their_partitions(merged, dagster, tmp_path):
    graph = f"{dagster.url}/locations/merge_pipeline/asset-groups/merge"

    dom = browser.dump_dom(graph)
    browser.screenshot(graph, tmp_path / "asset_graph.png")
    partitions = browser.dump_dom(f"{dagster.url}/assets/hf_model?view=partitions")

    for asset in ("checkpoint", "parallel_config", "merged_state_dict", "hf_model"):
        assert f">{asset}<" in dom, asset
    assert dom.count("1 partition") == 4 and "3 / 3 Passed" in dom
    assert KEY in partitions
    assert (tmp_path / "asset_graph.png").stat().st_size > 20_000
