"""Where the policy goes after a train step: a full checkpoint when due, else weights only."""

from __future__ import annotations

from dataplane import paths
from rl.backends.interfaces import PolicyBackend
from tasks.run_config import RunConfig
from tasks.types import PolicyVersion, RunInfo


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    return step % cfg.checkpointing.checkpoint_period == 0 or step == cfg.grpo.max_num_steps


def saves_trainer_state(cfg: RunConfig, run: RunInfo, step: int) -> bool:
    """Whether :func:`save_policy` saves the trainer state (optimizer, scheduler, RNG) with the weights of ``step``."""
    return checkpoint_due(cfg, step) or run.cold_tasks


def serving_dtype(cfg: RunConfig, run: RunInfo) -> str | None:
    """The dtype of the weights copy a save adds for the next step's generation pod (``rl.checkpoint.save``'s
    ``serving_dtype``): ``bfloat16`` where tasks run cold (each its own pod, loading from storage) and rollouts run on
    GPUs (``resources.rollout.gpu`` >= 1) at a precision that resolves to bfloat16 there (``auto`` or ``bfloat16``);
    else None. Such a pod then downloads half the float32 master's bytes and none of the optimizer state (which only
    the next train pod reads). A GPU without bfloat16 resolves ``auto`` to float32 and reads the float32 root instead.
    """
    if not run.cold_tasks or cfg.resources.rollout.gpu < 1:
        return None
    return "bfloat16" if cfg.model.precision in ("auto", "bfloat16") else None


def save_policy(cfg: RunConfig, run: RunInfo, backend: PolicyBackend, *, started_from: PolicyVersion) -> PolicyVersion:
    """Save the weights of ``backend.weight_version``: with trainer state under ``checkpoints/`` when due (keeping the
    newest ``keep_last_k``), otherwise under ``weights/`` (keeping the newest one), with the trainer state too when
    tasks run cold (``run.cold_tasks``: the next step's train task is another process and finds it there). The policy
    the step ``started_from`` is kept too, so that a retry of this step finds its input; the next step prunes it. With
    ``grpo.max_trajectory_age_steps`` = a, so are the a policies before this one: later steps' rollouts generate with
    them (``rl.async_grpo.generation_version``). Inside a task that runs several steps, its input policy is kept
    (``run.task_input_policy``), and a step before its last saves only a checkpoint that is due
    (``run.weights_superseded``): the returned version then names a folder that was not written."""
    from rl import checkpoint

    root, so = cfg.dataplane.root, cfg.dataplane.storage_options
    step = backend.weight_version
    assert step is not None
    from rl.rollout import prompt_position

    position = {"data_position": step, "prompt_position": prompt_position(cfg, step)}  # what resume checks
    state = checkpoint.TrainerState(step=step, mlflow_run_id=run.mlflow_run_id, extra=position)
    # never prune: this save (a killed run may have left newer folders, which would count as the newest), the input
    # of this step (for its retry), and the policies later rollouts generate with (async)
    keep = {
        started_from.path,
        *(policy_url(cfg, run, v) for v in range(max(step - cfg.grpo.max_trajectory_age_steps, 0), step + 1)),
    }
    if run.task_input_policy:  # a task running several steps: its input, for its retry
        keep.add(run.task_input_policy)
    if checkpoint_due(cfg, step):
        url = paths.checkpoint_dir(root, run.run_id, step)
        backend.save_checkpoint(url, trainer_state=state, serving_dtype=serving_dtype(cfg, run))
        checkpoint.prune(paths.checkpoints_dir(root, run.run_id), cfg.checkpointing.keep_last_k, so, keep=keep)
        checkpoint.prune(paths.weights_dir(root, run.run_id), 0, so, keep=keep)
    elif run.weights_superseded:  # read by no other process: not written (a load of ``url`` fails: not complete)
        url = paths.weights_step_dir(root, run.run_id, step)
    else:  # weights only; in a cold process also the trainer state: how it reaches the next step's train task
        url = paths.weights_step_dir(root, run.run_id, step)
        backend.save_checkpoint(
            url, trainer_state=state if run.cold_tasks else None, serving_dtype=serving_dtype(cfg, run)
        )
        checkpoint.prune(paths.weights_dir(root, run.run_id), 1, so, keep=keep)
    return PolicyVersion(step=step, path=url)


def policy_url(cfg: RunConfig, run: RunInfo, step: int) -> str:
    """Where :func:`save_policy` puts the policy of ``step`` (``checkpoints/`` when due, else ``weights/``)."""
    root = cfg.dataplane.root
    return (
        paths.checkpoint_dir(root, run.run_id, step)
        if checkpoint_due(cfg, step)
        else paths.weights_step_dir(root, run.run_id, step)
    )


def saved_version(cfg: RunConfig, run: RunInfo, step: int) -> PolicyVersion | None:
    """The policy of ``step`` where :func:`save_policy` puts it, if that save completed; else None."""
    from rl import checkpoint

    url = policy_url(cfg, run, step)
    return PolicyVersion(step=step, path=url) if checkpoint.is_complete(url, cfg.dataplane.storage_options) else None


def prune_finished(cfg: RunConfig, run: RunInfo) -> None:
    """At the end of a run: the newest ``keep_last_k`` checkpoints only, no weights-only folders."""
    from rl import checkpoint

    root, so = cfg.dataplane.root, cfg.dataplane.storage_options
    checkpoint.prune(paths.checkpoints_dir(root, run.run_id), cfg.checkpointing.keep_last_k, so)
    checkpoint.prune(paths.weights_dir(root, run.run_id), 0, so)
