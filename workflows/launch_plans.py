"""Launch plans: one per shipped config (``configs/*.yaml``), with cluster defaults, and a scheduled evaluation of
the newest checkpoint. Registered with the workflows (``pyflyte register workflows``); the console lists them.

Cluster defaults are read from the environment of whoever registers:

- ``GRPOFLOW_DATAPLANE_ROOT``: the data plane of every launch plan (unset: a local ``dataplane.root`` becomes
  ``s3://grpoflow/runs``, an object-store one is kept);
- ``MLFLOW_TRACKING_URI``: the tracking server of every launch plan (unset: a local store becomes the in-cluster
  ``http://mlflow.mlflow.svc.cluster.local:5000``, a server URI is kept);
- ``GRPOFLOW_NOTIFY_EMAILS``: comma-separated addresses told when an execution fails, times out or is aborted;
- ``GRPOFLOW_EVAL_SCHEDULE``: cron expression of the scheduled evaluation (default every 6 hours).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from flytekit import CronSchedule, Email, LaunchPlan, WorkflowExecutionPhase

from tasks.run_config import RunConfig, load_run_config
from workflows.evaluate import evaluate
from workflows.grpo import grpo

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_DATAPLANE_ROOT = "s3://grpoflow/runs"
DEFAULT_TRACKING_URI = "http://mlflow.mlflow.svc.cluster.local:5000"
FAILED = [WorkflowExecutionPhase.FAILED, WorkflowExecutionPhase.TIMED_OUT, WorkflowExecutionPhase.ABORTED]


def _local(url: str) -> bool:
    return "://" not in url or url.startswith(("file:", "sqlite:"))


def for_cluster(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the cluster's locations: ``GRPOFLOW_DATAPLANE_ROOT`` and ``MLFLOW_TRACKING_URI`` when set, and
    in any case no local data plane (each pod has its own disk) or local MLflow store."""
    dp, tr = cfg.dataplane, cfg.tracking
    root = os.environ.get("GRPOFLOW_DATAPLANE_ROOT") or (DEFAULT_DATAPLANE_ROOT if _local(dp.root) else dp.root)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or (DEFAULT_TRACKING_URI if _local(tr.uri) else tr.uri)
    dp, tr = dataclasses.replace(dp, root=root), dataclasses.replace(tr, uri=uri)
    return dataclasses.replace(cfg, dataplane=dp, tracking=tr)


def notifications() -> list[Email]:
    """A failure e-mail to ``GRPOFLOW_NOTIFY_EMAILS``; none when it is unset."""
    to = [a.strip() for a in os.environ.get("GRPOFLOW_NOTIFY_EMAILS", "").split(",") if a.strip()]
    return [Email(phases=FAILED, recipients_email=to)] if to else []


def launch_plan_name(stem: str) -> str:
    return f"grpo_{stem.replace('-', '_')}"


CONFIG_LAUNCH_PLANS = {
    path.stem: LaunchPlan.get_or_create(
        workflow=grpo,
        name=launch_plan_name(path.stem),
        default_inputs={"cfg": for_cluster(load_run_config(str(path)))},
        notifications=notifications(),
    )
    for path in sorted(CONFIGS.glob("*.yaml"))
}
"""Config file stem -> its launch plan ``grpo_<stem>``."""

evaluate_newest = LaunchPlan.get_or_create(
    workflow=evaluate,
    name="evaluate_newest",
    default_inputs={"cfg": for_cluster(load_run_config(str(CONFIGS / "cluster.yaml")))},
    schedule=CronSchedule(schedule=os.environ.get("GRPOFLOW_EVAL_SCHEDULE", "0 */6 * * *")),
    notifications=notifications(),
)
"""Every 6 hours: the greedy held-out accuracy of the newest checkpoint of any run, logged as
``evaluation/accuracy`` in that run. Activate it after registering (``flytectl update launchplan -p grpoflow -d
development evaluate_newest --version <v> --activate``)."""
