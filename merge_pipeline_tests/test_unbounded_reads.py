"""Files we read whole (trackers, ``latest``, JSON, manifests, DCP ``.metadata``) never block and never
cost memory in proportion to their size: a FIFO is refused at once, a 1 GB file by its size.

A regression must fail, not hang: each blocking case runs in a thread given a few seconds, and
each 1 GB case in a subprocess whose peak RSS (VmHWM) is measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from merge_pipeline.engine.publish import check_target
from merge_pipeline.errors import MergeError
from merge_pipeline.formats.step_folders import TRACKER
from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline.watch.discovery import completeness

GB = 1 << 30


def returns_within(seconds: float, call, fifo: Path):
    """``call()``'s result, or a test failure if it is still blocked after ``seconds`` (then it is unblocked)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except MergeError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer that closes at once: the reader gets EOF
        thread.join(10)
        pytest.fail(f"blocked on the FIFO {fifo}")
    return outcome


def step_with_a_file(root: Path, step_folder: str) -> Path:
    role_dir = root / step_folder
    role_dir.mkdir(parents=True)
    (role_dir / "model_world_size_1_rank_0.pt").write_bytes(b"x")
    return role_dir


@pytest.mark.parametrize("stack", ["verl_tracker", "deepspeed_latest"])
def test_a_fifo_as_tracker_or_latest_does_not_block_the_sensor(tmp_path, stack):
    if stack == "verl_tracker":
        role_dir, fifo = step_with_a_file(tmp_path, "global_step_1/actor"), tmp_path / TRACKER
    else:
        role_dir, fifo = step_with_a_file(tmp_path, "global_step1"), tmp_path / "latest"
    os.mkfifo(fifo)

    outcome = returns_within(10, lambda: completeness(role_dir, 1, settle_seconds=3600), fifo)

    assert not outcome["value"].complete, outcome


def test_a_fifo_manifest_in_the_target_does_not_block_overwrite(tmp_path):
    target, source = tmp_path / "out", tmp_path / "checkpoint"
    target.mkdir()
    source.mkdir()
    (target / "eval.txt").write_text("a person's notes")
    os.mkfifo(target / MANIFEST)

    outcome = returns_within(10, lambda: check_target(target, source=source, overwrite=True), target / MANIFEST)

    assert f"is not empty and has no {MANIFEST} from merge_pipeline" in str(outcome["error"])


READ_HUGE_FILES = """
import json, sys
from pathlib import Path
from merge_pipeline.formats.step_folders import read_tracker
from merge_pipeline.errors import MergeError
from merge_pipeline.formats.dcp_files import read_dcp_metadata
from merge_pipeline.formats.deepspeed.reader import tag_dir
from merge_pipeline.files.json_files import read_json_object
from merge_pipeline.workers.writing import peak_rss_bytes

folder = Path(sys.argv[1])
before = peak_rss_bytes()
results = {}
for name, read in [
    ("tracker", lambda: read_tracker(folder / "latest_checkpointed_iteration.txt")),
    ("latest", lambda: tag_dir(folder)),
    ("ckpt_contents.json", lambda: read_json_object(folder / "ckpt_contents.json")),
    ("dcp .metadata", lambda: read_dcp_metadata(folder / "dist_ckpt" / ".metadata")),
]:
    try:
        results[name] = repr(read())
    except MergeError as exc:
        results[name] = str(exc)
print(json.dumps({"grew": peak_rss_bytes() - before, "results": results}))
"""


@pytest.mark.slow
def test_1gb_tracker_latest_json_and_metadata_cost_no_memory(tmp_path):
    """Sparse 1 GB files of spaces' worth (zeros on disk): refused by size, not read (was 2.4 to 5.6 GB)."""
    for name in ("latest_checkpointed_iteration.txt", "latest", "ckpt_contents.json", "dist_ckpt/.metadata"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        with open(tmp_path / name, "wb") as f:
            f.truncate(GB)

    done = subprocess.run(
        [sys.executable, "-c", READ_HUGE_FILES, str(tmp_path)], capture_output=True, text=True, timeout=60
    )

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["grew"] < 32 << 20, report
    results = report["results"]
    assert results["tracker"] == "None"  # the sensor: not a step number
    assert results["latest"] == f"{tmp_path / 'latest'}: is larger than 4096 bytes: too large to name a tag"
    assert results["ckpt_contents.json"] == (
        f"{tmp_path / 'ckpt_contents.json'}: is larger than 64 MB: too large for a JSON config or index"
    )
    assert results["dcp .metadata"].startswith(f"{tmp_path / 'dist_ckpt/.metadata'}: is larger than 67,108,864 bytes")
