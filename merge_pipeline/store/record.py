"""What this tool writes beside and into a target prefix, by which it knows what it wrote: the manifest
(the commit marker of a published folder) and the record of a merge publishing there.

A prefix's objects are ours if our manifest names them or the record ``.merge_publishing`` of a merge that
has not finished publishing does; only those are ever replaced or deleted (``target_rules``, ``published_prefix``).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from merge_pipeline.store.url import StoreLocation

MANIFEST = "merge_manifest.json"  # hf.manifest writes it: the commit marker of a published folder
PUBLISHING = ".merge_publishing"  # beside the prefix, as its lock: what a merge publishing into it may leave
_MAX_RECORD_BYTES = 64 * 10**6  # ours list one line per file; a larger one is not ours


def written_names(store: StoreLocation) -> set[str] | None:
    """The names under the prefix this tool wrote: those its manifest names (and the manifest), and those
    recorded by merges that have not finished publishing there; None if there is neither."""
    manifest = _names_in(store, store.key(MANIFEST))
    recorded = _names_in(store, store.path + PUBLISHING)
    if manifest is None and recorded is None:
        return None
    return {*(manifest or ()), *(recorded or ()), *((MANIFEST,) if manifest is not None else ())}


def _names_in(store: StoreLocation, key: str) -> set[str] | None:
    """The file names of our manifest or record at ``key``; None if absent, not JSON or not ours."""
    try:
        data = store.fs.cat_file(key, start=0, end=_MAX_RECORD_BYTES + 1)
        body = json.loads(data) if len(data) <= _MAX_RECORD_BYTES else None
    except (FileNotFoundError, ValueError):
        return None
    if (
        not (isinstance(body, dict) and isinstance(body.get("tool"), dict))
        or body["tool"].get("name") != "merge_pipeline"
    ):
        return None
    files = body.get("files")
    return {name for name in files if isinstance(name, str)} if isinstance(files, (dict, list)) else None


def record_publishing(store: StoreLocation, names: set[str], guard: Callable[[], None]) -> set[str]:
    """Before a merge uploads ``names`` into the prefix: they are recorded beside it with every name this tool
    wrote there before (the manifest being replaced, a killed merge's record), so that once the manifest is
    deleted its names stay known: the next merge counts them as ours, publishing may delete them. What was
    known before."""
    known = written_names(store) or set()
    record = {"tool": {"name": "merge_pipeline"}, "files": sorted(known | names)}
    guard()
    store.fs.pipe_file(store.path + PUBLISHING, json.dumps(record).encode())
    return known


def delete_stale(store: StoreLocation, written: set[str], kept: set[str], guard: Callable[[], None]) -> None:
    """After the manifest: the objects an earlier merge wrote (``written``, listed now) that the new folder
    lacks are deleted, then the record; an object no merge wrote is never deleted."""
    stale = sorted(written - kept)
    guard()
    if stale:
        store.fs.rm([store.key(r) for r in stale])
    store.fs.rm_file(store.path + PUBLISHING)
