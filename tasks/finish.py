"""`finish_run`: plot the curves into the Flyte deck and MLflow, log the final model (an MLflow transformers model,
registered when asked), close the run, say where everything is."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

from flytekit import Deck, task

from dataplane.urls import redact
from tasks import plots, runtime, saving, tracking
from tasks.placement import declared
from tasks.run_config import RunConfig
from tasks.types import PolicyVersion, RunInfo, RunSummary

MODEL_NAME = "model"
"""Name of the logged MLflow model (``runs:/<mlflow_run_id>/model`` resolves to it)."""
MODEL_TASK = "text-generation"
"""The transformers pipeline task the model is logged for (what ``mlflow.pyfunc`` serves)."""
_PIP_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")
"""What loading the model needs besides MLflow (which MLflow pins itself), pinned to the installed versions."""


def pip_requirements() -> list[str]:
    """``["torch==2.13.0", "transformers==...", ...]``: the installed versions of ``_PIP_PACKAGES`` without local
    labels (``2.13.0+cpu`` -> ``2.13.0``, installable from PyPI). Given explicitly so that MLflow does not infer
    them (which would load the model in a subprocess)."""

    return [f"{name}=={version(name).split('+')[0]}" for name in _PIP_PACKAGES]


@contextmanager
def hf_folder(cfg: RunConfig, policy: PolicyVersion) -> Iterator[Path]:
    """A local folder holding the HF files of ``policy`` only (weights, config, tokenizer: what ``from_pretrained``
    loads), without the ``_COMPLETE`` marker and the ``trainer_state/`` folder; removed on exit, together with the
    local copy of a remote checkpoint.

    The folder is named after the step (``step_000004``) and holds symlinks to the checkpoint's files.

    Raises:
        dataplane.errors.IntegrityError: a checkpoint after step 0 without its ``_COMPLETE`` marker, or whose files
            fail it.
        FileNotFoundError: the folder has no ``config.json`` (not an HF model folder).
        storage errors: see :func:`rl.checkpoint.local_copy`.
    """
    from rl.checkpoint import local_copy, remove_copy

    found = local_copy(policy.path, cfg.dataplane.storage_options, require_complete=policy.step > 0, weights_only=True)
    folder = Path(found).resolve()
    copied = folder != Path(policy.path.removeprefix("file://")).resolve()  # a remote checkpoint: a temporary copy
    try:
        with tempfile.TemporaryDirectory(prefix="grpoflow-model-") as tmp:
            hf = Path(tmp) / f"step_{policy.step:06d}"
            hf.mkdir()
            for item in sorted(folder.iterdir()):
                if item.is_file() and not item.name.startswith("_"):  # HF files only: no trainer state, no marker
                    (hf / item.name).symlink_to(item)
            if not (hf / "config.json").is_file():
                msg = (
                    f"policy of step {policy.step} at {policy.path}: no config.json there, "
                    "so it is not an HF model folder to log"
                )
                raise FileNotFoundError(msg)
            yield hf
    finally:
        if copied:
            remove_copy(found)


def _model_card(cfg: RunConfig, run: RunInfo, policy: PolicyVersion) -> Any:
    from huggingface_hub import ModelCard

    text = (
        f"---\nlibrary_name: transformers\npipeline_tag: {MODEL_TASK}\ntags: [grpo, grpoflow]\n---\n"
        f"# {cfg.tracking.registered_model_name or MODEL_NAME}\n\n"
        f"{cfg.model.name} after {policy.step} GRPO steps of grpoflow run `{run.run_id}` "
        f"(MLflow run `{run.mlflow_run_id}`).\n"
    )
    return ModelCard(text)


def log_model_and_end_run(cfg: RunConfig, run: RunInfo, policy: PolicyVersion) -> Any:
    """Log ``policy``'s HF files as the MLflow model ``model`` (transformers flavor, task ``text-generation``) of the
    run ``run.mlflow_run_id``, register it under ``cfg.tracking.registered_model_name`` when set, and end the run:
    FINISHED, or FAILED if logging raised, KILLED if a signal stopped it (``tasks.failure.watch_interrupts``) (the
    run's single termination; nothing else marks it finished).

    Needs no network: the checkpoint is a local folder (``transformers_model=<path>``: the weights are copied, never
    loaded), the requirements are given (:func:`pip_requirements`), and so is the model card. The global MLflow
    tracking URI is set for the call and restored afterwards.

    Returns:
        mlflow.models.model.ModelInfo: ``model_uri`` (``models:/<model_id>``) and, when registered,
        ``registered_model_version``.

    Raises:
        what :func:`hf_folder` raises, before the run is touched; MLflow errors (the run is then FAILED).
    """
    import mlflow
    import mlflow.transformers

    with hf_folder(cfg, policy) as hf:
        previous = mlflow.get_tracking_uri() if mlflow.tracking.is_tracking_uri_set() else None
        mlflow.set_tracking_uri(cfg.tracking.uri)
        try:
            mlflow.start_run(run_id=run.mlflow_run_id)  # the active run: the logged model belongs to its experiment
            try:
                info = mlflow.transformers.log_model(
                    str(hf),
                    name=MODEL_NAME,
                    task=MODEL_TASK,
                    model_card=_model_card(cfg, run, policy),
                    pip_requirements=pip_requirements(),
                    registered_model_name=cfg.tracking.registered_model_name,
                )
            except BaseException as err:  # a stopped run (Ctrl-C, SIGTERM: tasks.failure) is KILLED, not FAILED
                mlflow.end_run(status="KILLED" if isinstance(err, (KeyboardInterrupt, SystemExit)) else "FAILED")
                raise
            mlflow.end_run(status="FINISHED")
        finally:
            mlflow.set_tracking_uri(previous)
    return info


@task(enable_deck=True, **declared("cpu"))
def finish_run(cfg: RunConfig, run: RunInfo, policy: PolicyVersion, validation_accuracy: float) -> RunSummary:
    """Log the reward/accuracy plot, the last checkpoint's location and the final model (see
    :func:`log_model_and_end_run`), mark the MLflow run finished."""

    since = runtime.begin_task()
    runtime.release(run)  # this process's engines and trainer of the run are done
    saving.prune_finished(cfg, run)
    removed = runtime.dataplane(cfg, run).collect_garbage()  # files of killed writers and losing attempts
    if any(removed.values()):
        print(
            f"[grpoflow] removed {removed['orphan_data_files']} orphan data files and "
            f"{removed['temp_files']} temporary files",
            flush=True,
        )
    c = tracking.client(cfg.tracking.uri)
    tracking.log_metrics(cfg.tracking.uri, run.mlflow_run_id, runtime.startup_metric("finish_run", since), policy.step)
    history = {key: [(m.step, m.value) for m in c.get_metric_history(run.mlflow_run_id, key)] for key in plots.CURVES}
    fig = plots.curves(history)
    c.log_figure(run.mlflow_run_id, fig, "plots/reward_accuracy.png")
    Deck("training curves", plots.to_html(fig))
    c.set_tag(run.mlflow_run_id, "grpoflow.last_checkpoint", redact(policy.path))
    model = log_model_and_end_run(cfg, run, policy)  # ends the run: FINISHED
    ended = c.get_run(run.mlflow_run_id)
    final = ended.data.metrics
    print(
        f"[grpoflow] done: {policy.step} steps | final reward {final.get('train/reward', float('nan')):.3f}"
        f" | validation accuracy {validation_accuracy:.3f}",
        flush=True,
    )
    print(
        f"[grpoflow] MLflow run {run.mlflow_run_id} in {redact(cfg.tracking.uri)} "
        f"(experiment {cfg.tracking.experiment_name!r})",
        flush=True,
    )
    print(f"[grpoflow] last checkpoint: {redact(policy.path)}", flush=True)
    registered = cfg.tracking.registered_model_name
    where = (
        f"models:/{registered}/{model.registered_model_version}"
        if registered
        else f"runs:/{run.mlflow_run_id}/{MODEL_NAME}"
    )
    print(f"[grpoflow] final model: {where} (mlflow.transformers.load_model)", flush=True)
    if cfg.tracking.uri.startswith(("sqlite:", "file:", "/")) or "://" not in cfg.tracking.uri:
        print(f"[grpoflow] open it with: mlflow ui --backend-store-uri {cfg.tracking.uri}", flush=True)
        print(
            f"[grpoflow] runs table: {tracking.runs_table_url('http://127.0.0.1:5000', ended.info.experiment_id)}",
            flush=True,
        )
    else:
        print(
            f"[grpoflow] runs table: {redact(tracking.runs_table_url(cfg.tracking.uri, ended.info.experiment_id))}",
            flush=True,
        )
    return RunSummary(
        run_id=run.run_id,
        mlflow_run_id=run.mlflow_run_id,
        tracking_uri=cfg.tracking.uri,
        final_step=policy.step,
        last_checkpoint=policy.path,
        validation_accuracy=validation_accuracy,
        metrics={k: float(v) for k, v in final.items()},
    )
