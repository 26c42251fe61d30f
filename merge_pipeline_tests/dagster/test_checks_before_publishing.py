"""The CLI, in one process and under torchrun, runs the blocking checks Dagster's ``hf_model`` runs, on the
complete staging folder before the rename: the same checkpoint is refused by all three with the same
line, nothing is published, and an existing good folder is kept; Dagster records each check's outcome as
an asset check of ``hf_model``."""

from __future__ import annotations

import json

import pytest

from merge_pipeline.engine.publish import staging_path
from merge_pipeline.hf.blocking_checks import CHECK_NAMES
from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline_tests.dagster.helpers import ACTOR, materialize
from merge_pipeline_tests.helpers import (
    config_claims_one_more_layer,
    error_lines,
    merge,
    merge_ok,
    torchrun,
    tree_digest,
)

pytestmark = pytest.mark.torchrun

KEY = "run/global_step_2/actor"


def refused(capsys, role_dir, target, *flags) -> str:
    code, _, err = merge(capsys, role_dir, target, *flags)
    [line] = error_lines(err)
    assert code == 1, err
    return line


def test_cli_torchrun_and_dagster_refuse_the_same_folder(capsys, fsdp_checkpoint, roots, instance, tmp_path):
    role_dir = roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_2")
    target = tmp_path / "cli"
    merge_ok(capsys, role_dir, target)
    published = tree_digest(target)
    # every entry point names the same checks in the manifest: those it ran before publishing
    assert json.loads((target / MANIFEST).read_text())["checks_before_publishing"] == CHECK_NAMES
    missing = config_claims_one_more_layer(role_dir)  # the reader cannot tell; transformers can
    roots.track(role_dir, 2)  # the trainer's tracker, after the save as edited
    before = tree_digest(role_dir)

    line = refused(capsys, role_dir, target, "--overwrite")

    assert line.startswith(
        f"error: {target}: not published: blocking check(s) loads_on_meta_device failed on the merged folder: missing from the weights: {missing} (and "
    )
    assert tree_digest(target) == published and not staging_path(target).exists()  # the good folder is kept
    with torchrun(2, "--local_dir", role_dir, "--target_dir", tmp_path / "torchrun", "--no-progress") as run:
        _, err = run.communicate(timeout=300)
    # Every rank fails with rank 0's line ("rank 0 failed: ..." on the others; torchrun may stop rank 0 first).
    assert run.returncode != 0 and line.removeprefix("error: ").replace(str(target), str(tmp_path / "torchrun")) in err
    assert not (tmp_path / "torchrun").exists() and not staging_path(tmp_path / "torchrun").exists()

    result = materialize(instance, roots.settings(), KEY)

    # Dagster's merge step fails with the CLI's very line (its own folder), after recording hf_model's asset
    # checks for the partition: the one that refused the folder failed with the same problem, the others passed
    [event] = [e for e in result.all_events if e.is_step_failure]
    description = event.step_failure_data.user_failure_data.description
    assert not result.success
    assert description == line.removeprefix("error: ").replace(str(target), str(roots.target(KEY)))
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert [(n, evaluations[n].passed, evaluations[n].partition) for n in CHECK_NAMES] == [
        ("loads_on_meta_device", False, KEY),
        ("index_matches_shards", True, KEY),
        ("manifest_sha256", True, KEY),
    ]
    assert evaluations["loads_on_meta_device"].description == f"missing from the weights: {missing}"
    assert evaluations["loads_on_meta_device"].metadata["problems"].value > 1  # "(and ... more)" in the line
    assert not roots.target(KEY).exists()
    assert tree_digest(role_dir) == before
