"""One file of a merged folder into a store: its sha256 kept as the object's metadata where the backend
can, an object already uploaded with the same sha256 kept; and the local folder a store target is built in."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.settings import SCRATCH
from merge_pipeline.store.asking import asking
from merge_pipeline.store.objects import ObjectIdentity, StoreObject
from merge_pipeline.store.url import StoreLocation

log = logging.getLogger("merge_pipeline")

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def free_tensor_bytes(path: Path) -> None:
    """Punch a hole over the tensor bytes of an uploaded safetensors file (its size and header stay, so the
    blocking checks, which read headers only, still run on it); a filesystem that cannot punch keeps them."""
    import ctypes

    with open(path, "rb+") as f:
        header = 8 + int.from_bytes(f.read(8), "little")
        start = -(-header // 4096) * 4096
        size = os.fstat(f.fileno()).st_size
        if size <= start:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        fallocate = libc.fallocate
        fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        if fallocate(f.fileno(), _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE, start, size - start) != 0:
            log.debug("%s: cannot punch a hole (errno %d): kept on disk until published", path, ctypes.get_errno())


def upload_file(
    store: StoreLocation,
    folder: Path,
    relative: str,
    sha256: str | None,
    guard: Callable[[], None],
    *,
    streamed: bool = False,
) -> None:
    """``streamed``: the file may have been uploaded while the merge wrote (``UploadSink``): say nothing.
    ``guard`` is confirmed before the object is written (in S3, again before a multipart upload is completed)."""
    path, key = folder / relative, store.key(relative)
    size = path.stat().st_size
    if sha256 is not None and _uploaded(store, key, size) == sha256:
        if not streamed:
            log.info("%s: kept (uploaded before with the same sha256)", store.url_of(relative))
        return
    if path.stat().st_blocks * 512 < size - 4096:  # its tensor bytes were freed after an upload that is gone
        raise MergeError(None, f"{store.url_of(relative)}: uploaded during the merge, no longer in the store: re-run")
    store.backend.put_file(path, key, guard, store.backend.digest_metadata(sha256) if sha256 else {})


def _uploaded(store: StoreLocation, key: str, size: int) -> str | None:
    """The sha256 an object already at ``key`` was uploaded with, if it has ``size`` bytes."""
    try:
        if int(store.fs.info(key, refresh=True)["size"]) != size:
            return None
        return store.backend.recorded_sha256(key)
    except (FileNotFoundError, AttributeError, NotImplementedError):
        return None


def sha256_uploaded_with(obj: StoreObject) -> str | None:
    """The sha256 a merge uploaded ``obj`` with (``Backend.digest_metadata``), if it is still the object listed;
    None where the store keeps no such metadata or the object is another one now."""
    with asking(obj.url):
        try:
            if ObjectIdentity.of(obj.store.fs.info(obj.key, refresh=True)).etag != obj.identity.etag:
                return None
            return obj.store.backend.recorded_sha256(obj.key)
        except (FileNotFoundError, AttributeError, NotImplementedError):
            return None


def local_twin(url: str) -> Path:
    """Where a merge into ``url`` builds its folder before publishing it: a folder of this machine named
    by the URL (``MERGE_PIPELINE_SCRATCH``, else ~/.cache/merge_pipeline/store-targets), so that a killed
    merge's staging folder is found again and resumed, as beside a local target."""
    scratch = SCRATCH.value() or Path.home() / ".cache/merge_pipeline/store-targets"
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return (scratch / f"{Path(url.rstrip('/')).name}-{digest}").absolute()
