"""Megatron-LM's own save folders (``pretrain_gpt.py --save``; Megatron-Bridge's pretraining writes the same).

``save_checkpoint`` (megatron/training/checkpointing.py, read at NVIDIA/Megatron-LM d98e8a64) writes
each save into ``<save>/iter_<iteration, 7 digits>/`` (``release/`` for a converted model) and then the
iteration, or ``release``, into ``<save>/latest_checkpointed_iteration.txt``. With ``--ckpt-format
torch_dist`` (its default) that folder is a megatron-core dist checkpoint (``metadata.json``,
``common.pt``, ``.metadata``, ``__*_*.distcp``) whose tensor keys are the model's own sharded keys:
the same names verl's Megatron saves hold, so ``formats/megatron/reader.py`` plans it like theirs.
"""

from __future__ import annotations

import re
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.files.inputs import read_capped
from merge_pipeline.formats.step_folders import MAX_TRACKER_BYTES, TRACKER, StepFolder

ITERATION_FOLDER = re.compile(r"iter_[0-9]{7,}|release")
# The sensor's view of the same folders: each iter_<N>/ one checkpoint, complete once the tracker names N.
MEGATRON_LM_STEPS = StepFolder("iter_", "Megatron-LM", tracker=TRACKER, digits=7)
# Megatron-Bridge 0.6's save_checkpoint with also_save_hf_checkpoint: the bridge's HF export in iter_N/hf/.
BRIDGE_HF_EXPORT = "hf"
# What only a dist checkpoint holds; Megatron-LM's legacy ``--ckpt-format torch`` saves mp_rank_*/ instead.
_DIST_FILES = ("metadata.json", ".metadata")
_LEGACY = "mp_rank_*"


def is_megatron_lm_save(folder: Path) -> bool:
    """An ``iter_N`` / ``release`` folder Megatron-LM saved, or its save folder with the tracker beside them."""
    if ITERATION_FOLDER.fullmatch(folder.name):
        return any((folder / name).is_file() for name in _DIST_FILES) or any(folder.glob(_LEGACY))
    return (folder / TRACKER).is_file() and any(ITERATION_FOLDER.fullmatch(d.name) for d in _subfolders(folder))


def holds_an_iteration(step_dir: Path, stack: StepFolder) -> bool:
    """The sensor's question: whether a step folder is one of Megatron-LM's saves."""
    return stack == MEGATRON_LM_STEPS and is_megatron_lm_save(step_dir)


def iteration_folder(folder: Path) -> Path:
    """The ``iter_N`` folder to merge: ``folder`` itself, or the one its tracker names; ``MergeError`` in one line."""
    if not ITERATION_FOLDER.fullmatch(folder.name):
        folder = _tracked_iteration(folder)
    if not any((folder / name).is_file() for name in _DIST_FILES) and any(folder.glob(_LEGACY)):
        raise MergeError(
            folder,
            "Megatron-LM's legacy --ckpt-format torch (mp_rank_*/model_optim_rng.pt): only torch_dist checkpoints can be read (save or convert with --ckpt-format torch_dist)",
        )
    return folder


def _tracked_iteration(save_dir: Path) -> Path:
    tracker = save_dir / TRACKER
    text = read_capped(tracker, MAX_TRACKER_BYTES, "too large to be an iteration number").decode(errors="replace")
    text = text.strip()
    if text == "release":
        name = "release"
    elif text.isascii() and text.isdigit():
        name = MEGATRON_LM_STEPS.folder_name(int(text))
    else:
        raise MergeError(tracker, f"{text!r} is neither an iteration number nor 'release'")
    if not (save_dir / name).is_dir():
        saved = ", ".join(sorted(d.name for d in _subfolders(save_dir) if ITERATION_FOLDER.fullmatch(d.name)))
        raise MergeError(
            tracker,
            f"names {text} but {name}/ is missing (saved: {saved}): pass the iteration folder to merge as --local_dir",
        )
    return save_dir / name


def _subfolders(folder: Path) -> list[Path]:
    try:
        return [d for d in folder.iterdir() if d.is_dir()]
    except OSError:
        return []
