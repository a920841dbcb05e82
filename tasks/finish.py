"""`finish_run`: plot the curves into the Flyte deck and MLflow, close the run, say where everything is."""

from __future__ import annotations

from flytekit import Deck, task

from rl.config import GRPOConfig
from tasks.types import PolicyVersion, RunInfo, RunSummary


def _log_model(c, cfg: GRPOConfig, run: RunInfo, policy: PolicyVersion) -> None:
    """Log the final weights as an HF folder artifact (``model/``) that ``from_pretrained`` loads."""
    from pathlib import Path

    from rl.checkpoint import local_copy

    folder = Path(local_copy(policy.path, cfg.dataplane.storage_options, require_complete=policy.step > 0))
    for item in sorted(folder.iterdir()):
        if item.is_file() and not item.name.startswith("_"):  # HF files only: no trainer state, no marker
            c.log_artifact(run.mlflow_run_id, str(item), artifact_path="model")


@task(enable_deck=True)
def finish_run(cfg: GRPOConfig, run: RunInfo, policy: PolicyVersion, validation_accuracy: float) -> RunSummary:
    """Log the reward/accuracy plot and the last checkpoint's location, mark the MLflow run finished."""
    from dataplane.urls import redact
    from tasks import plots, runtime, saving, tracking

    runtime.release(run)  # this process's engines and trainer of the run are done
    saving.prune_finished(cfg, run)
    removed = runtime.dataplane(cfg, run).collect_garbage()  # files of killed writers and losing attempts
    if any(removed.values()):
        print(f"[grpoflow] removed {removed['orphan_data_files']} orphan data files and {removed['temp_files']} temporary files", flush=True)
    c = tracking.client(cfg.tracking.uri)
    history = {key: [(m.step, m.value) for m in c.get_metric_history(run.mlflow_run_id, key)] for key in plots.CURVES}
    fig = plots.curves(history)
    c.log_figure(run.mlflow_run_id, fig, "plots/reward_accuracy.png")
    Deck("training curves", plots.to_html(fig))
    c.set_tag(run.mlflow_run_id, "grpoflow.last_checkpoint", redact(policy.path))
    _log_model(c, cfg, run, policy)
    tracking.set_terminated(cfg.tracking.uri, run.mlflow_run_id)
    final = c.get_run(run.mlflow_run_id).data.metrics
    print(f"[grpoflow] done: {policy.step} steps | final reward {final.get('train/reward', float('nan')):.3f}"
          f" | validation accuracy {validation_accuracy:.3f}", flush=True)
    print(f"[grpoflow] MLflow run {run.mlflow_run_id} in {redact(cfg.tracking.uri)} (experiment {cfg.tracking.experiment_name!r})", flush=True)
    print(f"[grpoflow] last checkpoint: {redact(policy.path)}", flush=True)
    if cfg.tracking.uri.startswith(("sqlite:", "file:", "/")) or "://" not in cfg.tracking.uri:
        print(f"[grpoflow] open it with: mlflow ui --backend-store-uri {cfg.tracking.uri}", flush=True)
    return RunSummary(
        run_id=run.run_id,
        mlflow_run_id=run.mlflow_run_id,
        tracking_uri=cfg.tracking.uri,
        final_step=policy.step,
        last_checkpoint=policy.path,
        validation_accuracy=validation_accuracy,
        metrics={k: float(v) for k, v in final.items()},
    )
