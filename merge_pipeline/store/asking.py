"""A store's answers as this tool's: one ``MergeError`` line naming the URL, a transient failure told apart
from a refusal (``StoreUnavailable``: the Dagster instance retries the run), and the store's 412."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from merge_pipeline.errors import MergeError, StoreUnavailable, first_line


def store_error(exc: BaseException, url: str) -> MergeError:
    """One line for a store's refusal, naming the URL: the library's words, which hold no credential."""
    if isinstance(exc, MergeError):
        return exc
    if transient(exc):
        return StoreUnavailable(
            None, f"{url}: the store did not answer after retries ({first_line(exc) or type(exc).__name__})"
        )
    if isinstance(exc, PermissionError):
        problem = f"access denied ({first_line(exc)}): check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...) and AWS_ENDPOINT_URL"
    elif isinstance(exc, FileNotFoundError) and "bucket" in str(exc).lower():
        problem = "the bucket does not exist"
    elif isinstance(exc, FileNotFoundError):
        problem = "not found"
    else:
        problem = first_line(exc) or type(exc).__name__
    return MergeError(None, f"{url}: {problem}")


# A store's words for "not now" (besides any 5xx); its library retried them (botocore: AWS_MAX_ATTEMPTS, AWS_RETRY_MODE).
_TRANSIENT_CODES = {"SlowDown", "RequestTimeout", "Throttling", "ThrottlingException"}
# Connections lost or timed out, by class name (botocore's, aiohttp's, fsspec's: optional imports).
_CONNECTION_ERRORS = {"HTTPClientError", "ConnectionError", "ClientConnectionError", "ClientPayloadError"}


def transient(exc: BaseException) -> bool:
    """Whether the store failed rather than refused: a later try may succeed (never a 412, a 403, a 404)."""
    for error in (exc, exc.__cause__):
        response = getattr(error, "response", None) or {}
        if (
            response.get("Error", {}).get("Code") in _TRANSIENT_CODES
            or response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500
            or isinstance(error, (ConnectionError, TimeoutError))
            or any(c.__name__ in _CONNECTION_ERRORS for c in type(error).__mro__)
        ):
            return True
    return False


@contextlib.contextmanager
def asking(url: str) -> Iterator[None]:
    """Turn any error of the store's library in the block into one ``MergeError`` line naming ``url``."""
    try:
        yield
    except MergeError:
        raise
    except Exception as exc:  # botocore, aiohttp and fsspec raise many kinds; each becomes one line
        raise store_error(exc, url) from None


def precondition_failed(exc: BaseException) -> bool:
    """The store's 412: a conditional GET or PUT refused (``If-Match`` on an ETag that changed,
    ``If-None-Match: *`` on a key that exists). s3fs raises it as an OSError (a FileExistsError for
    ``If-None-Match``) whose cause is botocore's error, which carries the code."""
    if isinstance(exc, FileExistsError):
        return True
    response = getattr(exc.__cause__, "response", None) or {}
    return (
        response.get("Error", {}).get("Code") in ("PreconditionFailed", "412")
        or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412
    )
