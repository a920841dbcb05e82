"""The ``on_failure`` handlers of the ``grpo`` workflows: when a run's execution fails, its MLflow run is marked FAILED
instead of staying RUNNING (also where a local run dies with an exception in this process), and a local run's
in-process back-ends and trajectory collector are released.

Flyte runs a workflow's ``on_failure`` node once the workflow has failed, with the workflow's inputs and the error
(https://docs.flyte.org/en/latest/user_guide/development_lifecycle/failure_node.html); flytekit's local executor
calls it in-process before re-raising the error (``flytekit.core.workflow.WorkflowBase.__call__``). A resume of the
run marks it RUNNING again (``tasks.setup``), and its end FINISHED (``tasks.finish``).
"""

from __future__ import annotations

import sys

from flytekit import current_context, task
from flytekit.types.error import FlyteError

from dataplane.urls import redact
from rl.config import load_config
from tasks import runtime, tracking
from tasks.placement import declared
from tasks.run_config import RunConfig


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
