"""`validate`: greedy completions on held-out problems through a ``validation`` partition; logs accuracy and samples."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from flytekit import task

from dataplane import fields as F
from rl.prompts import prompt_source
from rl.scoring import environments
from rl.seeding import step_seed
from tasks import runtime, tracking
from tasks.placement import declared
from tasks.retry import transient_errors_retried
from tasks.run_config import RunConfig
from tasks.types import PolicyVersion, RunInfo

if TYPE_CHECKING:
    from rl.groups import Groups


@task(retries=2, **declared("rollout"))
@transient_errors_retried
def validate(cfg: RunConfig, run: RunInfo, policy: PolicyVersion) -> float:
    """Accuracy (share of reward 1) of the policy at ``policy.step`` on ``data.num_val_problems`` questions
    of the validation split; logs ``validation/accuracy``, ``validation/avg_length`` and a sample table (and
    ``validation/sampled_accuracy`` with ``grpo.num_val_generations_per_prompt`` > 0)."""

    since = runtime.begin_task()
    return greedy_accuracy(cfg, run, policy, since=since, kind="validation", task="validate")


def greedy_accuracy(
    cfg: RunConfig, run: RunInfo, policy: PolicyVersion, *, since: float, kind: str, task: str
) -> float:
    """Greedy completions of ``policy`` on ``data.num_val_problems`` held-out questions, through the partition
    ``{kind}_{step}`` of the run's data plane; logs ``{kind}/accuracy``, ``{kind}/avg_length`` (tokens per
    completion), ``{kind}/reward`` and ``timing/{task}/startup`` at ``policy.step`` in the run's MLflow run, and the
    completions as a table ``{kind}/step_{step}.json``. With ``grpo.num_val_generations_per_prompt`` = K > 0 it also
    samples K completions per question at ``generation.temperature`` (seeded by the step) and logs
    :func:`sampled_accuracy`'s metrics; only the greedy completions go to the table.

    Returns:
        the share of questions answered correctly (reward 1), in [0, 1].

    Raises:
        whatever loading the policy, the data plane or MLflow raise.
    """
    import torch

    from rl.rollout import ROLLOUT_DTYPES, generate_groups, to_columns

    started = time.time()
    runtime.set_threads()
    problems = prompt_source(cfg, root=cfg.dataplane.root, run_id=run.run_id).validation(cfg.data.num_val_problems)
    environments(cfg, wait=False)  # the reward workers start while the model generates
    with runtime.generation_exclusive(run):  # an async run's collector lends its back-end for the validation
        generator = runtime.generation(cfg, run, policy)
        ready = runtime.startup_metric(task, since)
        t0 = time.perf_counter()
        groups = generate_groups(
            generator, runtime.base_tokenizer(cfg, run), problems, cfg, group_size=1, greedy=True, seed=cfg.grpo.seed
        )
        k = cfg.grpo.num_val_generations_per_prompt
        sampled = None
        if k:  # pass@1 at the training temperature, as NeMo-RL's validate measures it (greedy=False)
            sampled = generate_groups(
                generator,
                runtime.base_tokenizer(cfg, run),
                problems,
                cfg,
                group_size=k,
                greedy=False,
                seed=step_seed(cfg.grpo.seed, policy.step, f"{kind}/sampled"),
            )
        gen_s = time.perf_counter() - t0
    columns = to_columns(groups, torch.ones(len(problems), dtype=torch.bool), group_size=1, weight_version=policy.step)
    dp = runtime.dataplane(cfg, run)
    partition = f"{kind}_{policy.step:06d}"
    dp.register_partition(partition, fields=ROLLOUT_DTYPES)
    meta = dp.put(partition, columns, group_size=1, task_name=kind, id_key=kind)
    rows = dp.read(
        meta, [F.PROMPT_TEXT, F.RESPONSE_TEXT, F.ANSWER_TEXT, F.REWARDS, F.TOKEN_MASK, F.TASK_NAME], layout="jagged"
    )
    dp.clear(partition)
    correct = (rows[F.REWARDS] >= 1.0).float()  # [N]
    lengths = rows[F.TOKEN_MASK].values().view(-1).float().sum() / len(problems)
    accuracy = float(correct.mean())
    out = {
        f"{kind}/accuracy": accuracy,
        f"{kind}/avg_length": float(lengths),
        f"{kind}/reward": float(rows[F.REWARDS].mean()),
        f"timing/{kind}/total_time": time.time() - started,
        **ready,
    }
    for task in sorted(set(rows[F.TASK_NAME])):  # per task: {kind}/accuracy/<task>, {kind}/reward/<task>
        mine = torch.tensor([t == task for t in rows[F.TASK_NAME]])
        out[f"{kind}/accuracy/{task}"] = float(correct[mine].mean())
        out[f"{kind}/reward/{task}"] = float(rows[F.REWARDS][mine].mean())
    if sampled is not None:
        out.update(sampled_accuracy(sampled, kind))
    logged = tracking.log_metrics(cfg.tracking.uri, run.mlflow_run_id, out, policy.step)  # once per step
    table = {
        "step": [policy.step] * len(problems),
        "prompt": rows[F.PROMPT_TEXT],
        "completion": rows[F.RESPONSE_TEXT],
        "answer": rows[F.ANSWER_TEXT],
        "task": rows[F.TASK_NAME],
        "reward": rows[F.REWARDS].tolist(),
        "correct": [bool(c) for c in correct],
    }
    if logged:  # MLflow's log_table appends: a re-run (a retry, a repeated evaluation) must not add the rows again
        tracking.client(cfg.tracking.uri).log_table(
            run.mlflow_run_id, data=table, artifact_file=f"{kind}/step_{policy.step:06d}.json"
        )
    also = f" | sampled accuracy {out[f'{kind}/sampled_accuracy']:.3f} ({k} per problem)" if sampled else ""
    print(
        f"[grpoflow] {kind} at step {policy.step} | accuracy {accuracy:.3f} on {len(problems)} held-out problems"
        f"{also} | avg length {float(lengths):.1f} | {gen_s:.1f} s",
        flush=True,
    )
    return accuracy


def sampled_accuracy(groups: Groups, kind: str) -> dict[str, float]:
    """The metrics of sampled validation completions (``G`` per problem, row-major): ``{kind}/sampled_accuracy``, the
    share of all ``N x G`` completions with reward >= 1 (pass@1 at ``generation.temperature``, estimated from G
    samples per problem), and ``{kind}/sampled_accuracy/<task>`` per task; in [0, 1]."""
    g = len(groups.rewards) // len(groups.problems)
    correct = [r >= 1.0 for r in groups.rewards]
    tasks = [p.task for p in groups.problems for _ in range(g)]
    out = {f"{kind}/sampled_accuracy": sum(correct) / len(correct)}
    for name in sorted(set(tasks)):
        mine = [c for c, t in zip(correct, tasks) if t == name]
        out[f"{kind}/sampled_accuracy/{name}"] = sum(mine) / len(mine)
    return out
