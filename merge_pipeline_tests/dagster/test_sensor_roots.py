"""What the sensor cannot watch is said, in its skip reason and its log, never "no new checkpoints"."""

from __future__ import annotations

import dagster as dg
import pytest

from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.errors import MergeError
from merge_pipeline.watch.cursor import cursor_keys
from merge_pipeline.watch.partitions import checkpoint_key
from merge_pipeline_tests.dagster.helpers import ACTOR, LOCATION

new_checkpoint_sensor = LOCATION.resolve_sensor_def("new_checkpoint_sensor")


def tick(capfd, instance, settings, cursor=None) -> tuple[dg.SensorResult, list[str]]:
    """One evaluation; returns its result and the warnings it logged (Dagster's console log, on stderr)."""
    capfd.readouterr()
    result = new_checkpoint_sensor(
        dg.build_sensor_context(instance=instance, cursor=cursor, resources={"settings": settings})
    )
    warnings = [
        line.split(" - WARNING - ", 1)[1]
        for line in capfd.readouterr().err.splitlines()
        if " - dagster - WARNING - " in line
    ]
    return result, warnings


@pytest.mark.parametrize("step_dir", ["global_step_007", "global_step_٣"])
def test_step_folders_that_do_not_map_back_are_skipped_with_a_reason(capfd, fsdp_checkpoint, roots, instance, step_dir):
    roots.drop(fsdp_checkpoint(ACTOR), f"run/{step_dir}", tracker=7)

    result, warnings = tick(capfd, instance, roots.settings())

    assert result.run_requests == [] and sorted(cursor_keys(result.cursor)) == []
    note = f"{roots.checkpoints / 'run' / step_dir}: skipped: verl names step folders global_step_<N> with ASCII digits and no leading zeros"
    assert result.skip_reason.skip_message.startswith(f"not watched: {note}")
    assert result.skip_reason.skip_message.endswith("| no new checkpoints (0 known)")
    assert len(warnings) == 1 and warnings[0].startswith(note)


def test_a_canonical_step_beside_an_odd_one_is_still_requested(capfd, fsdp_checkpoint, roots, instance):
    sample = fsdp_checkpoint(ACTOR)
    roots.drop(sample, "run/global_step_7", tracker=7, link=True)
    roots.drop(sample, "run/global_step_007", link=True)

    result, warnings = tick(capfd, instance, roots.settings())

    assert [r.partition_key for r in result.run_requests] == ["run/global_step_7/actor"]
    assert [w.split(":")[0] for w in warnings] == [str(roots.checkpoints / "run" / "global_step_007")]


@pytest.mark.parametrize("key", ["run/global_step_007/actor", "run/global_step_٣/actor", "run/global_step_1\n/actor"])
def test_partition_keys_name_only_canonical_step_folders(key):
    with pytest.raises(MergeError, match="is not <run_name>/global_step_<N>/<actor|critic>"):
        checkpoint_key(key)


def test_missing_root_is_reported(capfd, roots, instance, tmp_path):
    missing = tmp_path / "not_mounted"
    settings = MergeSettings(checkpoint_roots=[str(missing), str(roots.checkpoints)], output_root=str(roots.output))

    result, warnings = tick(capfd, instance, settings)

    assert (
        result.skip_reason.skip_message
        == f"not watched: {missing}: the checkpoint root does not exist | no new checkpoints (0 known)"
    )
    assert warnings == [f"{missing}: the checkpoint root does not exist"]


@pytest.mark.parametrize("kind", ["a file", "a symlink loop"])
def test_unreadable_root_is_reported(capfd, roots, instance, tmp_path, kind):
    root = tmp_path / "bad_root"
    if kind == "a file":
        root.write_text("")
        problem = "Not a directory"
    else:
        root.symlink_to(root)  # unreadable even to root, unlike chmod 000
        problem = "Too many levels of symbolic links"

    result, warnings = tick(capfd, instance, MergeSettings(checkpoint_roots=[str(root)], output_root=str(roots.output)))

    assert warnings == [f"{root}: the checkpoint root cannot be read ({problem})"]
    assert result.skip_reason.skip_message.startswith(
        f"not watched: {root}: the checkpoint root cannot be read ({problem})"
    )


def test_output_root_inside_a_checkpoint_root_is_reported(capfd, roots, instance):
    output = roots.checkpoints / "merged"
    settings = MergeSettings(checkpoint_roots=[str(roots.checkpoints)], output_root=str(output))

    result, warnings = tick(capfd, instance, settings)

    note = f"{output}: the output root lies inside the checkpoint root {roots.checkpoints}"
    assert result.skip_reason.skip_message.startswith(f"not watched: {note}")
    assert len(warnings) == 1 and warnings[0].startswith(note)


@pytest.mark.parametrize(
    "spelling", ["output through ..", "output through a symlink", "checkpoint root through a symlink"]
)
def test_an_output_root_inside_a_checkpoint_root_is_recognised_however_spelled(capfd, roots, instance, spelling):
    """Compared resolved: the sensor never takes its own merged folders for checkpoints (before: requested them)."""
    merged = roots.checkpoints / "merged" / "run" / "global_step_1" / "actor"  # an earlier merge's output
    merged.mkdir(parents=True)
    (merged / "config.json").write_text("{}")
    link = roots.checkpoints.parent / "checkpoints_link"
    link.symlink_to(roots.checkpoints)
    root, output = {
        "output through ..": (roots.checkpoints, roots.checkpoints / ".." / "checkpoints" / "merged"),
        "output through a symlink": (roots.checkpoints, link / "merged"),
        "checkpoint root through a symlink": (link, roots.checkpoints / "merged"),
    }[spelling]
    settings = MergeSettings(checkpoint_roots=[str(root)], output_root=str(output), settle_seconds=0)

    result, warnings = tick(capfd, instance, settings)

    assert result.run_requests == [] and cursor_keys(result.cursor) == {}
    note = f"{output}: the output root lies inside the checkpoint root {root} (not scanned; better kept apart)"
    assert result.skip_reason.skip_message == f"not watched: {note} | no new checkpoints (0 known)"
    assert warnings == [note]
