"""Rollout of one step: G completions per problem, scored, optionally filtered (dynamic sampling,
overlong filtering), as data-plane columns plus rollout metrics.

Owns the mapping from problems to the rollout columns; writes nothing (the rollout task does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dataplane import fields as F
from dataplane.codec import nested_from_values
from rl.backends.interfaces import GenerationBackend
from rl.config import GRPOConfig
from rl.data import Problem, prompt_token_ids, score, train_problems
from rl.filters import informative_groups, overlong_mask
from rl.seeding import step_seed


@dataclass
class Groups:
    """Completions grouped by problem, row-major (group-contiguous), before they become columns."""

    problems: list[Problem] = field(default_factory=list)
    input_ids: list[torch.Tensor] = field(default_factory=list)
    generation_logprobs: list[torch.Tensor] = field(default_factory=list)
    token_mask: list[torch.Tensor] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    response_lengths: list[int] = field(default_factory=list)

    def take(self, groups: list[int], g: int) -> Groups:
        rows = [b * g + i for b in groups for i in range(g)]
        out = Groups(problems=[self.problems[b] for b in groups])
        for name in (
            "input_ids",
            "generation_logprobs",
            "token_mask",
            "responses",
            "rewards",
            "truncated",
            "prompt_lengths",
            "response_lengths",
        ):
            setattr(out, name, [getattr(self, name)[r] for r in rows])
        return out

    def extend(self, other: Groups) -> None:
        for name, value in vars(other).items():
            getattr(self, name).extend(value)


def generate_groups(
    generator: GenerationBackend,
    tokenizer: Any,
    problems: list[Problem],
    cfg: GRPOConfig,
    *,
    group_size: int,
    greedy: bool,
    seed: int,
) -> Groups:
    """Generate ``group_size`` completions per problem with ``generator`` (sampling seeded by ``seed``) and score each
    with the dataset's ``score_answer``."""
    prompts = [prompt_token_ids(tokenizer, p.question, cfg.data.system_prompt) for p in problems]
    gen = generator.generate(prompts, group_size=group_size, seed=seed, greedy=greedy)
    responses = tokenizer.batch_decode(gen.response_token_ids, skip_special_tokens=True)
    owners = [p for p in problems for _ in range(group_size)]
    return Groups(
        problems=list(problems),
        input_ids=gen.input_ids,
        generation_logprobs=gen.generation_logprobs,
        token_mask=gen.token_mask,
        responses=responses,
        rewards=[
            score(p, r, cfg.data.dataset, cfg.data.dataset_kwargs, cfg.data.seed) for p, r in zip(owners, responses)
        ],
        truncated=gen.truncated.tolist(),
        prompt_lengths=gen.prompt_lengths.tolist(),
        response_lengths=gen.response_lengths.tolist(),
    )


def sample_step(
    generator: GenerationBackend, tokenizer: Any, cfg: GRPOConfig, *, step: int
) -> tuple[Groups, torch.Tensor, dict[str, float]]:
    """The B groups of ``step``; with dynamic sampling, generation batches until B informative groups.

    Generation batch i of step k uses training problems ``((k-1) * M + i) * B ..`` (M =
    ``dynamic_sampling_max_gen_batches``, 1 without dynamic sampling) and the sampling seed
    ``step_seed(grpo.seed, k, f"rollout/{i}")``, so every step's data and samples are fixed by its number: a
    resumed or retried step draws the same completions.

    Returns:
        ``(groups, sample_mask [N] bool, metrics)``.

    Raises:
        RuntimeError: fewer than B informative groups after ``dynamic_sampling_max_gen_batches`` batches.
    """
    g, b, d = cfg.grpo.num_generations_per_prompt, cfg.grpo.num_prompts_per_step, cfg.data
    dynamic = cfg.grpo.use_dynamic_sampling
    max_batches = cfg.grpo.dynamic_sampling_max_gen_batches if dynamic else 1
    kept, seen_rewards, discarded, gen_s = Groups(), [], 0, 0.0
    for i in range(max_batches):
        problems = train_problems(
            dataset=d.dataset,
            dataset_kwargs=d.dataset_kwargs,
            seed=d.seed,
            val_fraction=d.val_fraction,
            start=((step - 1) * max_batches + i) * b,
            count=b,
        )
        t0 = time.perf_counter()
        seed = step_seed(cfg.grpo.seed, step, f"rollout/{i}")
        batch = generate_groups(generator, tokenizer, problems, cfg, group_size=g, greedy=False, seed=seed)
        gen_s += time.perf_counter() - t0
        seen_rewards += batch.rewards
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
    }
    return kept, _sample_mask(kept, cfg), metrics


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
    }


ROLLOUT_DTYPES = F.ROLLOUT_DTYPES
"""Schema of a validation partition (rollout columns only); defined in ``dataplane.fields``."""

STEP_SCHEMA = F.STEP_SCHEMA
"""Schema of a step partition (rollout columns, then later tasks' delta columns); defined in ``dataplane.fields``."""
