"""A store prefix seen as a local folder, so the readers walk it as they walk any checkpoint.

``viewed`` lists the prefix once and lays it out under a temporary folder: other files (trackers, JSON, DCP
``.metadata``, configs, tokenizer) are downloaded whole; weight files (rank files, ``.distcp``,
``.safetensors``, ...) are placeholders of their size (no disk used) whose bytes are the store object's:
``byte_source`` hands out that object for a placeholder, a ``LocalFile`` for any other path. Nothing large
is downloaded whole.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from merge_pipeline.errors import MergeError, show_folder_as
from merge_pipeline.settings import MAX_DOWNLOAD_BYTES
from merge_pipeline.store.asking import asking
from merge_pipeline.store.objects import ObjectIdentity, StoreObject
from merge_pipeline.store.record import MANIFEST
from merge_pipeline.store.sources import ByteSource, LocalFile
from merge_pipeline.store.url import StoreLocation, is_store_url, location

# Weight files (the suffixes the caller gives: ``formats.weight_suffixes``, an HF folder's) are read through
# ranged GETs, never downloaded: what the readers stream tensor bytes from. Any other file is downloaded into the view whole (a JSON, a tracker, DCP's .metadata, a tokenizer): a side
# file must be copied with its bytes, never a placeholder's. Past MAX_DOWNLOAD_BYTES the prefix is refused.

# Placeholders in views, by absolute local path: the objects ``byte_source`` hands out for them.
_OBJECTS: dict[Path, StoreObject] = {}
_OBJECTS_LOCK = threading.Lock()


def byte_source(path: Path) -> ByteSource:
    """Where the bytes of the input file at ``path`` come from: the store object a view's placeholder stands
    for, else the local file."""
    return _OBJECTS.get(Path(path).absolute()) or LocalFile(Path(path))


def store_object(path: Path) -> StoreObject | None:
    """The store object a view's placeholder at ``path`` stands for, if it is one."""
    return _OBJECTS.get(Path(path).absolute())


def listed(store: StoreLocation) -> dict[str, dict]:
    """Every object under the prefix, by key relative to it (listed in the library's pages)."""
    with asking(store.url):
        store.backend.check_bucket(store.url, store.path.split("/")[0])
        found = store.fs.find(store.path, detail=True, withdirs=False)
    objects = {}
    for key, info in found.items():
        relative = key[len(store.path) :].lstrip("/")
        if not relative or relative.endswith("/"):
            continue
        if any(p in ("", ".", "..") for p in relative.split("/")):
            raise MergeError(None, f"{store.url_of(relative)}: a key with an empty, '.' or '..' part: refused")
        objects[relative] = info
    return objects


@contextlib.contextmanager
def viewed(location_or_url: str | Path, weights: tuple[str, ...], *, merged: bool = False) -> Iterator[Path]:
    """A local folder standing for a store prefix while the block runs (a local path is yielded as it is).

    Other files are downloaded, weight files (those ending in one of ``weights``) are placeholders read through ``byte_source``.
    Errors naming a file in the view name its URL (``errors.show_folder_as``). ``merged``: a merged folder
    (``test``'s reference, ``upload``, ``diff``), refused unless the listing holds its commit marker; the
    weight files listed with it are pinned to their ETags, so a re-publish under way fails their reads."""
    if not is_store_url(location_or_url):
        yield Path(location_or_url)
        return
    store = location(str(location_or_url))
    objects = listed(store)
    if not objects:
        raise MergeError(None, f"{store.url}: no object under this prefix")
    if merged and MANIFEST not in objects:
        raise MergeError(None, f"{store.url}: incomplete: no {MANIFEST}; a merge is still publishing or failed")
    root = Path(tempfile.mkdtemp(prefix="merge_pipeline-view-")) / Path(store.path).name
    registered: list[Path] = []
    try:
        small = []
        for relative, info in objects.items():
            local = root / relative
            local.parent.mkdir(parents=True, exist_ok=True)
            if relative.endswith(weights):
                registered.append(placeholder(local, store, relative, info))
            else:
                small.append((store.key(relative), str(local)))
        downloaded = MAX_DOWNLOAD_BYTES.value()
        if sum(int(objects[k[len(store.path) + 1 :]]["size"]) for k, _ in small) > downloaded:
            raise MergeError(
                None,
                f"{store.url}: holds more than {downloaded:,} bytes of files that are not weight files "
                "(downloaded whole): give the checkpoint's own prefix, or raise MERGE_PIPELINE_MAX_DOWNLOAD_BYTES",
            )
        if small:
            with asking(store.url):
                store.fs.get([k for k, _ in small], [p for _, p in small])
        with show_folder_as(root, store.url):
            yield root
    finally:
        forget_placeholders(registered)
        shutil.rmtree(root.parent, ignore_errors=True)


def placeholder(local: Path, store: StoreLocation, relative: str, info: dict) -> Path:
    """A stand-in at ``local`` for the object ``relative`` listed with ``info``, whose bytes ``byte_source``
    reads from the store, pinned to the ETag listed. Code that opens it as a file instead gets none of them,
    never zeros: it holds one line naming the object, and no one may read it (``files.inputs`` refuses it in one
    line, and so does the OS unless run by root). Its absolute path."""
    local.write_text(
        f"{store.url_of(relative)}: an object in a store, read through the store: none of its bytes are here\n"
    )
    os.chmod(local, 0)
    local = local.absolute()
    with _OBJECTS_LOCK:
        _OBJECTS[local] = StoreObject(store, store.key(relative), store.url_of(relative), ObjectIdentity.of(info))
    return local


def forget_placeholders(paths: list[Path]) -> None:
    with _OBJECTS_LOCK:
        for path in paths:
            _OBJECTS.pop(path, None)
