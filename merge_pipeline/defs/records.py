"""Small JSON records an asset leaves for the next one: ``<output_root>/.records/<partition key>/<asset>.json``.

Large data never goes through Dagster: an asset's real output is files on disk, and its record says
where they are and what they hold.
"""

from __future__ import annotations

import json
from pathlib import Path

from merge_pipeline.defs.partitions import CheckpointKey
from merge_pipeline.defs.resources import MergeSettings
from merge_pipeline.errors import MergeError


def record_path(settings: MergeSettings, key: CheckpointKey, asset: str) -> Path:
    return settings.records_dir(key) / f"{asset}.json"


def write_record(settings: MergeSettings, key: CheckpointKey, asset: str, data: dict) -> Path:
    path = record_path(settings, key, asset)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    partial.replace(path)  # a reader never sees half a record
    return path


def read_record(settings: MergeSettings, key: CheckpointKey, asset: str) -> dict:
    path = record_path(settings, key, asset)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise MergeError(path, f"not found: materialize {asset} for {key} first") from None


def drop_record(settings: MergeSettings, key: CheckpointKey, asset: str) -> None:
    record_path(settings, key, asset).unlink(missing_ok=True)
