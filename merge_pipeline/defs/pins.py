"""Keep a complete step alive until its merge is done (``pin_steps``, off by default).

A trainer's rotation (verl's ``max_ckpt_to_keep``) may delete a complete step while its merge waits
in the queue. With pinning on, the sensor hard-links every file of the checkpoint folder into
``<pin root>/<partition key>/`` the moment it requests the merge; the merge reads that pinned copy
and removes it once the step is published or failed. A hard link costs no bytes and outlives the
trainer's delete of the original. Hard links cannot cross filesystems: there the step is not pinned
(a warning, never a copy of the bytes). The pin root is ``<checkpoint root>/.merge_pins`` (hidden, so
the sensor's scan never enters it), or the ``pin_root`` setting.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from urllib.parse import quote, unquote

import dagster as dg

from merge_pipeline.defs.partitions import CheckpointKey
from merge_pipeline.errors import MergeError, printable

PINS = ".merge_pins"
PARTITION_TAG = "dagster/partition"
PIN_GRACE_SECONDS = 120  # a run requested by a tick exists by the next one; this much more is for a busy daemon
ACTIVE_RUNS = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]


def pin_path(pin_root: Path, key: CheckpointKey) -> Path:
    """Where ``key``'s pin lies: ``<pin root>/<key, quoted>/<step folder>[/<role>]``: one folder per key
    (found again by listing the pin root), ending in the step folder's and role's own names as the readers
    and the model card see them."""
    return _key_folder(pin_root, key) / key.path.relative_to(key.run_name)


def _key_folder(pin_root: Path, key: CheckpointKey) -> Path:
    return pin_root / quote(str(key), safe="")


def pin(role_dir: Path, pin_root: Path, key: CheckpointKey) -> str | None:
    """Hard-link the files of ``role_dir`` into its pin (built beside it, renamed into place when whole);
    None when pinned (or already pinned), else the one-line reason why not."""
    pin_dir = pin_path(pin_root, key)
    if pin_dir.is_dir():
        return None
    try:
        pin_root.mkdir(parents=True, exist_ok=True)
        if os.stat(pin_root).st_dev != os.stat(role_dir).st_dev:
            return f"{printable(str(role_dir))}: not pinned: the pin folder {printable(str(pin_root))} is on another filesystem (hard links cannot cross filesystems; the step is merged from where it is, if the trainer keeps it)"
        partial = pin_dir.with_name(f".{pin_dir.name}.pinning-{os.getpid()}")
        for folder, _, files in os.walk(role_dir):
            relative = Path(folder).relative_to(role_dir)
            (partial / relative).mkdir(parents=True, exist_ok=True)
            for name in files:
                os.link(Path(folder) / name, partial / relative / name, follow_symlinks=False)
        partial.rename(pin_dir)
    except OSError as exc:  # the trainer deleting the step under us, a full inode table, no permission
        unpin(pin_root, key)
        return f"{printable(str(role_dir))}: not pinned: {exc.strerror or exc}"
    return None


def unpin(pin_root: Path, key: CheckpointKey) -> None:
    """Remove a pin: its links only (the trainer's files, where still there, are other links to the same data)."""
    shutil.rmtree(_key_folder(pin_root, key), ignore_errors=True)


def pins_under(pin_root: Path) -> list[CheckpointKey]:
    """The keys of every pin below ``pin_root``."""
    if not pin_root.is_dir():
        return []
    keys = []
    for entry in pin_root.iterdir():
        try:
            keys.append(CheckpointKey.parse(unquote(entry.name)))
        except MergeError:
            continue
    return keys


def stale_pins(instance: dg.DagsterInstance, pin_roots: list[Path], keep: set[str]) -> list[tuple[Path, CheckpointKey]]:
    """Pins no run will read: no run of their partition is queued or running, and they are not new.

    The merge removes its pin itself; this finds what a run that never reached its merge step left
    (cancelled in the queue, its worker killed before the step, deleted by hand)."""
    stale = []
    for pin_root in pin_roots:
        for key in pins_under(pin_root):
            if str(key) in keep:
                continue
            try:
                age = time.time() - _key_folder(pin_root, key).stat().st_mtime
            except FileNotFoundError:  # its merge removed it since the listing
                continue
            if age < PIN_GRACE_SECONDS:
                continue
            active = instance.get_runs(dg.RunsFilter(tags={PARTITION_TAG: str(key)}, statuses=ACTIVE_RUNS), limit=1)
            if not active:
                stale.append((pin_root, key))
    return stale
