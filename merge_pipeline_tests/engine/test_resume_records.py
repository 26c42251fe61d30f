"""The resume records' rule for a finished file: it is kept only if its bytes are those its record
names: untouched since its fsync and sealed with the record's digest, or else its size and sha256
checked now (its entry then carries the identity it was hashed with); any other file is removed and
written again."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from merge_pipeline.engine import resume
from merge_pipeline.engine.outputs import ShardFile
from merge_pipeline.engine.resume import RECORDS, ResumeLog, keep_finished, seal
from merge_pipeline.hf.manifest import stat_identity

KEY = "a merge key"
NAME = "model-00001-of-00002.safetensors"
FILES = [ShardFile(NAME, ()), ShardFile("model-00002-of-00002.safetensors", ())]


def _finished_file(staging: Path, data: bytes = b"weights" * 1000) -> Path:
    """A finished weight file and its record, as ``write_weights`` leaves them."""
    path = staging / NAME
    path.write_bytes(data)
    entry = {"filename": NAME, "bytes": len(data), "tensors": 1, "sha256": hashlib.sha256(data).hexdigest()}
    seal(path, entry["sha256"])
    ResumeLog(staging, KEY).record({**entry, "identity": stat_identity(path.stat())})
    return path


def _rewrite_record(staging: Path, **changes) -> None:
    record = staging / RECORDS / f"{NAME}.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), **changes}))


def test_a_record_naming_a_sha256_its_untouched_file_does_not_have_drops_the_file(tmp_path):
    """A record edited by someone who can write to the staging folder: the file is the one recorded
    (same stat identity) but the digest is not its bytes'. Taken from the record, that digest would go
    into the manifest, and ``manifest_sha256`` would compare the file by it."""
    path = _finished_file(tmp_path)
    _rewrite_record(tmp_path, sha256="0" * 64)

    kept = keep_finished(tmp_path, KEY, FILES)

    assert kept.finished == {} and not path.exists()
    assert not (tmp_path / RECORDS / f"{NAME}.json").exists()


def test_a_file_edited_in_place_with_its_mtime_restored_is_hashed_and_dropped(tmp_path):
    path = _finished_file(tmp_path)
    before = path.stat()
    time.sleep(0.05)  # past the filesystem clock's tick, as any later edit by someone else is
    with open(path, "r+b") as f:
        f.write(b"X")  # same size, one byte changed
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))

    kept = keep_finished(tmp_path, KEY, FILES)

    assert kept.finished == {} and not path.exists()


def test_a_file_with_another_identity_but_the_recorded_bytes_is_kept_after_hashing(tmp_path):
    path = _finished_file(tmp_path)
    copy = tmp_path / "copy"
    copy.write_bytes(path.read_bytes())
    os.replace(copy, path)  # a new inode (e.g. the staging folder copied elsewhere and back)

    kept = keep_finished(tmp_path, KEY, FILES)

    assert list(kept.finished) == [NAME] and path.exists()
    # Hashed once here: the entry (handed to every worker) carries the identity it was checked with, so the
    # blocking checks compare the file by this sha256 rather than reading it again.
    assert kept.finished[NAME]["identity"] == stat_identity(path.stat())


def test_an_untouched_sealed_file_is_kept_without_hashing_it(tmp_path, monkeypatch):
    """The resume's fast path: a file untouched since its fsync, sealed with its record's digest,
    is not read again (at 8B, hashing the kept files would cost more than the rest of the resume)."""
    _finished_file(tmp_path)
    hashed = []
    monkeypatch.setattr(resume, "_sha256_of", lambda f: hashed.append(f) or "")

    kept = keep_finished(tmp_path, KEY, FILES)

    assert list(kept.finished) == [NAME] and hashed == []


def test_a_file_with_another_seal_than_its_records_digest_is_hashed(tmp_path):
    """Someone edited both the record's digest and the file's seal: the seal's change set the file's
    ctime, so its identity is no longer the recorded one, and the bytes are hashed (and do not match)."""
    path = _finished_file(tmp_path)
    time.sleep(0.05)
    seal(path, "0" * 64)
    _rewrite_record(tmp_path, sha256="0" * 64)

    kept = keep_finished(tmp_path, KEY, FILES)

    assert kept.finished == {} and not path.exists()
