"""Whatever starts it, one merge: the same checkpoint merged by the CLI, by torchrun ranks, by the Dagster
step in its process and by the Dagster step with its torchrun launcher gives the same folder, byte for
byte, the manifest included (``pipeline.merge`` is the one sequence; the entry points only inject who
writes and how workers agree)."""

from __future__ import annotations

import pytest

from merge_pipeline_tests.defs.helpers import materialize
from merge_pipeline_tests.helpers import merge, torchrun, tree_digest
from merge_pipeline_tests.test_distributed import SPEC

pytestmark = pytest.mark.torchrun

KEY = "run/global_step_1/actor"
FLAGS = ("--max-shard-size", "2MB", "--dtype", "bfloat16")
CONFIG = {"max_shard_size": "2MB", "dtype": "bfloat16"}


def test_cli_torchrun_and_dagster_write_the_same_bytes(capsys, tmp_path, roots, instance, fsdp_checkpoint):
    role_dir = roots.drop(fsdp_checkpoint(SPEC), "run/global_step_1", tracker=1)
    settings = roots.settings(settle_seconds=0)
    folders = {}

    code, _, err = merge(capsys, role_dir, tmp_path / "cli", *FLAGS)
    assert code == 0, err
    folders["cli"] = tree_digest(tmp_path / "cli")

    with torchrun(2, "--local_dir", role_dir, "--target_dir", tmp_path / "torchrun", *FLAGS) as run:
        _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    folders["torchrun"] = tree_digest(tmp_path / "torchrun")

    published = roots.target(KEY)
    for launcher in ({"launcher": "inprocess"}, {"launcher": "torchrun", "nproc_per_node": 2}):
        result = materialize(instance, settings, KEY, merge_config={**CONFIG, **launcher})
        assert result.success, result.all_events
        folders[f"dagster {launcher['launcher']}"] = tree_digest(published)
        published.rename(tmp_path / f"dagster_{launcher['launcher']}")  # the next one publishes there again

    assert len([name for name in folders["cli"] if name.endswith(".safetensors")]) > 2
    for entry_point, digest in folders.items():
        assert digest == folders["cli"], entry_point
