"""Bad FSDP input: one line naming the file, non-zero exit, inputs untouched, no damage to the target.

Every case runs against an existing good target with ``--overwrite``: it must survive unchanged.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from merge_pipeline.engine.publish import staged_output
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.folder import finish_folder, write_side_files
from merge_pipeline.pipeline.prepare import prepare
from merge_pipeline.workers.writing import write_weights
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, load_safetensors_dir, run_cli, same_bits, tree_digest

SPEC = FsdpSpec(world_size=3, with_optimizer=False)
MARKER = "/tmp/merge_pipeline_unsafe_pickle_ran"


def rank_file(role_dir, rank, world_size=3):
    return role_dir / f"model_world_size_{world_size}_rank_{rank}.pt"


class RunsShellOnUnpickle:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


def missing_rank(d):
    rank_file(d, 1).unlink()
    return rank_file(d, 1), "missing"


def extra_rank(d):
    shutil.copy(rank_file(d, 0), rank_file(d, 3))
    return rank_file(d, 3), "unexpected rank file"


def empty_rank(d):
    rank_file(d, 2).write_bytes(b"")
    return rank_file(d, 2), "empty"


def truncated_rank(d):
    data = rank_file(d, 1).read_bytes()
    rank_file(d, 1).write_bytes(data[: len(data) // 2])
    return rank_file(d, 1), "truncated"


def swapped_ranks(d):
    a, b = rank_file(d, 0), rank_file(d, 1)
    a.rename(d / "tmp")
    b.rename(a)
    (d / "tmp").rename(b)
    return rank_file(d, 0), "mesh coordinate"


def config_world_size_disagrees(d):
    (d / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    return d / "fsdp_config.json", "world_size 4"


def garbage_fsdp_config(d):
    (d / "fsdp_config.json").write_text("{not json")
    return d / "fsdp_config.json", "not valid JSON"


def no_huggingface_dir(d):
    shutil.rmtree(d / "huggingface")
    return d / "huggingface" / "config.json", "not found"


def no_config_json(d):
    (d / "huggingface" / "config.json").unlink()
    return d / "huggingface" / "config.json", "not found"


def garbage_config_json(d):
    (d / "huggingface" / "config.json").write_text("]]")
    return d / "huggingface" / "config.json", "not valid JSON"


def unsafe_pickle(d):
    state = torch.load(rank_file(d, 1), weights_only=True)
    state["payload"] = RunsShellOnUnpickle()
    torch.save(state, rank_file(d, 1))
    return rank_file(d, 1), "refused to unpickle"


def keys_differ(d):
    state = torch.load(rank_file(d, 2), weights_only=True)
    state.pop(next(iter(state)))
    torch.save(state, rank_file(d, 2))
    return rank_file(d, 2), "different keys"


CASES = [
    missing_rank,
    extra_rank,
    empty_rank,
    truncated_rank,
    swapped_ranks,
    config_world_size_disagrees,
    garbage_fsdp_config,
    no_huggingface_dir,
    no_config_json,
    garbage_config_json,
    unsafe_pickle,
    keys_differ,
]


@pytest.mark.parametrize("corrupt", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_fails_cleanly(capsys, fsdp_checkpoint, fresh_copy, good_target, corrupt):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    bad_file, problem = corrupt(sample.role_dir)
    inputs_before, target_before = tree_digest(sample.role_dir), tree_digest(good_target)
    if os.path.exists(MARKER):
        os.unlink(MARKER)

    code, _, err = run_cli(
        capsys,
        "merge",
        "--backend",
        "fsdp",
        "--local_dir",
        sample.role_dir,
        "--target_dir",
        good_target,
        "--overwrite",
        "--no-progress",
    )

    assert code == 1
    [line] = error_lines(err)
    assert str(bad_file) in line and problem in line, line
    assert "Traceback" not in err
    assert tree_digest(sample.role_dir) == inputs_before, "inputs must be untouched"
    assert tree_digest(good_target) == target_before, "the existing good target must survive"
    assert sorted(p.name for p in good_target.parent.iterdir()) == ["published"], "no staging or lock left behind"
    assert not os.path.exists(MARKER), "the pickled payload must never run"


def test_no_target_created_on_failure(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    missing_rank(sample.role_dir)
    code, _, err = run_cli(capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", tmp_path / "new" / "out")
    assert code == 1 and not (tmp_path / "new" / "out").exists()


def test_existing_target_refused_without_overwrite(capsys, fsdp_checkpoint, good_target):
    before = tree_digest(good_target)
    code, _, err = run_cli(capsys, "merge", "--local_dir", fsdp_checkpoint(SPEC).role_dir, "--target_dir", good_target)
    assert code == 1 and "already exists" in error_lines(err)[0] and tree_digest(good_target) == before


def test_overwrite_replaces_only_when_complete(capsys, fsdp_checkpoint, good_target):
    (good_target / "stale.txt").write_text("from an older merge")
    code, _, err = run_cli(
        capsys,
        "merge",
        "--local_dir",
        fsdp_checkpoint(SPEC).role_dir,
        "--target_dir",
        good_target,
        "--overwrite",
        "--dtype",
        "bfloat16",
    )
    assert code == 0, err
    assert not (good_target / "stale.txt").exists()
    assert json.loads((good_target / "config.json").read_text())["dtype"] == "bfloat16"


def test_unwritable_target(capsys, tmp_path, fsdp_checkpoint):
    (tmp_path / "a_file").write_text("")
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", fsdp_checkpoint(SPEC).role_dir, "--target_dir", tmp_path / "a_file" / "out"
    )
    [line] = error_lines(err)
    assert code == 1 and str(tmp_path / "a_file") in line and "not a directory" in line


def test_stale_staging_from_a_killed_merge_is_cleaned(capsys, tmp_path, fsdp_checkpoint):
    staging = tmp_path / ".out.staging"
    staging.mkdir()
    (staging / "model-00001-of-00002.safetensors").write_bytes(b"half written")
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", fsdp_checkpoint(SPEC).role_dir, "--target_dir", tmp_path / "out"
    )
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_checkpoint_deleted_mid_merge_still_merges_exactly(tmp_path, fsdp_checkpoint, fresh_copy):
    """Trainer rotation rmtree's the step after planning: open files keep the bytes readable."""
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    options = MergeOptions()
    with (
        prepare(sample.role_dir, options) as prepared,
        staged_output(tmp_path / "out", source=sample.role_dir, overwrite=False) as staging,
    ):
        write_side_files(prepared, staging, options)
        shutil.rmtree(sample.role_dir)
        report = write_weights(prepared.outputs, staging, show_progress=False)
        finish_folder(prepared, staging, options, report)
    merged = load_safetensors_dir(tmp_path / "out")
    from safetensors.torch import load_file

    for name, tensor in load_file(sample.reference_dir / "model.safetensors").items():
        assert same_bits(merged[name], tensor), name


def test_checkpoint_deleted_before_merge(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    shutil.rmtree(sample.role_dir)
    code, _, err = run_cli(capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", tmp_path / "out")
    [line] = error_lines(err)
    assert code == 1 and str(sample.role_dir) in line and "does not exist" in line
