"""Which task failures are retried: Flyte re-runs a task (up to its ``retries``) only for system errors and
``FlyteRecoverableException``, and a local execution here does the same (flytekit's local executor alone runs a task
once). A failure is raised as recoverable when it may go away (``dataplane.errors.is_transient``: a refused or dropped
connection, a timeout, throttling); corrupt data, missing files and bad input stay fatal: a retry would fail the same
way."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, ParamSpec, TypeVar

from flytekit.core import context_manager
from flytekit.core.base_task import PythonTask
from flytekit.core.context_manager import FlyteContext
from flytekit.exceptions.base import FlyteRecoverableException as Recoverable
from flytekit.exceptions.user import FlyteRecoverableException
from flytekit.models.literals import LiteralMap

from dataplane.errors import is_transient

P = ParamSpec("P")
R = TypeVar("R")

_RETRIED_LOCALLY = "grpoflow_retried_locally"
"""Set on the functions :func:`transient_errors_retried` returns: the tasks whose local attempts are retried."""

_in_local_attempt: ContextVar[bool] = ContextVar("grpoflow_in_local_attempt", default=False)


def transient_errors_retried(fn: Callable[P, R]) -> Callable[P, R]:
    """Re-raise transient errors of ``fn`` (see :func:`dataplane.errors.is_transient`) as
    ``FlyteRecoverableException`` (chained, message kept); every other error passes unchanged.

    The task made of ``fn`` (``@task(retries=n)`` above this decorator) is also retried under a local execution
    (``pyflyte run`` without ``--remote``, a workflow or task called in Python): a recoverable error of an attempt
    prints ``[grpoflow] <task>: attempt 1 of 3 failed (recoverable: ...); retrying`` to stderr and the task runs again
    with the same inputs, up to ``n`` times; the last attempt's error is raised. Other errors are raised at once. A
    pod's attempt (Flyte's entry point, ``pyflyte-execute``) only raises: Flyte retries it.

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

    setattr(wrapper, _RETRIED_LOCALLY, True)
    return wrapper


def _retried_locally(task: PythonTask) -> bool:
    """Whether a local attempt of ``task`` that fails recoverably is re-run: only for a task made of a
    :func:`transient_errors_retried` function, and not for one called in such a task's body (the enclosing attempt
    is retried instead: no retries multiplied) nor in a pod's task body (a remote attempt, Flyte's entry point:
    the pod's attempt fails and Flyte retries it). The nodes of a local ``@dynamic`` are retried each on its own."""
    if not getattr(getattr(task, "task_function", None), _RETRIED_LOCALLY, False) or _in_local_attempt.get():
        return False
    remote = context_manager.ExecutionState.Mode.TASK_EXECUTION
    return not any(
        c.execution_state is not None and c.execution_state.mode == remote
        for c in context_manager.flyte_context_Var.get()
    )


def _sandbox_execute_retried(self: PythonTask, ctx: FlyteContext, input_literal_map: LiteralMap) -> LiteralMap:
    """``PythonTask.sandbox_execute`` (one attempt of a task, which only flytekit's local executor calls), re-run
    with the same inputs while it fails recoverably, up to the task's ``retries`` times (see :func:`_retried_locally`);
    the last attempt's error is raised."""
    if not _retried_locally(self):
        return _sandbox_execute(self, ctx, input_literal_map)
    retries = self.metadata.retries
    for attempt in range(retries + 1):
        token = _in_local_attempt.set(True)
        try:
            return _sandbox_execute(self, ctx, input_literal_map)
        except Recoverable as err:  # FlyteRecoverableException, and system errors (which Flyte retries too)
            if attempt == retries:
                raise
            name = self.name.rsplit(".", 1)[-1]
            print(
                f"[grpoflow] {name}: attempt {attempt + 1} of {retries + 1} failed (recoverable: {_reason(err)}); "
                "retrying",
                file=sys.stderr,
                flush=True,
            )
        finally:
            _in_local_attempt.reset(token)
    raise AssertionError("unreachable")


def _reason(err: Recoverable) -> str:
    """The first line of ``err``'s own message, without what flytekit adds: its code (``USER:Recoverable: error=``),
    the local executor's header (``Error encountered while executing '<task>':``) and the cause (``, cause=...``)."""
    for line in str(err).splitlines():
        text = line.strip().removeprefix(f"{err._ERROR_CODE}: error=").partition(", cause=")[0]
        if text and not text.startswith("Error encountered while executing"):
            return text
    return type(err).__name__


# flytekit has no hook for a local attempt; this method is its one place (a pod runs ``dispatch_execute`` itself)
_sandbox_execute: Callable[[Any, FlyteContext, LiteralMap], LiteralMap] = getattr(
    PythonTask.sandbox_execute, "__wrapped__", PythonTask.sandbox_execute
)
_sandbox_execute_retried.__wrapped__ = _sandbox_execute  # type: ignore[attr-defined]  # a reload of this module wraps it once
PythonTask.sandbox_execute = _sandbox_execute_retried  # type: ignore[method-assign]
