"""A store that fails as real ones do: an HTTP proxy on 127.0.0.1 in front of the tests' SeaweedFS that answers
the first requests matching a rule with a store's 500 ``InternalError``, a reset connection, a reset after
the request reached the store (its answer lost) or half-way through its answer, then forwards the rest
unchanged. SeaweedFS cannot be told to
fail; this is a real network component between the client and a real store, not a mock of either.

Each client connection carries one request: the proxy asks the store to close after answering (``Connection:
close``), so a pooled connection is never reused past the proxy's view and every request meets the rules.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

INTERNAL_ERROR = (
    b"<?xml version='1.0' encoding='UTF-8'?>\n<Error><Code>InternalError</Code>"
    b"<Message>We encountered an internal error, please try again.</Message></Error>"
)


@dataclass
class Fault:
    """Requests whose method is ``method`` and whose path holds ``path`` get ``kind`` (``"500"``, ``"reset"``,
    ``"lost answer"``, ``"cut answer"``), ``times`` times (None: always)."""

    method: str
    path: str
    kind: str
    times: int | None = 1
    hits: int = 0

    def takes(self, method: str, path: str) -> bool:
        if method != self.method or self.path not in path or (self.times is not None and self.hits >= self.times):
            return False
        self.hits += 1
        return True


class FaultProxy:
    def __init__(self, upstream: str):
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str]] = []  # every request seen: (method, path)
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def fail(self, method: str, path: str, kind: str, times: int | None = 1) -> Fault:
        fault = Fault(method, path, kind, times)
        with self.lock:
            self.faults.append(fault)
        return fault

    def close(self) -> None:
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with contextlib.closing(client):
            head, body = _read_head(client)
            if head is None:
                return
            method, path = head.split(b" ", 2)[:2]
            method, path = method.decode(), path.decode()
            with self.lock:
                self.requests.append((method, path))
                fault = next((f for f in self.faults if f.takes(method, path)), None)
            # at once, as a store refusing an ``Expect: 100-continue`` does; no body to a HEAD
            if fault and fault.kind == "500":
                client.sendall(
                    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/xml\r\n"
                    + f"Content-Length: {len(INTERNAL_ERROR)}\r\nConnection: close\r\n\r\n".encode()
                    + (INTERNAL_ERROR if method != "HEAD" else b"")
                )
                return
            if fault and fault.kind == "reset":
                _reset(client)
                return
            lines = head.split(b"\r\n")
            if b"expect: 100-continue" in (line.lower() for line in lines):  # said here: the store's is not seen
                client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = _read_body(client, lines, body)
            lines = [line for line in lines if not line.lower().startswith((b"connection:", b"expect:"))]
            with socket.create_connection(self.upstream) as upstream:
                upstream.sendall(b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + body)
                answer = _read_all(upstream)
            if fault and fault.kind == "cut answer":  # the answer's head and half its body, then a reset
                head_end = answer.index(b"\r\n\r\n") + 4
                client.sendall(answer[: head_end + (len(answer) - head_end) // 2])
            if fault:  # "lost answer": the store did it, the client never hears
                _reset(client)
            else:
                client.sendall(answer)


def _read_body(sock: socket.socket, lines: list[bytes], body: bytes) -> bytes:
    """The request's body (botocore always sends its Content-Length), read whole before it is forwarded."""
    length = next((int(line.split(b":", 1)[1]) for line in lines if line.lower().startswith(b"content-length:")), 0)
    data = bytearray(body)
    while len(data) < length and (chunk := sock.recv(1 << 20)):
        data += chunk
    return bytes(data)


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the store closes (it does after answering: ``Connection: close``)."""
    data = bytearray()
    while chunk := sock.recv(1 << 20):
        data += chunk
    return bytes(data)


def _read_head(sock: socket.socket) -> tuple[bytes | None, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST


@contextlib.contextmanager
def fault_proxy(endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(endpoint)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def faulty_store(s3_server, bucket, monkeypatch) -> Iterator[FaultProxy]:
    """The tests' store, reached through a ``FaultProxy`` (AWS_ENDPOINT_URL names it); ``bucket``'s own
    filesystem still reaches the store directly, to set up and look."""
    import s3fs

    with fault_proxy(s3_server) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        s3fs.S3FileSystem.clear_instance_cache()
        yield proxy
        s3fs.S3FileSystem.clear_instance_cache()
