"""Rollout of one step: G completions per problem, scored, optionally filtered (dynamic sampling,
overlong filtering), as data-plane columns plus rollout metrics.

Owns the mapping from problems to the rollout columns; writes nothing (the rollout task does).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from dataplane import fields as F
from dataplane.codec import nested_from_values
from rl.backends.interfaces import GenerationBackend
from rl.config import GRPOConfig
from rl.data import Problem
from rl.filters import informative_groups, overlong_mask
from rl.groups import Groups
from rl.prompts import PromptSource, prompt_source, render_prompt
from rl.scoring import environments, score_completions
from rl.seeding import step_seed

if TYPE_CHECKING:
    from rl.environments import EnvironmentInterface


def generate_groups(
    generator: GenerationBackend,
    tokenizer: Any,
    problems: list[Problem],
    cfg: GRPOConfig,
    *,
    group_size: int,
    greedy: bool,
    seed: int,
    envs: dict[str, EnvironmentInterface] | None = None,
) -> Groups:
    """Generate ``group_size`` completions per problem with ``generator`` (sampling seeded by ``seed``) and score each
    with the environment of its problem's task (:func:`rl.scoring.score_completions`; ``envs`` defaults to the
    config's, :func:`rl.scoring.environments`). With ``grpo.max_rollout_turns`` > 1, episodes of several turns
    (:func:`rl.multi_turn.multi_turn_groups`)."""
    envs = envs if envs is not None else environments(cfg)
    assert envs is not None
    if cfg.grpo.max_rollout_turns > 1:
        from rl.multi_turn import multi_turn_groups

        return multi_turn_groups(
            generator, tokenizer, problems, cfg, group_size=group_size, greedy=greedy, seed=seed, envs=envs
        )
    d = cfg.data
    prompts = [
        render_prompt(tokenizer, p, system_prompt=d.system_prompt, apply_chat_template=d.apply_chat_template)
        for p in problems
    ]
    gen = generator.generate(prompts, group_size=group_size, seed=seed, greedy=greedy)
    response_ids = [[int(t) for t in ids] for ids in gen.response_token_ids]
    responses = tokenizer.batch_decode(gen.response_token_ids, skip_special_tokens=True)
    owners = [p for p in problems for _ in range(group_size)]
    scores = score_completions(envs, owners, responses, response_ids, cfg)
    n = len(owners)
    return Groups(
        problems=list(problems),
        input_ids=gen.input_ids,
        generation_logprobs=gen.generation_logprobs,
        token_mask=gen.token_mask,
        responses=responses,
        rewards=scores.rewards,
        reward_components=scores.components,
        truncated=gen.truncated.tolist(),
        prompt_lengths=gen.prompt_lengths.tolist(),
        response_lengths=gen.response_lengths.tolist(),
        turns=[1] * n,
        turns_at_max_new_tokens=[int(t) for t in gen.truncated.tolist()],
        environment_tokens=[0] * n,
        truncated_by=[""] * n,
        env_metrics=scores.metrics,
    )


def sample_step(
    generator: GenerationBackend, tokenizer: Any, cfg: GRPOConfig, *, step: int, source: PromptSource | None = None
) -> tuple[Groups, torch.Tensor, dict[str, float]]:
    """The B groups of ``step``; with dynamic sampling, generation batches until B informative groups.

    Generation batch i of step k uses training problems ``((k-1) * M + i) * B ..`` (M =
    ``dynamic_sampling_max_gen_batches``, 1 without dynamic sampling) and the sampling seed
    ``step_seed(grpo.seed, k, f"rollout/{i}")``, so every step's data and samples are fixed by its number: a
    resumed or retried step draws the same completions. ``source`` gives the problems at those positions (default:
    reasoning-gym's, :func:`rl.prompts.prompt_source`).

    Returns:
        ``(groups, sample_mask [N] bool, metrics)``; the metrics include ``reward/<task>`` and
        ``reward/<task>/<reward name>`` (means over the samples of that task, of every generation batch), and
        ``epoch`` and ``prompt_position`` (the stream position after the step).

    Raises:
        RuntimeError: fewer than B informative groups after ``dynamic_sampling_max_gen_batches`` batches.
    """
    g, b = cfg.grpo.num_generations_per_prompt, cfg.grpo.num_prompts_per_step
    dynamic = cfg.grpo.use_dynamic_sampling
    max_batches = cfg.grpo.dynamic_sampling_max_gen_batches if dynamic else 1
    source = source if source is not None else prompt_source(cfg)
    environments(cfg, wait=False)  # the reward workers start while the model generates
    kept, seen, discarded, gen_s = Groups(), Groups(), 0, 0.0
    for i in range(max_batches):
        problems = source.problems(((step - 1) * max_batches + i) * b, b)
        t0 = time.perf_counter()
        seed = step_seed(cfg.grpo.seed, step, f"rollout/{i}")
        batch = generate_groups(generator, tokenizer, problems, cfg, group_size=g, greedy=False, seed=seed)
        gen_s += time.perf_counter() - t0
        seen.extend(batch)
        mask = _sample_mask(batch, cfg)
        if dynamic:
            batch, dropped = keep_informative(batch, mask, group_size=g)
            discarded += dropped
        kept.extend(batch)
        if len(kept.problems) >= b:
            break
    else:
        if dynamic:
            msg = (
                f"dynamic sampling found {len(kept.problems)} of {b} informative groups in {max_batches} generation "
                "batches; raise grpo.dynamic_sampling_max_gen_batches or use easier/harder problems"
            )
            raise RuntimeError(msg)
    kept = kept.take(list(range(b)), g)
    generated = sum(kept.response_lengths)
    seen_rewards = seen.rewards
    metrics = {
        "reward": sum(seen_rewards) / len(seen_rewards),
        "filtered_reward": sum(kept.rewards) / len(kept.rewards),
        "dynamic_sampling_num_gen_batches": float(i + 1),
        "dynamic_sampling_num_discarded_valid_samples": float(discarded),
        "mean_prompt_length": sum(kept.prompt_lengths) / len(kept.prompt_lengths),
        "mean_response_length": generated / len(kept.response_lengths),
        "truncated_fraction": sum(kept.truncated) / len(kept.truncated),
        "generated_tokens": float(generated),
        "generation_time_s": gen_s,
        "generated_tokens_per_s": generated / max(gen_s, 1e-9),
        **per_task_rewards(seen, group_size=g),
        **(episode_metrics(kept) if cfg.grpo.max_rollout_turns > 1 else {}),
        **{f"env/{k}": v for k, v in seen.env_metrics.items()},
        "epoch": float(source.epoch(prompt_position(cfg, step) - 1)),
        "prompt_position": float(prompt_position(cfg, step)),
    }
    return kept, _sample_mask(kept, cfg), metrics


def episode_metrics(groups: Groups) -> dict[str, float]:
    """Multi-turn rollout metrics over the kept samples: ``turns_per_sample``, ``assistant_tokens`` and
    ``environment_tokens`` (means per sample), ``truncated_by_turns_fraction`` and ``truncated_by_length_fraction``
    (shares of the samples), and ``turns_at_max_new_tokens_fraction``: the share of all assistant turns that ended at
    ``generation.max_new_tokens`` with neither EOS nor a stop string (replies cut short: raise ``max_new_tokens``
    when it is high)."""
    n = max(len(groups.turns), 1)
    return {
        "turns_per_sample": sum(groups.turns) / n,
        "assistant_tokens": sum(groups.response_lengths) / n,
        "environment_tokens": sum(groups.environment_tokens) / n,
        "truncated_by_turns_fraction": groups.truncated_by.count("turns") / n,
        "truncated_by_length_fraction": groups.truncated_by.count("length") / n,
        "turns_at_max_new_tokens_fraction": sum(groups.turns_at_max_new_tokens) / max(sum(groups.turns), 1),
    }


def prompt_position(cfg: GRPOConfig, step: int) -> int:
    """The training stream's position after step ``step``: the prompts its steps drew, ``step * M * B`` (step k draws
    positions ``(k - 1) * M * B ..``; M = ``dynamic_sampling_max_gen_batches`` with dynamic sampling, else 1)."""
    g = cfg.grpo
    return step * (g.dynamic_sampling_max_gen_batches if g.use_dynamic_sampling else 1) * g.num_prompts_per_step


def per_task_rewards(groups: Groups, *, group_size: int) -> dict[str, float]:
    """``reward/<task>``: the mean weighted reward of each task's samples, and ``reward/<task>/<name>``: the mean of
    each named reward over the samples it applies to (not NaN)."""
    owners = [p for p in groups.problems for _ in range(group_size)]
    totals: dict[str, list[float]] = {}
    named: dict[str, list[float]] = {}
    for p, r, comps in zip(owners, groups.rewards, groups.reward_components):
        totals.setdefault(p.task, []).append(r)
        for name, v in comps.items():
            if not math.isnan(v):
                named.setdefault(f"{p.task}/{name}", []).append(v)
    out = {f"reward/{t}": sum(v) / len(v) for t, v in totals.items()}
    out.update({f"reward/{k}": sum(v) / len(v) for k, v in named.items()})
    return out


def keep_informative(groups: Groups, sample_mask: torch.Tensor, *, group_size: int) -> tuple[Groups, int]:
    """DAPO dynamic sampling: keep whole groups whose valid rewards differ, in order.

    ``[1, 0, 0, 0]`` keeps all four samples (NeMo-RL's row-wise filter keeps only the three wrong ones).

    Args:
        groups: B groups of ``group_size`` completions.
        sample_mask: [B * group_size] bool.

    Returns:
        ``(kept groups, number of valid samples discarded)``.
    """
    good = informative_groups(torch.tensor(groups.rewards), sample_mask, group_size=group_size).tolist()
    discarded = sum(int(sample_mask.view(-1, group_size)[j].sum()) for j, ok in enumerate(good) if not ok)
    return groups.take([j for j, ok in enumerate(good) if ok], group_size), discarded


def _sample_mask(groups: Groups, cfg: GRPOConfig) -> torch.Tensor:
    truncated = torch.tensor(groups.truncated, dtype=torch.bool)
    return overlong_mask(truncated) if cfg.grpo.overlong_filtering else torch.ones_like(truncated)


def to_columns(groups: Groups, sample_mask: torch.Tensor, *, group_size: int, weight_version: int) -> dict[str, Any]:
    """Columns named as in ``dataplane.fields.ROLLOUT_FIELDS``: per-token ones jagged [N, L_i]
    (``input_ids`` int64, ``generation_logprobs`` float32, ``token_mask`` bool), per-sample ones [N], text
    as list[str]."""
    n = len(groups.input_ids)
    lengths = torch.tensor([len(x) for x in groups.input_ids], dtype=torch.int64)  # [N]
    owners = [p for p in groups.problems for _ in range(group_size)]
    return {
        F.INPUT_IDS: nested_from_values(torch.cat(groups.input_ids), lengths),
        F.INPUT_LENGTHS: lengths,
        F.GENERATION_LOGPROBS: nested_from_values(torch.cat(groups.generation_logprobs), lengths),
        F.TOKEN_MASK: nested_from_values(torch.cat(groups.token_mask), lengths),
        F.SAMPLE_MASK: sample_mask,
        F.REWARDS: torch.tensor(groups.rewards, dtype=torch.float32),
        F.TRUNCATED: torch.tensor(groups.truncated, dtype=torch.bool),
        F.PROMPT_INDEX: torch.arange(n, dtype=torch.int64) // group_size,
        F.GENERATION_INDEX: torch.arange(n, dtype=torch.int64) % group_size,
        F.WEIGHT_VERSION: torch.full((n,), weight_version, dtype=torch.int64),
        F.PROMPT_LENGTHS: torch.tensor(groups.prompt_lengths, dtype=torch.int64),
        F.PROMPT_TEXT: [p.question for p in owners],
        F.RESPONSE_TEXT: list(groups.responses),
        F.ANSWER_TEXT: [p.answer for p in owners],
        F.TASK_NAME: [p.task for p in owners],
        F.ROW_ID: [p.row_id for p in owners],
        F.REWARD_COMPONENTS: list(groups.reward_components),
    }


ROLLOUT_DTYPES = F.ROLLOUT_DTYPES
"""Schema of a validation partition (rollout columns only); defined in ``dataplane.fields``."""

STEP_SCHEMA = F.STEP_SCHEMA
"""Schema of a step partition (rollout columns, then later tasks' delta columns); defined in ``dataplane.fields``."""
