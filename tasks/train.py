"""`train`: one optimizer update on the step's batch, keep its rollouts and log its metrics, save the next weights (and
a checkpoint when due), log the save's timings, clear the step's partition (last: a retry after any earlier point
finds its inputs).

The order keeps every stopping point from losing the step's records (no kill window loses a step's metrics): a
resumed run restarts after the newest checkpoint, so what a step records is written before that checkpoint exists.
Rollouts and metrics go first; a run stopped between them and the save trains the step again (same seeds, the same
values) and finds them written (``kept_rollouts.keep`` replaces the file, ``tracking.log_metrics`` logs a step once).
Only the save's own timings (``timing/train/checkpointing``, ``timing/train/total_step_time``) are measured after it:
they are logged last, and a step counts as finished (:func:`_finished_attempt`) only once they are, so a retried
task trains the step again and logs them. A resumed run does not train that step again: one killed between the
checkpoint's ``_COMPLETE`` marker and this last log lacks those two timings at that step (the killed process
measured them and died with them); the step's other metrics are all logged.

A retry in a warm process (a local run) of a task that failed after its update saves the update the live trainer holds
(:func:`_kept_update`) instead of training again: the step's input may be saved with weights only (not a checkpoint
step), and its optimizer state then exists nowhere else. Where it cannot (the update itself failed), the task says how
to resume the run (:func:`_require_optimizer_state`).
"""

from __future__ import annotations

import time
from typing import Any

from flytekit import task

from dataplane import paths
from dataplane.meta import KVBatchMeta
from dataplane.urls import redact
from rl.async_grpo import partitions_to_clear
from rl.backends.dataplane_policy import DataPlanePolicy
from tasks import runtime, saving, tracking
from tasks.data_parallel import DataParallel, fault_drill
from tasks.failure import how_to_continue
from tasks.placement import declared
from tasks.retry import transient_errors_retried
from tasks.run_config import RunConfig
from tasks.types import PolicyVersion, RunInfo

_KEPT: dict[str, tuple[int, dict[str, float]]] = {}
"""run_id -> (the step of the live trainer's last update, that update's metrics), from the update until
the step is saved and logged: a warm process's retry of a train task that failed after its update saves that update
(:func:`_kept_update`) instead of training again from an input that may have no optimizer state on storage."""

DONE_METRIC = "timing/train/checkpointing"
"""Logged in the step's last batch, after its save (with ``timing/train/total_step_time``; the batch's first key, which
``tracking.log_metrics`` checks to log it once): a step whose policy is saved and which has this metric is finished."""


@task(retries=2, task_config=DataParallel(), **declared("train"))
@transient_errors_retried
def train(
    cfg: RunConfig,
    run: RunInfo,
    policy: PolicyVersion,
    with_advantages: KVBatchMeta,
    with_prev_logprobs: KVBatchMeta,
    with_reference_logprobs: KVBatchMeta,
) -> PolicyVersion:
    """Train on the step's columns that ``rl.step.train_fields`` names (the metas the advantages, policy-logprob and
    reference-logprob tasks returned: the columns they wrote and their timings) and return the policy after this step.

    With ``policy.nnodes * policy.nproc_per_node`` > 1 this body runs on every rank (``tasks.data_parallel``), each
    on its shard of the step; rank 0 alone saves, logs and clears, after every rank finished its update."""
    from rl import distributed

    since = runtime.begin_task()
    with distributed.process_group():
        train_meta = with_advantages.join(with_prev_logprobs, with_reference_logprobs)
        return _train(cfg, run, policy, train_meta, since)


def _train(cfg: RunConfig, run: RunInfo, policy: PolicyVersion, meta: KVBatchMeta, since: float) -> PolicyVersion:
    from rl import distributed
    from rl.step import update
    from tasks import kept_rollouts  # loads numpy: kept out of the task module's import

    started = time.time()
    runtime.set_threads()
    step = policy.step + 1
    lead = distributed.rank() == 0
    dp = runtime.dataplane(cfg, run)
    finished = distributed.broadcast_object(
        _finished_attempt(cfg, run, step) if lead else None
    )  # one answer for all ranks
    if finished is not None:  # an earlier attempt saved, logged and maybe cleared, then died before returning
        if lead:
            runtime.publish(run, finished)
            _clear_partitions(cfg, dp, step)
            print(
                f"[grpoflow] step {step}/{cfg.grpo.max_num_steps}"
                f" | done by an earlier attempt: {redact(finished.path)}",
                flush=True,
            )
        return finished
    metrics = _kept_update(run, step)  # an earlier attempt's update that this process holds (a local retry)
    if metrics is None:
        _require_optimizer_state(cfg, run, policy)
    backend = runtime.policy(cfg, run, policy if metrics is None else None, training=True)
    ready = runtime.startup_metric("train", since)
    try:
        if metrics is None:
            # seeded by the step (``rl.step.update``): the checkpoint's RNG state is a function of the step
            metrics = update(cfg, DataPlanePolicy(backend, dp), meta, step=step)
            if not run.cold_tasks:
                _KEPT[run.run_id] = (step, metrics)
        trained = time.time()
        fault_drill("train")
        backend.prepare_checkpoint(
            with_trainer_state=saving.saves_trainer_state(cfg, run, step)
        )  # model-parallel shards to rank 0
        distributed.barrier()  # rank 0 commits the step only once every rank has finished it
        if not lead:
            return policy  # rank 0's result is the task's; the others' is dropped
        prepared = time.time()
        out = _step_metrics(meta, metrics, ready, started=started, trained=trained)
        # before the save, which a resumed run restarts after (see the module's docstring): once each, also when the
        # step is trained again after a stop here
        kept_rollouts.keep(cfg, run, dp, meta, step)
        tracking.log_metrics(cfg.tracking.uri, run.mlflow_run_id, out, step)
        saving_from = time.time()
        new_policy = saving.save_policy(cfg, run, backend, started_from=policy)
        done = time.time()
    except BaseException:
        # the in-memory policy may have moved past ``policy``: a retry reloads it from storage, unless it holds this
        # step's whole update (kept by a warm process: the retry saves it)
        if _kept_update(run, step) is None:
            runtime.discard(run, "policy")
        raise
    _KEPT.pop(run.run_id, None)

    after = {  # measured only now: see the module's docstring
        DONE_METRIC: (prepared - trained) + (done - saving_from),  # gathering the shards, and the save
        "timing/train/total_step_time": time.time() - meta.extra_info["step_started_unix"],
    }
    tracking.log_metrics(cfg.tracking.uri, run.mlflow_run_id, after, step)  # last: it marks the step finished
    out.update(after)
    runtime.publish(run, new_policy)  # an async local run's collector generates with it
    _clear_partitions(cfg, dp, step)  # last: until here a retry finds the whole step
    print(
        f"[grpoflow] step {step}/{cfg.grpo.max_num_steps} | reward {out['train/reward']:.3f}"
        f" | loss {out['train/loss']:+.4f} | kl {out['train/kl_penalty']:.5f}"
        f" | gen {out['train/generated_tokens_per_s']:.0f} tok/s"
        f" | step {out['timing/train/total_step_time']:.1f} s",
        flush=True,
    )
    return new_policy


def _kept_update(run: RunInfo, step: int) -> dict[str, float] | None:
    """The metrics of the update of ``step`` if this process's live trainer of ``run`` holds its result (the weights
    and optimizer state after it): an earlier attempt of this task updated, then failed before its save completed.
    None: the update must be made (again)."""
    kept_step, metrics = _KEPT.get(run.run_id, (None, None))
    if kept_step != step or not runtime.holds_trainer(run, PolicyVersion(step=step, path="")):
        return None
    return metrics


def _require_optimizer_state(cfg: RunConfig, run: RunInfo, policy: PolicyVersion) -> None:
    """Raise, saying how to go on, where a local run cannot train from ``policy``: it was saved with weights only and
    this process no longer holds its optimizer state (an earlier attempt of this task failed during its update, which
    may have left the weights half-updated). Tasks that run cold find the trainer state on storage
    (``tasks.saving.saves_trainer_state``); a load there raises ``rl.checkpoint.require_trainer_state``'s error.

    Raises:
        RuntimeError: see above; the message says how to go on (``tasks.failure.how_to_continue``: the command that
            resumes the run from its newest checkpoint, or that starts it again where it has none).
    """
    from rl import checkpoint

    if run.cold_tasks or policy.step == 0 or runtime.holds_trainer(run, policy):
        return
    if checkpoint.has_trainer_state(policy.path, cfg.dataplane.storage_options):
        return
    msg = (
        f"step {policy.step + 1}: the policy of step {policy.step} at {redact(policy.path)} has no optimizer state "
        "(saved with weights only), and this process no longer holds it (an earlier attempt of this task failed "
        f"during its update), so this step cannot be trained again here; {how_to_continue(cfg, run.run_id)} ; "
        "checkpointing.checkpoint_period: 1 saves the optimizer state at every step, so that any step can be retried"
    )
    raise RuntimeError(msg)


def _step_metrics(
    meta: KVBatchMeta, metrics: dict[str, float], ready: dict[str, float], *, started: float, trained: float
) -> dict[str, float]:
    """The step's metrics known before its save: the update's (``train/*``), the rollout's, advantages' and earlier
    tasks' (from ``meta.extra_info``), and the timings up to the end of the update."""
    info = meta.extra_info
    out = {f"train/{k}": v for k, v in metrics.items()}
    out.update({f"train/{k.removeprefix('rollout/')}": v for k, v in info.items() if k.startswith("rollout/")})
    out.update(
        {
            f"train/{k}": v
            for k, v in info.items()
            if k.startswith(("advantages/", "baseline_reward/", "reward_shaping/"))
        }
    )
    out.update({k: v for k, v in info.items() if k.startswith("timing/")})
    out.update(ready)
    out["timing/train/policy_and_reference_logprobs"] = info.get("timing/train/prev_lp", 0.0) + info.get(
        "timing/train/ref_lp", 0.0
    )
    out["timing/train/policy_training"] = trained - started
    return out


def _clear_partitions(cfg: RunConfig, dp: Any, step: int) -> None:
    """Clear the step's partition; async (a > 0), keep those a resume from the newest checkpoint needs and clear them
    at the next checkpoint (``rl.async_grpo.partitions_to_clear``)."""

    checkpoints = [c for c in range(1, step + 1) if saving.checkpoint_due(cfg, c)]
    for done in partitions_to_clear(step, cfg.grpo.max_trajectory_age_steps, checkpoints):
        dp.clear(paths.step_partition(done))


def _finished_attempt(cfg: RunConfig, run: RunInfo, step: int) -> PolicyVersion | None:
    """The policy of ``step`` if an earlier attempt of this task finished its work: saved it completely, logged the
    step's metrics to the last (:data:`DONE_METRIC`, logged after the save; all of this happens before the clear),
    and left what the next step needs (the trainer state on storage, or the live trainer of this process at that
    version). None: this attempt must train (it logs what the earlier one did not)."""
    from rl import checkpoint

    saved = saving.saved_version(cfg, run, step)
    if saved is None or not tracking.has_metric(cfg.tracking.uri, run.mlflow_run_id, DONE_METRIC, step):
        return None
    if checkpoint.has_trainer_state(saved.path, cfg.dataplane.storage_options) or runtime.holds_trainer(run, saved):
        return saved
    return None
