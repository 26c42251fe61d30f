"""JSON files of a checkpoint (configs, indexes, metadata): read, or fail with one line naming the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.input_files import open_regular


def read_json_object(path: Path) -> dict:
    with os.fdopen(open_regular(path), "rb") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise MergeError(path, f"not valid JSON ({exc})") from None
    except RecursionError:  # the decoder recurses once per nesting level
        raise MergeError(path, "JSON nested too deeply to be a config") from None
    if not isinstance(data, dict):
        raise MergeError(path, f"expected a JSON object, found {type(data).__name__}")
    return data
