"""What the instance recorded for a partition: its latest materialization of an asset."""

from __future__ import annotations

import dagster as dg


def latest_materialization(
    instance: dg.DagsterInstance, asset_key: dg.AssetKey, partition: str
) -> dg.EventLogRecord | None:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key, asset_partitions=[partition]), limit=1
    ).records
    return records[0] if records else None
