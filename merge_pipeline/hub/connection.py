"""The Hub client that publishing (``upload``) and promotion (``promotion``) share: an ``HfApi`` made by one
set of rules, the errors a user can act on and their description, and the token kept out of every message.

The endpoint comes from ``HF_ENDPOINT`` (read at call time), the token from ``HF_TOKEN`` or the stored
login; none is one line. Every request has a timeout (connect, read, write: ``timeout_s``, else
``MERGE_PIPELINE_HUB_TIMEOUT``, else 60 s), and every answer's body is capped (``MAX_RESPONSE_BYTES``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import httpx2
from huggingface_hub import HfApi, get_session, get_token, set_client_factory
from huggingface_hub.errors import HfHubHTTPError, HFValidationError

from merge_pipeline import __version__
from merge_pipeline.errors import MergeError
from merge_pipeline.settings import HUB_TIMEOUT

DEFAULT_ENDPOINT = "https://huggingface.co"
HUB_ERRORS = (HfHubHTTPError, httpx2.TransportError, HFValidationError)  # what a user can act on
# Any one answer of the Hub (a page of a tree listing, a small file, a commit's result): a server that
# streams without end must cost bounded memory.
MAX_RESPONSE_BYTES = 64 << 20


@dataclass(frozen=True)
class Hub:
    api: HfApi
    endpoint: str  # without a trailing slash
    token: str = field(repr=False)

    def redact(self, message: str) -> str:
        """``message`` without the token (a server may echo the request's headers)."""
        return redact(message, self.token)


def connect(endpoint: str | None, token: str | None, timeout_s: float | None) -> Hub:
    """The Hub at ``endpoint`` (else ``HF_ENDPOINT``, else huggingface.co) with ``token`` (else the stored
    login), every request of this process given the timeout."""
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    token = token or get_token()
    if not token:
        raise MergeError(None, f"no Hugging Face token for {endpoint}: set HF_TOKEN or run `hf auth login`")
    _use_timeout(hub_timeout_s(timeout_s))
    api = HfApi(endpoint=endpoint, token=token, library_name="merge_pipeline", library_version=__version__)
    return Hub(api, endpoint, token)


def hub_timeout_s(given: float | None) -> float:
    """Seconds each request may take: ``given`` (``--hub-timeout``), else ``MERGE_PIPELINE_HUB_TIMEOUT``."""
    return HUB_TIMEOUT.value(given, "--hub-timeout")


def describe(exc: BaseException) -> str:
    """A Hub error in a few words: its status (never its body) and the request it answered."""
    request = _request_of(exc)
    where = f" on {request.method} {request.url.path}" if request is not None else ""
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        return f"HTTP {exc.response.status_code}{where}"
    return f"{type(exc).__name__}: {exc}{where}"


def redact(message: str, token: str) -> str:
    return message.replace(token, "hf_***")


def _request_of(exc: BaseException):
    with contextlib.suppress(AttributeError, RuntimeError):  # httpx raises RuntimeError when unset
        return exc.response.request if isinstance(exc, HfHubHTTPError) else exc.request
    return None


def _use_timeout(seconds: float) -> None:
    """Give huggingface_hub's shared HTTP client connect, read and write timeouts.

    Its default client waits forever (timeout=None), and a Hub that accepts a connection and never
    answers would hang the upload. The factory stays for the rest of the process (a client the
    library recreates after a failure must keep the timeout); it keeps the library's own hooks.
    """
    hooks = get_session().event_hooks  # huggingface_hub's: offline mode, request ids, debug log
    hooks = {**hooks, "response": [*hooks.get("response", []), _cap_response]}  # and a cap on every answer's size
    set_client_factory(lambda: httpx2.Client(event_hooks=hooks, follow_redirects=True, timeout=httpx2.Timeout(seconds)))


def _cap_response(response: httpx2.Response) -> None:
    """An event hook: the body of every Hub answer is read through ``_CappedBody``."""
    response.stream = _CappedBody(response.stream, f"{response.request.method} {response.request.url.path}")


class _CappedBody(httpx2.SyncByteStream):
    def __init__(self, inner: httpx2.SyncByteStream, what: str):
        self.inner, self.what = inner, what

    def __iter__(self):
        received = 0
        for chunk in self.inner:
            received += len(chunk)
            if received > MAX_RESPONSE_BYTES:
                raise MergeError(
                    None,
                    f"the Hub's answer to {self.what} passed {MAX_RESPONSE_BYTES >> 20} MB: not a Hub answer, refused",
                )
            yield chunk

    def close(self) -> None:
        self.inner.close()
