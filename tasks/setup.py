"""`start_run`: resolve the model, check the data, open the MLflow run, pick the starting point."""

from __future__ import annotations

import time
import uuid

from flytekit import current_context, task

from rl.config import GRPOConfig
from tasks.types import RunInfo


@task(retries=2)
def start_run(cfg: GRPOConfig) -> RunInfo:
    """Resolve (and convert once) the model, validate the dataset, create the MLflow run with the
    flattened config as params, and return the run's handle."""
    from rl.data import train_problems, val_problems
    from rl.model import resolve_model
    from tasks import tracking

    model_path = resolve_model(cfg.model.name)
    d = cfg.data
    train_problems(dataset=d.dataset, dataset_kwargs=d.dataset_kwargs, seed=d.seed, val_fraction=d.val_fraction, start=0, count=1)
    if cfg.grpo.val_period or cfg.grpo.val_at_start:
        val_problems(dataset=d.dataset, dataset_kwargs=d.dataset_kwargs, seed=d.val_seed, val_fraction=d.val_fraction, count=d.num_val_problems)
    run_id = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    execution = current_context().execution_id
    tags = {
        "grpoflow.run_id": run_id,
        "flyte.execution_id": f"{execution.project}/{execution.domain}/{execution.name}",
        "flyte.workflow": "workflows.grpo.grpo",
        "mlflow.source.git.commit": tracking.git_commit(),
        "grpoflow.version": _version(),
    }
    params = cfg.flat_params()
    params["model.resolved_path"] = model_path
    mlflow_run_id = tracking.start_run(
        uri=cfg.tracking.uri, experiment_name=cfg.tracking.experiment_name, run_name=cfg.tracking.run_name, params=params, tags=tags
    )
    print(f"[grpoflow] run {run_id} | MLflow run {mlflow_run_id} | model {model_path}", flush=True)
    return RunInfo(run_id=run_id, mlflow_run_id=mlflow_run_id, model_path=model_path, start_step=0, start_policy_path=model_path)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("grpoflow")
    except metadata.PackageNotFoundError:
        return "0+unknown"
