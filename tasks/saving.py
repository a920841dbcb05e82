"""Where the policy goes after a train step: a full checkpoint when due, else weights only."""

from __future__ import annotations

from typing import Any

from rl.config import GRPOConfig
from tasks.runtime import LiveState
from tasks.types import PolicyVersion, RunInfo


def checkpoint_due(cfg: GRPOConfig, step: int) -> bool:
    return step % cfg.checkpointing.checkpoint_period == 0 or step == cfg.grpo.max_num_steps


def save_policy(cfg: GRPOConfig, run: RunInfo, state: LiveState, tokenizer: Any, *, started_from: PolicyVersion) -> PolicyVersion:
    """Save the weights of ``state.step``: with trainer state under ``checkpoints/`` when due (keeping the
    newest ``keep_last_k``), otherwise weights only under ``weights/`` (keeping the newest one). The policy the
    step ``started_from`` is kept too, so that a retry of this step finds its input; the next step prunes it."""
    from dataplane import paths
    from rl import checkpoint

    root, so = cfg.dataplane.root, cfg.dataplane.storage_options
    if checkpoint_due(cfg, state.step):
        url = paths.checkpoint_dir(root, run.run_id, state.step)
        checkpoint.save(
            url,
            model=state.model,
            tokenizer=tokenizer,
            optimizer=state.optimizer,
            scheduler=state.scheduler,
            state=checkpoint.TrainerState(step=state.step, mlflow_run_id=run.mlflow_run_id, extra={"data_position": state.step}),
            storage_options=so,
        )
        checkpoint.prune(paths.checkpoints_dir(root, run.run_id), cfg.checkpointing.keep_last_k, so, keep=started_from.path)
        checkpoint.prune(paths.weights_dir(root, run.run_id), 0, so, keep=started_from.path)
    else:
        url = paths.weights_step_dir(root, run.run_id, state.step)
        checkpoint.save(url, model=state.model, tokenizer=tokenizer, storage_options=so)
        checkpoint.prune(paths.weights_dir(root, run.run_id), 1, so, keep=started_from.path)
    return PolicyVersion(step=state.step, path=url)


def prune_finished(cfg: GRPOConfig, run: RunInfo) -> None:
    """At the end of a run: the newest ``keep_last_k`` checkpoints only, no weights-only folders."""
    from dataplane import paths
    from rl import checkpoint

    root, so = cfg.dataplane.root, cfg.dataplane.storage_options
    checkpoint.prune(paths.checkpoints_dir(root, run.run_id), cfg.checkpointing.keep_last_k, so)
    checkpoint.prune(paths.weights_dir(root, run.run_id), 0, so)
