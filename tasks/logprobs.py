"""`policy_logprobs` and `reference_logprobs`: forward passes that add a logprob column to the step."""

from __future__ import annotations

import time

from flytekit import task

from dataplane.meta import KVBatchMeta
from rl.backends.dataplane_policy import DataPlanePolicy
from tasks import runtime
from tasks.data_parallel import DataParallel, fault_drill
from tasks.placement import declared
from tasks.retry import transient_errors_retried
from tasks.run_config import RunConfig
from tasks.types import PolicyVersion, RunInfo


@task(retries=2, task_config=DataParallel(), **declared("train"))
@transient_errors_retried
def policy_logprobs(cfg: RunConfig, run: RunInfo, policy: PolicyVersion, meta: KVBatchMeta) -> KVBatchMeta:
    """Write ``prev_logprobs``: log pi_old of every token under the policy that generated the step.

    Skipped when the step is on-policy (one optimizer update per step): pi_old is then the policy being
    trained, and the train task takes ``prev_logprobs`` from its own forward pass (detached), which saves
    one forward pass over the batch and is exactly equal rather than equal up to float noise.
    """
    from rl import distributed

    since = runtime.begin_task()
    if cfg.on_policy:  # the step loop does not even create this node then (see workflows/grpo.py)
        return meta.with_extra_info(**{"timing/train/prev_lp": 0.0, "prev_logprobs_from_train": 1.0})
    started = time.time()
    runtime.set_threads()
    with distributed.process_group():  # N ranks: each writes its shard's rows (tasks.data_parallel)
        backend = runtime.policy(cfg, run, policy)
        ready = runtime.startup_metric("policy_logprobs", since)
        out = DataPlanePolicy(backend, runtime.dataplane(cfg, run)).get_logprobs_from_meta(meta)
        fault_drill("policy_logprobs")
    return out.with_extra_info(**{"timing/train/prev_lp": time.time() - started, **ready})


@task(retries=2, task_config=DataParallel(), **declared("train"))
@transient_errors_retried
def reference_logprobs(cfg: RunConfig, run: RunInfo, meta: KVBatchMeta) -> KVBatchMeta:
    """Write ``reference_policy_logprobs``: log pi_ref of every token under the base model."""
    from rl import distributed

    since = runtime.begin_task()
    started = time.time()
    runtime.set_threads()
    with distributed.process_group():  # N ranks: each writes its shard's rows (tasks.data_parallel)
        backend = runtime.policy(cfg, run)
        backend.load_reference_policy()
        ready = runtime.startup_metric("reference_logprobs", since)
        out = DataPlanePolicy(backend, runtime.dataplane(cfg, run)).get_reference_policy_logprobs_from_meta(meta)
        fault_drill("reference_logprobs")
    return out.with_extra_info(**{"timing/train/ref_lp": time.time() - started, **ready})
