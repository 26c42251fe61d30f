"""A Dagster webserver's GraphQL API, asked from the command line, trusting nothing that answers.

Whatever listens at the URL the user gave may not be Dagster: a redirect, a proxy's page, ``[]``, an
endless or a trickling body. Each exchange goes through one deadline for the whole command
(``DEADLINE_SECONDS``, the connect, every read of a trickling body included: a library's per-read
timeout restarts with each byte), reads at most ``ANSWER_BYTES``, follows no redirect, and anything but
a JSON object holding the field asked for is one line. The URL is shown without its password or its
query's values.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import time
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from merge_pipeline.errors import MergeError, first_line

DEADLINE_SECONDS = 60
ANSWER_BYTES = 4 << 20  # the merge jobs' partitions of a large deployment fit many times over
_READ_BYTES = 1 << 16


def shown_url(url: str) -> str:
    """``url`` as it may be printed: ``user:***@`` for a password, ``name=***`` for each query value."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username}:***@{netloc.rpartition('@')[2]}"
    query = (
        "&".join(f"{p.partition('=')[0]}=***" if "=" in p else p for p in parts.query.split("&")) if parts.query else ""
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


class WebserverAPI:
    """The ``/graphql`` endpoint under ``url``, with one deadline from now for every exchange."""

    def __init__(self, url: str):
        self.parts = urlsplit(url.rstrip("/"))
        if self.parts.scheme not in ("http", "https") or not self.parts.hostname:
            raise MergeError(None, f"--url {shown_url(url)}: expected http://HOST:PORT or https://HOST")
        self.shown = shown_url(url.rstrip("/"))
        self.deadline = time.monotonic() + DEADLINE_SECONDS

    def query(self, query: str, field: str, **variables: Any) -> dict[str, Any]:
        """``data[field]`` of the answer to ``query``: an object, else one line."""
        body = self._post(json.dumps({"query": query, "variables": variables}).encode())
        try:
            answer = json.loads(body)
        except ValueError:
            raise self._not_dagster("the answer is not JSON") from None
        if isinstance(answer, dict) and isinstance(answer.get("errors"), list) and answer["errors"]:
            error = answer["errors"][0]
            raise MergeError(
                None, f"{self.shown}: {first_line(error.get('message') if isinstance(error, dict) else error)}"
            )
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, dict) or not isinstance(data.get(field), dict):
            raise self._not_dagster(f"the answer holds no {field}")
        return data[field]

    def not_understood(self) -> MergeError:
        """For an answer whose fields are not the API's."""
        return self._not_dagster("the answer is not shaped as Dagster's")

    def _not_dagster(self, problem: str) -> MergeError:
        return MergeError(None, f"{self.shown}/graphql: {problem}: is this a Dagster webserver?")

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    def _post(self, payload: bytes) -> bytes:
        try:
            return self._exchange(payload)
        except TimeoutError:
            raise MergeError(None, f"{self.shown}: the webserver did not answer within {DEADLINE_SECONDS} s") from None
        except (ConnectionError, socket.gaierror) as exc:
            raise MergeError(
                None,
                f"{self.shown}: no Dagster webserver listens there ({exc.strerror or exc}): start `dagster dev` or pass --url",
            ) from None
        except (OSError, http.client.HTTPException) as exc:
            raise self._not_dagster(f"the exchange failed ({first_line(exc) or type(exc).__name__})") from None

    def _exchange(self, payload: bytes) -> bytes:
        parts = self.parts
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.hostname, parts.port, timeout=self._left())
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if parts.username is not None:  # the URL's user:password, as a browser would send them
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        path = quote(parts.path, safe="/%") + "/graphql" + (f"?{parts.query}" if parts.query else "")
        try:
            connection.request("POST", path, body=payload, headers=headers)
            sock = connection.sock  # the response reads it after the connection lets go of it (HTTP/1.0)
            sock.settimeout(self._left())
            response = connection.getresponse()
            if 300 <= response.status < 400:
                location = response.getheader("Location") or "nowhere"
                raise MergeError(
                    None,
                    f"{self.shown}/graphql: redirects (HTTP {response.status}) to {shown_url(location)[:200]}:"
                    " give the webserver's own URL as --url",
                )
            if response.status != 200:
                raise self._not_dagster(f"HTTP {response.status}")
            return self._body(response, sock)
        finally:
            connection.close()

    def _body(self, response: http.client.HTTPResponse, sock: socket.socket) -> bytes:
        """The body, up to ``ANSWER_BYTES``, each read waiting at most until the deadline."""
        chunks, size = [], 0
        while True:
            sock.settimeout(self._left())
            chunk = response.read1(_READ_BYTES)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > ANSWER_BYTES:
                raise self._not_dagster(f"the answer is larger than {ANSWER_BYTES >> 20} MiB")
            chunks.append(chunk)
