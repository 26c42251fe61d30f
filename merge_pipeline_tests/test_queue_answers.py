"""``merge-pipeline queue --url`` at something that is not a Dagster webserver: a real HTTP server in the
test answering JSON that is not the API, a redirect, an endless or a trickling body, an error to a URL with a
password. Each is one line within the deadline, the answer read up to its bound, no password or token shown."""

from __future__ import annotations

import http.server
import json
import threading
import time
import tracemalloc
from collections.abc import Iterator

import pytest

from merge_pipeline.webserver import client as webserver_api
from merge_pipeline_tests.helpers import error_lines, run_cli

KEY = "run/global_step_1/actor"
SECRETS = ("hunter2", "s3cr3t")


class Hostile(http.server.BaseHTTPRequestHandler):
    """Answers ``POST /<mode>/graphql`` as ``mode`` says."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        mode = self.path.split("/")[1].split("?")[0]
        if mode == "redirect":
            self.send_response(302)
            self.send_header("Location", "http://admin:s3cr3t@elsewhere.example/graphql?token=s3cr3t")
            self.end_headers()
            return
        if mode == "password":
            self.send_response(401)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        if mode in BODIES:
            self.wfile.write(json.dumps(BODIES[mode]).encode())
            return
        try:
            while True:  # endless: as fast as it goes; trickle: a byte now and then, never silent for long
                self.wfile.write(b" " * (1 << 16) if mode == "endless" else b" ")
                self.wfile.flush()
                if mode == "trickle":
                    time.sleep(0.2)
        except OSError:  # the client hung up: what it should do
            pass

    def log_message(self, *args) -> None:
        pass


BODIES = {
    "list": [],
    "empty": {},
    "null_data": {"data": None},
    "wrong_shape": {"data": {"repositoriesOrError": {"nodes": [{"name": 1, "pipelines": 7}]}}},
}


@pytest.fixture
def server() -> Iterator[str]:
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile) as running:
        running.daemon_threads = True
        threading.Thread(target=running.serve_forever, daemon=True).start()
        yield f"127.0.0.1:{running.server_address[1]}"
        running.shutdown()


def queued(capsys, url: str) -> tuple[int, str, str]:
    return run_cli(capsys, "queue", KEY, "--url", url)


@pytest.mark.parametrize("mode", sorted(BODIES))
def test_json_that_is_not_the_dagster_api_is_one_line(capsys, server, mode):
    """Before: a traceback (AttributeError, KeyError, TypeError) for each."""
    code, out, err = queued(capsys, f"http://{server}/{mode}")

    assert code == 1 and not out
    assert error_lines(err) == [err.strip()] and "is this a Dagster webserver?" in err, err
    assert err.startswith(f"error: http://{server}/{mode}/graphql: ")


def test_a_redirect_is_one_line_naming_it_without_its_password(capsys, server):
    code, _, err = queued(capsys, f"http://{server}/redirect")

    assert code == 1 and err.count("\n") == 1
    assert err == (
        f"error: http://{server}/redirect/graphql: redirects (HTTP 302) to"
        " http://admin:***@elsewhere.example/graphql?token=***: give the webserver's own URL as --url\n"
    )


def test_a_password_or_token_in_the_url_is_never_shown(capsys, server):
    code, out, err = queued(capsys, f"http://alice:hunter2@{server}/password?token=s3cr3t")

    assert code == 1
    assert (
        err == f"error: http://alice:***@{server}/password?token=***/graphql: HTTP 401: is this a Dagster webserver?\n"
    )
    assert not any(secret in out + err for secret in SECRETS)


def test_an_endless_answer_is_read_up_to_its_bound(capsys, server):
    """Before: read into memory until MemoryError (2.9 GB in 12 s)."""
    tracemalloc.start()
    try:
        started = time.monotonic()
        code, _, err = queued(capsys, f"http://{server}/endless")
        took = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert code == 1 and took < 10
    assert err.endswith("/endless/graphql: the answer is larger than 4 MiB: is this a Dagster webserver?\n")
    assert peak < 4 * webserver_api.ANSWER_BYTES, peak


@pytest.mark.slow
def test_a_trickling_answer_ends_at_the_one_deadline(capsys, server, monkeypatch):
    """Before: each byte restarted the client's read timeout, so a trickle held it for ever."""
    monkeypatch.setattr(webserver_api, "DEADLINE_SECONDS", 3)  # the same clock as 60 s, shorter for the test
    started = time.monotonic()
    code, _, err = queued(capsys, f"http://{server}/trickle")
    took = time.monotonic() - started

    assert code == 1 and 2.5 < took < 6, took
    assert err == f"error: http://{server}/trickle: the webserver did not answer within 3 s\n"
