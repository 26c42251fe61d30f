"""``new_checkpoint_sensor``'s cursor: the keys it is done with, each with its step's state then,
and what its last tick did, in words.

The state is the step's newest change when its merge was requested: a step whose merge failed is
requested again once that changes (the trainer finished the save a too-early merge read). The
sensor's page in the UI prints the cursor as it is, next to the latest tick (whose skip reason shows
only on hover): so the cursor leads with the tick's summary. A cursor of this shape (JSON with a
``__class__``) is shown as ``name=value`` pairs, ``last tick=waiting for 1 partial checkpoint(s):
...,keys=...``. A cursor written before it had states (a list of keys, alone or under ``keys``)
still reads: its keys' states are unknown (None).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

SUMMARY_CHARS = 300  # the page shows the whole cursor in one cell: the keys follow the summary


def cursor_keys(cursor: str | None) -> dict[str, float | None]:
    """The partition keys the sensor requested before or found already merged, each with the newest
    change of its step when requested (None: found merged, or recorded by an older cursor)."""
    if not cursor:
        return {}
    state = json.loads(cursor)
    keys = state["keys"] if isinstance(state, dict) else state
    return dict(keys) if isinstance(keys, dict) else dict.fromkeys(keys)


def sensor_cursor(keys: Mapping[str, float | None], summary: str) -> str:
    summary = summary if len(summary) <= SUMMARY_CHARS else summary[: SUMMARY_CHARS - 3] + "..."
    return json.dumps({"__class__": "NewCheckpointCursor", "last tick": summary, "keys": dict(sorted(keys.items()))})
