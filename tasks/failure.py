"""The ``on_failure`` handlers of the ``grpo`` workflows: when a run's execution fails, its MLflow run is marked FAILED
instead of staying RUNNING (also where a local run dies with an exception in this process), and a local run's
in-process back-ends and trajectory collector are released. A local run stopped by Ctrl-C (SIGINT) or SIGTERM has its
MLflow run marked KILLED and prints how to resume it (:func:`watch_interrupts`).

Flyte runs a workflow's ``on_failure`` node once the workflow has failed, with the workflow's inputs and the error
(https://docs.flyte.org/en/latest/user_guide/development_lifecycle/failure_node.html); flytekit's local executor
calls it in-process before re-raising the error (``flytekit.core.workflow.WorkflowBase.__call__``). A resume of the
run marks it RUNNING again (``tasks.setup``), and its end FINISHED (``tasks.finish``).
"""

from __future__ import annotations

import atexit
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from flytekit import current_context, task
from flytekit.core.context_manager import FlyteContextManager
from flytekit.types.error import FlyteError

from dataplane.urls import redact
from rl.config import load_config
from tasks import runtime, tracking
from tasks.cli import run_command
from tasks.placement import declared
from tasks.run_config import RunConfig
from tasks.types import RunInfo

TERMINATED_EXIT_CODE = 128 + signal.SIGTERM
"""The exit status of a local run stopped by SIGTERM (143, as a shell reports a process killed by it)."""

_WATCHED: dict[str, tuple[RunConfig, str]] = {}
"""MLflow run id -> (config, run_id): the runs this process started or resumed locally."""
_STOPPED_BY: list[str] = []
"""The name of the signal that stopped this process (``SIGINT``, ``SIGTERM``), once one did."""


@task(**declared("cpu"))
def run_failed(cfg: RunConfig, err: FlyteError | None = None) -> None:
    """Mark the failed execution's MLflow run FAILED (the ``on_failure`` node of ``workflows.grpo.grpo``)."""
    mark_failed(cfg, err)


@task(**declared("cpu"))
def run_failed_from_file(config_url: str, err: FlyteError | None = None) -> None:
    """:func:`run_failed` for ``workflows.grpo.grpo_from_file``: the config is read from ``config_url`` again (a config
    that does not load failed the run before it had an MLflow run: nothing to mark)."""
    try:
        cfg = load_config(config_url)
    except Exception as exc:  # noqa: BLE001 - the workflow's own error is the one raised
        print(
            f"[grpoflow] run failed before its config loaded ({type(exc).__name__}): no MLflow run to mark",
            file=sys.stderr,
            flush=True,
        )
        return
    mark_failed(cfg, err)


def mark_failed(cfg: RunConfig, err: FlyteError | None) -> list[str]:
    """Mark FAILED the MLflow runs the failed execution left RUNNING, and release a local run's in-process state.

    Local (every task ran in this process): the runs this process started or resumed in ``cfg.tracking.uri``
    (:func:`tasks.tracking.fail_open_runs`); then every collector and back-end of this process is stopped
    (:func:`tasks.runtime.release_all`: a failed run's collector would go on generating). Remote: the RUNNING runs
    tagged with this execution (:func:`tasks.tracking.fail_execution_runs`). Never raises: a failure here is printed,
    and the workflow's own error is what the execution reports.

    Returns:
        the ids of the runs marked FAILED.
    """
    failed: list[str] = []
    try:
        execution = current_context().execution_id
        if execution.name == "local":
            try:
                failed = tracking.fail_open_runs(cfg.tracking.uri)
            finally:
                runtime.release_all()
        else:
            failed = tracking.fail_execution_runs(
                cfg.tracking.uri,
                cfg.tracking.experiment_name,
                f"{execution.project}/{execution.domain}/{execution.name}",
            )
        lines = (err.message or "").strip().splitlines() if err is not None else []
        why = f" ({redact(lines[-1][:300])})" if lines else ""
    except Exception as exc:  # noqa: BLE001 - see above
        print(
            f"[grpoflow] warning: could not mark the failed run's MLflow run FAILED: {type(exc).__name__}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return failed
    for run_id in failed:
        print(f"[grpoflow] run failed{why} | MLflow run {run_id} marked FAILED", file=sys.stderr, flush=True)
    return failed


def watch_interrupts(cfg: RunConfig, run: RunInfo) -> None:
    """In a local execution, make Ctrl-C (SIGINT) and SIGTERM end ``run`` cleanly: the signal raises in the main
    thread (SIGINT: ``KeyboardInterrupt``, as Python's own handler; SIGTERM: ``SystemExit(143)``), so ``finally``
    blocks run (temporary checkpoint copies are removed, `rl.checkpoint`); at exit the run's MLflow run is marked KILLED
    and one line gives the run id and how to go on (:func:`how_to_continue`), e.g.
    ``[grpoflow] run run-... stopped by SIGTERM | MLflow run 3f2a... marked KILLED | resume: pyflyte run ...``. Python
    prints no traceback for the interrupt (``pyflyte`` prints ``Aborted!`` for SIGINT, as click does).

    A handler is installed only over the default one (another handler, e.g. a test runner's, is left alone), once per
    process, from the main thread; flytekit's own SIGINT handler (installed when flytekit is imported: it runs the
    handlers of ``FlyteContextManager.add_signal_handler``, then calls ``exit(1)``) gets it as one of its handlers,
    which raises before that ``exit(1)``. A remote execution (a pod: Flyte handles its termination) installs nothing.
    """
    if current_context().execution_id.name != "local":
        return
    _WATCHED[run.mlflow_run_id] = (cfg, run.run_id)
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _stop)
    if _stop not in FlyteContextManager.signal_handlers:  # flytekit's SIGINT handler calls these, then exit(1)
        FlyteContextManager.add_signal_handler(_stop)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stop)
    if not getattr(sys.excepthook, "grpoflow_stop", False):  # over Python's, or rich's that flytekit installs
        sys.excepthook = _quiet_stop(sys.excepthook)
    atexit.unregister(_mark_killed)
    atexit.register(_mark_killed)


def _stop(signum: int, frame: Any) -> None:
    """The signal handler of :func:`watch_interrupts`."""
    name = signal.Signals(signum).name
    if not _STOPPED_BY:
        _STOPPED_BY.append(name)
    if signum == signal.SIGTERM:
        raise SystemExit(TERMINATED_EXIT_CODE)
    raise KeyboardInterrupt


def _quiet_stop(previous: Callable[..., Any]) -> Callable[..., Any]:
    """``sys.excepthook`` that prints no traceback for the ``KeyboardInterrupt`` of a stop (:func:`_mark_killed` says
    what happened); every other uncaught error goes to ``previous``."""

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not (_STOPPED_BY and issubclass(kind, KeyboardInterrupt)):
            previous(kind, value, tb)

    excepthook.grpoflow_stop = True  # type: ignore[attr-defined]
    return excepthook


def _mark_killed() -> list[str]:
    """At the exit of a process that a signal stopped (:func:`watch_interrupts`): mark KILLED the watched runs that are
    still RUNNING (or that a handler already marked KILLED) and print one line for each; returns their MLflow run ids.
    A run that ended otherwise (FINISHED, FAILED) is left as it is. An MLflow error is printed, never raised (the
    process is exiting)."""
    if not _STOPPED_BY:
        return []
    killed = []
    for mlflow_run_id, (cfg, run_id) in list(_WATCHED.items()):
        uri = cfg.tracking.uri
        try:
            status = tracking.client(uri).get_run(mlflow_run_id).info.status
            if status not in ("RUNNING", "KILLED"):
                continue
            tracking.set_terminated(uri, mlflow_run_id, "KILLED")
            then = how_to_continue(cfg, run_id)
        except Exception as exc:  # noqa: BLE001 - exiting: say so, then go on with the other runs
            print(
                f"[grpoflow] warning: could not mark MLflow run {mlflow_run_id} KILLED: {type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )
            continue
        killed.append(mlflow_run_id)
        print(
            f"[grpoflow] run {run_id} stopped by {_STOPPED_BY[0]} | MLflow run {mlflow_run_id} marked KILLED | {then}",
            file=sys.stderr,
            flush=True,
        )
    return killed


def how_to_continue(cfg: RunConfig, run_id: str) -> str:
    """How a local run that stopped goes on: ``resume: <command>`` (:func:`tasks.cli.run_command` with
    ``checkpointing.resume_run_id``) where it has a complete checkpoint to resume from, else ``no checkpoint yet
    (checkpointing.checkpoint_period: N): start it again: <command>``.

    Raises:
        storage errors: listing the run's checkpoints failed (permanent, or transient past the retry deadline).
    """
    from dataplane import paths
    from rl.checkpoint import list_complete

    if list_complete(paths.checkpoints_dir(cfg.dataplane.root, run_id), cfg.dataplane.storage_options):
        return f"resume: {run_command(cfg, resume_run_id=run_id)}"
    period = cfg.checkpointing.checkpoint_period
    return f"no checkpoint yet (checkpointing.checkpoint_period: {period}): start it again: {run_command(cfg)}"
