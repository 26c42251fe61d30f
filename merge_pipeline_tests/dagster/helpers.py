"""Helpers for the Dagster tests: temp watched roots, real checkpoints dropped into them, and the chain materialized."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import dagster as dg

from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.definitions import location
from merge_pipeline.formats.step_folders import TRACKER
from merge_pipeline.watch.keys import PASSED
from merge_pipeline.watch.partitions import checkpoint_key
from merge_pipeline_samples.fsdp import FsdpSpec

PROJECT_ROOT = Path(__file__).resolve().parents[2]


LOCATION = (
    location()
)  # the definitions the tests take by name, as the code location serves them (built afresh: location())


def asset(key: str) -> dg.AssetsDefinition | dg.AssetSpec:
    """The location's definition of asset ``key`` as declared, no resources bound (``resolve_assets_def``
    binds the location's): the tests run it with their own ``settings``."""
    wanted = dg.AssetKey(key)
    return next(a for a in LOCATION.assets if wanted in (a.keys if isinstance(a, dg.AssetsDefinition) else {a.key}))


ACTOR = FsdpSpec()  # FSDP2, world size 2: the spec the engine tests use too, so a session writes it once
CRITIC = FsdpSpec(arch="llama", critic=True)
# the external checkpoint, and the merge step (its three stages: parallel_config, state_dict, hf_model)
CHAIN = [asset("checkpoint"), asset("hf_model")]


@dataclass
class Roots:
    checkpoints: Path
    output: Path

    def settings(self, settle_seconds: float = 60.0, **fields) -> MergeSettings:
        return MergeSettings(
            checkpoint_roots=[str(self.checkpoints)],
            output_root=str(self.output),
            settle_seconds=settle_seconds,
            **fields,
        )

    def target(self, key: str) -> Path:
        return self.settings().target_dir(checkpoint_key(key))

    def drop(self, sample, step_dir: str, *, tracker: int | None = None, link: bool = False) -> Path:
        """Put a real checkpoint's role folder at ``<checkpoints>/<step_dir>/<role>``, as a trainer would.

        ``tracker``: then write the trainer's latest_checkpointed_iteration.txt beside the step, last.
        ``link``: hard links instead of copies (many steps at no disk cost; never write to them).
        """
        role_dir = self.checkpoints / step_dir / sample.role_dir.name
        shutil.copytree(
            sample.role_dir, role_dir, copy_function=os.link if link else shutil.copy
        )  # fresh mtimes, as if just saved
        if tracker is not None:
            self.track(role_dir, tracker)
        return role_dir

    def track(self, role_dir: Path, step: int) -> None:
        """Write the trainer's latest_checkpointed_iteration.txt beside ``role_dir``'s step, as verl does once
        every role of the step is saved: it vouches only for files written before it."""
        (role_dir.parent.parent / TRACKER).write_text(str(step))


def materialize(
    instance, settings: MergeSettings, key: str, *, merge_config: dict | None = None, selection=CHAIN, tags=None
) -> dg.ExecuteInProcessResult:
    """Run the merge chain (and its checks) for one partition, as the merge job does; failures are returned.
    ``tags``: the run's, e.g. those the daemon gives a sensor's run (its run key)."""
    instance.add_dynamic_partitions("checkpoints", [key])
    run_config = {"ops": {"hf_model": {"config": merge_config}}} if merge_config else None
    return dg.materialize(
        selection,
        partition_key=key,
        instance=instance,
        resources={"settings": settings},
        run_config=run_config,
        raise_on_error=False,
        tags=tags,
    )


def checks_passed(result: dg.ExecuteInProcessResult) -> list[str]:
    """The blocking checks the folder passed before it was published, as hf_model's materialization lists them."""
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key.path[-1] == "hf_model"]
    return event.materialization.metadata[PASSED].value
