"""Which task failures Flyte retries: it re-runs a task (up to its ``retries``) only for system errors and
``FlyteRecoverableException``; any other user exception fails the execution at once. Storage and network
errors are usually transient, so tasks raise them as recoverable; bad input stays fatal."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from flytekit.exceptions.user import FlyteRecoverableException

P = ParamSpec("P")
R = TypeVar("R")

TRANSIENT = (OSError, TimeoutError, ConnectionError)
"""I/O failures worth a retry (``FileNotFoundError`` included: an object store may lag a listing)."""


def transient_errors_retried(fn: Callable[P, R]) -> Callable[P, R]:
    """Re-raise :data:`TRANSIENT` errors of ``fn`` as ``FlyteRecoverableException`` (chained, message kept).

    Every task of a GRPO step is safe to re-run with the same inputs: data-plane writes replace their own
    earlier attempt, metrics are logged once per step, and the trainer reloads its input checkpoint.
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except TRANSIENT as err:
            msg = f"{fn.__name__}: transient {type(err).__name__}: {err} (Flyte retries the task)"
            raise FlyteRecoverableException(msg) from err

    return wrapper
