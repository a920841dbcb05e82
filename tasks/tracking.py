"""MLflow: one run per execution, params from the resolved config, each step's metrics in one batched call."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
"""MLflow's experiment tag naming the kind of an experiment (``genai_development`` or ``custom_model_development``).
MLflow 3.x UIs before the sidebar's GenAI / Machine-learning switch choose the experiment's default page from it (the
runs table for ``custom_model_development``); without it they guess the kind, or ask. MLflow 3.17's UI takes the kind
from that switch instead (see :func:`runs_table_url`)."""
EXPERIMENT_KIND = "custom_model_development"
"""The kind of a grpoflow experiment: model training (runs, metrics, checkpoints), not a GenAI app (traces)."""


EXECUTION_TAG = "grpoflow.execution_id"
"""Run tag: the Flyte execution (``project/domain/name``) that last started or resumed the run; the failure handler of
a remote execution (``tasks.failure``) finds the run by it."""

_OPEN: dict[str, str] = {}
"""MLflow run id -> tracking URI: the runs this process started or reopened (:func:`start_run`, :func:`reopen_run`),
for the failure handler of a local run (:func:`fail_open_runs`); :func:`set_terminated` forgets one."""
_OPEN_LOCK = threading.Lock()


def _ensure_local_store(uri: str) -> None:
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)


def client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    _ensure_local_store(uri)
    return MlflowClient(tracking_uri=uri)


def start_run(
    *,
    uri: str,
    experiment_name: str,
    run_name: str | None,
    params: dict[str, str],
    tags: dict[str, str],
    reuse_tag: str | None = None,
) -> str:
    """Create the run (and the experiment if needed); return its id.

    The experiment carries ``EXPERIMENT_KIND_TAG = EXPERIMENT_KIND`` (set when it is created, and added to an
    existing experiment that lacks the tag; a kind already set, e.g. chosen in the UI, is left as it is).

    With ``reuse_tag``, a run of the experiment whose tag ``reuse_tag`` already has the value in ``tags`` (made
    by an earlier attempt of the same task, e.g. the same Flyte execution) is returned instead of a new one.
    """
    c = client(uri)
    exp = c.get_experiment_by_name(experiment_name)
    if exp is None:
        artifact_location = None
        if uri.startswith("sqlite:///"):
            artifact_location = (Path(uri.removeprefix("sqlite:///")).parent.resolve() / "mlartifacts").as_uri()
        exp_id = c.create_experiment(
            experiment_name, artifact_location=artifact_location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
        )
    else:
        exp_id = exp.experiment_id
        if EXPERIMENT_KIND_TAG not in exp.tags:
            c.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    if "flyte.execution_id" in tags:
        tags = {**tags, EXECUTION_TAG: tags["flyte.execution_id"]}
    found = []
    if reuse_tag is not None:
        value = tags[reuse_tag].replace("'", "")
        found = c.search_runs([exp_id], filter_string=f"tags.`{reuse_tag}` = '{value}'", max_results=1)
    run_id = found[0].info.run_id if found else c.create_run(exp_id, run_name=run_name, tags=tags).info.run_id
    from mlflow.entities import Param

    # logged again on reuse: the earlier attempt may have died before its params (same values are accepted)
    items = [Param(k, v[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i : i + 100])
    with _OPEN_LOCK:
        _OPEN[run_id] = uri
    return run_id


def reopen_run(uri: str, run_id: str, *, execution: str | None = None) -> None:
    """Mark the run RUNNING again (a resumed run), tag it with the resuming Flyte ``execution``
    (``project/domain/name``, :data:`EXECUTION_TAG`) when given, and count it among this process's open runs."""
    c = client(uri)
    c.update_run(run_id, status="RUNNING")
    if execution:
        c.set_tag(run_id, EXECUTION_TAG, execution)
    with _OPEN_LOCK:
        _OPEN[run_id] = uri


def fail_open_runs(uri: str | None) -> list[str]:
    """Mark FAILED every run in the store ``uri`` (None: in any store) that this process started or reopened and that
    is still RUNNING (its workflow failed: a local run executes every task in this process); returns their ids. Runs
    that ended (FINISHED, FAILED) are left as they are."""
    with _OPEN_LOCK:
        opened = [(run_id, where) for run_id, where in _OPEN.items() if uri is None or where == uri]
    failed = []
    for run_id, where in opened:
        if client(where).get_run(run_id).info.status == "RUNNING":
            set_terminated(where, run_id, "FAILED")
            failed.append(run_id)
    return failed


def fail_execution_runs(uri: str, experiment_name: str, execution: str) -> list[str]:
    """Mark FAILED the RUNNING runs of ``experiment_name`` that the Flyte ``execution`` (``project/domain/name``)
    started or resumed (:data:`EXECUTION_TAG`); returns their ids."""
    c = client(uri)
    exp = c.get_experiment_by_name(experiment_name)
    if exp is None:
        return []
    value = execution.replace("'", "")
    found = c.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{EXECUTION_TAG}` = '{value}' and attributes.status = 'RUNNING'"
    )
    for run in found:
        set_terminated(uri, run.info.run_id, "FAILED")
    return [run.info.run_id for run in found]


def log_metrics(uri: str, run_id: str, metrics: dict[str, float], step: int) -> bool:
    """All of a step's metrics in one ``log_batch`` call, once: if the run already holds the first of these
    metrics at ``step`` (a retried task, or a resumed run redoing a step), nothing is logged.

    Returns:
        whether the metrics were logged.
    """
    from mlflow.entities import Metric

    c = client(uri)
    marker = min(metrics)
    if any(m.step == step for m in c.get_metric_history(run_id, marker)):
        return False
    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items())]
    for i in range(0, len(items), 1000):
        c.log_batch(run_id, metrics=items[i : i + 1000])
    return True


def has_metric(uri: str, run_id: str, key: str, step: int) -> bool:
    """Whether the run holds metric ``key`` at ``step``."""
    return any(m.step == step for m in client(uri).get_metric_history(run_id, key))


def set_terminated(uri: str, run_id: str, status: str = "FINISHED") -> None:
    client(uri).set_terminated(run_id, status=status)
    with _OPEN_LOCK:
        _OPEN.pop(run_id, None)


def runs_table_url(ui_url: str, experiment_id: str) -> str:
    """The MLflow UI address of the experiment's runs table, e.g.
    ``http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning``.

    MLflow 3.17's UI opens an experiment on the page of its sidebar's workflow switch (``workflowType``: the URL
    query, else the last choice saved in the browser, else ``genai``, whose page is the GenAI overview), whatever
    the experiment's tags say; the query makes this link open the runs table in the Machine-learning view.

    Args:
        ui_url: where the UI is served (``http://127.0.0.1:5000`` for ``mlflow ui``, or the tracking server's URL).
        experiment_id: the experiment's id.
    """
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def git_commit() -> str:
    head = Path(__file__).resolve().parents[1] / ".git"
    try:
        ref = (head / "HEAD").read_text().strip()
        if ref.startswith("ref: "):
            return (head / ref.removeprefix("ref: ")).read_text().strip()
        return ref
    except OSError:
        return os.environ.get("GIT_COMMIT", "unknown")
