import time

import pytest
import s3fs

from merge_pipeline_tests.fault_proxy import fault_proxy


@pytest.mark.parametrize("kind", ["lost answer", "cut answer", "500", "reset"])
def test_defaults(bucket, s3_server, kind, monkeypatch):
    fs, b = bucket
    with fault_proxy(s3_server) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        s3fs.S3FileSystem.clear_instance_cache()
        f2 = s3fs.S3FileSystem()
        f2.pipe(f"{b}/x", b"1" * 100000)
        proxy.fail("PUT", "/lk", kind, 1)
        t = time.monotonic()
        try:
            f2.pipe_file(f"{b}/lk", b"abc", IfNoneMatch="*")
            print(kind, "ok", time.monotonic() - t)
        except Exception as e:
            print(kind, "FAILED", repr(e), time.monotonic() - t)
        proxy.fail("GET", "/x", kind, 1)
        from merge_pipeline.storage import _s3_range

        t = time.monotonic()
        try:
            print(kind, "range", len(_s3_range(f2, f"{b}/x", 10, 90000, "")), time.monotonic() - t)
        except Exception as e:
            print(kind, "RANGE FAILED", repr(e), time.monotonic() - t)
