"""Google Cloud Storage: ``gs://`` URLs through gcsfs, against a GCS-compatible server the test
starts on 127.0.0.1 (``gcp-storage-emulator``, the JSON API gcsfs speaks; ``STORAGE_EMULATOR_HOST`` is the
standard variable Google's libraries and gcsfs honour). A checkpoint in a bucket merges into a bucket and
into a local folder bit for bit, as from local disk."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.merge import merge
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import assert_bit_exact, tree_digest

pytestmark = pytest.mark.slow

# gcsfs's default filesystem first asks Google's gRPC control plane for each bucket's layout, which an
# emulator does not serve (each call then retries its TLS handshake for minutes); read when gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

SHARDS = 60_000


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def gcs_server(tmp_path_factory):
    emulator = shutil.which("gcp-storage-emulator", path=str(Path(sys.executable).parent))
    assert emulator, "gcp-storage-emulator is in the test extra: pip install -e '.[test]'"
    port, log = _free_port(), tmp_path_factory.mktemp("gcs") / "emulator.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [emulator, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"], stdout=out, stderr=out
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/storage/v1/b?project=test", timeout=2).read()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.3)
        yield endpoint
    finally:
        server.kill()
        server.wait()


@pytest.fixture
def gcs_bucket(gcs_server, monkeypatch):
    import gcsfs

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    gcsfs.GCSFileSystem.clear_instance_cache()
    fs = gcsfs.GCSFileSystem(token="anon", project="test")
    name = f"b-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    return fs, name


def test_gs_to_gs_and_gs_to_local_write_what_local_disk_writes(gcs_bucket, fsdp_checkpoint, tmp_path):
    fs, b = gcs_bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=3))
    options = MergeOptions(max_shard_size=SHARDS)
    fs.put(str(sample.role_dir) + "/", f"{b}/ckpt/actor/", recursive=True)
    source = f"gs://{b}/ckpt/actor"

    merge(sample.role_dir, tmp_path / "local", options, show_progress=False)
    merge(source, tmp_path / "from_store", options, show_progress=False)
    merge(source, f"gs://{b}/merged", options, show_progress=False)
    fs.get(f"{b}/merged/", str(tmp_path / "downloaded") + "/", recursive=True)

    def weights(folder: Path) -> dict[str, str]:
        return {k: v for k, v in tree_digest(folder).items() if k != "merge_manifest.json"}

    assert weights(tmp_path / "from_store") == weights(tmp_path / "local")
    assert weights(tmp_path / "downloaded") == weights(tmp_path / "local")
    assert_bit_exact(tmp_path / "downloaded", sample.reference_dir)
