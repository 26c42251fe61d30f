"""Read what a ``torch.save`` file holds without reading its tensor data.

``torch.load(map_location="meta", weights_only=True)`` runs the restricted unpickler (no arbitrary
globals, ever) and gives meta tensors whose storages carry ``_checkpoint_offset``: the byte offset
of the storage's record inside the zip archive. torch writes records uncompressed, so a tensor's
bytes are a plain file range we can copy or read in pieces, with no mmap growing our RSS.
"""

from __future__ import annotations

import logging
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.tensor  # noqa: F401  (puts DTensor and its placements on the safe list)

from merge_pipeline.engine.plan import ByteRun, SourceFile
from merge_pipeline.errors import MergeError


@dataclass(frozen=True)
class StoredTensor:
    """A tensor inside a torch.save file: its meta view and where its storage begins."""

    meta: torch.Tensor  # on the meta device: shape, stride, dtype, storage offset
    storage_file_offset: int

    def byte_run(self, file: SourceFile) -> ByteRun | None:
        """The file range holding the tensor, or ``None`` if it is not contiguous in storage."""
        if not self.meta.is_contiguous():
            return None
        item = self.meta.element_size()
        return ByteRun(file, self.storage_file_offset + self.meta.storage_offset() * item, self.meta.numel() * item)


class _QuietDeviceMesh(logging.Filter):
    # Unpickling a DeviceMesh outside its process group logs a torch.compile warning per tensor.
    def filter(self, record: logging.LogRecord) -> bool:
        return "pickling/unpickling of the DeviceMesh" not in record.getMessage()


logging.getLogger("torch.distributed.device_mesh").addFilter(_QuietDeviceMesh())


def load_meta_state_dict(path: Path) -> dict[str, object]:
    """Unpickle a state dict safely onto the meta device; one-line ``MergeError`` on any problem."""
    size = path.stat().st_size
    if size == 0:
        raise MergeError(path, "file is empty")
    if not zipfile.is_zipfile(path):
        raise MergeError(path, "not a torch.save zip archive (truncated, corrupt, or the pre-1.6 legacy format)")
    try:
        state = torch.load(path, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise MergeError(path, f"refused to unpickle (weights_only=True): {_unpickling_refusal(exc)}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise MergeError(path, f"unreadable torch.save file ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise MergeError(path, f"expected a state dict of name -> tensor, found {type(state).__name__}")
    return state


def _unpickling_refusal(exc: pickle.UnpicklingError) -> str:
    """What torch refused, without its advice paragraphs and the ANSI bold codes they carry."""
    text = str(exc).split("\n\nCheck the documentation")[0]
    if refused := re.search(r"GLOBAL (\S+)", text):
        return f"the file names the global {refused.group(1)}, which is not allowed"
    return text.rsplit("WeightsUnpickler error: ", 1)[-1].strip().split("\n\n")[-1]


def stored_tensor(path: Path, name: str, tensor: torch.Tensor, file_size: int) -> StoredTensor:
    storage = tensor.untyped_storage()
    offset = getattr(storage, "_checkpoint_offset", None)
    if offset is None:
        raise MergeError(path, f"{name}: cannot locate the tensor's bytes in the archive")
    end = offset + (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    if tensor.numel() and end > file_size:
        raise MergeError(path, f"{name}: data ends at byte {end} but the file has {file_size} bytes (truncated)")
    return StoredTensor(tensor, offset)
