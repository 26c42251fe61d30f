"""Resuming a killed merge: weight files it finished in the staging folder are kept, not written again.

After each weight file is written and fsynced, the merge records it in ``<staging>/.merge_resume/``:
its size, its sha256 (computed while it was written) and the merge's key, a digest of the inputs
(path, size, inode, mtime of every file read) and of every option and output decision. A merge of
the same target started again with the same key keeps each recorded file whose size and sha256
still match and writes only the rest (the sha256 is not computed again while the file's stat
identity is still the one recorded, see ``_intact``); anything else in the staging folder is
removed first. A changed input or option changes the key, and the merge starts over. The records are removed
before the manifest is written, so a published folder never holds them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from merge_pipeline.engine.outputs import ShardFile
from merge_pipeline.plan import SourceFile, dtype_name

log = logging.getLogger("merge_pipeline")

RECORDS = ".merge_resume"
_HASH_CHUNK = 16 << 20


def merge_key(inputs: Iterable[SourceFile], options: Mapping[str, object], files: Iterable[ShardFile]) -> str:
    """What the output's bytes depend on: the input files as they are on disk, the options, the output plan."""
    described = {
        "inputs": [_identity(f.path) for f in inputs],
        "options": options,
        "outputs": [
            [f.filename, [[t.planned.name, dtype_name(t.dtype), list(t.planned.shape)] for t in f.tensors]]
            for f in files
        ],
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


def _identity(path: Path) -> list:
    found = os.stat(path)
    return [str(path), found.st_size, found.st_dev, found.st_ino, found.st_mtime_ns]


@dataclass
class ResumeLog:
    """The finished files of this merge (by file name: the write report's entries) and where to record more."""

    staging: Path
    key: str
    finished: dict[str, dict] = field(default_factory=dict)

    def record(self, entry: dict) -> None:
        """Note a written, fsynced weight file (``entry``: filename, bytes, tensors, sha256)."""
        folder = self.staging / RECORDS
        folder.mkdir(exist_ok=True)
        path = folder / _record_name(entry["filename"])
        partial = path.with_suffix(".partial")
        identity = stat_identity(os.stat(self.staging / entry["filename"]))
        partial.write_text(json.dumps({"key": self.key, **entry, "identity": identity}))
        os.replace(partial, path)  # a record is whole or absent


def _record_name(filename: str) -> str:
    return filename.replace("/", "%") + ".json"


def keep_finished(staging: Path, key: str, files: Iterable[ShardFile]) -> ResumeLog:
    """Check what a killed merge left in ``staging``; keep the weight files it finished for the same key
    (size re-checked, sha256 too unless the file is untouched since its record), remove everything else.
    Run by one process before any writing."""
    kept: dict[str, dict] = {}
    for shard in files:
        record = _record(staging, shard.filename, key)
        if record is not None and _intact(staging / shard.filename, record):
            kept[shard.filename] = _entry(record)
    _remove_all_but(staging, {staging / name for name in kept} | {staging / RECORDS / _record_name(n) for n in kept})
    if kept:
        total = sum(e["bytes"] for e in kept.values())
        log.info("reusing %d weight file(s), %d bytes, finished by a merge that was killed", len(kept), total)
    return ResumeLog(staging, key, kept)


def finished(staging: Path, key: str, files: Iterable[ShardFile]) -> ResumeLog:
    """The files ``keep_finished`` kept (for processes that did not run it: their records are trusted)."""
    found = {s.filename: _entry(r) for s in files if (r := _record(staging, s.filename, key)) is not None}
    return ResumeLog(staging, key, found)


def forget(staging: Path) -> None:
    """Remove the records: the folder is complete."""
    shutil.rmtree(staging / RECORDS, ignore_errors=True)


def _record(staging: Path, filename: str, key: str) -> dict | None:
    """The record of ``filename`` if this merge's key wrote it."""
    try:
        record = json.loads((staging / RECORDS / _record_name(filename)).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key or record.get("filename") != filename:
        return None
    return record


def _entry(record: dict) -> dict:
    """The write report's entry of a recorded file."""
    return {k: record[k] for k in ("filename", "bytes", "tensors", "sha256")}


def stat_identity(found: os.stat_result) -> list[int]:
    """What any change to a file's bytes changes too: its inode, size, and modification and change
    times in ns. The change time (ctime) is set by the kernel on every write, truncate, rename over
    or ``utime``; no ordinary call sets it back, so restoring the mtime does not hide an edit."""
    return [found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns]


def _intact(path: Path, record: dict) -> bool:
    """The file is the one recorded: its stat identity is the one taken right after its fsync (then
    its sha256 is trusted, not computed again), or else its size and sha256 match.

    Trusting the identity is safe because what would escape it (a write within the same clock tick
    as our record, a clock set back, a raw write to the disk) still cannot be published: the
    blocking check ``manifest_sha256`` hashes every file against the recorded sha256 before the
    folder is published, and a failed merge removes its staging folder, so the next one starts over."""
    try:
        with open(path, "rb", buffering=0) as f:
            found = os.fstat(f.fileno())
            if found.st_size != record["bytes"]:
                return False
            if stat_identity(found) == record.get("identity"):
                return True
            digest = hashlib.file_digest(f, "sha256", _bufsize=_HASH_CHUNK)
    except OSError:
        return False
    return digest.hexdigest() == record["sha256"]


def _remove_all_but(staging: Path, keep: set[Path]) -> None:
    for root, dirs, names in os.walk(staging, topdown=False):
        for name in names:
            path = Path(root) / name
            if path not in keep:
                path.unlink()
        for name in dirs:
            path = Path(root) / name
            if not any(k.is_relative_to(path) for k in keep):
                shutil.rmtree(path)
