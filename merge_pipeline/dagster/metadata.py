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


def sha256_table(files: Mapping[str, Mapping[str, object]]) -> dg.MetadataValue:
    """The manifest's files as a Markdown table: a table cell cuts a 64-digit sha256 short, a code span keeps it whole."""
    rows = [f"| {name} | {human_bytes(int(f['size']))} | `{f['sha256']}` |" for name, f in files.items()]
    return dg.MetadataValue.md("\n".join(["| file | size | sha256 |", "|---|---:|---|", *rows]))
