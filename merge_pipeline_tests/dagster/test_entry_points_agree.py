"""Whatever starts it, one merge: the same checkpoint merged by the CLI (in its process, under torchrun, on
Ray), by the Dagster step in its process, with its torchrun launcher and on Ray gives the same folder, byte
for byte, the manifest included; and so does the average of the same merged steps, whether ``average`` on
the CLI or Dagster's ``averaged_model`` writes it (``pipeline.merge`` is the one sequence; the entry points
only pick who writes and how workers agree, with ``workers.workers_for``).

The Ray cluster is real (``local_servers/ray_cluster.py``): run these under ``flock /tmp/ray-tests.lock``."""

from __future__ import annotations

import dagster as dg
import pytest

from local_servers.ray_cluster import local_cluster
from merge_pipeline.dagster.averaged_model import Averaging, averaged_model_definition
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline_tests.dagster.averaged_steps import publish_merged_steps
from merge_pipeline_tests.dagster.helpers import materialize
from merge_pipeline_tests.helpers import merge, run_cli, torchrun, tree_digest
from merge_pipeline_tests.test_distributed import SPEC

pytestmark = pytest.mark.torchrun

KEY = "run/global_step_1/actor"
FLAGS = ("--max-shard-size", "2MB", "--dtype", "bfloat16")
CONFIG = {"max_shard_size": "2MB", "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(workers=2) as started:
        yield started


def test_cli_torchrun_ray_and_dagster_write_the_same_bytes(capsys, tmp_path, roots, instance, fsdp_checkpoint, cluster):
    role_dir = roots.drop(fsdp_checkpoint(SPEC), "run/global_step_1", tracker=1)
    settings = roots.settings(settle_seconds=0)
    folders = {}

    code, _, err = merge(capsys, role_dir, tmp_path / "cli", *FLAGS)
    assert code == 0, err
    folders["cli"] = tree_digest(tmp_path / "cli")

    code, _, err = merge(capsys, role_dir, tmp_path / "cli_ray", *FLAGS, "--ray-address", cluster.address)
    assert code == 0, err
    folders["cli ray"] = tree_digest(tmp_path / "cli_ray")

    with torchrun(2, "--local_dir", role_dir, "--target_dir", tmp_path / "torchrun", *FLAGS) as run:
        _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    folders["torchrun"] = tree_digest(tmp_path / "torchrun")

    published = roots.target(KEY)
    launchers = (
        {"launcher": "inprocess"},
        {"launcher": "torchrun", "nproc_per_node": 2},
        {"launcher": "ray", "ray_address": cluster.address},
    )
    for launcher in launchers:
        result = materialize(instance, settings, KEY, merge_config={**CONFIG, **launcher})
        assert result.success, result.all_events
        folders[f"dagster {launcher['launcher']}"] = tree_digest(published)
        published.rename(tmp_path / f"dagster_{launcher['launcher']}")  # the next one publishes there again

    assert len([name for name in folders["cli"] if name.endswith(".safetensors")]) > 2
    for entry_point, digest in folders.items():
        assert digest == folders["cli"], entry_point


AVERAGE_FLAGS = ("--max-shard-size", "200KB", "--overwrite")  # Dagster's average replaces the run's previous one


def test_cli_and_dagster_write_the_same_average_in_process_on_ray_and_under_torchrun(
    capsys, tmp_path, roots, instance, fsdp_checkpoint, cluster
):
    publish_merged_steps(fsdp_checkpoint, roots, instance, ("run",))
    inputs = [roots.target(f"run/global_step_{step}/actor") for step in (1, 2, 3)]
    folders = {}

    for name, flags in {"cli": (), "cli ray": ("--ray-address", cluster.address)}.items():
        target = tmp_path / name.replace(" ", "_")
        code, _, err = run_cli(
            capsys, "average", "--inputs", *inputs, "--target_dir", target, "--no-progress", *AVERAGE_FLAGS, *flags
        )
        assert code == 0, err
        folders[name] = tree_digest(target)

    with torchrun(
        2, "--inputs", *inputs, "--target_dir", tmp_path / "torchrun", *AVERAGE_FLAGS, command="average"
    ) as run:
        _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    folders["cli torchrun"] = tree_digest(tmp_path / "torchrun")

    published = roots.output / "run" / "averaged" / "actor"
    instance.add_dynamic_partitions("averaged_runs", ["run/actor"])
    for launcher in ({"launcher": "inprocess"}, {"launcher": "ray", "ray_address": cluster.address}):
        result = dg.materialize(
            [averaged_model_definition(Names(""), Averaging(last_k=3))],
            partition_key="run/actor",
            instance=instance,
            resources={"settings": roots.settings()},
            run_config={"ops": {"averaged_model": {"config": {"max_shard_size": "200KB", **launcher}}}},
        )
        assert result.success
        folders[f"dagster {launcher['launcher']}"] = tree_digest(published)
        published.rename(tmp_path / f"dagster_{launcher['launcher']}")

    assert len([name for name in folders["cli"] if name.endswith(".safetensors")]) > 1
    for entry_point, digest in folders.items():
        assert digest == folders["cli"], entry_point
