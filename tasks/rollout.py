"""`rollout`: generate G completions per prompt with the step's policy, score them, first put."""

from __future__ import annotations

import time

from flytekit import task

from dataplane.meta import KVBatchMeta
from rl.config import GRPOConfig
from tasks.types import PolicyVersion, RunInfo


@task(retries=2)
def rollout(cfg: GRPOConfig, run: RunInfo, policy: PolicyVersion, step: int) -> KVBatchMeta:
    """Write the step partition's bulk columns (``ROLLOUT_FIELDS``) for the B prompts of ``step``."""
    import torch

    from dataplane import paths
    from rl.data import train_problems
    from rl.rollout import STEP_SCHEMA, rollout_columns
    from tasks import runtime

    started = time.time()
    runtime.set_threads()
    b, g = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
    d = cfg.data
    problems = train_problems(
        dataset=d.dataset, dataset_kwargs=d.dataset_kwargs, seed=d.seed, val_fraction=d.val_fraction, start=(step - 1) * b, count=b
    )
    torch.manual_seed(cfg.grpo.seed * 1_000_003 + step)
    model = runtime.peek_policy(cfg, run, policy)
    columns, metrics = rollout_columns(
        model, runtime.tokenizer(run.model_path), problems, cfg, group_size=g, greedy=False, weight_version=policy.step
    )
    dp = runtime.dataplane(cfg, run)
    partition = paths.step_partition(step)
    dp.register_partition(partition, fields=STEP_SCHEMA, consumers=["prev_lp", "ref_lp", "train"])
    meta = dp.put(partition, columns, group_size=g, task_name="rollout")
    info = {f"rollout/{k}": v for k, v in metrics.items()}
    info["step_started_unix"] = started
    info["timing/train/generation"] = time.time() - started
    return meta.with_extra_info(**info).stamp_pad_seqlen()
