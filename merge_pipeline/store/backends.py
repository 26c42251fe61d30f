"""What differs between the stores: one class per protocol, picked by ``backend_of`` from the filesystem.

Every store is an fsspec filesystem, and ``Backend`` is what any of them offers: whole-range reads, one
PUT per file, its own listing as one page, no digest metadata and no conditional writes. ``S3`` (and the
S3-compatible stores) adds what its API has: ranged GETs conditional on the ETag (``If-Match``), multipart
uploads confirmed again before they are completed, ``x-amz-meta-sha256``, listings in bounded pages, the
conditional PUTs and DELETEs the store lock needs, incomplete multipart uploads. ``GCS`` keeps the sha256
as its custom metadata.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from merge_pipeline.errors import MergeError
from merge_pipeline.settings import LIST_PAGE_KEYS, PART_BYTES, PARTS_IN_FLIGHT


class Backend:
    """Any fsspec filesystem: no condition on reads, no metadata, no lock across machines."""

    conditional_writes = False  # PUTs with If-None-Match / If-Match: what the store lock needs
    multipart = False  # uploads in parts that a killed merge can leave behind

    def __init__(self, fs: Any):
        self.fs = fs  # fsspec.AbstractFileSystem, from the standard credential chain

    def read_range(self, key: str, start: int, end: int, etag: str) -> bytes:
        """Bytes ``[start, end)`` of ``key``; where the store can, only if it still has ``etag``."""
        return self.fs.cat_file(key, start=start, end=end)

    def check_bucket(self, url: str, bucket: str) -> None:
        """Refuse a missing bucket (and, where the store says so, wrong credentials) in one line."""
        if not self.fs.exists(bucket):
            raise MergeError(None, f"{url}: the bucket does not exist")

    def pages(self, prefix: str, *, recursive: bool, max_pages: int | None) -> Iterator[tuple[list[dict], list[str]]]:
        """The objects (Key, size, LastModified) and, unless ``recursive``, the subfolder prefixes under
        ``prefix`` (``bucket/...``, ending in ``/``), page by page: here the filesystem's listing as one page."""
        found = self.fs.find(prefix, detail=True) if recursive else self.fs.ls(prefix, detail=True)
        files = [dict(i, Key=i["name"]) for i in (found.values() if recursive else found) if i["type"] == "file"]
        folders = [] if recursive else [i["name"] + "/" for i in found if i["type"] == "directory"]
        yield files, folders

    def put_file(self, path: Path, key: str, guard: Callable[[], None], metadata: dict) -> None:
        """Upload ``path`` to ``key`` with ``metadata`` (``digest_metadata``); ``guard`` confirmed first."""
        guard()
        self.fs.put_file(
            str(path), key, chunksize=PART_BYTES.value(), max_concurrency=PARTS_IN_FLIGHT.value(), **metadata
        )

    def digest_metadata(self, sha256: str) -> dict:
        """``put_file`` keywords that keep ``sha256`` as the object's own metadata; none in a store without
        it: weight files then stay on local disk until published, since nothing in the store vouches for them."""
        return {}

    def recorded_sha256(self, key: str) -> str | None:
        """The sha256 the object at ``key`` was uploaded with (``digest_metadata``)."""
        return self.fs.metadata(key, refresh=True).get("sha256")


class S3(Backend):
    """S3 and the S3-compatible stores (SeaweedFS, MinIO, R2, ...), through s3fs's botocore client."""

    conditional_writes = True
    multipart = True

    def call(self, operation: str, **request) -> dict:
        """One request of the S3 API (botocore retries it)."""
        from fsspec.asyn import sync

        return sync(self.fs.loop, self.fs._call_s3, operation, **request)

    def read_range(self, key: str, start: int, end: int, etag: str) -> bytes:
        """One GET of ``[start, end)``, only if the object still has ``etag`` (else the store answers 412).
        The library retries the request; a connection lost while its body is read is retried here as
        ``cat_file`` does, with s3fs's own backoff (a refusal, a 412 among them, is not)."""
        from fsspec.asyn import sync
        from s3fs.core import _error_wrapper

        bucket, _, name = key.partition("/")

        async def get() -> bytes:
            response = await self.fs._call_s3(
                "get_object",
                Bucket=bucket,
                Key=name,
                Range=f"bytes={start}-{end - 1}",
                **({"IfMatch": etag} if etag else {}),
            )
            async with response["Body"] as body:
                return await body.read()

        return sync(self.fs.loop, _error_wrapper, get, retries=self.fs.retries)

    def check_bucket(self, url: str, bucket: str) -> None:
        """HEAD the bucket with the credentials: wrong ones and a missing bucket are refused here (``exists``
        would answer False to both)."""
        try:
            self.call("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            raise MergeError(None, f"{url}: the bucket does not exist") from None

    def pages(self, prefix: str, *, recursive: bool, max_pages: int | None) -> Iterator[tuple[list[dict], list[str]]]:
        """``list_objects_v2``, ``LIST_PAGE_KEYS`` keys a page: a tick never holds a whole bucket's listing."""
        bucket, _, key_prefix = prefix.partition("/")
        request = {"Bucket": bucket, "Prefix": key_prefix, "MaxKeys": LIST_PAGE_KEYS.value()}
        if not recursive:
            request["Delimiter"] = "/"
        listed = 0
        while max_pages is None or listed < max_pages:
            answer = self.call("list_objects_v2", **request)
            listed += 1
            files = [
                {"Key": f"{bucket}/{o['Key']}", "size": o["Size"], "LastModified": o["LastModified"]}
                for o in answer.get("Contents", [])
            ]
            yield files, [f"{bucket}/{p['Prefix']}" for p in answer.get("CommonPrefixes", [])]
            if not answer.get("IsTruncated"):
                return
            request["ContinuationToken"] = answer["NextContinuationToken"]

    def put_file(self, path: Path, key: str, guard: Callable[[], None], metadata: dict) -> None:
        if path.stat().st_size < 2 * PART_BYTES.value():
            super().put_file(path, key, guard, metadata)
            return
        guard()
        self._multipart(path, key, guard, **metadata)

    def _multipart(self, path: Path, key: str, guard: Callable[[], None], **kwargs) -> None:
        """``put_file``'s multipart upload, with ``guard`` confirmed again before it is completed: the parts are
        no object until then, so a merge that lost its lock while they went up replaces nothing (left: the
        milliseconds between that confirmation and the completion)."""
        from fsspec.asyn import sync
        from s3fs.core import calculate_chunksize

        fs = self.fs
        bucket, _, name = key.partition("/")
        upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=name, **kwargs)
        try:
            with open(path, "rb") as f:
                chunk = calculate_chunksize(path.stat().st_size, chunksize=PART_BYTES.value())
                send = fs._upload_file_part_concurrent
                sent = sync(fs.loop, send, bucket, name, upload, f, chunk, max_concurrency=PARTS_IN_FLIGHT.value())
            guard()
            parts = [{"PartNumber": n, "ETag": part["ETag"]} for n, part in enumerate(sent, 1)]
            fs.call_s3(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=name,
                UploadId=upload["UploadId"],
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            with contextlib.suppress(Exception):  # its parts would be kept (and billed) until aborted
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=name, UploadId=upload["UploadId"])
            raise
        fs.invalidate_cache(key)

    def digest_metadata(self, sha256: str) -> dict:
        return {"Metadata": {"sha256": sha256}}  # x-amz-meta-sha256

    def put_if(self, key: str, body: bytes, **condition: str) -> str:
        """A conditional PUT (``IfNoneMatch="*"``, ``IfMatch=etag``); the new ETag, from the answer."""
        bucket, _, name = key.partition("/")
        return self.fs.call_s3("put_object", Bucket=bucket, Key=name, Body=body, **condition)["ETag"]

    def delete_if(self, key: str, etag: str) -> None:
        """Delete ``key`` only if it still has ``etag``."""
        bucket, _, name = key.partition("/")
        self.fs.call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=etag)


class GCS(Backend):
    """Google Cloud Storage, through gcsfs: the sha256 as custom metadata."""

    def digest_metadata(self, sha256: str) -> dict:
        return {"metadata": {"sha256": sha256}}

    def recorded_sha256(self, key: str) -> str | None:
        return (self.fs.info(key, refresh=True).get("metadata") or {}).get("sha256")


_BY_PROTOCOL = {"s3": S3, "gs": GCS}


def backend_of(fs: Any) -> Backend:
    """The backend of a filesystem, by the protocols it answers to (``s3``/``s3a``, ``gs``/``gcs``)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    kind = next((_BY_PROTOCOL[p] for p in protocols if p in _BY_PROTOCOL), Backend)
    return kind(fs)
