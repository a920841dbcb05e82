"""Local executions retry a task's recoverable errors up to its ``retries``, as Flyte does on a cluster
(`tasks.retry`): tiny tasks called through flytekit's local executor, counting their attempts."""

from __future__ import annotations

import pytest
from flytekit import dynamic, task, workflow
from flytekit.core.context_manager import ExecutionState, FlyteContextManager
from flytekit.exceptions.user import FlyteRecoverableException

from tasks.retry import transient_errors_retried

CALLS: list[str] = []
"""One entry per attempt of the tasks below: the failure each attempt is told to raise (``FAILURES``), or "ok"."""
FAILURES: list[str] = []


def _attempt() -> None:
    CALLS.append(FAILURES.pop(0) if FAILURES else "ok")
    what = CALLS[-1]
    if what == "recoverable":
        msg = f"attempt {len(CALLS)} lost a rank"
        raise FlyteRecoverableException(msg)
    if what == "transient":
        msg = f"attempt {len(CALLS)}: connection reset"
        raise ConnectionResetError(msg)
    if what == "fatal":
        msg = f"attempt {len(CALLS)}: bad input"
        raise ValueError(msg)


@task(retries=2)
@transient_errors_retried
def flaky(x: int) -> int:
    _attempt()
    return x + 1


@task(retries=2)
def not_marked(x: int) -> int:
    _attempt()
    return x + 1


OUTER: list[str] = []
"""The attempts of ``outer``."""


@task(retries=2)
@transient_errors_retried
def outer(x: int) -> int:
    OUTER.append("attempt")
    flaky(x=x)  # a task called in a task's body (locally flytekit returns a Promise: its errors are what count here)
    return x + 10


@dynamic
def flaky_dynamic(x: int) -> int:
    return flaky(x=x)


@workflow
def flaky_wf(x: int) -> int:
    return flaky_dynamic(x=x)


@pytest.fixture(autouse=True)
def _reset():
    for kept in (CALLS, FAILURES, OUTER):
        kept.clear()
    yield
    for kept in (CALLS, FAILURES, OUTER):
        kept.clear()


def test_a_recoverable_failure_is_retried_and_the_second_attempt_returns(capfd):
    FAILURES.append("recoverable")
    assert flaky(x=1) == 2
    assert CALLS == ["recoverable", "ok"]  # exactly two attempts
    err = capfd.readouterr().err
    assert "[grpoflow] flaky: attempt 1 of 3 failed (recoverable: attempt 1 lost a rank); retrying" in err


def test_a_transient_error_is_retried_in_a_local_workflow(capfd):
    """A node of a ``@dynamic`` in a workflow called in Python (``pyflyte run`` without ``--remote`` runs it so, as
    ``workflows.grpo``); the transient error is one that ``transient_errors_retried`` makes recoverable."""
    FAILURES.extend(["transient", "transient"])
    assert flaky_wf(x=1) == 2
    assert CALLS == ["transient", "transient", "ok"]
    err = capfd.readouterr().err
    assert "flaky: attempt 2 of 3 failed (recoverable: flaky: transient ConnectionResetError: attempt 2" in err


def test_a_non_recoverable_error_runs_once():
    FAILURES.extend(["fatal", "recoverable"])
    with pytest.raises(ValueError, match="attempt 1: bad input"):
        flaky(x=1)
    assert CALLS == ["fatal"]


def test_exhausted_retries_raise_the_last_attempts_error(capfd):
    FAILURES.extend(["recoverable"] * 5)
    with pytest.raises(FlyteRecoverableException, match="attempt 3 lost a rank"):
        flaky(x=1)
    assert CALLS == ["recoverable"] * 3  # 1 + retries
    assert capfd.readouterr().err.count("[grpoflow] flaky: attempt") == 2  # no line for the last attempt


def test_only_tasks_made_with_transient_errors_retried_are_retried():
    FAILURES.append("recoverable")
    with pytest.raises(FlyteRecoverableException):
        not_marked(x=1)
    assert CALLS == ["recoverable"]


def test_a_task_called_in_a_tasks_body_is_retried_with_the_enclosing_attempt_only():
    FAILURES.append("recoverable")
    assert outer(x=1) == 11
    assert OUTER == ["attempt", "attempt"] and CALLS == ["recoverable", "ok"]  # not 1 outer x 2 inner attempts


def test_inside_a_remote_attempt_a_task_runs_once():
    """A pod runs its task under flytekit's entry point (execution mode ``TASK_EXECUTION``): a task called in that
    task's body runs once, and its error fails the pod's attempt, which Flyte retries."""
    FAILURES.append("recoverable")
    ctx = FlyteContextManager.current_context()
    pod = ctx.with_execution_state(ctx.new_execution_state().with_params(mode=ExecutionState.Mode.TASK_EXECUTION))
    with FlyteContextManager.with_context(pod), pytest.raises(FlyteRecoverableException, match="attempt 1 lost a rank"):
        flaky(x=1)
    assert CALLS == ["recoverable"]
