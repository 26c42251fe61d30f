"""One rule for symlinks, weights and side files alike: a link that stays inside the checkpoint folder
is followed, one that leads out of it is refused (give the real folder instead); and the sensor never
follows a link out of its watched roots.
"""

from __future__ import annotations

import shutil

from safetensors.torch import load_file

from merge_pipeline.watch.discovery import find_checkpoints
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, load_safetensors_dir, merge, same_bits

SPEC = FsdpSpec(world_size=3, with_optimizer=False)


def test_a_rank_file_linked_out_of_the_checkpoint_is_refused(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    rank_file = sample.role_dir / "model_world_size_3_rank_1.pt"
    elsewhere = tmp_path / "elsewhere" / rank_file.name
    elsewhere.parent.mkdir()
    rank_file.rename(elsewhere)
    rank_file.symlink_to(elsewhere)

    code, _, err = merge(capsys, sample.role_dir, tmp_path / "out")

    assert code == 1
    assert error_lines(err) == [
        f"error: {rank_file}: is a symlink to {elsewhere}, outside the checkpoint folder {sample.role_dir}: "
        "refused (copy the file into the checkpoint, or give its real folder)"
    ]
    assert not (tmp_path / "out").exists()


def test_a_rank_file_linked_inside_the_checkpoint_merges_bit_exact(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    rank_file = sample.role_dir / "model_world_size_3_rank_1.pt"
    (sample.role_dir / "moved").mkdir()
    rank_file.rename(sample.role_dir / "moved" / rank_file.name)
    rank_file.symlink_to(f"moved/{rank_file.name}")

    code, _, err = merge(capsys, sample.role_dir, tmp_path / "out")

    assert code == 0, err
    merged = load_safetensors_dir(tmp_path / "out")
    for name, tensor in load_file(sample.reference_dir / "model.safetensors").items():
        assert same_bits(merged[name], tensor), name


def test_the_sensor_follows_no_link_out_of_its_watched_root(tmp_path, fsdp_checkpoint):
    root, private = tmp_path / "checkpoints", tmp_path / "private"
    shutil.copytree(fsdp_checkpoint(SPEC).role_dir, root / "run" / "global_step_1" / "actor")
    shutil.copytree(fsdp_checkpoint(SPEC).role_dir, private / "secret_run" / "global_step_2" / "actor")
    shutil.copytree(fsdp_checkpoint(SPEC).role_dir, private / "actor")
    private.chmod(0o700)
    (root / "linked_run").symlink_to(private / "secret_run")  # a run folder linked out of the root
    (root / "run" / "global_step_3").mkdir()
    (root / "run" / "global_step_3" / "actor").symlink_to(private / "actor")  # a role folder linked out
    (root / "run" / "global_step_4").symlink_to("global_step_1")  # a link that stays inside: followed

    found = sorted(str(f.key.path) for f in find_checkpoints(root, []))

    assert found == ["run/global_step_1/actor", "run/global_step_4/actor"]
