"""What storage failures mean: the data plane's own error types, which failures are transient (worth a retry),
and a bounded retry of one idempotent storage operation.

Errors are classified by what they mean, not by base class: botocore's ``EndpointConnectionError`` (an endpoint
refusing connections) is not an ``OSError`` but is transient; a corrupt Parquet file or a committed file that is
gone is an ``OSError`` but is permanent (a retry reads the same bytes).
"""

from __future__ import annotations

import errno
import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

RETRY_DEADLINE_S = float(os.environ.get("GRPOFLOW_IO_RETRY_S", "120"))
"""How long one storage operation keeps retrying transient failures (s) before it gives up
(environment variable ``GRPOFLOW_IO_RETRY_S``); an outage longer than this fails the task, and Flyte's task
retries take over."""


class DataPlaneError(KeyError):
    """A read of something that is not there: unknown partition, field, or sample id. Permanent."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""


class StaleMetaError(DataPlaneError):
    """A meta names rows that were put again with other content after it was made (``clear`` and a re-put with the
    same ``id_key``, a retried put that wrote other rows): reading or writing under it would mix two batches.
    Permanent: use the meta the latest put returned (or re-run the task that produced the meta)."""


class IntegrityError(Exception):
    """Stored bytes fail verification: a checksum mismatch, an unreadable file, a committed file that is gone, a
    malformed record. Permanent: the message names the object; a retry would read the same bytes."""


class DataPlaneWarning(UserWarning):
    """Something under a partition was skipped on read (a malformed or stray commit record), or kept by a garbage
    collection for want of a modification time; the message names it."""


_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EPIPE,
        errno.EAGAIN,
    }
)
_PERMANENT = (
    DataPlaneError,
    IntegrityError,
    PermissionError,
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
)
# by (module prefix, class name) so that nothing here imports botocore, aiohttp or requests
_TRANSIENT_NAMES = {
    ("botocore", "EndpointConnectionError"),
    ("botocore", "ConnectionError"),
    ("botocore", "ConnectTimeoutError"),
    ("botocore", "ReadTimeoutError"),
    ("botocore", "ConnectionClosedError"),
    ("botocore", "HTTPClientError"),
    ("botocore", "ProxyConnectionError"),
    ("botocore", "ResponseStreamingError"),
    ("urllib3", "ProtocolError"),
    ("urllib3", "IncompleteRead"),
    ("urllib3", "NewConnectionError"),
    ("urllib3", "MaxRetryError"),
    ("requests", "ConnectionError"),
    ("requests", "Timeout"),
    ("aiohttp", "ClientConnectionError"),
    ("aiohttp", "ClientConnectorError"),
    ("aiohttp", "ServerDisconnectedError"),
    ("aiohttp", "ClientPayloadError"),
    ("aiohttp", "ClientOSError"),
    ("fsspec", "FSTimeoutError"),
}
_TRANSIENT_S3_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
    }
)


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and its causes (``__cause__``, else ``__context__``), outermost first."""
    out: list[BaseException] = []
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen and len(out) < 16:
        out.append(e)
        seen.add(id(e))
        e = e.__cause__ if e.__cause__ is not None else e.__context__
    return out


def _named_transient(e: BaseException) -> bool:
    for cls in type(e).__mro__:
        root = cls.__module__.split(".", 1)[0]
        if (root, cls.__name__) in _TRANSIENT_NAMES:
            return True
    return False


def _s3_transient(e: BaseException) -> bool:
    response = getattr(e, "response", None)  # botocore ClientError
    if not isinstance(response, dict):
        return False
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code in _TRANSIENT_S3_CODES or status >= 500 or status == 429


def _mlflow_transient(e: BaseException) -> bool:
    """MLflow's REST client gives up on a dropped connection with an ``MlflowException`` whose message carries the
    requests error (it does not chain it)."""
    if type(e).__name__ != "MlflowException":
        return False
    code = getattr(e, "error_code", "")
    text = str(e)
    return code in ("TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED") or any(
        s in text
        for s in (
            "Max retries exceeded",
            "Connection refused",
            "Connection aborted",
            "Read timed out",
            "RemoteDisconnected",
        )
    )


def is_transient(err: BaseException) -> bool:
    """Whether ``err`` may go away on its own (a refused or dropped connection, a timeout, throttling, a 5xx).

    The outermost error of a known meaning decides: the data plane's own errors, missing files and denied
    access are permanent even when a network error is somewhere in their chain; connection errors, timeouts
    (botocore, aiohttp, urllib3, requests, builtins), socket errnos such as ``ECONNREFUSED``, S3 ``SlowDown``
    / 5xx and MLflow's give-up on a dropped connection are transient. Anything else is permanent.
    """
    for e in _chain(err):
        if isinstance(e, _PERMANENT):
            return False
        if (
            isinstance(e, (ConnectionError, TimeoutError))
            or _named_transient(e)
            or _s3_transient(e)
            or _mlflow_transient(e)
        ):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


def retry_transient(
    fn: Callable[[], T],
    *,
    what: str,
    deadline_s: float | None = None,
    first_delay_s: float = 0.5,
    max_delay_s: float = 8.0,
) -> T:
    """Call ``fn`` (one idempotent storage operation) until it succeeds, retrying transient failures with
    exponential backoff (``first_delay_s`` doubling up to ``max_delay_s``) for at most ``deadline_s`` seconds.

    Each retry prints one line to stderr naming ``what`` and the error. Permanent errors are raised at once.

    Raises:
        whatever ``fn`` raised last: a permanent error at once, a transient one once the deadline has passed.
    """
    deadline = time.monotonic() + (RETRY_DEADLINE_S if deadline_s is None else deadline_s)
    delay = first_delay_s
    while True:
        try:
            return fn()
        except Exception as err:
            if not is_transient(err) or time.monotonic() + delay > deadline:
                raise
            print(
                f"[grpoflow] {what}: transient {type(err).__name__}: {err}; retrying in {delay:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(delay)
            delay = min(delay * 2, max_delay_s)
