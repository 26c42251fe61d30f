"""Watching a store prefix as the sensor watches a folder: listings in bounded pages, laid out locally.

The readers answer "which folders are step folders" and "is this save complete" by looking at a local
folder (``formats.completeness``: markers, their contents, modification times). ``Mirror`` lays out what
a listing of a store prefix found under a temporary folder, at the same relative paths: each object a
sparse file of its size whose modification time is the object's ``LastModified``, small files that are
no weight files (trackers, ``latest``, ``ckpt_contents.json``) downloaded, each folder dated by its
newest object. The readers' own answers then hold for the store unchanged. A weight file is read only
where a reader's rule asks for a few of its bytes, through ranged GETs (``view.placeholder``):
DeepSpeed's model states say the data-parallel world size in their pickle.

Listings go one folder at a time (``Delimiter='/'``), ``LIST_PAGE_KEYS`` keys per request, so a tick
never holds a whole bucket's listing in one answer. ``StoreURL`` is a store prefix that joins and
answers ``is_dir``/``is_file`` like a ``Path``, so settings and the partition-key mapping treat a store
root as they treat a folder. A ``Folder`` is either; what differs between the two is answered here
(``folder_or_url``, ``published``, ``refusal``, ``laid_out``), so the watching code does not ask which.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path, PurePosixPath

from merge_pipeline.errors import MergeError
from merge_pipeline.store.asking import asking
from merge_pipeline.store.record import MANIFEST
from merge_pipeline.store.url import StoreLocation, is_store_url, location
from merge_pipeline.store.view import forget_placeholders, placeholder

MARKER_BYTES = 64 << 10  # a file the readers read to judge a save (a step number, a tag, a JSON) is smaller


class StoreURL(str):
    """``s3://bucket/prefix`` that joins (``url / "step"``) and is asked like a folder; every question is
    one request, and a store's refusal is one ``MergeError`` line naming the URL."""

    def __new__(cls, url: str) -> StoreURL:
        return super().__new__(cls, url.rstrip("/"))

    def __truediv__(self, other: str | PurePosixPath) -> StoreURL:
        return StoreURL(f"{self}/{PurePosixPath(other).as_posix()}")

    @property
    def name(self) -> str:
        return self.rsplit("/", 1)[-1]

    @property
    def parent(self) -> StoreURL:
        return StoreURL(self.rsplit("/", 1)[0])

    def is_dir(self) -> bool:
        """Some object lies under this prefix (a store has no empty folders)."""
        store = location(self)
        for files, folders in pages(store, store.path + "/", recursive=True, max_pages=1):
            return bool(files or folders)
        return False

    def is_file(self) -> bool:
        store = location(self)
        with asking(self):
            return store.fs.isfile(store.path)

    def published(self) -> bool:
        """A merged folder in the store is there once its commit marker is (docs/SAFETY.md)."""
        return (self / MANIFEST).is_file()


Folder = Path | StoreURL  # a folder on disk or a prefix in a store: the functions below answer for both


def folder_or_url(text: str | Path) -> Folder:
    """``s3://bucket/prefix`` (any fsspec URL) as a store prefix, anything else as a local folder made absolute."""
    return StoreURL(str(text)) if is_store_url(text) else Path(text).absolute()


def on_disk(folder: Folder | str) -> Path | None:
    """The local folder ``folder`` names; ``None`` for a store prefix (it lies in no folder)."""
    return None if is_store_url(folder) else Path(folder)


def in_store(folder: Folder) -> StoreURL | None:
    """The store prefix ``folder`` names; ``None`` for a local folder."""
    return StoreURL(folder) if is_store_url(folder) else None


def published(folder: Folder) -> bool:
    """A merged folder is there: on disk it appears whole (renamed into place), in a store once its
    commit marker is (docs/SAFETY.md)."""
    store = in_store(folder)
    return store.published() if store else Path(folder).exists()


def refusal(where: Folder | None, problem: str) -> MergeError:
    """One line about ``where``; a URL named as it is spelled (a ``Path`` would fold its ``//``)."""
    return MergeError(None, f"{where}: {problem}") if is_store_url(where or "") else MergeError(where, problem)


@contextlib.contextmanager
def laid_out(folder: Folder, weights: tuple[str, ...]) -> Iterator[Path]:
    """A checkpoint folder as the readers judge a save: on disk, itself; in a store, its objects listed
    whole in a ``Mirror`` with the two folders above it (a tracker or DeepSpeed's ``latest`` lies beside
    the step folders)."""
    store = in_store(folder)
    if store is None:
        yield Path(folder)
        return
    with Mirror(weights) as mirror:
        # a step folder at the bucket's top has no grandparent: "s3:" names no bucket
        for above in (store.parent.parent, store.parent):
            if above.partition("://")[2]:
                mirror.list(above)
        mirror.list(store, recursive=True)
        yield mirror.folder(store)


def pages(
    store: StoreLocation, prefix: str, *, recursive: bool, max_pages: int | None = None
) -> Iterator[tuple[list[dict], list[str]]]:
    """The objects (Key, size, LastModified) and, unless ``recursive``, the subfolder prefixes under
    ``prefix`` (``bucket/...``, ending in ``/``), page by page (``Backend.pages``)."""
    with asking(store.url):
        yield from store.backend.pages(prefix, recursive=recursive, max_pages=max_pages)


class Mirror:
    """A temporary local folder laying out what listings of store prefixes found (``list``), at
    ``folder(url)``; removed on ``close``."""

    def __init__(self, weights: tuple[str, ...]) -> None:
        self.weights = weights  # the suffixes of weight files (``formats.weight_suffixes``): never downloaded
        self.top = Path(tempfile.mkdtemp(prefix="merge_pipeline-listing-"))
        self.newest: dict[Path, float] = {}  # each folder's newest object listed so far
        self.placeholders: list[Path] = []  # weight files, read through the store if a reader asks

    def __enter__(self) -> Mirror:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        forget_placeholders(self.placeholders)
        shutil.rmtree(self.top, ignore_errors=True)

    def folder(self, url: str) -> Path:
        """Where the prefix ``url`` lies in the mirror (``<top>/<protocol>/<bucket>/<keys>``)."""
        protocol, _, rest = url.rstrip("/").partition("://")
        return self.top / protocol / rest

    def list(self, url: str, *, recursive: bool = False) -> list[str]:
        """Lay out the objects under ``url`` (all of them, or its own files and subfolders); the names
        of its subfolders."""
        store = location(url)
        base = self.folder(url)
        base.mkdir(parents=True, exist_ok=True)
        names, small, listed = [], [], {}
        for files, folders in pages(store, store.path + "/", recursive=recursive):
            for info in files:
                relative = info["Key"][len(store.path) + 1 :]
                if any(p in ("", ".", "..") for p in relative.split("/")):
                    continue  # a folder marker, or a key no reader's path could name
                local = base / relative
                local.parent.mkdir(parents=True, exist_ok=True)
                if relative.endswith(self.weights):
                    self.placeholders.append(placeholder(local, store, relative, info))
                else:
                    with open(local, "wb") as f:
                        f.truncate(int(info["size"]))  # sparse: the size, no bytes
                    if int(info["size"]) <= MARKER_BYTES:
                        small.append((info["Key"], local))
                listed[local] = _timestamp(info["LastModified"])
            for prefix in folders:
                name = prefix.rstrip("/").rsplit("/", 1)[-1]
                if name not in (".", ".."):
                    (base / name).mkdir(exist_ok=True)
                    names.append(name)
        if small:
            with asking(url):
                store.fs.get([k for k, _ in small], [str(p) for _, p in small])
        self._dated(base, listed)
        return names

    def _dated(self, base: Path, listed: dict[Path, float]) -> None:
        """Each file dated by its object, each folder by the newest object under it (never "now": a
        folder made here must not look like a trainer's change). Only what this listing touched:
        ``base``, the folders below it, and those above it."""
        for path, mtime in listed.items():
            os.utime(path, (mtime, mtime))
            for parent in path.parents:
                if parent == self.top:
                    break
                self.newest[parent] = max(self.newest.get(parent, 0.0), mtime)
        touched = [Path(parent) / name for parent, dirs, _ in os.walk(base) for name in dirs]
        touched += [base, *(p for p in base.parents if p.is_relative_to(self.top) and p != self.top)]
        for folder in touched:
            stamp = self.newest.get(folder, 0.0)
            os.utime(folder, (stamp, stamp))


def _timestamp(modified: datetime | str | float) -> float:
    if isinstance(modified, datetime):
        return modified.timestamp()
    if isinstance(modified, str):
        return datetime.fromisoformat(modified.replace("Z", "+00:00")).timestamp()
    return float(modified)
