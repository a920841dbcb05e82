"""GRPO as Flyte workflows: one step as a workflow of tasks, a `@dynamic` loop that unrolls the steps,
and the `grpo` entry point. Control flow only: tensors stay in the data plane, tasks pass handles.

    pyflyte run workflows/grpo.py grpo [--cfg configs/x.yaml | --cfg '{"grpo": {"max_num_steps": 2}}']
"""

from __future__ import annotations

from flytekit import dynamic, workflow

from dataplane.meta import KVBatchMeta
from rl.config import GRPOConfig
from tasks.advantages import advantages
from tasks.finish import finish_run
from tasks.logprobs import policy_logprobs, reference_logprobs
from tasks.rollout import rollout
from tasks.setup import start_run
from tasks.train import train
from tasks.types import PolicyVersion, RunInfo, RunSummary
from tasks.validate import validate


@workflow
def grpo_step(cfg: GRPOConfig, run: RunInfo, policy: PolicyVersion, step: int) -> PolicyVersion:
    """One synchronous GRPO step: the policy after ``step - 1`` updates -> the policy after ``step``."""
    # 1 rollout: G completions per prompt, scored, first put of the step partition
    batch: KVBatchMeta = rollout(cfg=cfg, run=run, policy=policy, step=step)
    # 2 policy logprobs and 3 reference-policy logprobs: independent delta writes
    prev = policy_logprobs(cfg=cfg, run=run, policy=policy, meta=batch)
    ref = reference_logprobs(cfg=cfg, run=run, meta=batch)
    # 4 advantages from the group rewards
    adv = advantages(cfg=cfg, run=run, meta=batch)
    # 5 update: clipped PG + KL, next weights, metrics, clear the partition
    return train(cfg=cfg, run=run, policy=policy, batch=adv, prev=prev, ref=ref)


def _validation_due(cfg: GRPOConfig, step: int) -> bool:
    period = cfg.grpo.val_period
    return period > 0 and (step % period == 0 or step == cfg.grpo.max_num_steps)


@dynamic
def training_loop(cfg: GRPOConfig, run: RunInfo) -> RunSummary:
    """Unroll steps ``start_step+1 .. max_num_steps`` as sub-workflow nodes, validating every ``val_period``."""
    policy = PolicyVersion(step=run.start_step, path=run.start_policy_path)
    accuracy = -1.0
    if cfg.grpo.val_at_start and run.start_step == 0:
        accuracy = validate(cfg=cfg, run=run, policy=policy)
    for step in range(run.start_step + 1, cfg.grpo.max_num_steps + 1):
        policy = grpo_step(cfg=cfg, run=run, policy=policy, step=step)
        if _validation_due(cfg, step):
            accuracy = validate(cfg=cfg, run=run, policy=policy)
    return finish_run(cfg=cfg, run=run, policy=policy, validation_accuracy=accuracy)


@workflow
def grpo(cfg: GRPOConfig = GRPOConfig()) -> RunSummary:
    """Train a policy with GRPO; every field of ``cfg`` has a default (see rl/config.py)."""
    run = start_run(cfg=cfg)
    return training_loop(cfg=cfg, run=run)
