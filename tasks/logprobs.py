"""`policy_logprobs` and `reference_logprobs`: forward passes that add a logprob column to the step."""

from __future__ import annotations

import time

from flytekit import task

from dataplane.meta import KVBatchMeta
from rl.config import GRPOConfig
from tasks.retry import transient_errors_retried
from tasks.types import PolicyVersion, RunInfo


def _write_logprobs(cfg: GRPOConfig, run: RunInfo, meta: KVBatchMeta, model, field: str, task_name: str) -> KVBatchMeta:
    from dataplane import fields as F
    from dataplane.codec import to_nested_by_length
    from rl.logprobs import batched_logprobs
    from tasks import runtime

    started = time.time()
    runtime.set_threads()
    dp = runtime.dataplane(cfg, run)
    tok = runtime.tokenizer(run.model_path)
    batch = dp.read(meta, [F.INPUT_IDS, F.INPUT_LENGTHS, F.TOKEN_MASK], pad_value_dict={F.INPUT_IDS: tok.pad_token_id})
    lp = batched_logprobs(
        model,
        batch[F.INPUT_IDS],
        batch[F.INPUT_LENGTHS],
        batch[F.TOKEN_MASK],
        batch_size=cfg.optim.logprob_batch_size,
        precision=cfg.model.precision,
        temperature=cfg.generation.temperature,
    )  # [N, S]
    out = dp.write_columns(meta, {field: to_nested_by_length(lp, batch[F.INPUT_LENGTHS])}, task_name=task_name)
    return out.with_extra_info(**{f"timing/train/{task_name}": time.time() - started})


@task(retries=2)
@transient_errors_retried
def policy_logprobs(cfg: GRPOConfig, run: RunInfo, policy: PolicyVersion, meta: KVBatchMeta) -> KVBatchMeta:
    """Write ``prev_logprobs``: log pi_old of every token under the policy that generated the step.

    Skipped when the step is on-policy (one optimizer update per step): pi_old is then the policy being
    trained, and the train task takes ``prev_logprobs`` from its own forward pass (detached), which saves
    one forward pass over the batch and is exactly equal rather than equal up to float noise.
    """
    from dataplane import fields as F
    from tasks import runtime

    if cfg.on_policy:
        return meta.with_extra_info(**{"timing/train/prev_lp": 0.0, "prev_logprobs_from_train": 1.0})
    return _write_logprobs(cfg, run, meta, runtime.peek_policy(cfg, run, policy), F.PREV_LOGPROBS, "prev_lp")


@task(retries=2)
@transient_errors_retried
def reference_logprobs(cfg: GRPOConfig, run: RunInfo, meta: KVBatchMeta) -> KVBatchMeta:
    """Write ``reference_policy_logprobs``: log pi_ref of every token under the base model."""
    from dataplane import fields as F
    from tasks import runtime

    return _write_logprobs(cfg, run, meta, runtime.reference_policy(run.model_path), F.REFERENCE_POLICY_LOGPROBS, "ref_lp")
