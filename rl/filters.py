"""Sample and group filters of a GRPO step: dynamic sampling (DAPO), overlong filtering, and the
sequence-level logprob-error mask. Pure tensor maths, no I/O.

Sources: DAPO (arXiv 2503.14476) dynamic sampling and overlong filtering; NeMo-RL grpo_sync
`_compute_seq_logprob_error_metrics`. Deviation from NeMo-RL: dynamic sampling keeps or drops whole
groups. NeMo-RL filters rows by the leave-one-out std, which for rewards ``[1, 0, 0, 0]`` drops the one
correct sample (its others all scored 0) and keeps its three wrong siblings (NeMo-RL PR #3469).
"""

from __future__ import annotations

import torch


def informative_groups(rewards: torch.Tensor, sample_mask: torch.Tensor, *, group_size: int) -> torch.Tensor:
    """[B] bool: groups whose valid samples do not all share one reward (they carry a learning signal).

    Args:
        rewards: [N] float, group-contiguous (N = B * G).
        sample_mask: [N] bool/0-1.
        group_size: G.
    """
    r = rewards.view(-1, group_size)  # [B, G]
    v = sample_mask.bool().view(-1, group_size)  # [B, G]
    big = torch.finfo(r.dtype).max
    hi = torch.where(v, r, torch.full_like(r, -big)).max(1).values  # [B]
    lo = torch.where(v, r, torch.full_like(r, big)).min(1).values  # [B]
    return (v.sum(1) >= 2) & (hi > lo)


def overlong_mask(truncated: torch.Tensor) -> torch.Tensor:
    """[N] bool sample mask that excludes truncated completions (DAPO overlong filtering)."""
    return ~truncated.bool()


def seq_mult_prob_error(
    generation_logprobs: torch.Tensor, prev_logprobs: torch.Tensor, token_mask: torch.Tensor
) -> torch.Tensor:
    """[N] per-sequence ``mean_t exp(|gen_t - prev_t|)`` over response tokens (1.0 = exact agreement; 0 for a row
    without response tokens). A position outside the mask enters no exp (``exp(100) * 0`` is NaN in float32).

    Args:
        generation_logprobs, prev_logprobs: [N, S] float, aligned with input_ids.
        token_mask: [N, S] bool, True on response tokens.
    """
    m = token_mask.bool()  # [N, S]
    gap = torch.where(
        m,
        (generation_logprobs - prev_logprobs).abs(),
        torch.zeros((), dtype=prev_logprobs.dtype, device=prev_logprobs.device),
    )  # [N, S]
    err = torch.where(m, torch.exp(gap), torch.zeros((), dtype=gap.dtype, device=gap.device))  # [N, S]
    return err.sum(1) / m.sum(1).clamp(min=1)
