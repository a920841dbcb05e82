"""`start_run`: resolve the model, check the data, open the MLflow run, pick the starting point."""

from __future__ import annotations

import time
import uuid

from flytekit import current_context, task

from rl.config import GRPOConfig
from tasks.retry import transient_errors_retried
from tasks.types import RunInfo


@task(retries=2)
@transient_errors_retried
def start_run(cfg: GRPOConfig) -> RunInfo:
    """Resolve (and convert once) the model, validate the dataset, create the MLflow run with the
    flattened config as params, and return the run's handle."""
    from rl.backends.registry import check_installed
    from rl.data import train_problems, val_problems
    from rl.model import resolve_model
    from tasks import tracking

    execution = current_context().execution_id
    local = execution.name == "local"  # every local execution has this id; a remote one is unique
    if local:  # every task runs here: a back-end that cannot be imported fails now, not at step 1 (remote tasks
        # import theirs in their own images)
        check_installed("generation", cfg.generation.backend)
        check_installed("policy", cfg.policy.backend)
    model_path = resolve_model(cfg.model.name)
    d = cfg.data
    train_problems(dataset=d.dataset, dataset_kwargs=d.dataset_kwargs, seed=d.seed, val_fraction=d.val_fraction, start=0, count=1)
    if cfg.grpo.val_period or cfg.grpo.val_at_start:
        val_problems(dataset=d.dataset, dataset_kwargs=d.dataset_kwargs, seed=d.val_seed, val_fraction=d.val_fraction, count=d.num_val_problems)
    if cfg.checkpointing.resume_run_id:
        return _resume(cfg, cfg.checkpointing.resume_run_id, model_path)
    # a retried start_run of a remote execution finds the MLflow run and run id of its first attempt
    run_id = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}" if local else f"run-{execution.name}"
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
        uri=cfg.tracking.uri, experiment_name=cfg.tracking.experiment_name, run_name=cfg.tracking.run_name, params=params, tags=tags,
        reuse_tag=None if local else "flyte.execution_id",
    )
    print(f"[grpoflow] run {run_id} | MLflow run {mlflow_run_id} | model {model_path}", flush=True)
    return RunInfo(run_id=run_id, mlflow_run_id=mlflow_run_id, model_path=model_path, start_step=0, start_policy_path=model_path)


def _resume(cfg: GRPOConfig, run_id: str, model_path: str) -> RunInfo:
    """Pick up ``run_id`` at its latest complete checkpoint with trainer state."""
    import json

    import fsspec

    from dataplane import paths
    from rl import checkpoint
    from tasks import tracking

    so = cfg.dataplane.storage_options
    found = [(s, u) for s, u in checkpoint.list_complete(paths.checkpoints_dir(cfg.dataplane.root, run_id), so) if checkpoint.has_trainer_state(u, so)]
    if not found:
        msg = f"checkpointing.resume_run_id={run_id!r}: no complete checkpoint under {paths.checkpoints_dir(cfg.dataplane.root, run_id)}; check the run id and dataplane.root"
        raise ValueError(msg)
    step, url = found[-1]
    fs, path = fsspec.core.url_to_fs(url, **so)
    state = json.loads(fs.cat_file(f"{path}/{checkpoint.TRAINER_STATE}/state.json"))
    tracking.client(cfg.tracking.uri).update_run(state["mlflow_run_id"], status="RUNNING")
    print(f"[grpoflow] resuming run {run_id} from step {step} ({url}) | MLflow run {state['mlflow_run_id']}", flush=True)
    return RunInfo(
        run_id=run_id,
        mlflow_run_id=state["mlflow_run_id"],
        model_path=model_path,
        start_step=step,
        start_policy_path=url,
    )


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("grpoflow")
    except metadata.PackageNotFoundError:
        return "0+unknown"
