"""Where a store prefix is: its URL parsed into a filesystem, its backend and the path in it.

``is_store_url`` is the one test of "a store or a local path" for text (a flag, a setting); ``StoreURL``
(``listing``) is a parsed one that joins and is asked like a folder. Credentials come from the library's own
chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance roles; ``AWS_ENDPOINT_URL``
for S3-compatible stores); none is ever logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from merge_pipeline.errors import MergeError, first_line
from merge_pipeline.store.backends import Backend, backend_of


def is_store_url(location: str | Path) -> bool:
    """An fsspec URL of another filesystem than the local one (``s3://``, ``gs://``, ...)."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


def as_location(text: str | Path) -> str | Path:
    """A local folder as a ``Path``, a store URL kept as written (``Path`` would fold ``s3://`` into ``s3:/``)."""
    return str(text) if is_store_url(text) else Path(text)


def absolute(location: str | Path) -> str | Path:
    """A local path made absolute, a store URL as written."""
    return location if is_store_url(location) else Path(location).absolute()


def spelled(location: str | Path) -> str:
    """A location as its name is compared and recorded: a store URL without its trailing ``/``, a local path
    made absolute."""
    return str(location).rstrip("/") if is_store_url(location) else str(Path(location).absolute())


def store_prefix(location: str | Path) -> str | None:
    """The store URL ``location`` names (no trailing ``/``); ``None`` for a local path."""
    return str(location).rstrip("/") if is_store_url(location) else None


@dataclass(frozen=True)
class StoreLocation:
    """A prefix in a store: its backend (the filesystem, from the standard credential chain) and the path in it."""

    url: str
    backend: Backend
    path: str  # bucket/prefix, no trailing slash

    @property
    def fs(self) -> Any:  # fsspec.AbstractFileSystem
        return self.backend.fs

    def key(self, relative: str) -> str:
        return f"{self.path}/{relative}"

    def url_of(self, relative: str) -> str:
        return f"{self.url}/{relative}"


# Their debug logs print request headers (the signature, the key id): never shown, even with --verbose.
for _name in ("botocore", "aiobotocore", "s3fs", "urllib3", "google", "gcsfs", "fsspec"):
    logging.getLogger(_name).setLevel(logging.WARNING)


def location(url: str) -> StoreLocation:
    """The store prefix ``url`` names; a ``..`` or ``.`` in its keys, an unknown protocol: one line."""
    import fsspec

    url = url.rstrip("/")
    protocol, _, rest = url.partition("://")
    parts = rest.split("/")
    if not parts[0] or any(p in ("..", ".") for p in parts):
        raise MergeError(None, f"{url}: a store URL needs a bucket and keys without '.' or '..' parts")
    try:
        fs = fsspec.filesystem(protocol)
    except (ImportError, ValueError) as exc:
        raise MergeError(
            None,
            f"{url}: no filesystem for {protocol}:// ({first_line(exc)}; pip install 'merge_pipeline[s3]' or [gcs])",
        ) from None
    return StoreLocation(url, backend_of(fs), rest.rstrip("/"))
