"""Turn engine facts into metadata a person reads in the Dagster UI."""

from __future__ import annotations

import json
from collections.abc import Mapping

import dagster as dg

from merge_pipeline.progress import human_bytes


def value(v: object) -> dg.MetadataValue:
    """bool/int/float/str as themselves; lists and dicts as readable JSON."""
    if isinstance(v, bool):
        return dg.MetadataValue.bool(v)
    if isinstance(v, int):
        return dg.MetadataValue.int(v)
    if isinstance(v, float):
        return dg.MetadataValue.float(v)
    if v is None or isinstance(v, str):
        return dg.MetadataValue.text(str(v))
    return dg.MetadataValue.text(json.dumps(v))


SHA256_SHOWN = 16  # hex digits: as git's short hashes, enough to tell files apart at a glance


def sha256_table(files: Mapping[str, Mapping[str, object]]) -> dg.MetadataValue:
    """The manifest's files as a Markdown table, each sha256 cut to its first digits: the whole 64 made the
    table wider than the asset page's metadata column at 1600 px, which then clipped every value in it.
    The whole digests are in the manifest, whose path is the ``manifest`` entry beside this one."""
    rows = [
        f"| {name} | {human_bytes(int(f['size']))} | `{str(f['sha256'])[:SHA256_SHOWN]}…` |"
        for name, f in files.items()
    ]
    return dg.MetadataValue.md("\n".join(["| file | size | sha256 (start) |", "|---|---:|---|", *rows]))
