"""Where checkpoints are watched and where merged folders land: the ``settings`` resource.

A field left unset is read from the environment when a run or a sensor tick uses it (``dg.EnvVar``;
``dagster dev`` and ``dg dev`` load ``.env`` from the project root first, see ``.env.example``):

``MERGE_PIPELINE_CHECKPOINT_ROOTS``  watched folders or store prefixes (``s3://bucket/prefix``), os.pathsep-separated (default ``./demo/checkpoints``)
``MERGE_PIPELINE_OUTPUT_ROOT``       (a folder or a store prefix) merged folders land in ``<root>/<partition key>/`` (e.g. ``<run_name>/global_step_<N>/<role>/``)
                                     (default ``./demo/merged``)
``MERGE_PIPELINE_SETTLE_SECONDS``    a step without the trainer's tracker file counts as complete once
                                     no file under it changed for this long (default 60)
``MERGE_PIPELINE_HF_MODEL_PATH``     the original HF model folder, for checkpoints that hold no config
                                     (torchtitan, accelerate, NeMo-RL, OpenRLHF's DeepSpeed, verl's
                                     dist_ckpt without HF files), when the run config names none
``MERGE_PIPELINE_PIN_STEPS``, ``MERGE_PIPELINE_PIN_ROOT``   hard-link a complete step until its merge is done (``pins``)
``MERGE_PIPELINE_SMOKE_TEST``, ``_PROMPT``, ``_MAX_SIZE``  the smoke test after a merge (``report``)
Relative paths resolve against the directory Dagster was started from.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
from pydantic import Field, model_validator

from merge_pipeline.dagster.numeric_settings import SETTLE
from merge_pipeline.dagster.partitions import CheckpointKey
from merge_pipeline.dagster.pins import PINS, PinSpace, verified_pin
from merge_pipeline.hf.smoke_test import DEFAULT_PROMPT
from merge_pipeline.options import parse_size
from merge_pipeline.storage import is_store_url
from merge_pipeline.store_listing import StoreURL

# discovery imports the pipeline, which imports torch: sensor ticks and runs import it, the location's load does not
if TYPE_CHECKING:
    from merge_pipeline.dagster.discovery import Scan

ROOTS_VAR, OUTPUT_VAR, HF_MODEL_VAR = (
    "MERGE_PIPELINE_CHECKPOINT_ROOTS",
    "MERGE_PIPELINE_OUTPUT_ROOT",
    "MERGE_PIPELINE_HF_MODEL_PATH",
)
PIN_VAR, PIN_ROOT_VAR = "MERGE_PIPELINE_PIN_STEPS", "MERGE_PIPELINE_PIN_ROOT"
SMOKE_VAR, SMOKE_PROMPT_VAR, SMOKE_LIMIT_VAR = (
    "MERGE_PIPELINE_SMOKE_TEST",
    "MERGE_PIPELINE_SMOKE_PROMPT",
    "MERGE_PIPELINE_SMOKE_MAX_SIZE",
)
SMOKE_MAX_SIZE = "2GB"  # the model is loaded whole, on CPU, in the run's process: a 1B bf16 model fits


class MergeSettings(dg.ConfigurableResource):
    checkpoint_roots: list[str] | None = Field(
        default=None,
        description=f"folders watched for checkpoints (verl global_step_<N>/<role>, DeepSpeed global_step<N>, torchtitan step-<N>, checkpoint-<N>, NeMo-RL step_<N>/policy, Megatron-LM iter_<N>); unset: ${ROOTS_VAR}, else ./demo/checkpoints",
    )
    output_root: str | None = Field(
        default=None,
        description=f"merged HF folders land in <output_root>/<partition key>/ (e.g. <run_name>/global_step_<N>/<role>/); unset: ${OUTPUT_VAR}, else ./demo/merged",
    )
    settle_seconds: float | None = Field(
        default=None,
        description=f"without the trainer's tracker file, a step is complete once no file under it changed for this long; unset: ${SETTLE.variable}, else {SETTLE.default:g}",
    )
    hf_model_path: str | None = Field(
        default=None,
        description=f"the original HF model folder for checkpoints that hold no config (torchtitan, accelerate, NeMo-RL, Megatron-LM, OpenRLHF's DeepSpeed), so the sensor's runs merge them; a run config's hf_model_path wins; unset: ${HF_MODEL_VAR}, else none",
    )

    pin_steps: bool | None = Field(
        default=None,
        description=f"hard-link a complete step into a pin folder when its merge is requested, so the trainer's rotation cannot delete it before it is merged; the pin is removed once published or failed; unset: ${PIN_VAR} (1/true), else off",
    )
    pin_root: str | None = Field(
        default=None,
        description=f"where pins lie: a folder of this user's (made 0700 if absent; each deployment's pins in a 0700 folder of their own), on the checkpoints' filesystem (hard links do not cross filesystems); unset: ${PIN_ROOT_VAR}, else <checkpoint root>/{PINS}",
    )

    smoke_test: bool | None = Field(
        default=None,
        description=f"after the merge, load the folder with transformers on CPU, greedy-generate a few tokens for smoke_prompt and measure the loss on a short fixed text (step_report and the model card); unset: ${SMOKE_VAR} (1/true), else off",
    )
    smoke_prompt: str | None = Field(
        default=None, description=f"the smoke test's prompt; unset: ${SMOKE_PROMPT_VAR}, else {DEFAULT_PROMPT!r}"
    )
    smoke_max_size: str | None = Field(
        default=None,
        description=f"folders with more weight bytes than this skip the smoke test (loaded whole); unset: ${SMOKE_LIMIT_VAR}, else {SMOKE_MAX_SIZE}",
    )

    @model_validator(mode="after")
    def _numbers_checked(self) -> MergeSettings:
        """The settle time and the smoke test's size limit, the fields' or the environment's, checked
        when the settings are made (the location's load): a bad value is one line there, not a
        traceback in every tick or a failure after each merge."""
        SETTLE.of(self.settle_seconds)
        _ = self.smoke_limit_bytes  # read for its check
        return self

    @property
    def roots(self) -> list[Path | StoreURL]:
        roots = (
            self.checkpoint_roots
            if self.checkpoint_roots is not None
            else _split_roots(dg.EnvVar(ROOTS_VAR).get_value("demo/checkpoints"))
        )
        return [_folder_or_url(r) for r in roots if r]

    @property
    def output_dir(self) -> Path | StoreURL:
        return _folder_or_url(
            self.output_root if self.output_root is not None else dg.EnvVar(OUTPUT_VAR).get_value("demo/merged")
        )

    @property
    def settle_time(self) -> float:
        return SETTLE.of(self.settle_seconds)

    @property
    def base_model_dir(self) -> str | None:
        return self.hf_model_path if self.hf_model_path is not None else dg.EnvVar(HF_MODEL_VAR).get_value() or None

    @property
    def pins_on(self) -> bool:
        return self.pin_steps if self.pin_steps is not None else _switched_on(PIN_VAR)

    @property
    def smoke_on(self) -> bool:
        return self.smoke_test if self.smoke_test is not None else _switched_on(SMOKE_VAR)

    @property
    def smoke_question(self) -> str:
        return (
            self.smoke_prompt
            if self.smoke_prompt is not None
            else dg.EnvVar(SMOKE_PROMPT_VAR).get_value(DEFAULT_PROMPT)
        )

    @property
    def smoke_limit_bytes(self) -> int:
        if self.smoke_max_size is not None:
            return parse_size(self.smoke_max_size, "smoke_max_size")
        return parse_size(dg.EnvVar(SMOKE_LIMIT_VAR).get_value(SMOKE_MAX_SIZE), SMOKE_LIMIT_VAR)

    @property
    def pin_spaces(self) -> list[PinSpace]:
        """This deployment's pins in each pin root (the setting, else one per checkpoint root): named by
        its output root, so two deployments watching one root keep their own."""
        chosen = self.pin_root if self.pin_root is not None else dg.EnvVar(PIN_ROOT_VAR).get_value()
        roots = [Path(chosen).absolute()] if chosen else [root / PINS for root in self.roots if isinstance(root, Path)]
        return [PinSpace.of(root, self.output_dir) for root in roots]

    def pin_space_of(self, role_dir: Path) -> PinSpace:
        """Where a checkpoint folder is pinned: the setting, else beside it in its own checkpoint root."""
        spaces = self.pin_spaces
        return spaces[0] if len(spaces) == 1 else next(s for s in spaces if role_dir.is_relative_to(s.root.parent))

    def pinned(self, key: CheckpointKey) -> tuple[PinSpace, Path] | None:
        """(this deployment's pins, the pinned folder) of ``key``, when pinned by it and still holding the
        files recorded then (``pins.verified_pin``); ``unpin(space, key)`` removes it."""
        return next(((s, folder) for s in self.pin_spaces if (folder := verified_pin(s, key)) is not None), None)

    def find_checkpoints(self) -> Scan:
        """Every role folder under every root, and what could not be watched."""
        from merge_pipeline.dagster.discovery import scan_roots

        return scan_roots(self.roots, self.output_dir)

    def role_dir(self, key: CheckpointKey) -> Path:
        from merge_pipeline.dagster.discovery import locate

        return locate(key, self.roots)

    def target_dir(self, key: CheckpointKey) -> Path:
        return self.output_dir / key.path


def _split_roots(setting: str) -> list[str]:
    """os.pathsep-separated roots, where a URL's own ``:`` (``s3://bucket/prefix``) separates nothing."""
    roots: list[str] = []
    for part in setting.split(os.pathsep):
        if roots and part.startswith("//") and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", roots[-1]):
            roots[-1] += os.pathsep + part
        else:
            roots.append(part)
    return roots


def _folder_or_url(setting: str) -> Path | StoreURL:
    """``s3://bucket/prefix`` (any fsspec URL) as a store prefix, anything else as a local folder."""
    return StoreURL(setting) if is_store_url(setting) else Path(setting).absolute()


def _switched_on(variable: str) -> bool:
    return dg.EnvVar(variable).get_value("0").lower() in ("1", "true", "yes")
