"""The launch plans (``workflows/launch_plans.py``): one per shipped config with the registering machine's cluster
defaults, failure e-mails, and the scheduled evaluation. The module reads its environment at import, so each case
imports it in a fresh interpreter and reports what it built as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.run_config import load_run_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
ENV_KEYS = ("GRPOFLOW_DATAPLANE_ROOT", "MLFLOW_TRACKING_URI", "GRPOFLOW_NOTIFY_EMAILS", "GRPOFLOW_EVAL_SCHEDULE")

DESCRIBE = r"""
import json
from flytekit import FlyteContextManager
from flytekit.core.type_engine import TypeEngine
from tasks.run_config import RunConfig
from workflows import launch_plans as m

def desc(lp):
    ctx = FlyteContextManager.current_context()
    params = lp.parameters.parameters
    cfg = TypeEngine.to_python_value(ctx, params["cfg"].default, RunConfig)
    defaults = {k: p.default.scalar.primitive.string_value for k, p in params.items() if k != "cfg"}
    schedule = lp.schedule
    return {
        "name": lp.name,
        "workflow": lp.workflow.name,
        "required": {k: p.required for k, p in params.items()},
        "defaults": defaults,
        "fixed": sorted(lp.fixed_inputs.literals),
        "cfg": cfg.to_dict(),
        "notifications": [
            {"phases": sorted(n.phases), "emails": list(n.email.recipients_email) if n.email else None,
             "slack": n.slack is not None, "pager_duty": n.pager_duty is not None}
            for n in lp.notifications
        ],
        "schedule": None if schedule is None else {
            "cron": schedule.cron_schedule.schedule if schedule.cron_schedule else None,
            "expression": schedule.cron_expression, "rate": schedule.rate is not None,
        },
    }

print("LAUNCH_PLANS=" + json.dumps({
    "configs": {stem: desc(lp) for stem, lp in m.CONFIG_LAUNCH_PLANS.items()},
    "evaluate_newest": desc(m.evaluate_newest),
}))
"""


def _describe(**env: str) -> dict:
    """Import workflows.launch_plans in a fresh interpreter with ``env`` (and none of ``ENV_KEYS`` otherwise)."""
    full = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    full.update(env, GRPOFLOW_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", DESCRIBE], cwd=ROOT, env=full, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("LAUNCH_PLANS=")]
    return json.loads(line.removeprefix("LAUNCH_PLANS="))


@pytest.fixture(scope="module")
def with_env() -> dict:
    return _describe(
        GRPOFLOW_DATAPLANE_ROOT="s3://b/runs",
        MLFLOW_TRACKING_URI="http://mlflow:5000",
        GRPOFLOW_NOTIFY_EMAILS="a@x.org, b@x.org,",
    )


@pytest.fixture(scope="module")
def without_env() -> dict:
    return _describe(GRPOFLOW_EVAL_SCHEDULE="30 2 * * 1")


def _failure_phases() -> list[int]:
    from flytekit import WorkflowExecutionPhase as P

    return sorted([P.FAILED, P.TIMED_OUT, P.ABORTED])


def _expected_cfg(path: Path, root: str, uri: str, *, env: bool = True) -> dict:
    """The file's config with the environment's locations (``env``), or without them, with a local data plane root
    and a local MLflow store replaced by the defaults."""
    cfg = load_run_config(str(path)).to_dict()
    if env or "://" not in cfg["dataplane"]["root"] or cfg["dataplane"]["root"].startswith("file:"):
        cfg["dataplane"]["root"] = root
    if env or "://" not in cfg["tracking"]["uri"] or cfg["tracking"]["uri"].startswith(("sqlite:", "file:")):
        cfg["tracking"]["uri"] = uri
    return cfg


def test_one_launch_plan_per_config(with_env):
    plans = with_env["configs"]
    assert sorted(plans) == [p.stem for p in CONFIGS]
    assert {stem: plan["name"] for stem, plan in plans.items()} == {
        p.stem: f"grpo_{p.stem.replace('-', '_')}" for p in CONFIGS
    }
    assert plans["learning_lr1e-5"]["name"] == "grpo_learning_lr1e_5"  # a Flyte name: no '-'
    for stem, plan in plans.items():
        assert plan["workflow"] == "workflows.grpo.grpo", stem
        assert plan["required"] == {"cfg": False}, stem
        assert plan["fixed"] == [], stem  # a default: the console can edit it
        assert plan["schedule"] is None, stem


def test_config_defaults_take_the_environments_cluster_locations(with_env):
    plans = with_env["configs"]
    for path in CONFIGS:
        assert plans[path.stem]["cfg"] == _expected_cfg(path, "s3://b/runs", "http://mlflow:5000"), path.name
    quick = plans["quick"]["cfg"]
    assert (quick["dataplane"]["root"], quick["tracking"]["uri"]) == ("s3://b/runs", "http://mlflow:5000")
    assert quick["grpo"]["max_num_steps"] == 2 and quick["generation"]["max_new_tokens"] == 16  # the file's values
    # cluster.yaml names its own S3 root and tracking server: the environment's win, so every launch plan (and the
    # scheduled evaluation) sees the same runs
    cluster = plans["cluster"]["cfg"]
    assert (cluster["dataplane"]["root"], cluster["tracking"]["uri"]) == ("s3://b/runs", "http://mlflow:5000")
    assert cluster["resources"]["train"] == {
        "image": "default",
        "gpu": 1,
        "accelerator": "nvidia-h100",
        "cpu": "8",
        "memory": "128Gi",
        "shared_memory": "16Gi",
    }
    # no local path is left in any launch plan
    for stem, plan in plans.items():
        assert plan["cfg"]["dataplane"]["root"].startswith("s3://"), stem
        assert plan["cfg"]["tracking"]["uri"].startswith("http://"), stem


def test_failure_emails_to_every_address(with_env):
    plans = [*with_env["configs"].values(), with_env["evaluate_newest"]]
    for plan in plans:
        assert plan["notifications"] == [
            {"phases": _failure_phases(), "emails": ["a@x.org", "b@x.org"], "slack": False, "pager_duty": False}
        ], plan["name"]


def test_evaluate_newest_is_scheduled_every_six_hours(with_env):
    plan = with_env["evaluate_newest"]
    assert plan["name"] == "evaluate_newest"
    assert plan["workflow"] == "workflows.evaluate.evaluate"
    assert plan["schedule"] == {"cron": "0 */6 * * *", "expression": None, "rate": False}
    # a scheduled launch needs every input defaulted: neither run_id nor checkpoint -> the newest checkpoint
    assert plan["required"] == {"cfg": False, "run_id": False, "checkpoint": False}
    assert plan["defaults"] == {"run_id": "", "checkpoint": ""}
    assert plan["fixed"] == []
    assert plan["cfg"] == _expected_cfg(ROOT / "configs" / "cluster.yaml", "s3://b/runs", "http://mlflow:5000")


def test_without_environment_defaults_apply_and_nobody_is_emailed(without_env):
    for path in CONFIGS:
        plan = without_env["configs"][path.stem]
        assert plan["notifications"] == [], path.name
        assert plan["cfg"] == _expected_cfg(
            path, "s3://grpoflow/runs", "http://mlflow.mlflow.svc.cluster.local:5000", env=False
        ), path.name
    assert without_env["configs"]["quick"]["cfg"]["dataplane"]["root"] == "s3://grpoflow/runs"
    evaluate = without_env["evaluate_newest"]
    assert evaluate["notifications"] == []
    assert evaluate["schedule"]["cron"] == "30 2 * * 1"  # GRPOFLOW_EVAL_SCHEDULE
