"""Where checkpoints are watched and where merged folders land: the ``settings`` resource.

Its fields are the run-time settings of ``settings.py`` (one declaration each: name, variable, default,
help, check). A field left unset is read from its environment variable when a run or a sensor tick
uses it (``value``; ``dagster dev`` and ``dg dev`` load ``.env`` from the project root first, see
``.env.example``). Relative paths resolve against the directory Dagster was started from.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
from pydantic import model_validator

from merge_pipeline.checkpoint_name import CheckpointName
from merge_pipeline.dagster.pins import PinSpace, verified_pin
from merge_pipeline.settings import Setting, T
from merge_pipeline.store.listing import StoreURL
from merge_pipeline.watch.keys import PINS
from merge_pipeline.watch.location_settings import (
    CHECKPOINT_ROOTS,
    OUTPUT_ROOT,
    PIN_ROOT,
    of_resource,
    with_fields,
)

# discovery imports the pipeline, which imports torch: sensor ticks and runs import it, the location's load does not
if TYPE_CHECKING:
    from merge_pipeline.watch.discovery import Scan

SETTINGS = of_resource("settings")


class MergeSettings(with_fields(dg.ConfigurableResource, SETTINGS)):
    @model_validator(mode="after")
    def _values_checked(self) -> MergeSettings:
        """The settle time and the smoke test's size limit, the fields' or the environment's, checked
        when the settings are made (the location's load): a bad value is one line there, not a
        traceback in every tick or a failure after each merge."""
        for setting in SETTINGS:
            if setting.kind.checked_at_load:
                self.value(setting)
        return self

    def value(self, setting: Setting[T]) -> T:
        """``setting`` as the code uses it (paths absolute, sizes in bytes): the field's, else
        its variable's now, else the default."""
        return setting.value(getattr(self, setting.name))

    @property
    def pin_spaces(self) -> list[PinSpace]:
        """This deployment's pins in each pin root (the setting, else one per checkpoint root): named by
        its output root, so two deployments watching one root keep their own."""
        chosen = self.value(PIN_ROOT)
        roots = [chosen] if chosen else [root / PINS for root in self.value(CHECKPOINT_ROOTS) if isinstance(root, Path)]
        return [PinSpace.of(root, self.value(OUTPUT_ROOT)) for root in roots]

    def pin_space_of(self, role_dir: Path) -> PinSpace:
        """Where a checkpoint folder is pinned: the setting, else beside it in its own checkpoint root."""
        spaces = self.pin_spaces
        return spaces[0] if len(spaces) == 1 else next(s for s in spaces if role_dir.is_relative_to(s.root.parent))

    def pinned(self, key: CheckpointName) -> tuple[PinSpace, Path] | None:
        """(this deployment's pins, the pinned folder) of ``key``, when pinned by it and still holding the
        files recorded then (``pins.verified_pin``); ``unpin(space, key)`` removes it."""
        return next(((s, folder) for s in self.pin_spaces if (folder := verified_pin(s, key)) is not None), None)

    def find_checkpoints(self) -> Scan:
        """Every role folder under every root, and what could not be watched."""
        from merge_pipeline.watch.discovery import scan_roots

        return scan_roots(self.value(CHECKPOINT_ROOTS), self.value(OUTPUT_ROOT))

    def role_dir(self, key: CheckpointName) -> Path:
        from merge_pipeline.watch.discovery import locate

        return locate(key, self.value(CHECKPOINT_ROOTS))

    def target_dir(self, key: CheckpointName) -> Path | StoreURL:
        return self.value(OUTPUT_ROOT) / key.path
