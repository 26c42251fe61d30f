"""A cast to a narrower dtype that would turn a finite value into inf is refused in one line naming the
tensor and its largest absolute value (before: exit 0, checks passed, inf in the model).

The checkpoints are real FSDP saves with one value of one rank's shard set, loaded and saved again
with torch, as a trainer that diverged would have saved it."""

from __future__ import annotations

import torch

from merge_pipeline.engine.publish import staging_path
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, merge, merge_error, merge_ok, tree_digest

SPEC = FsdpSpec(with_optimizer=False)  # fp32 weights, two rank files
TENSOR = "lm_head.weight"  # written last: earlier files are in the staging folder when the cast fails
FLAGS = ("--max-shard-size", "100KB")


def _set_one_value(role_dir, value: float) -> None:
    rank_file = role_dir / "model_world_size_2_rank_1.pt"
    state = torch.load(rank_file, weights_only=True)
    state[TENSOR].to_local().view(-1)[5] = value
    torch.save(state, rank_file)


def test_a_value_beyond_float16_is_refused_and_nothing_is_published(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    _set_one_value(sample.role_dir, 70000.0)
    target = tmp_path / "out"

    line = merge_error(capsys, sample.role_dir, target, "--dtype", "float16", *FLAGS)

    assert f"{TENSOR}: largest absolute value 70000 is beyond float16's range (largest finite 65504)" in line, line
    assert line.endswith("the cast would write inf; --dtype auto keeps the stored float32"), line
    assert not staging_path(target).exists()


def test_a_value_beyond_bfloat16_is_refused_and_the_published_merge_kept(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    target = tmp_path / "out"
    merge_ok(capsys, sample.role_dir, target, "--dtype", "bfloat16", *FLAGS)
    published = tree_digest(target)
    _set_one_value(sample.role_dir, 3.4e38)  # finite in fp32 (largest ~3.4028e38), inf in bf16

    code, _, err = merge(capsys, sample.role_dir, target, "--dtype", "bfloat16", "--overwrite", *FLAGS)

    [line] = error_lines(err)
    assert code == 1 and "Traceback" not in err
    assert f"{TENSOR}: largest absolute value 3.4e+38 is beyond bfloat16's range" in line, line
    assert tree_digest(target) == published and not staging_path(target).exists()
