"""Resuming a killed merge: weight files it finished in the staging folder are kept, not written again.

After each weight file is written and fsynced, the merge records it in ``<staging>/.merge_resume/``:
its size, its sha256 (computed while it was written), its stat identity and the merge's key, a digest of the
inputs (path and every field of the identity planning recorded: device, inode, size, mtime, ctime) and of
every option and output decision. A merge of the same target started again with the same key keeps each
recorded file whose size and sha256 still match and writes only the rest (a file untouched since its
fsync and sealed with its digest is not hashed again, see ``seal`` and ``_intact``);
anything else in the staging folder is removed first. A changed input or option changes the key, and the
merge starts over. The records are removed before the manifest is written, so a published folder never
holds them. A kept file's entry (the sha256 just checked and the identity it was checked with) goes into
the write report as a written file's does: the blocking check ``manifest_sha256`` compares the file by it,
so no byte is hashed twice in one merge.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from merge_pipeline.engine.outputs import ShardFile
from merge_pipeline.errors import shown_path
from merge_pipeline.hf.manifest import stat_identity
from merge_pipeline.plan import SourceFile, dtype_name

log = logging.getLogger("merge_pipeline")

RECORDS = ".merge_resume"
_HASH_CHUNK = 16 << 20
_SEAL = "user.merge_pipeline.sha256"  # on each weight file: the digest the writer computed (``seal``)
_ENTRY = ("filename", "bytes", "tensors", "sha256", "identity")  # a record: these and the key


def merge_key(inputs: Iterable[SourceFile], options: Mapping[str, object], files: Iterable[ShardFile]) -> str:
    """What the output's bytes depend on: the input files as they are on disk, the options, the output plan.

    Each input by its path and every field of the identity its planning recorded from the opened file
    (``SourceFile.identity``: device, inode, size, mtime and ctime): a save rewritten in place at the
    same size with its mtime put back (``rsync --inplace --times``) still has a new ctime."""
    described = {
        "inputs": [[shown_path(f.path), asdict(f.identity)] for f in inputs],  # a store's file by its URL
        "options": options,
        "outputs": [
            [f.filename, [[t.planned.name, dtype_name(t.dtype), list(t.planned.shape)] for t in f.tensors]]
            for f in files
        ],
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class ResumeLog:
    """The finished files of this merge (by file name: the write report's entries) and where to record more."""

    staging: Path
    key: str
    finished: dict[str, dict] = field(default_factory=dict)

    def record(self, entry: dict) -> None:
        """Note a written, fsynced weight file (``entry``: filename, bytes, tensors, sha256, and its
        stat identity right after the fsync)."""
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
    (size and sha256 re-checked against the record), remove everything else. Run by one process before
    any writing."""
    kept: dict[str, dict] = {}
    resume = ResumeLog(staging, key)
    for shard in files:
        record = _record(staging, shard.filename, key)
        identity = _intact(staging / shard.filename, record) if record is not None else None
        if identity is not None:
            kept[shard.filename] = {**_entry(record), "identity": identity}
            if identity != record["identity"]:  # other ranks and the checks go by the identity just hashed
                resume.record(kept[shard.filename])
    _remove_all_but(staging, {staging / name for name in kept} | {staging / RECORDS / _record_name(n) for n in kept})
    if kept:
        total = sum(e["bytes"] for e in kept.values())
        log.info("reusing %d weight file(s), %d bytes, finished by a merge that was killed", len(kept), total)
    resume.finished.update(kept)
    return resume


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
    if any(k not in record for k in _ENTRY):
        return None
    return record


def _entry(record: dict) -> dict:
    """The write report's entry of a recorded file."""
    return {k: record[k] for k in _ENTRY}


def seal(path: Path, sha256: str) -> None:
    """Write the sha256 of a finished weight file onto the file itself (an extended attribute), before its
    stat identity is taken: a record naming another digest then cannot match both the file's seal and
    its identity, since changing the seal changes the file's ctime. Where the filesystem keeps no user
    attributes, a kept file is hashed on every resume instead."""
    with contextlib.suppress(OSError):
        os.setxattr(path, _SEAL, sha256.encode())


def _intact(path: Path, record: dict) -> list[int] | None:
    """The file's stat identity if its bytes are those its record names, else None.

    Not hashed when the file is untouched since its fsync and sealed with the record's digest (its
    identity is the one recorded, taken after ``seal``): the digest is then the one the writer computed
    from the bytes it handed to the kernel, whatever was done to the record, which is a file anyone able
    to write to the staging folder can edit. Otherwise its size, then its sha256 are checked now. Read
    once per resume, never again in this merge: the identity taken here stands for these bytes until
    the checks; a write meanwhile changes it, and the file is hashed again there."""
    try:
        with open(path, "rb", buffering=0) as f:
            found = os.fstat(f.fileno())
            if found.st_size != record["bytes"]:
                return None
            if stat_identity(found) == record.get("identity") and _sealed_with(f.fileno()) == record["sha256"]:
                return record["identity"]
            digest = _sha256_of(f)
    except OSError:
        return None
    return stat_identity(found) if digest == record["sha256"] else None


def _sha256_of(f) -> str:
    """What hashlib.file_digest (Python 3.11+) does."""
    digest = hashlib.sha256()
    while chunk := f.read(_HASH_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def _sealed_with(fd: int) -> str | None:
    try:
        return os.getxattr(fd, _SEAL).decode()
    except (OSError, UnicodeDecodeError):
        return None


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
