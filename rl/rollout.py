"""One rollout batch: G completions per problem, scored, as data-plane columns plus rollout metrics.

Owns the mapping from problems to the rollout columns; writes nothing (the rollout task does).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dataplane import fields as F
from dataplane.codec import nested_from_values
from rl.config import GRPOConfig
from rl.data import Problem, prompt_token_ids, score
from rl.generation import generate


def rollout_columns(
    model: torch.nn.Module,
    tokenizer: Any,
    problems: list[Problem],
    cfg: GRPOConfig,
    *,
    group_size: int,
    greedy: bool,
    weight_version: int,
) -> tuple[dict[str, Any], dict[str, float]]:
    """Generate ``group_size`` completions per problem (group-contiguous) and score them.

    Returns:
        ``(columns, metrics)``: columns named as in ``dataplane.fields.ROLLOUT_FIELDS`` (per-token ones
        jagged [N, L_i]; ``rewards`` [N] float32; ``sample_mask`` [N] bool; text as list[str]) and
        metrics (``reward``, ``mean_prompt_length``, ``mean_response_length``, ``truncated_fraction``,
        ``generated_tokens``, ``generation_time_s``, ``generated_tokens_per_s``).
    """
    prompts = [prompt_token_ids(tokenizer, p.question, cfg.data.system_prompt) for p in problems]
    repeated = [ids for ids in prompts for _ in range(group_size)]
    t0 = time.perf_counter()
    gen = generate(
        model,
        tokenizer,
        repeated,
        max_new_tokens=cfg.generation.max_new_tokens,
        temperature=cfg.generation.temperature,
        top_p=cfg.generation.top_p,
        greedy=greedy,
        batch_size=cfg.generation.batch_size,
        precision=cfg.model.precision,
    )
    gen_s = time.perf_counter() - t0
    responses = tokenizer.batch_decode(gen.response_token_ids, skip_special_tokens=True)
    owners = [p for p in problems for _ in range(group_size)]
    rewards = torch.tensor(
        [score(p, r, cfg.data.dataset, cfg.data.dataset_kwargs, cfg.data.seed) for p, r in zip(owners, responses)],
        dtype=torch.float32,
    )  # [N]
    n = len(repeated)
    lengths = torch.tensor([len(x) for x in gen.input_ids], dtype=torch.int64)  # [N]
    columns: dict[str, Any] = {
        F.INPUT_IDS: nested_from_values(torch.cat(gen.input_ids), lengths),
        F.INPUT_LENGTHS: lengths,
        F.GENERATION_LOGPROBS: nested_from_values(torch.cat(gen.generation_logprobs), lengths),
        F.TOKEN_MASK: nested_from_values(torch.cat(gen.token_mask), lengths),
        F.SAMPLE_MASK: torch.ones(n, dtype=torch.bool),
        F.REWARDS: rewards,
        F.TRUNCATED: gen.truncated,
        F.PROMPT_INDEX: torch.arange(n, dtype=torch.int64) // group_size,
        F.GENERATION_INDEX: torch.arange(n, dtype=torch.int64) % group_size,
        F.WEIGHT_VERSION: torch.full((n,), weight_version, dtype=torch.int64),
        F.PROMPT_LENGTHS: gen.prompt_lengths,
        F.PROMPT_TEXT: [p.question for p in owners],
        F.RESPONSE_TEXT: responses,
        F.ANSWER_TEXT: [p.answer for p in owners],
    }
    generated = int(gen.response_lengths.sum())
    metrics = {
        "reward": float(rewards.mean()),
        "mean_prompt_length": float(gen.prompt_lengths.float().mean()),
        "mean_response_length": float(gen.response_lengths.float().mean()),
        "truncated_fraction": float(gen.truncated.float().mean()),
        "generated_tokens": float(generated),
        "generation_time_s": gen_s,
        "generated_tokens_per_s": generated / max(gen_s, 1e-9),
    }
    return columns, metrics


ROLLOUT_DTYPES = {
    F.INPUT_IDS: "int64",
    F.INPUT_LENGTHS: "int64",
    F.GENERATION_LOGPROBS: "float32",
    F.TOKEN_MASK: "bool",
    F.SAMPLE_MASK: "bool",
    F.REWARDS: "float32",
    F.TRUNCATED: "bool",
    F.PROMPT_INDEX: "int64",
    F.GENERATION_INDEX: "int64",
    F.WEIGHT_VERSION: "int64",
    F.PROMPT_LENGTHS: "int64",
    F.PROMPT_TEXT: "str",
    F.RESPONSE_TEXT: "str",
    F.ANSWER_TEXT: "str",
}
"""Schema of a step partition: rollout columns plus the deltas written by later tasks."""

STEP_SCHEMA = {
    **ROLLOUT_DTYPES,
    F.PREV_LOGPROBS: "float32",
    F.REFERENCE_POLICY_LOGPROBS: "float32",
    F.ADVANTAGES: "float32",
}
