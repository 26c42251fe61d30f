"""A target in a shared folder (``/tmp``, a team folder): another user planting the lock, staging or
previous entries beside it first cannot make a merge write, restore, print or delete anything of ours.

The other user is real: uid 65534 (``setpriv``), creating its entries in a 0777 folder.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from merge_pipeline.engine.publish import lock_path, locked_target, previous_path, staging_path
from merge_pipeline.errors import MergeError
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, run_cli, tree_digest

SPEC = FsdpSpec(world_size=3, with_optimizer=False)
SECRET = "HF_TOKEN=hf_planted_lock_must_not_print_this"
NOBODY = 65534


def as_other_user(*command: str) -> None:
    subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command], check=True, timeout=30
    )


@pytest.fixture
def shared(tmp_path) -> Path:
    """A world-writable folder every user can reach (pytest's own tmp folders are private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="shared_", dir="/tmp"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def ours(tmp_path) -> Path:
    """Files of this user that a planted symlink points at: a secret, and a folder with a merge in it."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "secret.env").write_text(SECRET)
    (tmp_path / "mine" / "folder").mkdir()
    (tmp_path / "mine" / "folder" / "merge_manifest.json").write_text('{"tool": {"name": "merge_pipeline"}}')
    return tmp_path / "mine"


@pytest.mark.parametrize(
    ("entry", "points_at"),
    [(lock_path, "secret.env"), (staging_path, "folder"), (previous_path, "folder")],
    ids=["lock", "staging", "previous"],
)
def test_a_symlink_planted_by_another_user_is_refused_and_followed_nowhere(
    capsys, fsdp_checkpoint, shared, ours, entry, points_at
):
    target = shared / "out"
    planted = entry(target)
    as_other_user("ln", "-s", str(ours / points_at), str(planted))
    before = tree_digest(ours)

    code, out, err = run_cli(
        capsys, "merge", "--local_dir", fsdp_checkpoint(SPEC).role_dir, "--target_dir", target, "--no-progress"
    )

    assert code == 1, err
    [line] = error_lines(err)
    assert line.startswith(f"error: {planted}: is a symlink (to {ours / points_at}): not made by merge_pipeline"), line
    assert SECRET not in out + err
    assert tree_digest(ours) == before and (ours / "secret.env").read_text() == SECRET
    assert os.readlink(planted) == str(ours / points_at)
    assert not target.exists(), "a planted previous folder was not 'restored' as the target"


def test_a_lock_file_of_another_user_is_refused_untouched(capsys, fsdp_checkpoint, shared):
    target = shared / "out"
    as_other_user("sh", "-c", f"printf '1\\n' > {lock_path(target)}")

    code, _, err = run_cli(
        capsys, "merge", "--local_dir", fsdp_checkpoint(SPEC).role_dir, "--target_dir", target, "--no-progress"
    )

    assert code == 1
    [line] = error_lines(err)
    assert line == (
        f"error: {lock_path(target)}: belongs to another user (uid {NOBODY}): not made by merge_pipeline for you; "
        "refused and left untouched (remove it if it is not needed)"
    )
    assert lock_path(target).read_text() == "1\n" and lock_path(target).stat().st_uid == NOBODY
    assert not target.exists() and not staging_path(target).exists()


def test_what_a_held_lock_file_says_is_never_printed(tmp_path, fsdp_checkpoint):
    """Only a pid is shown: forged lines and terminal escape codes in the lock file stay in it."""
    target = tmp_path / "out"
    with open(lock_path(target), "w+b") as held:
        held.write(b"\x1b[2J\nerror: forged line\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)  # a second open file description: as another process holds it
        with pytest.raises(MergeError) as refused:
            with locked_target(target, source=fsdp_checkpoint(SPEC).role_dir, overwrite=False):
                pass
    assert str(refused.value) == f"{target}: another merge is writing this target right now"
