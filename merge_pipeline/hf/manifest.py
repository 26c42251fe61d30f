"""``merge_manifest.json``: what went in, what decisions were made, and the sha256 of what came out."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from merge_pipeline.store.record import MANIFEST  # the commit marker the store looks for: one name

_LIBRARIES = ("torch", "transformers", "safetensors", "huggingface_hub", "peft", "megatron-core")


def sha256_file(path: Path, block: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    found = {}
    for name in ("merge_pipeline", *_LIBRARIES):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def stat_identity(found: os.stat_result) -> list[int]:
    """What any change to a file's bytes changes too: its inode, size, and modification and change
    times in ns. The change time (ctime) is set by the kernel on every write, truncate, rename over
    or ``utime``; no ordinary call sets it back, so restoring the mtime does not hide an edit."""
    return [found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns]


def digests_still_valid(folder: Path, written: Mapping[str, Mapping]) -> dict[str, str]:
    """The sha256 of each file a merge hashed itself (``written``: relative path -> write report entry,
    its ``sha256`` and its stat ``identity`` right after the fsync or the resume's verification),
    for those files that are still the very file hashed (same identity): no byte of them is read."""
    valid = {}
    for name, entry in written.items():
        try:
            found = os.stat(folder / name)
        except OSError:
            continue
        if stat_identity(found) == entry.get("identity"):
            valid[name] = entry["sha256"]
    return valid


def file_sums(folder: Path, known_sha256: dict[str, str] | None = None) -> dict[str, dict[str, object]]:
    """Size and sha256 of every file under ``folder`` except the manifest itself.

    ``known_sha256`` (relative path -> digest) are files hashed while they were written: not read again.
    """
    known_sha256 = known_sha256 or {}
    sums = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            name = p.relative_to(folder).as_posix()
            sums[name] = {"size": p.stat().st_size, "sha256": known_sha256.get(name) or sha256_file(p)}
    return sums


def write_manifest(folder: Path, body: dict, known_sha256: dict[str, str] | None = None) -> dict:
    manifest = {**body, "versions": library_versions(), "files": file_sums(folder, known_sha256)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())
