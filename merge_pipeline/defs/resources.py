"""Where checkpoints are watched and where merged folders land: one resource, read from the environment.

``MERGE_PIPELINE_CHECKPOINT_ROOTS``  watched folders, os.pathsep-separated (default ``./demo/checkpoints``)
``MERGE_PIPELINE_OUTPUT_ROOT``       merged folders land in ``<root>/<run_name>/global_step_<N>/<role>/``
                                     (default ``./demo/merged``)
``MERGE_PIPELINE_SETTLE_SECONDS``    a step without the trainer's tracker file counts as complete once
                                     no file under it changed for this long (default 60)
Relative paths resolve against the directory Dagster was started from.
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
from pydantic import Field

from merge_pipeline.defs.discovery import Scan, locate, scan_roots
from merge_pipeline.defs.partitions import CheckpointKey

RECORDS = ".records"  # under the output root: what each asset found, for the next one


class MergeSettings(dg.ConfigurableResource):
    checkpoint_roots: list[str] = Field(description="folders watched for global_step_<N>/<role> checkpoints")
    output_root: str = Field(description="merged HF folders land in <output_root>/<run_name>/global_step_<N>/<role>/")
    settle_seconds: float = Field(default=60.0, description="without the trainer's tracker file, a step is complete once no file under it changed for this long")

    @classmethod
    def from_env(cls) -> MergeSettings:
        roots = os.environ.get("MERGE_PIPELINE_CHECKPOINT_ROOTS", "demo/checkpoints")
        return cls(
            checkpoint_roots=[str(Path(r).absolute()) for r in roots.split(os.pathsep) if r],
            output_root=str(Path(os.environ.get("MERGE_PIPELINE_OUTPUT_ROOT", "demo/merged")).absolute()),
            settle_seconds=float(os.environ.get("MERGE_PIPELINE_SETTLE_SECONDS", "60")),
        )

    @property
    def roots(self) -> list[Path]:
        return [Path(r) for r in self.checkpoint_roots]

    def find_checkpoints(self) -> Scan:
        """Every role folder under every root, and what could not be watched."""
        return scan_roots(self.roots, Path(self.output_root))

    def role_dir(self, key: CheckpointKey) -> Path:
        return locate(key, self.roots)

    def target_dir(self, key: CheckpointKey) -> Path:
        return Path(self.output_root) / key.path

    def records_dir(self, key: CheckpointKey) -> Path:
        return Path(self.output_root) / RECORDS / key.path


defs = dg.Definitions(resources={"settings": MergeSettings.from_env()})
