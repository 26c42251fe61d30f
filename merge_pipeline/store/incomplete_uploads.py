"""Incomplete multipart uploads under a target prefix: what a merge killed mid-upload leaves in an S3 store.

A weight file goes up in parts (``settings.PART_BYTES``); a failure inside the upload aborts it (s3fs), but a
killed process (SIGKILL, out of memory, a lost node, a cancelled Ray task) leaves the parts in the store,
billed and invisible to a listing. The next merge into the same target aborts them once it holds the
target's store lock (so none belongs to a live merge), and ``inspect`` of the prefix counts them. Only uploads
of keys under the target's own prefix and ``/`` are touched, never those of a neighbour sharing its name as a
prefix (``s3://b/model`` is not ``s3://b/model-2``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from merge_pipeline.errors import MergeError, printable
from merge_pipeline.store.asking import asking
from merge_pipeline.store.url import StoreLocation, is_store_url, location

log = logging.getLogger("merge_pipeline")

SHOWN = 3  # keys named in a line


@dataclass(frozen=True)
class IncompleteUpload:
    key: str  # in the bucket
    name: str  # relative to the target prefix
    upload_id: str
    bytes: int  # of the parts uploaded so far


def incomplete_uploads(url: str | Path) -> list[IncompleteUpload]:
    """The multipart uploads begun and never completed nor aborted under the prefix ``url`` (none where
    the store is not S3, nor in a local folder)."""
    if not is_store_url(url):
        return []
    store = location(str(url))
    if not store.backend.multipart:
        return []
    bucket, _, key = store.path.partition("/")
    prefix = f"{key}/" if key else ""
    found = []
    with asking(url):
        for page in _pages(store, "list_multipart_uploads", "Uploads", Bucket=bucket, Prefix=prefix):
            for upload in page:
                if not upload["Key"].startswith(prefix):  # a store ignoring Prefix: never another's uploads
                    continue
                size = sum(
                    part["Size"]
                    for parts in _pages(
                        store, "list_parts", "Parts", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                    for part in parts
                )
                found.append(IncompleteUpload(upload["Key"], upload["Key"][len(prefix) :], upload["UploadId"], size))
    return found


def abort_incomplete_uploads(url: str) -> None:
    """Abort every incomplete multipart upload under ``url``; the caller holds the target's store lock.
    Cleanup only: credentials allowed to write but not to list or abort uploads get a warning, not a failure."""
    store = location(url)
    bucket = store.path.split("/")[0]
    try:
        uploads = incomplete_uploads(url)
        with asking(url):
            for upload in uploads:
                store.backend.call("abort_multipart_upload", Bucket=bucket, Key=upload.key, UploadId=upload.upload_id)
    except MergeError as exc:
        log.warning("incomplete multipart uploads not aborted: %s", exc)
        return
    if uploads:
        log.warning("%s: aborted %s, left by a merge that did not finish", url, describe(uploads))


def describe(uploads: list[IncompleteUpload]) -> str:
    """``2 incomplete multipart upload(s) of 40.0 MiB in parts (model-00001-of-00002.safetensors, ...)``."""
    names = ", ".join(printable(u.name) for u in uploads[:SHOWN]) + (", ..." if len(uploads) > SHOWN else "")
    total = sum(u.bytes for u in uploads)
    return f"{len(uploads)} incomplete multipart upload(s) of {total / 2**20:.1f} MiB in parts ({names})"


def _pages(store: StoreLocation, operation: str, field: str, **request):
    """The ``field`` lists of every page of a paginated listing (uploads by key and id, parts by number)."""
    markers = {"list_multipart_uploads": ("KeyMarker", "UploadIdMarker"), "list_parts": ("PartNumberMarker",)}
    while True:
        answer = store.backend.call(operation, **request)
        yield answer.get(field) or []
        if not answer.get("IsTruncated"):
            return
        for marker in markers[operation]:
            request[marker] = answer[f"Next{marker}"]
