"""Resuming a killed merge: weight files it finished in the staging folder are kept, not written again.

After each weight file is written and fsynced, the merge records it in ``<staging>/.merge_resume/``:
its size, its sha256 (computed while it was written) and the merge's key, a digest of the inputs
(path, size, inode, mtime of every file read) and of every option and output decision. A merge of
the same target started again with the same key keeps each recorded file whose size and sha256
still match and writes only the rest; anything else in the staging folder is removed first. A
changed input or option changes the key, and the merge starts over. The records are removed
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
        partial.write_text(json.dumps({"key": self.key, **entry}))
        os.replace(partial, path)  # a record is whole or absent


def _record_name(filename: str) -> str:
    return filename.replace("/", "%") + ".json"


def keep_finished(staging: Path, key: str, files: Iterable[ShardFile]) -> ResumeLog:
    """Check what a killed merge left in ``staging``; keep the weight files it finished for the same key
    (size and sha256 re-checked), remove everything else. Run by one process before any writing."""
    kept: dict[str, dict] = {}
    for shard in files:
        entry = _recorded(staging, shard.filename, key)
        if entry is not None and _intact(staging / shard.filename, entry):
            kept[shard.filename] = entry
    _remove_all_but(staging, {staging / name for name in kept} | {staging / RECORDS / _record_name(n) for n in kept})
    if kept:
        total = sum(e["bytes"] for e in kept.values())
        log.info("reusing %d weight file(s), %d bytes, finished by a merge that was killed", len(kept), total)
    return ResumeLog(staging, key, kept)


def finished(staging: Path, key: str, files: Iterable[ShardFile]) -> ResumeLog:
    """The files ``keep_finished`` kept (for processes that did not run it: their records are trusted)."""
    found = {s.filename: e for s in files if (e := _recorded(staging, s.filename, key)) is not None}
    return ResumeLog(staging, key, found)


def forget(staging: Path) -> None:
    """Remove the records: the folder is complete."""
    shutil.rmtree(staging / RECORDS, ignore_errors=True)


def _recorded(staging: Path, filename: str, key: str) -> dict | None:
    try:
        entry = json.loads((staging / RECORDS / _record_name(filename)).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or entry.get("filename") != filename:
        return None
    return {k: entry[k] for k in ("filename", "bytes", "tensors", "sha256")}


def _intact(path: Path, entry: dict) -> bool:
    try:
        with open(path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != entry["bytes"]:
                return False
            digest = hashlib.file_digest(f, "sha256", _bufsize=_HASH_CHUNK)
    except OSError:
        return False
    return digest.hexdigest() == entry["sha256"]


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
