"""`validate`: greedy completions on held-out problems through a ``val`` partition; logs accuracy and samples."""

from __future__ import annotations

import time

from flytekit import task

from rl.config import GRPOConfig
from tasks.retry import transient_errors_retried
from tasks.types import PolicyVersion, RunInfo


@task(retries=2)
@transient_errors_retried
def validate(cfg: GRPOConfig, run: RunInfo, policy: PolicyVersion) -> float:
    """Accuracy (share of reward 1) of the policy at ``policy.step`` on ``data.num_val_problems`` questions
    of the validation split; logs ``validation/accuracy``, ``validation/avg_length`` and a sample table."""
    import torch

    from dataplane import fields as F
    from dataplane import paths
    from rl.data import val_problems
    from rl.rollout import ROLLOUT_DTYPES, generate_groups, to_columns
    from tasks import runtime, tracking

    started = time.time()
    runtime.set_threads()
    d = cfg.data
    problems = val_problems(dataset=d.dataset, dataset_kwargs=d.dataset_kwargs, seed=d.val_seed, val_fraction=d.val_fraction, count=d.num_val_problems)
    generator = runtime.generation(cfg, run, policy)
    t0 = time.perf_counter()
    groups = generate_groups(generator, runtime.tokenizer(run.model_path), problems, cfg, group_size=1, greedy=True, seed=cfg.grpo.seed)
    gen_s = time.perf_counter() - t0
    columns = to_columns(groups, torch.ones(len(problems), dtype=torch.bool), group_size=1, weight_version=policy.step)
    dp = runtime.dataplane(cfg, run)
    partition = paths.val_partition(policy.step)
    dp.register_partition(partition, fields=ROLLOUT_DTYPES, consumers=["validation"])
    meta = dp.put(partition, columns, group_size=1, task_name="validation", id_key="validation")
    rows = dp.read(meta, [F.PROMPT_TEXT, F.RESPONSE_TEXT, F.ANSWER_TEXT, F.REWARDS, F.TOKEN_MASK], layout="jagged")
    dp.clear(partition)
    correct = (rows[F.REWARDS] >= 1.0).float()  # [N]
    lengths = rows[F.TOKEN_MASK].values().view(-1).float().sum() / len(problems)
    accuracy = float(correct.mean())
    out = {
        "validation/accuracy": accuracy,
        "validation/avg_length": float(lengths),
        "validation/reward": float(rows[F.REWARDS].mean()),
        "timing/validation/total_time": time.time() - started,
    }
    tracking.log_metrics(cfg.tracking.uri, run.mlflow_run_id, out, policy.step)
    table = {
        "step": [policy.step] * len(problems),
        "prompt": rows[F.PROMPT_TEXT],
        "completion": rows[F.RESPONSE_TEXT],
        "answer": rows[F.ANSWER_TEXT],
        "reward": rows[F.REWARDS].tolist(),
        "correct": [bool(c) for c in correct],
    }
    tracking.client(cfg.tracking.uri).log_table(run.mlflow_run_id, data=table, artifact_file=f"validation/step_{policy.step:06d}.json")
    print(
        f"[grpoflow] validation at step {policy.step} | accuracy {accuracy:.3f} on {len(problems)} held-out problems"
        f" | avg length {float(lengths):.1f} | {gen_s:.1f} s",
        flush=True,
    )
    return accuracy
