"""A Hub per test (``hub``), and one real merged folder per session (``merged_folder``).

The client is the real huggingface_hub; it reaches the test's FakeHub through HF_ENDPOINT, read by
merge_pipeline.hub.upload at call time (huggingface_hub itself reads it once, at import).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from local_servers.fake_hub import FakeHub, User
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.merge import merge
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.dagster.conftest import instance, roots  # noqa: F401 (fixtures for the Dagster tests here)

WRITER = "hf_writerTOKENx7Qz9"  # alice: member of "org", may write
READER = "hf_readerTOKENk2Lm4"  # bob: member of "org", read-only token
OUTSIDER = "hf_outsiderTOKENp8"  # carol: no organization
TOKENS = (WRITER, READER, OUTSIDER)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    users = {WRITER: User("alice", ("org",)), READER: User("bob", ("org",), write=False), OUTSIDER: User("carol")}
    with FakeHub(users) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
        monkeypatch.setenv("HF_TOKEN", WRITER)
        yield server


@pytest.fixture(scope="session")
def merged_folder(fsdp_checkpoint, tmp_path_factory) -> Path:
    """A real merged FSDP checkpoint (3 weight shards + index, tokenizer, manifest). Read only.

    Its source sits at ``ppo-qwen/global_step_7/actor``, as verl lays checkpoints out.
    """
    root = tmp_path_factory.mktemp("hub_merge")
    role_dir = root / "ppo-qwen" / "global_step_7" / "actor"
    shutil.copytree(fsdp_checkpoint(FsdpSpec()).role_dir, role_dir)
    options = MergeOptions(backend="fsdp", max_shard_size="300KB")
    return merge(role_dir, root / "merged", options, show_progress=False).target_dir


@pytest.fixture(scope="session")
def unsharded_folder(fsdp_checkpoint, tmp_path_factory) -> Path:
    """The same checkpoint's next step, merged into one ``model.safetensors`` (no index). Read only."""
    root = tmp_path_factory.mktemp("hub_merge_unsharded")
    role_dir = root / "ppo-qwen" / "global_step_8" / "actor"
    shutil.copytree(fsdp_checkpoint(FsdpSpec()).role_dir, role_dir)
    return merge(role_dir, root / "merged", MergeOptions(backend="fsdp"), show_progress=False).target_dir


@contextlib.contextmanager
def silent_endpoint() -> Iterator[str]:
    """A Hub that accepts connections (the kernel completes them) and never answers a byte."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # never accept()ed
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@contextlib.contextmanager
def endless_endpoint() -> Iterator[str]:
    """A Hub whose every answer is 200 and a JSON body that never ends (chunked, a page of file entries forever)."""

    class Endless(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _answer(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            entry = b'{"type": "file", "oid": "0", "size": 1, "path": "x"},' * 1000
            chunk = b"%x\r\n%s\r\n" % (len(entry), entry)
            with contextlib.suppress(OSError):  # the client hangs up once it has had enough
                self.wfile.write(b"1\r\n[\r\n")
                while True:
                    self.wfile.write(chunk)

        do_GET = do_POST = do_PUT = do_HEAD = _answer

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
