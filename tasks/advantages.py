"""`advantages`: the step's advantages from its rewards (`rl.step.write_advantages`), with their metrics."""

from __future__ import annotations

import time

from flytekit import task

from dataplane.meta import KVBatchMeta
from tasks import runtime
from tasks.placement import declared
from tasks.retry import transient_errors_retried
from tasks.run_config import RunConfig
from tasks.types import RunInfo


@task(retries=2, **declared("cpu"))
@transient_errors_retried
def advantages(cfg: RunConfig, run: RunInfo, meta: KVBatchMeta) -> KVBatchMeta:
    """Compute per-sample advantages (``grpo.adv_estimator``, after ``grpo.reward_shaping``) and write them per token
    (the sample's A on every token)."""
    from rl.step import write_advantages

    since = runtime.begin_task()
    started = time.time()
    dp = runtime.dataplane(cfg, run)
    ready = runtime.startup_metric("advantages", since)
    out, rewards, written = write_advantages(cfg, dp, meta)
    adv = written.advantages  # [N]
    grouped = rewards.view(-1, cfg.grpo.num_generations_per_prompt)  # [B, G]
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
        info["reward_shaping/overlong_penalty"] = float(written.overlong_penalty.mean())
    return out.with_extra_info(**info)
