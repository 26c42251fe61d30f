"""One dynamic partition per checkpoint folder, keyed ``<run_name>/<step folder>[/<role>]``.

``STEP_FOLDERS`` lists how each training stack names its step folders and which role folders it
saves inside them. verl's keys are ``<run_name>/global_step_<N>/<actor|critic>``; a checkpoint saved
in the step folder itself (verl's SFT trainer, a DeepSpeed tag, torchtitan, the HF Trainer) has no
role part (``<run_name>/step-<N>``) and its role is ``model``. The key keeps the step folder's name
as it is on disk, so it leads back to exactly that folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import PurePosixPath

import dagster as dg

from merge_pipeline.errors import MergeError

checkpoint_partitions = dg.DynamicPartitionsDefinition(name="checkpoints")

STEP_ROLE = "model"  # the role of a checkpoint saved in the step folder itself


@dataclass(frozen=True)
class StepFolder:
    """How one stack names its step folders: ``<prefix><N>``, with the role folders it saves inside."""

    prefix: str
    stack: str  # who writes such folders, for messages
    roles: tuple[str, ...] = ()  # role folders inside the step folder
    in_step_folder: bool = True  # the step folder itself may be the checkpoint (role STEP_ROLE)

    @cached_property
    def name(self) -> re.Pattern:
        """The canonical name: ASCII digits, no leading zeros. Only such a name round-trips through a
        key (step_007 or step_٣ would parse to a step whose folder is another). Use fullmatch: "$"
        would let a trailing newline in."""
        return re.compile(re.escape(self.prefix) + r"(0|[1-9][0-9]*)")

    @cached_property
    def look_alike(self) -> re.Pattern:
        """Any name int() reads as a step (\\d: any Unicode digit): skipped with a reason, not descended into."""
        return re.compile(re.escape(self.prefix) + r"\d+")

    @property
    def key_forms(self) -> list[str]:
        forms = [f"<run_name>/{self.prefix}<N>/<{'|'.join(self.roles)}>"] if self.roles else []
        return forms + ([f"<run_name>/{self.prefix}<N>"] if self.in_step_folder else [])


VERL = StepFolder("global_step_", "verl", ("actor", "critic"))  # SFT: the model in global_step_<N>/ itself
DEEPSPEED = StepFolder("global_step", "DeepSpeed")  # a tag folder; the save dir beside it holds `latest`
TORCHTITAN = StepFolder("step-", "torchtitan")  # a DCP folder
HF_TRAINER = StepFolder("checkpoint-", "the HF Trainer")  # accelerate's pytorch_model_fsdp_0/ or a DeepSpeed save dir
NEMO_RL = StepFolder("step_", "NeMo-RL", ("policy",), in_step_folder=False)  # policy/weights/ is a DCP folder
STEP_FOLDERS = (VERL, DEEPSPEED, TORCHTITAN, HF_TRAINER, NEMO_RL)  # no name matches two of them

ROLES = VERL.roles
STEP_DIR = VERL.name


def step_folder(name: str) -> tuple[StepFolder, int] | None:
    """Which stack's step folder ``name`` is, and its step; None when it is no canonical step folder name."""
    for folder in STEP_FOLDERS:
        if step := folder.name.fullmatch(name):
            return folder, int(step.group(1))
    return None


@dataclass(frozen=True)
class CheckpointKey:
    """A partition key, parsed. ``run_name`` is the trainer folder's path below its watched root."""

    run_name: str
    step: int
    role: str
    prefix: str = VERL.prefix  # of the step folder's name: <prefix><step>

    @property
    def step_dir(self) -> str:
        return f"{self.prefix}{self.step}"

    def __str__(self) -> str:
        step_key = f"{self.run_name}/{self.step_dir}"
        return step_key if self.role == STEP_ROLE else f"{step_key}/{self.role}"

    @property
    def path(self) -> PurePosixPath:
        """Where this checkpoint folder sits below a root (and its merged folder below the output root)."""
        return PurePosixPath(str(self))

    @classmethod
    def parse(cls, key: str) -> CheckpointKey:
        parts = key.rsplit("/", 2)
        if len(parts) == 3 and (found := step_folder(parts[1])) and parts[2] in found[0].roles:
            if _is_run_name(parts[0]):
                return cls(parts[0], found[1], parts[2], found[0].prefix)
        run_name, _, step_dir = key.rpartition("/")
        if (found := step_folder(step_dir)) and found[0].in_step_folder and _is_run_name(run_name):
            return cls(run_name, found[1], STEP_ROLE, found[0].prefix)
        forms = [form for folder in STEP_FOLDERS for form in folder.key_forms]
        raise MergeError(None, f"partition key {key!r} is not {' or '.join(forms)}")


def _is_run_name(name: str) -> bool:
    """A plain relative path: no empty, '.' or '..' parts, nothing a join could escape the root with."""
    path = PurePosixPath(name)
    return str(path) == name and bool(path.parts) and not path.is_absolute() and ".." not in path.parts
