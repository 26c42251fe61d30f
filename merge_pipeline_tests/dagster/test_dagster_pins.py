"""``pin_steps``: a complete step hard-linked when its merge is requested survives the trainer's rotation,
is merged bit for bit from the pin, and no pin is left behind: published, failed or never run."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import dagster as dg
from safetensors.torch import load_file

from merge_pipeline.dagster.pins import PIN_GRACE_SECONDS, pin_path
from merge_pipeline.watch.partitions import checkpoint_key
from merge_pipeline_tests.dagster.helpers import ACTOR, LOCATION, materialize
from merge_pipeline_tests.helpers import load_safetensors_dir, same_bits

new_checkpoint_sensor = LOCATION.resolve_sensor_def("new_checkpoint_sensor")

KEY = "run/global_step_1/actor"


def tick(capfd, instance, settings, cursor=None) -> tuple[dg.SensorResult, list[str]]:
    capfd.readouterr()
    result = new_checkpoint_sensor(
        dg.build_sensor_context(instance=instance, cursor=cursor, resources={"settings": settings})
    )
    logged = capfd.readouterr().err.splitlines()
    return result, [line.split(" - WARNING - ", 1)[1] for line in logged if " - dagster - WARNING - " in line]


def files_under(folder: Path) -> dict[str, int]:
    """Relative path -> inode of every file below ``folder``."""
    return {str(p.relative_to(folder)): p.stat().st_ino for p in folder.rglob("*") if p.is_file()}


def test_a_step_deleted_by_the_rotation_mid_wait_is_merged_bit_exact_from_its_pin(
    capfd, fsdp_checkpoint, roots, instance
):
    sample = fsdp_checkpoint(ACTOR)
    role_dir = roots.drop(sample, "run/global_step_1", tracker=1)
    settings = roots.settings(pin_steps=True)
    original = files_under(role_dir)

    result, warnings = tick(capfd, instance, settings)

    assert [r.partition_key for r in result.run_requests] == [KEY] and warnings == []
    [space] = settings.pin_spaces
    pinned = pin_path(space, checkpoint_key(KEY))
    assert files_under(pinned) == original  # the same inodes: hard links, not a byte copied
    instance.add_dynamic_partitions("checkpoints", [KEY])  # what the daemon does with the tick's request

    shutil.rmtree(role_dir.parent)  # the trainer's rotation (max_ckpt_to_keep), before the run starts
    result, _ = tick(capfd, instance, settings, result.cursor)
    assert result.dynamic_partitions_requests == [] and instance.get_dynamic_partitions("checkpoints") == [KEY]

    merged = materialize(instance, settings, KEY)

    assert merged.success
    reference = load_file(sample.reference_dir / "model.safetensors")
    weights = load_safetensors_dir(roots.target(KEY))
    assert set(weights) == set(reference) and all(same_bits(weights[n], t) for n, t in reference.items())
    [hf_model] = [e for e in merged.get_asset_materialization_events() if e.asset_key == dg.AssetKey("hf_model")]
    assert hf_model.materialization.metadata["completeness"].value == "pinned by the sensor when complete"
    assert list(space.folder.iterdir()) == []  # published: the pin is gone


def test_a_failed_merge_removes_its_pin_and_publishes_nothing(capfd, fsdp_checkpoint, roots, instance):
    role_dir = roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_1", tracker=1)
    settings = roots.settings(pin_steps=True)
    tick(capfd, instance, settings)
    rank_file = next(role_dir.glob("model_world_size_*_rank_0.pt"))
    saved = rank_file.stat()
    with open(rank_file, "r+b") as f:  # a copy in this test's root: the pin is the same file
        f.write(b"\0" * 100)  # in place, its size and mtime kept: still the file the pin recorded
    os.utime(rank_file, ns=(saved.st_atime_ns, saved.st_mtime_ns))

    merged = materialize(instance, settings, KEY)

    assert not merged.success and not roots.target(KEY).exists()
    assert list(settings.pin_spaces[0].folder.iterdir()) == []


def test_no_pin_across_filesystems_only_a_warning(capfd, fsdp_checkpoint, roots, instance):
    role_dir = roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_1", tracker=1)
    other_filesystem = Path("/dev/shm") / f"merge_pins_{uuid.uuid4().hex}"  # tmpfs: never the test root's
    assert os.stat("/dev/shm").st_dev != os.stat(role_dir).st_dev
    try:
        result, warnings = tick(capfd, instance, roots.settings(pin_steps=True, pin_root=str(other_filesystem)))

        assert [r.partition_key for r in result.run_requests] == [KEY]  # merged from where it is
        assert warnings == [
            f"{role_dir}: not pinned: the pin folder {other_filesystem} is on another filesystem (hard links cannot cross filesystems; the step is merged from where it is, if the trainer keeps it)"
        ]
        assert not any(other_filesystem.rglob("*"))  # nothing copied
    finally:
        shutil.rmtree(other_filesystem, ignore_errors=True)


def test_a_pin_whose_run_never_came_is_removed_by_the_sensor(capfd, fsdp_checkpoint, roots, instance):
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_1", tracker=1)
    settings = roots.settings(pin_steps=True)
    result, _ = tick(capfd, instance, settings)  # requested and pinned; no run is ever launched here
    [entry] = settings.pin_spaces[0].folder.iterdir()

    result, _ = tick(capfd, instance, settings, result.cursor)
    assert entry.is_dir()  # young: its run may not be queued yet
    then = time.time() - PIN_GRACE_SECONDS - 1
    os.utime(entry, (then, then))
    tick(capfd, instance, settings, result.cursor)

    assert list(settings.pin_spaces[0].folder.iterdir()) == []
    assert (roots.checkpoints / "run/global_step_1/actor").is_dir()  # the trainer's own files untouched
