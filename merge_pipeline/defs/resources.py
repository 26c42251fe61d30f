"""Where checkpoints are watched and where merged folders land: the ``settings`` resource.

A field left unset is read from the environment when a run or a sensor tick uses it (``dg.EnvVar``;
``dagster dev`` and ``dg dev`` load ``.env`` from the project root first, see ``.env.example``):

``MERGE_PIPELINE_CHECKPOINT_ROOTS``  watched folders, os.pathsep-separated (default ``./demo/checkpoints``)
``MERGE_PIPELINE_OUTPUT_ROOT``       merged folders land in ``<root>/<partition key>/`` (e.g. ``<run_name>/global_step_<N>/<role>/``)
                                     (default ``./demo/merged``)
``MERGE_PIPELINE_SETTLE_SECONDS``    a step without the trainer's tracker file counts as complete once
                                     no file under it changed for this long (default 60)
``MERGE_PIPELINE_HF_MODEL_PATH``     the original HF model folder, for checkpoints that hold no config
                                     (torchtitan, accelerate, NeMo-RL, OpenRLHF's DeepSpeed, verl's
                                     dist_ckpt without HF files), when the run config names none
Relative paths resolve against the directory Dagster was started from.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
from pydantic import Field

from merge_pipeline.defs.partitions import CheckpointKey

# discovery imports the pipeline, which imports torch: sensor ticks and runs import it, the location's load does not
if TYPE_CHECKING:
    from merge_pipeline.defs.discovery import Scan

ROOTS_VAR, OUTPUT_VAR, SETTLE_VAR, HF_MODEL_VAR = (
    "MERGE_PIPELINE_CHECKPOINT_ROOTS",
    "MERGE_PIPELINE_OUTPUT_ROOT",
    "MERGE_PIPELINE_SETTLE_SECONDS",
    "MERGE_PIPELINE_HF_MODEL_PATH",
)


class MergeSettings(dg.ConfigurableResource):
    checkpoint_roots: list[str] | None = Field(
        default=None,
        description=f"folders watched for checkpoints (verl global_step_<N>/<role>, DeepSpeed global_step<N>, torchtitan step-<N>, checkpoint-<N>, NeMo-RL step_<N>/policy); unset: ${ROOTS_VAR}, else ./demo/checkpoints",
    )
    output_root: str | None = Field(
        default=None,
        description=f"merged HF folders land in <output_root>/<partition key>/ (e.g. <run_name>/global_step_<N>/<role>/); unset: ${OUTPUT_VAR}, else ./demo/merged",
    )
    settle_seconds: float | None = Field(
        default=None,
        description=f"without the trainer's tracker file, a step is complete once no file under it changed for this long; unset: ${SETTLE_VAR}, else 60",
    )
    hf_model_path: str | None = Field(
        default=None,
        description=f"the original HF model folder for checkpoints that hold no config (torchtitan, accelerate, NeMo-RL, OpenRLHF's DeepSpeed), so the sensor's runs merge them; a run config's hf_model_path wins; unset: ${HF_MODEL_VAR}, else none",
    )

    @property
    def roots(self) -> list[Path]:
        roots = (
            self.checkpoint_roots
            if self.checkpoint_roots is not None
            else dg.EnvVar(ROOTS_VAR).get_value("demo/checkpoints").split(os.pathsep)
        )
        return [Path(r).absolute() for r in roots if r]

    @property
    def output_dir(self) -> Path:
        return Path(
            self.output_root if self.output_root is not None else dg.EnvVar(OUTPUT_VAR).get_value("demo/merged")
        ).absolute()

    @property
    def settle_time(self) -> float:
        return self.settle_seconds if self.settle_seconds is not None else float(dg.EnvVar(SETTLE_VAR).get_value("60"))

    @property
    def base_model_dir(self) -> str | None:
        return self.hf_model_path if self.hf_model_path is not None else dg.EnvVar(HF_MODEL_VAR).get_value() or None

    def find_checkpoints(self) -> Scan:
        """Every role folder under every root, and what could not be watched."""
        from merge_pipeline.defs.discovery import scan_roots

        return scan_roots(self.roots, self.output_dir)

    def role_dir(self, key: CheckpointKey) -> Path:
        from merge_pipeline.defs.discovery import locate

        return locate(key, self.roots)

    def target_dir(self, key: CheckpointKey) -> Path:
        return self.output_dir / key.path


defs = dg.Definitions(resources={"settings": MergeSettings()})
