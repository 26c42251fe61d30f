"""JSON files of a checkpoint (configs, indexes, metadata): read, or fail with one line naming the file."""

from __future__ import annotations

import json
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.files.inputs import read_capped

# Larger than any config, index or metadata a checkpoint holds (a 1T-parameter model's
# model.safetensors.index.json is ~10 MB); a file past it is no such file, and reading it whole would cost
# several times its size in memory.
MAX_JSON_BYTES = 64 * 10**6


def read_json_object(path: Path, *, inside: Path | None = None) -> dict:
    """The JSON object in ``path``; with ``inside``, refused unless the file lies inside that folder."""
    text = read_capped(
        path,
        MAX_JSON_BYTES,
        f"is larger than {MAX_JSON_BYTES // 10**6} MB: too large for a JSON config or index",
        inside=inside,
    )
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise MergeError(path, f"not valid JSON ({exc})") from None
    except RecursionError:  # the decoder recurses once per nesting level
        raise MergeError(path, "JSON nested too deeply to be a config") from None
    if not isinstance(data, dict):
        raise MergeError(path, f"expected a JSON object, found {type(data).__name__}")
    return data
