"""Which task failures Flyte retries: it re-runs a task (up to its ``retries``) only for system errors and
``FlyteRecoverableException``; any other user exception fails the execution at once. A failure is raised as
recoverable when it means something that may go away (``dataplane.errors.is_transient``: a refused or dropped
connection, a timeout, throttling); corrupt data, missing files and bad input stay fatal: a retry would fail the
same way."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from flytekit.exceptions.user import FlyteRecoverableException

from dataplane.errors import is_transient

P = ParamSpec("P")
R = TypeVar("R")


def transient_errors_retried(fn: Callable[P, R]) -> Callable[P, R]:
    """Re-raise transient errors of ``fn`` (see :func:`dataplane.errors.is_transient`) as
    ``FlyteRecoverableException`` (chained, message kept); every other error passes unchanged.

    Every task of a GRPO step is safe to re-run with the same inputs at any point: data-plane writes replace their
    own earlier attempt, metrics are logged once per step, the trainer reloads its input checkpoint, and a train
    task whose first attempt finished returns the policy that attempt saved.
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except FlyteRecoverableException:
            raise  # a task called inside another (``workflows.grpo.grpo_steps``) already said so
        except Exception as err:
            if not is_transient(err):
                raise
            msg = f"{fn.__name__}: transient {type(err).__name__}: {err} (Flyte retries the task)"
            raise FlyteRecoverableException(msg) from err

    return wrapper
