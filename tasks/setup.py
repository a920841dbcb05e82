"""`start_run`: resolve the model, check the data, open the MLflow run, pick the starting point."""

from __future__ import annotations

import os
import sys
import time
import uuid
from importlib import metadata
from typing import Any

from flytekit import current_context, task

from dataplane import paths
from dataplane.errors import IntegrityError
from dataplane.urls import redact
from rl.backends.registry import check_installed
from rl.data import prompt_token_ids, train_problems, val_problems
from rl.lengths import check_fits, context_limit, model_max_len
from rl.model import load_tokenizer, resolve_model
from rl.model_store import is_remote, materialize, publish
from rl.prompts import prepare_prompts
from tasks import failure, lineage, runtime, tracking
from tasks.placement import declared
from tasks.retry import transient_errors_retried
from tasks.run_config import RunConfig, check_placement
from tasks.types import RunInfo


@task(retries=2, **declared("cpu"))
@transient_errors_retried
def start_run(cfg: RunConfig) -> RunInfo:
    """Resolve (and convert once) the model, validate the dataset, publish the model to the run's storage (a
    remote execution: :func:`run_model`), create the MLflow run with the flattened config as params, and return the
    run's handle."""

    since = runtime.begin_task()
    execution = current_context().execution_id
    local = execution.name == "local"  # every local execution has this id; a remote one is unique
    # tasks run cold in pods, and locally too with data-parallel ranks: each train task spawns new rank processes
    cold = not local or cfg.policy.world_size > 1
    if local:  # every task runs here: a back-end that cannot be imported fails now, not at step 1 (remote tasks
        # import theirs in their own images)
        check_installed("generation", cfg.generation.backend)
        check_installed("policy", cfg.policy.backend)
    check_placement(cfg, local=local)
    resolved, folder = _resolve(cfg)
    if cfg.policy.backend == "megatron":  # the model's shapes against the parallel sizes, before any GPU task starts
        from transformers import AutoConfig

        from rl.backends.megatron.model import check_model

        check_model(AutoConfig.from_pretrained(folder), cfg.policy.megatron_cfg)
    if cfg.policy.lora is not None and os.path.isdir(folder):  # target modules the model lacks: now, not at step 1
        from rl.lora import check_targets

        check_targets(folder, cfg.policy.lora)
    _check_lengths(cfg, folder)
    model_path = _shared(cfg, resolved, folder, local=local)
    if cfg.checkpointing.resume_run_id:
        info = _resume(cfg, cfg.checkpointing.resume_run_id, model_path, cold_tasks=cold)
        failure.watch_interrupts(cfg, info)  # a local run stopped by a signal: its MLflow run KILLED
        _prepare_prompts(cfg, info.run_id, folder, resume=True)  # the copy the run's first start made
        return info
    # a retried start_run of a remote execution finds the MLflow run and run id of its first attempt
    run_id = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}" if local else f"run-{execution.name}"
    prepared = _prepare_prompts(cfg, run_id, folder)  # every bad row fails here, before the MLflow run exists
    tags = {
        "grpoflow.run_id": run_id,
        "flyte.execution_id": f"{execution.project}/{execution.domain}/{execution.name}",
        "flyte.workflow": "workflows.grpo.grpo",
        "mlflow.source.git.commit": tracking.git_commit(),
        "grpoflow.version": _version(),
    }
    params = cfg.flat_params()
    params["model.resolved_path"] = redact(model_path)
    params.update(lineage.environment_params(cfg))
    mlflow_run_id = tracking.start_run(
        uri=cfg.tracking.uri,
        experiment_name=cfg.tracking.experiment_name,
        run_name=cfg.tracking.run_name or (None if local else execution.name),
        params=params,
        tags=tags,
        reuse_tag=None if local else "flyte.execution_id",
    )
    tracking.log_metrics(cfg.tracking.uri, mlflow_run_id, runtime.startup_metric("start_run", since), 0)
    lineage.log_datasets(cfg, mlflow_run_id, prepared)
    print(f"[grpoflow] run {run_id} | MLflow run {mlflow_run_id} | model {redact(model_path)}", flush=True)
    info = RunInfo(
        run_id=run_id,
        mlflow_run_id=mlflow_run_id,
        model_path=model_path,
        start_step=0,
        start_policy_path=model_path,
        cold_tasks=cold,
    )
    failure.watch_interrupts(cfg, info)  # a local run stopped by a signal: its MLflow run KILLED
    return info


def _prepare_prompts(cfg: RunConfig, run_id: str, folder: str, *, resume: bool = False) -> tuple[Any, Any] | None:
    """A file dataset (``data.train``) read, checked and prepared into the run's storage
    (:func:`rl.prompts.prepare_prompts`), prompts too long for the context refused or skipped
    (``data.on_overlong_prompt``); None for reasoning-gym's problems."""
    if not cfg.data.from_files:
        return None
    limit = context_limit(cfg, model_max_len(folder)) if os.path.isdir(folder) else None  # a hub id: its tasks check
    return prepare_prompts(
        cfg,
        root=cfg.dataplane.root,
        run_id=run_id,
        tokenizer=load_tokenizer(folder) if limit is not None else None,
        max_prompt_tokens=limit[0] - cfg.generation.max_new_tokens if limit is not None else None,
        resume=resume,
    )


def _check_lengths(cfg: RunConfig, folder: str) -> None:
    """Check the dataset (its first step's problems, and the validation problems) and that those prompts plus
    ``generation.max_new_tokens`` fit the context (:mod:`rl.lengths`); the back-ends check every later prompt too.
    A file dataset's prompts are checked row by row as it is prepared (:func:`_prepare_prompts`)."""

    d = cfg.data
    limit = context_limit(cfg, model_max_len(folder)) if os.path.isdir(folder) else None  # a hub id: its tasks check
    if limit is not None:
        check_fits([], cfg.generation.max_new_tokens, *limit)  # before the dataset: no prompt fits then
    if d.from_files:
        return
    problems = train_problems(
        dataset=d.dataset,
        dataset_kwargs=d.dataset_kwargs,
        seed=d.seed,
        val_fraction=d.val_fraction,
        start=0,
        count=cfg.grpo.num_prompts_per_step,
    )
    if cfg.grpo.val_period or cfg.grpo.val_at_start:
        problems += val_problems(
            dataset=d.dataset,
            dataset_kwargs=d.dataset_kwargs,
            seed=d.val_seed,
            val_fraction=d.val_fraction,
            count=d.num_val_problems,
        )
    if limit is not None:
        tokenizer = load_tokenizer(folder)
        check_fits(
            [len(prompt_token_ids(tokenizer, p.question, d.system_prompt)) for p in problems],
            cfg.generation.max_new_tokens,
            *limit,
        )


def run_model(cfg: RunConfig, *, local: bool) -> str:
    """``model.name`` as every task of the run can load it: what :attr:`RunInfo.model_path` carries.

    A local execution (every task on this machine) gets the local folder or hub id ``model.name`` resolves to
    (:func:`rl.model.resolve_model`, which converts the default model once into this machine's cache): nothing is
    hashed or copied. A remote execution's tasks run in pods of their own, where this pod's disk is gone, so a local
    folder is published to the run's storage once (:func:`rl.model_store.publish`, content-addressed: a second run
    of the same model uploads nothing) and its URL is returned; pods load it through their node's model cache
    (:func:`tasks.runtime.base_model`). A published model's URL or a hub id (each pod downloads it from the hub
    itself) is returned unchanged.

    Args:
        cfg: the config (``model.name``, ``dataplane.root``, ``dataplane.storage_options``).
        local: the execution is local (the local executor).

    Raises:
        FileNotFoundError: the default model was asked for but its wheel is not installed.
        ValueError, dataplane.errors.IntegrityError: ``model.name`` is a remote URL that is not a complete published
            model (:func:`rl.model_store.materialize`).
        OSError and storage errors: the publish failed (permanently, or transiently past the retry deadline).
    """
    resolved, folder = _resolve(cfg)
    return _shared(cfg, resolved, folder, local=local)


def _resolve(cfg: RunConfig) -> tuple[str, str]:
    """``(model.name resolved, a local folder or hub id holding it)``: a published model's URL is downloaded into
    this node's model cache."""

    resolved = resolve_model(cfg.model.name)
    return resolved, materialize(resolved, cfg.dataplane.storage_options)


def _shared(cfg: RunConfig, resolved: str, folder: str, *, local: bool) -> str:
    if local or is_remote(resolved) or not os.path.isdir(folder):
        if not local and not is_remote(resolved):
            print(
                f"[grpoflow] model {resolved!r} is not a local folder: "
                "every pod loads it from the Hugging Face hub itself",
                flush=True,
            )
        return resolved
    return publish(folder, cfg.dataplane.root, cfg.dataplane.storage_options)


def _resume(cfg: RunConfig, run_id: str, model_path: str, *, cold_tasks: bool = False) -> RunInfo:
    """Pick up ``run_id`` at its newest complete checkpoint with trainer state whose files verify against its
    manifest (:func:`rl.checkpoint.verify`; remote files are hashed as they stream).

    A checkpoint that fails verification (a file missing, truncated or corrupt, or a malformed marker) is skipped
    with a ``[grpoflow]`` warning on stderr naming it and why; the next older one is tried.

    Args:
        cfg: the run's config (``dataplane.root``, ``dataplane.storage_options``, ``tracking.uri``).
        run_id: the run to resume.
        model_path: the base model as the run's tasks load it (:func:`run_model`).
        cold_tasks: every task runs in a fresh process (:attr:`RunInfo.cold_tasks`).

    Returns:
        the run's handle, starting after the chosen checkpoint's step, its MLflow run marked running again.

    Raises:
        ValueError: the run has no complete checkpoint with trainer state, or none of them verifies.
    """

    from rl import checkpoint

    so = cfg.dataplane.storage_options
    where = paths.checkpoints_dir(cfg.dataplane.root, run_id)
    found = [(s, u) for s, u in checkpoint.list_complete(where, so) if checkpoint.has_trainer_state(u, so)]
    if not found:
        msg = (
            f"checkpointing.resume_run_id={run_id!r}: no complete checkpoint under {redact(where)}; "
            "check the run id and dataplane.root"
        )
        raise ValueError(msg)
    bad = []
    for step, url in reversed(found):  # newest first
        try:
            checkpoint.verify(url, so)
            break
        except IntegrityError as err:
            bad.append(f"{redact(url)}: {err}")
            print(
                f"[grpoflow] warning: not resuming from checkpoint {redact(url)} (step {step}): {err}",
                file=sys.stderr,
                flush=True,
            )
    else:
        msg = (
            f"checkpointing.resume_run_id={run_id!r}: none of the {len(found)} complete checkpoints "
            f"under {redact(where)} "
            f"verifies: {'; '.join(bad)}"
        )
        raise ValueError(msg)
    state = checkpoint.trainer_state_doc(url, so)
    _check_position(cfg, step, state.get("extra") or {})
    execution = current_context().execution_id
    remote = None if execution.name == "local" else f"{execution.project}/{execution.domain}/{execution.name}"
    tracking.reopen_run(cfg.tracking.uri, state["mlflow_run_id"], execution=remote)  # its failure handler finds it
    older = f", skipping {len(bad)} newer checkpoint(s) that fail verification" if bad else ""
    print(
        f"[grpoflow] resuming run {run_id} from step {step} ({redact(url)}){older} "
        f"| MLflow run {state['mlflow_run_id']}",
        flush=True,
    )
    return RunInfo(
        run_id=run_id,
        mlflow_run_id=state["mlflow_run_id"],
        model_path=model_path,
        start_step=step,
        start_policy_path=url,
        cold_tasks=cold_tasks,
    )


def _check_position(cfg: RunConfig, step: int, extra: dict[str, Any]) -> None:
    """The checkpoint's position in the prompt stream against the one this config gives its step: a resumed run must
    see exactly the prompts an uninterrupted run sees.

    Raises:
        ValueError: they differ (``grpo.num_prompts_per_step`` or dynamic sampling changed since the checkpoint).
    """
    from rl.rollout import prompt_position

    saved, now = extra.get("prompt_position"), prompt_position(cfg, step)
    if saved is not None and int(saved) != now:
        msg = (
            f"checkpointing.resume_run_id={cfg.checkpointing.resume_run_id!r}: its step {step} checkpoint is at "
            f"position {saved} of the prompt stream, but this config puts step {step} at {now}; resume with the run's "
            "own grpo.num_prompts_per_step, use_dynamic_sampling and dynamic_sampling_max_gen_batches"
        )
        raise ValueError(msg)


def _version() -> str:
    try:
        return metadata.version("grpoflow")
    except metadata.PackageNotFoundError:
        return "0+unknown"
