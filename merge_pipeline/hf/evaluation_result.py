"""An evaluation's result in a merged folder: its metrics in ``merge_manifest.json`` (key ``evaluation``), and
the threshold a metric must meet.

The manifest lists every other file of the folder with its sha256 and is not listed itself, so the result
written into it leaves the folder consistent with its manifest; the model card's ``model-index`` is read
from it (``model_card``), so the card stays a function of the manifest.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.hf.manifest import MANIFEST, read_manifest

EVALUATION = "evaluation"  # the manifest's key
_THRESHOLD = re.compile(r"\s*(?P<metric>.+?)\s*(?P<op><=|>=)\s*(?P<bound>\S+)\s*")


@dataclass(frozen=True)
class Threshold:
    """``<metric> <= <bound>`` (a maximum, e.g. a loss) or ``<metric> >= <bound>`` (a minimum, e.g. an accuracy)."""

    metric: str
    op: str
    bound: float

    @classmethod
    def parse(cls, text: str, named: str) -> Threshold:
        found = _THRESHOLD.fullmatch(text)
        try:
            bound = float(found["bound"]) if found else math.nan
        except ValueError:
            bound = math.nan
        if not found or not math.isfinite(bound):
            raise MergeError(None, f"{named} is {text!r}: expected '<metric> <= <number>' or '<metric> >= <number>'")
        return cls(found["metric"], found["op"], bound)

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.bound:g}"

    def problem(self, metrics: dict[str, float]) -> str | None:
        """None when the metrics meet it, else why not (one line)."""
        if self.metric not in metrics:
            return f"the evaluation reported no {self.metric!r} (it reported: {', '.join(metrics) or 'nothing'})"
        value = metrics[self.metric]
        if value <= self.bound if self.op == "<=" else value >= self.bound:
            return None
        return f"{self.metric} is {value:g}: expected {self.op} {self.bound:g}"


_BEST_BY = re.compile(r"\s*(?P<metric>.+?)\s+(?P<way>max|min)\s*")


@dataclass(frozen=True)
class BestBy:
    """``<metric> max`` (the highest value is best, e.g. an accuracy) or ``<metric> min`` (e.g. a loss)."""

    metric: str
    way: str

    @classmethod
    def parse(cls, text: str, named: str) -> BestBy:
        found = _BEST_BY.fullmatch(text)
        if not found:
            raise MergeError(None, f"{named} is {text!r}: expected '<metric> max' or '<metric> min'")
        return cls(found["metric"], found["way"])

    def __str__(self) -> str:
        return f"{self.metric} {self.way}"

    def rank(self, value: float) -> float:
        """Higher is better, whichever way the metric goes."""
        return value if self.way == "max" else -value


def record_in_manifest(folder: Path, command: str, metrics: dict[str, float], evaluated: dict) -> None:
    """The metrics under the manifest's ``evaluation`` key, replacing the file at once (a reader sees the
    old manifest or the new one, never half of one). ``evaluated``: the manifest when the evaluation began;
    a folder merged again since is refused (its new weights were not the ones evaluated). The caller holds
    the folder's lock."""
    manifest = read_manifest(folder)
    if _without_evaluation(manifest) != _without_evaluation(evaluated):
        raise MergeError(folder, "was merged again while it was evaluated: evaluate it again")
    manifest[EVALUATION] = {"command": command, "metrics": metrics}
    written = folder / f".{MANIFEST}.evaluation"
    written.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(written, folder / MANIFEST)


def _without_evaluation(manifest: dict) -> dict:
    return {key: value for key, value in manifest.items() if key != EVALUATION}
