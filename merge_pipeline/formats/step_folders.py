"""The words every reader uses to say where trainers save and when a save is finished.

A trainer saves each checkpoint in a step folder ``<prefix><N>`` (N zero-padded by some), the model
either in role folders inside it (verl's ``actor/``) or in the step folder itself. Each reader lists,
in ``step_folders``, the step folders of the trainers that save its format, and answers for a folder
in one of them whether the save is complete (``completeness``). The step folders two readers share
(verl's, for FSDP and Megatron; the HF Trainer's, for DeepSpeed and DCP) are declared here; the others
in their reader. Plain filesystem work: folders may vanish at any moment (a trainer's rotation).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.files.inputs import read_capped

TRACKER = "latest_checkpointed_iteration.txt"  # verl writes it beside its steps after every role of step N
MAX_TRACKER_BYTES = 64  # a step number; verl writes a few bytes: a larger file is not a tracker


@dataclass(frozen=True)
class StepFolder:
    """How one stack names its step folders: ``<prefix><N>``, with the role folders it saves inside."""

    prefix: str
    stack: str  # who writes such folders, for messages
    roles: tuple[str, ...] = ()  # role folders inside the step folder
    in_step_folder: bool = True  # the step folder itself may be the checkpoint
    tracker: str | None = None  # a file beside the step folders naming the newest complete step
    digits: int = 1  # the step is zero-padded to this many digits (Megatron-LM: iter_0000100)

    @cached_property
    def name(self) -> re.Pattern:
        """The canonical name, ``folder_name(N)``: ASCII digits, no leading zeros beyond the padding.
        Only such a name round-trips through a key (step_007 or step_٣ would parse to a step whose
        folder is another). Use fullmatch: "$" would let a trailing newline in."""
        return re.compile(re.escape(self.prefix) + f"([0-9]{{{self.digits}}}|[1-9][0-9]{{{self.digits},}})")

    @cached_property
    def look_alike(self) -> re.Pattern:
        """Any name int() reads as a step (\\d: any Unicode digit): skipped with a reason, not descended into."""
        return re.compile(re.escape(self.prefix) + r"\d+")

    def folder_name(self, step: int) -> str:
        return f"{self.prefix}{step:0{self.digits}d}"

    @property
    def numbering(self) -> str:
        """How the step is written, for messages."""
        if self.digits == 1:
            return "with ASCII digits and no leading zeros"
        return f"with ASCII digits, zero-padded to {self.digits}"

    @property
    def key_forms(self) -> list[str]:
        step = f"{self.prefix}<N>" if self.digits == 1 else f"{self.prefix}<N, {self.digits} digits>"
        forms = [f"<run_name>/{step}/<{'|'.join(self.roles)}>"] if self.roles else []
        return forms + ([f"<run_name>/{step}"] if self.in_step_folder else [])


# verl: global_step_<N>/<actor|critic>/, or (its SFT trainer) the model in global_step_<N>/ itself.
VERL = StepFolder("global_step_", "verl", ("actor", "critic"), tracker=TRACKER)
# The HF Trainer's checkpoint-<N>/: accelerate's pytorch_model_fsdp_0/ (DCP) or a DeepSpeed save dir.
HF_TRAINER = StepFolder("checkpoint-", "the HF Trainer")


@dataclass(frozen=True)
class Completeness:
    complete: bool
    reason: str  # one line a person reads in the UI
    newest_change: float | None  # newest mtime under the role folder; None when it holds no file


@dataclass(frozen=True)
class Quiet:
    """How long a folder has been quiet: the settle rule for saves that leave no marker of their end."""

    settle_seconds: float
    newest: float  # the newest change under the folder
    age: float  # seconds since then

    def settled(self, says: str) -> Completeness:
        if self.age >= self.settle_seconds:
            return Completeness(
                True,
                f"{says}; no file changed for {self.age:.0f} s (settle time {self.settle_seconds:g} s)",
                self.newest,
            )
        return Completeness(
            False, f"{says}; a file changed {self.age:.0f} s ago (settle time {self.settle_seconds:g} s)", self.newest
        )

    def not_yet(self, reason: str) -> Completeness:
        return Completeness(False, reason, self.newest)

    def done(self, reason: str) -> Completeness:
        return Completeness(True, reason, self.newest)


def step_dir_of(folder: Path, stack: StepFolder) -> Path:
    """The step folder ``folder`` is, or sits in (a role folder)."""
    return folder if stack.name.fullmatch(folder.name) else folder.parent


def read_tracker(path: Path) -> int | None:
    try:
        return int(read_capped(path, MAX_TRACKER_BYTES, "too large to be a step number").strip())
    except (MergeError, OSError, ValueError):
        return None


def tracker_vouches(folder: Path, step: int, stack: StepFolder, newest: float) -> tuple[bool, str]:
    """Whether the stack's tracker beside the step folders says ``step``'s save is finished, and what
    it says (for the reason).

    It must name ``step`` or a later one and have been written after the step's last change
    (``newest``): a tracker left by an earlier run ("5" while step 3 is being saved again) names a
    later step but vouches for nothing."""
    if stack.tracker is None:
        return False, f"{stack.stack}: no marker of a finished save"
    tracker = step_dir_of(folder, stack).parent / stack.tracker
    latest = read_tracker(tracker)
    if latest is None:
        return False, f"no {stack.tracker}"
    if latest < step:
        return False, f"{stack.tracker} says {latest}"
    if not written_after(tracker, newest):
        return (
            False,
            f"{stack.tracker} says {latest} >= {step}, but was written before the step's last change (an earlier run's?)",
        )
    return True, f"{stack.tracker} says {latest} >= {step}"


def written_after(marker: Path, newest: float) -> bool:
    """Whether ``marker`` (a file a trainer writes once a save is finished) was last written at or after
    ``newest``, the saved folder's last change; only then does it speak for that save. Equal times
    count: a marker written in the same clock tick as the last file is that save's."""
    try:
        return os.stat(marker).st_mtime >= newest
    except OSError:
        return False


def newest_change(folder: Path) -> float | None:
    """The newest mtime of any file or folder below ``folder`` (None when it holds no file)."""
    newest, files = None, 0
    for parent, dirs, names in os.walk(folder):
        for name in dirs + names:
            try:
                mtime = os.stat(os.path.join(parent, name)).st_mtime
            except OSError:
                continue
            newest = mtime if newest is None else max(newest, mtime)
        files += len(names)
    return newest if files else None
