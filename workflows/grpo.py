"""GRPO as Flyte workflows: a `@dynamic` loop that unrolls the steps, each step a handful of task nodes placed on
their images and resources from the config, and the `grpo` entry points. Control flow only: tensors stay in the
data plane, tasks pass handles.

    pyflyte run workflows/grpo.py grpo [--cfg configs/x.yaml | --cfg '{"grpo": {"max_num_steps": 2}}']
    pyflyte run workflows/grpo.py grpo_from_file --config_url s3://bucket/configs/x.yaml
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from flytekit import dynamic, task, workflow

from dataplane.meta import KVBatchMeta
from rl.async_grpo import generation_version
from tasks import saving, tracking
from tasks.advantages import advantages
from tasks.config_file import load_config_file
from tasks.failure import run_failed, run_failed_from_file
from tasks.finish import finish_run
from tasks.logprobs import policy_logprobs, reference_logprobs
from tasks.placement import declared, placed
from tasks.retry import transient_errors_retried
from tasks.rollout import rollout
from tasks.run_config import RunConfig
from tasks.setup import start_run
from tasks.train import DONE_METRIC, train
from tasks.types import PolicyVersion, RunInfo, RunSummary
from tasks.validate import validate


def grpo_step(
    cfg: RunConfig,
    run: RunInfo,
    policy: PolicyVersion,
    step: int,
    behaviour: PolicyVersion,
    node: Callable[[Any], Callable[..., Any]] | None = None,
) -> PolicyVersion:
    """One GRPO step: the policy after ``step - 1`` updates -> the policy after ``step``, trained on completions
    sampled from ``behaviour``: ``policy`` itself when synchronous, an older policy when async. ``node(task)`` is how
    a task is called: a placed node of the DAG (the default), or its Python body inside :func:`grpo_steps`. The same
    step as plain calls in one process, without Flyte: :func:`rl.step.grpo_step`."""
    node = node or _nodes(cfg, f"step-{step}")
    # 1 rollout: G completions per prompt by the behaviour policy, scored, first put of the step partition
    rollout_meta: KVBatchMeta = node(rollout)(cfg=cfg, run=run, policy=behaviour, step=step)
    # 2 policy logprobs (only off-policy: on-policy, pi_old is the training forward itself) and
    # 3 reference-policy logprobs: independent delta writes
    with_prev_logprobs = (
        rollout_meta if cfg.on_policy else node(policy_logprobs)(cfg=cfg, run=run, policy=policy, meta=rollout_meta)
    )
    with_reference_logprobs = node(reference_logprobs)(cfg=cfg, run=run, meta=rollout_meta)
    # 4 advantages from the group rewards
    with_advantages = node(advantages)(cfg=cfg, run=run, meta=rollout_meta)
    # 5 update: clipped PG + KL, next weights, metrics, clear the partition
    return node(train)(
        cfg=cfg,
        run=run,
        policy=policy,
        with_advantages=with_advantages,
        with_prev_logprobs=with_prev_logprobs,
        with_reference_logprobs=with_reference_logprobs,
    )


def _nodes(cfg: RunConfig, prefix: str) -> Callable[[Any], Callable[..., Any]]:
    """``node(task)``: ``task`` placed on the image and resources of ``cfg.resources`` and named
    ``{prefix}-{task}`` in the console (see ``tasks/placement.py``)."""
    return lambda task: placed(cfg, task, node_name=f"{prefix}-{task.name.rsplit('.', 1)[-1].replace('_', '-')}")


def _validation_due(cfg: RunConfig, step: int) -> bool:
    period = cfg.grpo.val_period
    return period > 0 and (step % period == 0 or step == cfg.grpo.max_num_steps)


@dynamic(**declared("cpu"))
def training_loop(cfg: RunConfig, run: RunInfo) -> RunSummary:
    """Unroll steps ``start_step+1 .. max_num_steps``, validating every ``val_period``.

    Async GRPO (``grpo.max_trajectory_age_steps`` = a > 0): the rollout of step k takes the policy after step
    k - 1 - a, so on a cluster it starts as soon as that policy exists, beside the training of steps k - a .. k - 1.
    """
    policy = PolicyVersion(step=run.start_step, path=run.start_policy_path)
    policies = {run.start_step: policy}  # step -> the policy after it, for the rollouts of later steps
    accuracy = -1.0
    if cfg.grpo.val_at_start and run.start_step == 0:
        accuracy = _nodes(cfg, "step-0")(validate)(cfg=cfg, run=run, policy=policy)
    k = cfg.resources.steps_per_task
    if k > 1:  # one node per k steps, back-ends warm inside it (synchronous GRPO only: tasks.run_config checks)
        for first in range(run.start_step + 1, cfg.grpo.max_num_steps + 1, k):
            last = min(first + k - 1, cfg.grpo.max_num_steps)
            policy, accuracy = _nodes(cfg, f"steps-{first}-{last}")(grpo_steps)(
                cfg=cfg, run=run, policy=policy, first=first, last=last, accuracy=accuracy
            )
        return _nodes(cfg, "end")(finish_run)(cfg=cfg, run=run, policy=policy, validation_accuracy=accuracy)
    for step in range(run.start_step + 1, cfg.grpo.max_num_steps + 1):
        behaviour = policies[generation_version(step, cfg.grpo.max_trajectory_age_steps, run.start_step)]
        policy = policies[step] = grpo_step(cfg, run, policy, step, behaviour)
        if _validation_due(cfg, step):
            accuracy = _nodes(cfg, f"step-{step}")(validate)(cfg=cfg, run=run, policy=policy)
    return _nodes(cfg, "end")(finish_run)(cfg=cfg, run=run, policy=policy, validation_accuracy=accuracy)


@task(retries=2, **declared("train"))
@transient_errors_retried
def grpo_steps(
    cfg: RunConfig, run: RunInfo, policy: PolicyVersion, first: int, last: int, accuracy: float
) -> tuple[PolicyVersion, float]:
    """Steps ``first .. last`` of synchronous GRPO in this one task (``resources.steps_per_task``): each step's tasks
    run as plain calls in this process, so the generation and policy back-ends stay warm from step to step (the
    generator refits from the live trainer), as under the local executor.

    Only the last step saves its weights with the trainer state (what the next such task loads); the steps before it
    save only the checkpoints that are due (``RunInfo.weights_superseded``), and ``policy`` is kept until the task
    ends (``RunInfo.task_input_policy``). A retry resumes after the newest step an earlier attempt finished with its
    trainer state saved (the last step, or a checkpoint), else from ``policy``; steps it trains again give the same
    weights (seeded per step) and are not logged twice.

    Returns:
        the policy after ``last``, and the validation accuracy of the last validation up to ``last`` (``accuracy``,
        the one before ``first``, when none was due).
    """

    done = _finished_steps(cfg, run, first, last)
    if done is not None:
        step, policy, accuracy = done[0], done[1], done[2] if done[2] is not None else accuracy
        first = step + 1
    kept = dataclasses.replace(run, task_input_policy=policy.path)
    inner = dataclasses.replace(
        kept, cold_tasks=False, weights_superseded=True
    )  # the next step's trainer is this process
    inline: Callable[[Any], Callable[..., Any]] = lambda t: t.task_function  # noqa: E731
    for step in range(first, last + 1):
        policy = grpo_step(cfg, kept if step == last else inner, policy, step, policy, node=inline)
        if _validation_due(cfg, step):
            accuracy = validate.task_function(cfg=cfg, run=run, policy=policy)
    return policy, accuracy


def _finished_steps(
    cfg: RunConfig, run: RunInfo, first: int, last: int
) -> tuple[int, PolicyVersion, float | None] | None:
    """The newest step of ``first .. last`` an earlier attempt of :func:`grpo_steps` finished (its policy saved with
    the trainer state, its metrics logged), that policy, and the newest validation accuracy logged up to it (None:
    none in the range); None when no step qualifies."""
    from rl import checkpoint

    for step in range(last, first - 1, -1):
        saved = saving.saved_version(cfg, run, step)
        if saved is None or not checkpoint.has_trainer_state(saved.path, cfg.dataplane.storage_options):
            continue
        if not tracking.has_metric(cfg.tracking.uri, run.mlflow_run_id, DONE_METRIC, step):  # the step's last metric
            continue
        history = tracking.client(cfg.tracking.uri).get_metric_history(run.mlflow_run_id, "validation/accuracy")
        logged = sorted((m.step, m.value) for m in history if first <= m.step <= step)
        return step, saved, (logged[-1][1] if logged else None)
    return None


@workflow(on_failure=run_failed)  # a failed run's MLflow run is marked FAILED (tasks/failure.py)
def grpo(cfg: RunConfig = RunConfig()) -> RunSummary:
    """Train a policy with GRPO.

    Args:
        cfg: the run's configuration; every field has a default. Reference: docs/config.md.
    """
    run = start_run(cfg=cfg)
    return training_loop(cfg=cfg, run=run)


@workflow(on_failure=run_failed_from_file)
def grpo_from_file(config_url: str) -> RunSummary:
    """Train a policy with GRPO, configured by a YAML or JSON file at ``config_url``.

    Args:
        config_url: a config file: ``s3://bucket/configs/x.yaml``, any fsspec URL, or a path in the image.
    """
    cfg = load_config_file(url=config_url)
    run = start_run(cfg=cfg)
    return training_loop(cfg=cfg, run=run)
