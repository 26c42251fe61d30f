"""The staging + lock API on real folders: what may be replaced, how, and what a killed writer leaves."""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

import pytest

from merge_pipeline.engine.publish import (
    _exchange,
    _replace_with_two_renames,
    check_target,
    lock_path,
    locked_target,
    previous_path,
    staged_output,
    staging_path,
)
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.manifest import MANIFEST, write_manifest
from merge_pipeline_tests.helpers import merge_in_progress, tree_digest


@pytest.fixture
def source(tmp_path) -> Path:
    """Stands in for the input checkpoint folder: only its location matters here."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "model_world_size_1_rank_0.pt").write_bytes(b"weights")
    return folder


def our_folder(path: Path, weights: bytes) -> Path:
    """A folder as a merge leaves it: files plus our manifest."""
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(weights)
    write_manifest(path, {"tool": {"name": "merge_pipeline"}})
    return path


def leftovers(target: Path) -> list[str]:
    """The lock, staging and previous folders beside ``target``."""
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))


# --- what --overwrite may replace -------------------------------------------------------------


def test_overwrite_replaces_our_folder_or_an_empty_one(tmp_path, source):
    check_target(our_folder(tmp_path / "ours", b"old"), source=source, overwrite=True)
    (tmp_path / "empty").mkdir()
    check_target(tmp_path / "empty", source=source, overwrite=True)


@pytest.mark.parametrize(
    "manifest",
    [None, "{not json", '{"tool": {"name": "someone_else"}}'],
    ids=["no_manifest", "garbage_manifest", "other_tool"],
)
def test_overwrite_refuses_a_folder_we_did_not_write(tmp_path, source, manifest):
    target = tmp_path / "notes"
    target.mkdir()
    (target / "eval.txt").write_text("results a person wrote")
    if manifest is not None:
        (target / MANIFEST).write_text(manifest)
    with pytest.raises(MergeError, match=f"^{target}: is not empty and has no {MANIFEST} from merge_pipeline"):
        check_target(target, source=source, overwrite=True)


@pytest.mark.parametrize("overwrite", [False, True])
def test_target_overlapping_the_input_is_refused(tmp_path, source, overwrite):
    (tmp_path / "link").symlink_to(source)
    cases = {
        source: "is the input checkpoint",
        tmp_path / "link": "is the input checkpoint",
        source / "merged": "lies inside the input checkpoint",
        tmp_path: "contains the input checkpoint",
    }
    for target, problem in cases.items():
        with pytest.raises(MergeError, match=f"^{target}: {problem} {source}"):
            check_target(target, source=source, overwrite=overwrite)


def test_target_that_appeared_foreign_while_merging_is_not_replaced(tmp_path, source):
    target = tmp_path / "out"
    with pytest.raises(MergeError, match="has no merge_manifest.json"):
        with staged_output(target, source=source, overwrite=True) as staging:
            (staging / "model.safetensors").write_bytes(b"new")
            target.mkdir()
            (target / "notes.txt").write_text("someone else's")
    assert (target / "notes.txt").read_text() == "someone else's"
    assert leftovers(target) == []


def test_a_failed_merge_leaves_no_folder_it_made_and_keeps_the_others(tmp_path, source):
    """The step folder a merge made for its target (``merged/run/global_step_3/``) goes with the failure;
    folders that were there before, or that hold a sibling's target, stay."""
    (tmp_path / "merged").mkdir()
    target = tmp_path / "merged" / "run" / "global_step_3" / "actor"
    with pytest.raises(MergeError, match="shard too large"):
        with staged_output(target, source=source, overwrite=False) as staging:
            (staging / "model.safetensors").write_bytes(b"half")
            raise MergeError(staging, "shard too large")
    assert list((tmp_path / "merged").iterdir()) == []

    critic = our_folder(tmp_path / "merged" / "run" / "global_step_3" / "critic", b"published")
    with pytest.raises(MergeError):
        with staged_output(target, source=source, overwrite=False):
            raise MergeError(None, "failed")
    assert [p.name for p in critic.parent.iterdir()] == ["critic"]


# --- publishing ---------------------------------------------------------------------------------


def test_exchange_swaps_two_folders_in_one_step(tmp_path):
    a, b = our_folder(tmp_path / "a", b"A"), our_folder(tmp_path / "b", b"B")
    assert _exchange(a, b)
    assert (a / "model.safetensors").read_bytes() == b"B" and (b / "model.safetensors").read_bytes() == b"A"


_renames: list[tuple[str, str]] | None = None  # recorded while a test sets it to a list


def _record_renames(event: str, args: tuple) -> None:
    if event == "os.rename" and _renames is not None:
        _renames.append((os.fsdecode(args[0]), os.fsdecode(args[1])))


sys.addaudithook(_record_renames)  # audit hooks cannot be removed: it records only inside the test below


def test_overwrite_never_moves_the_target_away(tmp_path, source):
    """The old target is exchanged with the new one: its path is never missing, not even for a moment."""
    global _renames
    target = our_folder(tmp_path / "out", b"old")
    _renames = []
    try:
        with staged_output(target, source=source, overwrite=True) as staging:
            (staging / "model.safetensors").write_bytes(b"new")
    finally:
        recorded, _renames = _renames, None
    assert (target / "model.safetensors").read_bytes() == b"new"
    assert [r for r in recorded if r[0] == str(target)] == [], f"the target was renamed away: {recorded}"
    assert leftovers(target) == []


def test_fallback_replace_without_exchange(tmp_path):
    """Where the filesystem has no RENAME_EXCHANGE: two renames, and the previous folder removed."""
    target, staging = our_folder(tmp_path / "out", b"old"), our_folder(tmp_path / ".out.staging", b"new")
    _replace_with_two_renames(staging, target)
    assert (target / "model.safetensors").read_bytes() == b"new"
    assert leftovers(target) == []


# --- what a killed writer leaves ----------------------------------------------------------------


def test_kill_between_the_fallback_renames_restores_the_previous_target(tmp_path, source, caplog):
    old = our_folder(tmp_path / "out", b"old")
    before = tree_digest(old)
    old.rename(previous_path(old))  # killed here: the target is missing, the new folder complete
    our_folder(staging_path(old), b"new")
    with caplog.at_level(logging.WARNING, logger="merge_pipeline"):
        with pytest.raises(MergeError, match="already exists"):  # restored, so a merge without --overwrite stops
            with locked_target(old, source=source, overwrite=False):
                pass
    assert tree_digest(old) == before
    assert f"{old}: restored from {previous_path(old)}" in caplog.text
    assert leftovers(old) == [staging_path(old).name]  # removed by the next writer that builds one


def test_kill_after_publishing_leaves_previous_removed_and_said(tmp_path, source, caplog):
    target = our_folder(tmp_path / "out", b"new")
    our_folder(previous_path(target), b"old")
    our_folder(staging_path(target), b"half")
    with caplog.at_level(logging.WARNING, logger="merge_pipeline"):
        with staged_output(target, source=source, overwrite=True) as staging:
            assert list(staging.iterdir()) == []
            (staging / "model.safetensors").write_bytes(b"newer")
    assert (target / "model.safetensors").read_bytes() == b"newer"
    assert f"removing {previous_path(target)}" in caplog.text and f"removing {staging_path(target)}" in caplog.text
    assert leftovers(target) == []


def test_lock_of_a_killed_writer_is_taken_over_and_said(tmp_path, source, caplog):
    target = tmp_path / "out"
    with merge_in_progress(target, source) as holder:
        holder.kill()
        holder.wait()
    assert lock_path(target).read_text() == f"{holder.pid}\n"
    with caplog.at_level(logging.WARNING, logger="merge_pipeline"):
        with staged_output(target, source=source, overwrite=False) as staging:
            (staging / "model.safetensors").write_bytes(b"new")
    assert f"the merge holding it (pid {holder.pid}) was killed" in caplog.text
    assert leftovers(target) == []


# --- one writer per target ------------------------------------------------------------------------


def test_a_second_writer_is_refused_and_touches_nothing(tmp_path, source):
    target = our_folder(tmp_path / "out", b"old")
    with merge_in_progress(target, source) as holder:
        with pytest.raises(
            MergeError, match=rf"^{target}: another merge \(pid {holder.pid}\) is writing this target right now$"
        ):
            with staged_output(target, source=source, overwrite=True):
                pass
        assert (staging_path(target) / "model.safetensors").read_bytes() == b"a merge half way"
    assert (target / "model.safetensors").read_bytes() == b"old"


_pause_flock: dict[str, object] = {}  # thread -> (opened, go_on) events, while the test below sets them


def _pause_before_flock(event: str, args: tuple) -> None:
    if event == "fcntl.flock" and _pause_flock.get("thread") is threading.current_thread():
        opened, go_on = _pause_flock.pop("thread_events")
        del _pause_flock["thread"]
        opened.set()
        go_on.wait(30)


sys.addaudithook(_pause_before_flock)


def test_lock_file_unlinked_under_a_waiting_writer_cannot_give_two_owners(tmp_path, source):
    """B opens the lock file, A releases (unlinks it), B locks the unlinked file: B must notice, or C could own the target too."""
    target = tmp_path / "out"
    opened, go_on, b_holds, b_may_go = (threading.Event() for _ in range(4))
    owners: list[str] = []

    def writer_b() -> None:
        with locked_target(target, source=source, overwrite=False):
            owners.append("B")
            b_holds.set()
            b_may_go.wait(30)

    b = threading.Thread(target=writer_b)
    with locked_target(target, source=source, overwrite=False):  # A
        _pause_flock.update(thread=b, thread_events=(opened, go_on))
        b.start()
        assert opened.wait(30), "B never reached its flock"
    go_on.set()  # A has unlinked and closed its lock file; B now locks the one it opened before
    assert b_holds.wait(30)
    try:
        with pytest.raises(MergeError, match="another merge"):
            with locked_target(target, source=source, overwrite=False):  # C
                owners.append("C")
    finally:
        b_may_go.set()
        b.join(30)
    assert owners == ["B"]
    assert leftovers(target) == []
