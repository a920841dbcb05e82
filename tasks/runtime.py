"""Process-local state shared by tasks of one local run: the data-plane client, the tokenizer, the
reference policy and the live trainer state, so a local run loads each model once. On a cluster every
task starts cold and falls back to storage.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from rl.config import GRPOConfig
from tasks.types import PolicyVersion, RunInfo


def set_threads() -> None:
    import torch

    threads = int(os.environ.get("GRPOFLOW_NUM_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)


def dataplane(cfg: GRPOConfig, run: RunInfo):
    from dataplane.client import DataPlane

    return DataPlane(cfg.dataplane.root, run.run_id, storage_options=cfg.dataplane.storage_options)


@lru_cache(maxsize=4)
def tokenizer(path: str) -> Any:
    from rl.model import load_tokenizer

    return load_tokenizer(path)


@lru_cache(maxsize=2)
def reference_policy(path: str) -> Any:
    from rl.model import load_model

    model = load_model(path)
    model.requires_grad_(False)
    return model


@dataclass
class LiveState:
    run_id: str
    step: int
    model: Any
    optimizer: Any
    scheduler: Any


_LIVE: dict[str, LiveState] = {}


def peek_policy(cfg: GRPOConfig, run: RunInfo, policy: PolicyVersion) -> Any:
    """The policy model at ``policy`` for inference: the live one if it is that version, else loaded."""
    live = _LIVE.get(run.run_id)
    if live is not None and live.step == policy.step:
        return live.model
    if policy.step == 0:  # the trainer starts from this model: load it once for both
        return take_trainer(cfg, run, policy).model
    from rl.checkpoint import local_copy
    from rl.model import load_model

    return load_model(local_copy(policy.path, cfg.dataplane.storage_options))


def discard_trainer(run: RunInfo) -> None:
    """Forget this process's trainer state of ``run`` (after a failed update it may be half-way)."""
    _LIVE.pop(run.run_id, None)


def take_trainer(cfg: GRPOConfig, run: RunInfo, policy: PolicyVersion) -> LiveState:
    """The trainer state at ``policy`` (model, optimizer, scheduler): live, fresh at step 0, or a checkpoint.

    Raises:
        RuntimeError: no optimizer state for that step in this process or on storage.
    """
    live = _LIVE.get(run.run_id)
    if live is not None and live.step == policy.step:
        return live
    from rl import checkpoint
    from rl.model import load_model
    from rl.train import make_optimizer

    if policy.step != 0 and not checkpoint.has_trainer_state(policy.path, cfg.dataplane.storage_options):
        msg = (
            f"no optimizer state for step {policy.step} of run {run.run_id} in this process or at {policy.path}; "
            "tasks that run in separate processes (a remote cluster) need checkpointing.checkpoint_period: 1"
        )
        raise RuntimeError(msg)
    folder = checkpoint.local_copy(policy.path, cfg.dataplane.storage_options)
    model = load_model(folder)
    optimizer, scheduler = make_optimizer(model, cfg)
    if policy.step != 0:
        checkpoint.load_trainer_state(folder, optimizer, scheduler)
    state = LiveState(run.run_id, policy.step, model, optimizer, scheduler)
    _LIVE[run.run_id] = state
    return state
