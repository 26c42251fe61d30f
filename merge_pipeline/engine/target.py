"""What a merge writes to, named once: a local folder, or a store prefix whose folder is built first in a
local twin (the same lock, staging, resume and checks as a local target), then uploaded; and every rule on
it (``store.target_rules``, ``engine.publish``) checked by one call, before any work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from merge_pipeline.engine.publish import check_target
from merge_pipeline.store.object_upload import local_twin
from merge_pipeline.store.target_rules import check_store_target, refuse_overlap
from merge_pipeline.store.url import store_prefix


@dataclass(frozen=True)
class MergeTarget:
    folder: Path  # where the folder is built and published on this machine: the target, or a store's twin
    store: str | None  # the store prefix it is uploaded to (no trailing ``/``); None for a local target
    overwrite: bool  # --overwrite

    @classmethod
    def of(cls, target_dir: str | Path, *, overwrite: bool) -> MergeTarget:
        store = store_prefix(target_dir)
        return cls(local_twin(store) if store else Path(target_dir).absolute(), store, overwrite)

    @property
    def named(self) -> str | Path:
        """The target as the user knows it: the store URL, or the folder."""
        return self.store or self.folder

    @property
    def folder_replaced(self) -> bool:
        """Whether an existing ``folder`` may be replaced: the twin is ours; the store's target is checked."""
        return self.overwrite or self.store is not None

    def check(self, inputs: Sequence[str | Path]) -> None:
        """Refuse, before any work, a target that is, lies inside or contains an input (``inputs[0]`` the
        checkpoint), a prefix holding objects this tool did not write, a folder that may not be replaced."""
        refuse_overlap(self.named, inputs)
        if self.store:
            check_store_target(self.store, overwrite=self.overwrite)
        check_target(self.folder, source=inputs[0], overwrite=self.folder_replaced)
