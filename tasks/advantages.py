"""`advantages`: the step's advantages from its rewards (`rl.advantages.advantages_for_step`); writes ``advantages``."""

from __future__ import annotations

import time

from flytekit import task

from dataplane.meta import KVBatchMeta
from tasks.placement import declared
from tasks.retry import transient_errors_retried
from tasks.run_config import RunConfig
from tasks.types import RunInfo


@task(retries=2, **declared("cpu"))
@transient_errors_retried
def advantages(cfg: RunConfig, run: RunInfo, meta: KVBatchMeta) -> KVBatchMeta:
    """Compute per-sample advantages (``grpo.adv_estimator``, after ``grpo.reward_shaping``) and write them per token
    (the sample's A on every token)."""
    import torch

    from dataplane import fields as F
    from dataplane.codec import nested_from_values
    from rl.advantages import advantages_for_step
    from tasks import runtime

    since = runtime.begin_task()
    started = time.time()
    dp = runtime.dataplane(cfg, run)
    ready = runtime.startup_metric("advantages", since)
    cols = dp.read(meta, [F.REWARDS, F.SAMPLE_MASK, F.INPUT_LENGTHS, F.PROMPT_LENGTHS])
    lengths = cols[F.INPUT_LENGTHS]  # [N]
    step = advantages_for_step(cols[F.REWARDS], cols[F.SAMPLE_MASK], lengths - cols[F.PROMPT_LENGTHS], cfg)
    adv = step.advantages  # [N]
    per_token = nested_from_values(torch.repeat_interleave(adv, lengths), lengths)  # [N, L_i]
    out = dp.write_columns(meta, {F.ADVANTAGES: per_token}, task_name="advantages")
    grouped = cols[F.REWARDS].view(-1, cfg.grpo.num_generations_per_prompt)  # [B, G]
    spread = grouped.max(1).values - grouped.min(1).values  # [B]
    info = {
        "advantages/mean": float(adv.mean()),
        "advantages/max": float(adv.max()),
        "advantages/min": float(adv.min()),
        "baseline_reward/pct_0": float((grouped.max(1).values == 0).float().mean()),
        "baseline_reward/pct_1": float((grouped.min(1).values == 1).float().mean()),
        "baseline_reward/pct_mixed": float((spread > 0).float().mean()),
        "timing/train/advantage_calculation": time.time() - started,
        **ready,
    }
    if cfg.grpo.reward_shaping.enabled:
        info["reward_shaping/overlong_penalty"] = float(step.overlong_penalty.mean())
    return out.stamp_tags({"baseline": step.baseline.tolist(), "std": step.std.tolist()}).with_extra_info(**info)
