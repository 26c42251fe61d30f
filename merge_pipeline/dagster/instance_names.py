"""The names one merge instance takes in a Dagster project: asset keys, partitions, job / sensor /
schedule / op names, resource keys and groups.

This project's own code location is the unprefixed instance (``Names()``: ``hf_model``,
``merge_checkpoint``, ``settings``, partitions ``checkpoints``). Each ``MergeCheckpoints`` component
in another project has its own prefix, so two instances (two training clusters) in one project share
no asset, partition set, sensor or resource: one sensor's rotation never deletes the other's partitions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import dagster as dg

PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # an asset key part, job name and resource key at once


@dataclass(frozen=True)
class Names:
    prefix: str = ""

    def __post_init__(self) -> None:
        if self.prefix and not PREFIX.fullmatch(self.prefix):
            raise ValueError(f"prefix {self.prefix!r}: use letters, digits and underscores (not first a digit)")

    def key(self, name: str) -> dg.AssetKey:
        return dg.AssetKey([self.prefix, name] if self.prefix else [name])

    def __call__(self, name: str) -> str:
        """A job, sensor, schedule, op, resource or group name of this instance."""
        return f"{self.prefix}__{name}" if self.prefix else name

    @property
    def partitions(self) -> dg.DynamicPartitionsDefinition:
        # The instance stores dynamic partitions by name: equal names are one set.
        return dg.DynamicPartitionsDefinition(name=self("checkpoints"))
