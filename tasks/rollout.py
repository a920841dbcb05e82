"""`rollout`: generate G completions per prompt with the step's policy, score them, first put."""

from __future__ import annotations

import time

from flytekit import task

from dataplane.meta import KVBatchMeta
from rl.config import GRPOConfig
from tasks.placement import declared
from tasks.retry import transient_errors_retried
from tasks.types import PolicyVersion, RunInfo


@task(retries=2, **declared("rollout"))
@transient_errors_retried
def rollout(cfg: GRPOConfig, run: RunInfo, policy: PolicyVersion, step: int) -> KVBatchMeta:
    """Write the step partition's bulk columns (``ROLLOUT_FIELDS``) for the B groups of ``step`` (after dynamic
    sampling and overlong filtering when they are on)."""
    from dataplane import paths
    from rl.rollout import STEP_SCHEMA, sample_step, to_columns
    from tasks import runtime

    since = runtime.begin_task()
    started = time.time()
    runtime.set_threads()
    g = cfg.grpo.num_generations_per_prompt
    generator = runtime.generation(cfg, run, policy)  # sampling is seeded per call, from the step number
    ready = runtime.startup_metric("rollout", since)
    groups, sample_mask, metrics = sample_step(generator, runtime.tokenizer(run.model_path), cfg, step=step)
    columns = to_columns(groups, sample_mask, group_size=g, weight_version=policy.step)
    dp = runtime.dataplane(cfg, run)
    partition = paths.step_partition(step)
    dp.register_partition(partition, fields=STEP_SCHEMA, consumers=["prev_lp", "ref_lp", "train"])
    meta = dp.put(partition, columns, group_size=g, task_name="rollout", id_key="rollout")
    info = {f"rollout/{k}": v for k, v in metrics.items()}
    info["step_started_unix"] = started
    info["timing/train/generation"] = time.time() - started
    info.update(ready)
    return meta.with_extra_info(**info).stamp_pad_seqlen()
