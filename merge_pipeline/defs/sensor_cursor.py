"""``new_checkpoint_sensor``'s cursor: the keys it is done with, and what its last tick did, in words.

The sensor's page in the UI prints the cursor as it is, next to the latest tick (whose skip reason
shows only on hover): so the cursor leads with the tick's summary. A cursor of this shape (JSON with
a ``__class__``) is shown as ``name=value`` pairs, ``last tick=waiting for 1 partial checkpoint(s):
...,keys=...``. A cursor written before it had a summary (a plain list of keys) still reads.
"""

from __future__ import annotations

import json
from collections.abc import Collection

SUMMARY_CHARS = 300  # the page shows the whole cursor in one cell: the keys follow the summary


def cursor_keys(cursor: str | None) -> set[str]:
    """The partition keys the sensor requested before or found already merged."""
    if not cursor:
        return set()
    state = json.loads(cursor)
    return set(state["keys"] if isinstance(state, dict) else state)


def sensor_cursor(keys: Collection[str], summary: str) -> str:
    summary = summary if len(summary) <= SUMMARY_CHARS else summary[: SUMMARY_CHARS - 3] + "..."
    return json.dumps({"__class__": "NewCheckpointCursor", "last tick": summary, "keys": sorted(keys)})
