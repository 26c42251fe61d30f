"""``pin_steps`` on a checkpoint root other users can write to (a sticky, world-writable team folder):
what another user plants under ``.merge_pins`` is refused in one line, left alone, never followed and
never published; a pin lets no other user read a file; a pin holding other files than it was made
with is not read; two deployments watching one root keep their own pins.

The other user is real: uid 65534 (``setpriv``), planting with its own ``mkdir``, ``cp`` and ``ln``.
Each planted pin is put where this code looks for it and where the code before it looked
(``<pin root>/<key, quoted>/<step folder>/<role>``).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import dagster as dg
import pytest
from safetensors.torch import load_file

from merge_pipeline.dagster.pins import PIN_GRACE_SECONDS, pin_path
from merge_pipeline.watch.keys import PINS
from merge_pipeline.watch.partitions import checkpoint_key
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.dagster.helpers import ACTOR, PROJECT_ROOT, Roots, materialize
from merge_pipeline_tests.dagster.test_dagster_failures import assert_nothing_published, failure
from merge_pipeline_tests.dagster.test_dagster_pins import files_under, tick
from merge_pipeline_tests.engine.test_shared_folder import NOBODY, as_other_user
from merge_pipeline_tests.helpers import load_safetensors_dir, same_bits, tree_digest

KEY = "run/global_step_1/actor"
STEP = "global_step_1"
EARLIER_LAYOUT = quote(KEY, safe="")  # the key folder of the layout before pins had an owner
OTHER_WEIGHTS = FsdpSpec(seed=1, with_optimizer=False)  # the same model, other weights: theirs, or a private run's
REFUSED = "not made by merge_pipeline for you; refused and left untouched (remove it if it is not needed)"


@pytest.fixture
def shared(tmp_path) -> Roots:
    """A checkpoint root every user can write to (mode 1777, as ``/tmp`` or a team folder); our merged
    folders land in a private one."""
    folder = Path(tempfile.mkdtemp(prefix="shared_checkpoints_", dir="/tmp"))
    folder.chmod(0o1777)
    yield Roots(folder, tmp_path / "merged")
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def outside() -> Path:
    """A folder outside the watched root that every user can write to: the other user's own folders go
    here, and the files we hand them."""
    folder = Path(tempfile.mkdtemp(prefix="other_user_", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def other_instance(tmp_path):
    """A second deployment's own Dagster instance."""
    home = tmp_path / "other_dagster_home"
    home.mkdir()
    shutil.copy(PROJECT_ROOT / "dagster.yaml", home)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        yield instance


def plant_copy(files: Path, at: Path, outside: Path) -> None:
    """The other user copies a checkpoint folder to ``at`` (their own files, made by their own ``cp``)."""
    readable = outside / uuid.uuid4().hex
    shutil.copytree(files, readable)
    as_other_user("mkdir", "-p", str(at.parent))
    as_other_user("cp", "-r", str(readable), str(at))


def assert_published(target: Path, sample) -> None:
    reference = load_file(sample.reference_dir / "model.safetensors")
    weights = load_safetensors_dir(target)
    assert set(weights) == set(reference) and all(same_bits(weights[n], t) for n, t in reference.items())


def pin_warnings(instance, run_id: str) -> list[str]:
    """The run's distinct warnings about its pin (assets.py asks for the pin again when removing it)."""
    return sorted({e.message for e in instance.all_logs(run_id) if e.message and "its pin is not read" in e.message})


def test_a_checkpoint_planted_at_our_next_steps_pin_is_not_published(capfd, fsdp_checkpoint, shared, outside, instance):
    settings = shared.settings(pin_steps=True)
    pins = shared.checkpoints / PINS
    as_other_user("mkdir", "-m", "777", str(pins))  # they made .merge_pins first
    theirs = fsdp_checkpoint(OTHER_WEIGHTS).role_dir
    for at in (pin_path(settings.pin_spaces[0], checkpoint_key(KEY)), pins / EARLIER_LAYOUT / STEP / "actor"):
        plant_copy(theirs, at, outside)
    planted = tree_digest(pins)
    ours = fsdp_checkpoint(ACTOR)
    role_dir = shared.drop(ours, f"run/{STEP}", tracker=1)

    result, warnings = tick(capfd, instance, settings)

    assert [r.partition_key for r in result.run_requests] == [KEY]
    assert warnings == [f"{role_dir}: not pinned: {pins}: belongs to another user (uid {NOBODY}): {REFUSED}"]
    merged = materialize(instance, settings, KEY)
    assert merged.success
    assert_published(shared.target(KEY), ours)  # the step itself, not their files
    assert pin_warnings(instance, merged.run_id) == [
        f"{KEY}: its pin is not read ({pins}: belongs to another user (uid {NOBODY}): {REFUSED}); the step is read where the trainer saved it"
    ]
    assert tree_digest(pins) == planted and {p.stat().st_uid for p in [pins, *pins.rglob("*")]} == {NOBODY}


@pytest.mark.parametrize("pin_root", ["theirs", "ours_world_writable"])
def test_a_pin_symlinked_to_a_private_run_is_refused_and_not_followed(
    capfd, fsdp_checkpoint, shared, outside, instance, tmp_path, pin_root
):
    """A ``.merge_pins`` of theirs, or a pin root of ours that every user can write to (``pin_root``, a
    1777 team folder): their link to our private run, where the pin would be, is refused."""
    private = tmp_path / "private"  # our 0700 run, not for them
    private_step = shutil.copytree(fsdp_checkpoint(OTHER_WEIGHTS).role_dir, private / "secret_run" / STEP / "actor")
    private_step = private_step.parent
    private.chmod(0o700)
    before = tree_digest(private)
    if pin_root == "theirs":
        root = shared.checkpoints / PINS
        as_other_user("mkdir", "-m", "777", str(root))
        settings = shared.settings(pin_steps=True)
    else:
        root = outside / "team_pins"
        root.mkdir()
        root.chmod(0o1777)
        settings = shared.settings(pin_steps=True, pin_root=str(root))
    space = settings.pin_spaces[0]
    links = [root / EARLIER_LAYOUT / STEP]  # the earlier layout: <pin root>/<key>/<step>/<role>
    if pin_root == "theirs":
        links.append(space.folder / EARLIER_LAYOUT / STEP)
    else:  # our space is their link, to a folder of theirs holding the key folder
        links += [outside / "theirs" / EARLIER_LAYOUT / STEP, space.folder]
    for link in links:
        as_other_user("mkdir", "-p", str(link.parent))
        as_other_user("ln", "-s", str(outside / "theirs" if link == space.folder else private_step), str(link))
    ours = fsdp_checkpoint(ACTOR)
    role_dir = shared.drop(ours, f"run/{STEP}", tracker=1)

    result, warnings = tick(capfd, instance, settings)

    refused = (
        f"{root}: belongs to another user (uid {NOBODY}): {REFUSED}"
        if pin_root == "theirs"
        else f"{space.folder}: is a symlink (to {outside / 'theirs'}): {REFUSED}"
    )
    assert [r.partition_key for r in result.run_requests] == [KEY]
    assert warnings == [f"{role_dir}: not pinned: {refused}"]
    merged = materialize(instance, settings, KEY)
    assert merged.success
    assert_published(shared.target(KEY), ours)  # the public run's weights, never the private run's
    assert pin_warnings(instance, merged.run_id) == [
        f"{KEY}: its pin is not read ({refused}); the step is read where the trainer saved it"
    ]
    assert tree_digest(private) == before
    assert all(link.is_symlink() for link in links)


def test_merge_pins_symlinked_into_a_foreign_folder_receives_nothing(capfd, fsdp_checkpoint, shared, outside, instance):
    theirs = outside / "theirs"
    as_other_user("mkdir", "-m", "777", str(theirs))
    pins = shared.checkpoints / PINS
    as_other_user("ln", "-s", str(theirs), str(pins))
    role_dir = shared.drop(fsdp_checkpoint(ACTOR), f"run/{STEP}", tracker=1)

    result, warnings = tick(capfd, instance, shared.settings(pin_steps=True))

    assert [r.partition_key for r in result.run_requests] == [KEY]
    assert warnings == [f"{role_dir}: not pinned: {pins}: is a symlink (to {theirs}): {REFUSED}"]
    assert list(theirs.iterdir()) == [] and pins.readlink() == theirs  # no link of ours there, their link kept


def test_pin_folders_are_0700_and_another_user_reads_nothing_through_them(capfd, fsdp_checkpoint, shared, instance):
    role_dir = shared.drop(fsdp_checkpoint(ACTOR), f"run/{STEP}", tracker=1)
    (shared.checkpoints / "run").chmod(0o700)  # a private run in the shared root
    settings = shared.settings(pin_steps=True)

    tick(capfd, instance, settings)

    pins = shared.checkpoints / PINS
    pinned = pin_path(settings.pin_spaces[0], checkpoint_key(KEY))
    assert files_under(pinned) == files_under(role_dir)
    folders = [pins, *(p for p in pins.rglob("*") if p.is_dir())]
    assert {(stat.S_IMODE(f.stat().st_mode), f.stat().st_uid) for f in folders} == {(0o700, 0)}
    for name in files_under(pinned):  # weights, optimizer and extra state alike
        read = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "cat", str(pinned / name)],
            capture_output=True,
            timeout=30,
        )
        assert read.returncode != 0 and b"Permission denied" in read.stderr, name


@pytest.mark.parametrize("step", ["kept", "rotated"])
def test_a_pin_holding_another_file_than_it_was_made_with_is_not_read(capfd, fsdp_checkpoint, roots, instance, step):
    """Whatever put it there (the earlier code let another user swap files in a pin): a pin is read only
    with the very inodes it recorded; else the step itself is merged, or the run fails in one line."""
    ours = fsdp_checkpoint(ACTOR)
    role_dir = roots.drop(ours, f"run/{STEP}", tracker=1)
    settings = roots.settings(pin_steps=True)
    tick(capfd, instance, settings)
    pinned_rank_file = next(pin_path(settings.pin_spaces[0], checkpoint_key(KEY)).glob("model_world_size_*_rank_0.pt"))
    pinned_rank_file.unlink()
    shutil.copy(next(fsdp_checkpoint(OTHER_WEIGHTS).role_dir.glob("model_world_size_*_rank_0.pt")), pinned_rank_file)
    if step == "rotated":
        shutil.rmtree(role_dir.parent)

    merged = materialize(instance, settings, KEY)

    assert pin_warnings(instance, merged.run_id) == [
        f"{KEY}: its pin is not read ({pinned_rank_file}: is not the file recorded when the step was pinned (added, removed or replaced since): the pin is not read); the step is read where the trainer saved it"
    ]
    if step == "kept":
        assert merged.success
        assert_published(roots.target(KEY), ours)
    else:
        assert not merged.success
        assert failure(merged) == (
            "hf_model",
            f"{roots.checkpoints / KEY}: no such checkpoint folder under the checkpoint roots (deleted by the trainer's rotation?)",
        )
        assert_nothing_published(instance, roots)


def two_deployments(roots: Roots):
    """A bf16 and an fp8 deployment watching one checkpoint root, each publishing to its own output root."""
    return roots.settings(pin_steps=True), Roots(roots.checkpoints, roots.output.with_name("merged_fp8")).settings(
        pin_steps=True
    )


def test_two_deployments_keep_their_own_pins_until_their_own_merge(
    capfd, fsdp_checkpoint, roots, instance, other_instance
):
    ours = fsdp_checkpoint(ACTOR)
    role_dir = roots.drop(ours, f"run/{STEP}", tracker=1)
    bf16, fp8 = two_deployments(roots)
    key = checkpoint_key(KEY)
    tick(capfd, instance, bf16)
    tick(capfd, other_instance, fp8)
    assert bf16.pinned(key)[1] != fp8.pinned(key)[1]

    assert materialize(instance, bf16, KEY).success
    assert bf16.pinned(key) is None and fp8.pinned(key) is not None  # the first to finish removed its own only
    shutil.rmtree(role_dir.parent)  # the trainer's rotation, while the fp8 merge waits in its queue
    merged = materialize(other_instance, fp8, KEY)

    assert merged.success
    assert_published(fp8.target_dir(key), ours)
    assert fp8.pinned(key) is None


def test_each_deployments_stale_sweep_leaves_the_others_pins(capfd, fsdp_checkpoint, roots, instance, other_instance):
    roots.drop(fsdp_checkpoint(ACTOR), f"run/{STEP}", tracker=1)
    bf16, fp8 = two_deployments(roots)
    key = checkpoint_key(KEY)
    first, _ = tick(capfd, instance, bf16)  # requested and pinned by each; no run is ever launched here
    tick(capfd, other_instance, fp8)
    then = time.time() - PIN_GRACE_SECONDS - 1
    for settings in (bf16, fp8):
        os.utime(pin_path(settings.pin_spaces[0], key).parents[1], (then, then))  # <space>/<key>: the pin's age

    tick(capfd, instance, bf16, first.cursor)  # bf16's sweep: no bf16 run of it queued or running

    assert bf16.pinned(key) is None
    assert fp8.pinned(key) is not None
