"""Clipped policy-gradient loss with a KL penalty to the reference policy (GRPO), and its KL estimators.

Pure tensor maths, no I/O. Sources: PPO clip (arXiv 1707.06347), GRPO objective (DeepSeekMath
2402.03300 eq. 3), dual clip (arXiv 1912.09729), k1/k2/k3 (joschu.net/blog/kl-approx), NeMo-RL
`loss_functions.ClippedPGLossFn` (clamps, token-level global normalization). No deviations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rl.config import LossConfig

KL_INPUT_CLAMP = 20.0
KL_OUTPUT_CLAMP = 10.0


def kl_penalty(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, kl_type: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token logprobs.

    With ``logr = ref - curr`` clamped to +-20: k1 = ``-logr``, k2 = ``logr^2 / 2``,
    k3 = ``exp(logr) - 1 - logr``; the result is clamped to +-10 (NeMo-RL ``calculate_kl``).

    Args:
        logprobs: [...] float, log pi(y_t) of the current policy, nats.
        reference_logprobs: [...] float, log pi_ref(y_t), nats.
        kl_type: ``k1``, ``k2`` or ``k3``.

    Returns:
        [...] float per-token KL estimate, nats.

    Raises:
        ValueError: unknown ``kl_type``.
    """
    logr = (reference_logprobs - logprobs).clamp(-KL_INPUT_CLAMP, KL_INPUT_CLAMP)
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr.square() / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        msg = f"unknown kl_type {kl_type!r}; use 'k1', 'k2' or 'k3'"
        raise ValueError(msg)
    return kl.clamp(-KL_OUTPUT_CLAMP, KL_OUTPUT_CLAMP)


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch, all per-token tensors [M, S] aligned with ``input_ids`` (position 0 unused).

    Attributes:
        logprobs: float, current policy log pi(x_t | x_<t), nats (with grad).
        prev_logprobs: float, log pi_old from the policy that generated the data (no grad).
        reference_policy_logprobs: float, log pi_ref.
        generation_logprobs: float, logprobs reported by the generation back-end.
        advantages: float, per-token advantage (the sample's A on each response token).
        token_mask: bool, True on response tokens.
        sample_mask: [M] bool/0-1, True where the sample counts.
    """

    logprobs: torch.Tensor
    prev_logprobs: torch.Tensor
    reference_policy_logprobs: torch.Tensor
    generation_logprobs: torch.Tensor
    advantages: torch.Tensor
    token_mask: torch.Tensor
    sample_mask: torch.Tensor


def loss_mask(token_mask: torch.Tensor, sample_mask: torch.Tensor) -> torch.Tensor:
    """[M, S-1] float: response tokens (shifted to prediction positions) of valid samples."""
    return token_mask[:, 1:].float() * sample_mask.float()[:, None]  # [M, S-1]


def clipped_pg_loss(
    batch: LossInputs,
    *,
    ratio_clip_min: float,
    ratio_clip_max: float,
    ratio_clip_c: float | None,
    reference_policy_kl_penalty: float,
    reference_policy_kl_type: str,
    token_level_loss: bool,
    global_valid_toks: float,
    global_valid_seqs: float,
    use_importance_sampling_correction: bool = False,
    truncated_importance_sampling_ratio: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of a micro-batch, normalized by global counts so micro-batch losses sum to the batch loss.

    Per token: ``r = exp(curr - prev)``; ``L_pg = max(-A r, -A clip(r, 1-eps_min, 1+eps_max))``; with dual
    clip, ``L_pg = min(L_pg, -A c)`` where ``A < 0``; ``L_kl = beta * k(curr, ref)``. With the importance-sampling
    correction, ``L_pg`` is weighted per token by ``w = exp(prev - gen)`` (detached; non-finite -> 0), truncated
    to ``w <= truncated_importance_sampling_ratio`` when given (TIS, fengyao.notion.site/off-policy-rl): the
    samples came from the generation back-end's distribution, not exactly pi_old's (NeMo-RL ClippedPGLossFn).
    Token-level: ``sum_{valid t} (L_pg + L_kl) / global_valid_toks``. Sequence-level: per-sequence mean over
    its valid tokens, summed over sequences, ``/ global_valid_seqs``.

    Args:
        batch: the micro-batch (see :class:`LossInputs`).
        ratio_clip_min, ratio_clip_max: clip range of the ratio.
        ratio_clip_c: dual-clip constant (> 1) or None.
        reference_policy_kl_penalty: beta.
        reference_policy_kl_type: ``k1``/``k2``/``k3``.
        token_level_loss: aggregation (see above).
        global_valid_toks: valid response tokens in the whole global batch (> 0).
        global_valid_seqs: valid samples in the whole global batch (> 0).
        use_importance_sampling_correction: weight ``L_pg`` by ``exp(prev - gen)`` per token.
        truncated_importance_sampling_ratio: upper bound of that weight, or None.

    Returns:
        ``(loss, sums)``: scalar loss (with grad) and detached per-micro-batch *sums* over valid tokens
        (``probs_ratio``, ``probs_ratio_clamped``, ``kl_penalty``, ``token_mult_prob_error``,
        ``approx_entropy``, ``pg_loss``, ``importance_sampling_weight``, ``valid_toks``) for exact aggregation across
        micro-batches, and the extremes ``importance_sampling_weight_max`` / ``_min`` over valid tokens (see
        :func:`accumulate`).
    """
    mask = loss_mask(batch.token_mask, batch.sample_mask)  # [M, S-1]
    curr = batch.logprobs[:, 1:]  # [M, S-1]
    prev = batch.prev_logprobs[:, 1:]  # [M, S-1]
    ref = batch.reference_policy_logprobs[:, 1:]  # [M, S-1]
    gen = batch.generation_logprobs[:, 1:]  # [M, S-1]
    adv = batch.advantages[:, 1:]  # [M, S-1]

    ratio = torch.exp(curr - prev)  # [M, S-1]
    ratio_clamped = ratio.clamp(1 - ratio_clip_min, 1 + ratio_clip_max)  # [M, S-1]
    pg = torch.maximum(-adv * ratio, -adv * ratio_clamped)  # [M, S-1]
    if ratio_clip_c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * ratio_clip_c), pg)
    if use_importance_sampling_correction:
        weight = torch.nan_to_num(torch.exp(prev - gen).detach(), nan=0.0, posinf=0.0, neginf=0.0)  # [M, S-1]
        if truncated_importance_sampling_ratio is not None:
            weight = weight.clamp(max=truncated_importance_sampling_ratio)
        pg = pg * weight
    else:
        weight = torch.ones_like(pg)  # [M, S-1]
    kl = kl_penalty(curr, ref, reference_policy_kl_type)  # [M, S-1]
    per_token = pg + reference_policy_kl_penalty * kl  # [M, S-1]

    if token_level_loss:
        loss = (per_token * mask).sum() / global_valid_toks
    else:
        seq_toks = mask.sum(-1).clamp(min=1)  # [M]
        loss = ((per_token * mask).sum(-1) / seq_toks).sum() / global_valid_seqs

    with torch.no_grad():
        sums = {
            "pg_loss": (pg * mask).sum(),
            "probs_ratio": (ratio * mask).sum(),
            "probs_ratio_clamped": (ratio_clamped * mask).sum(),
            "kl_penalty": (kl * mask).sum(),
            "token_mult_prob_error": (torch.exp((gen - prev).abs()) * mask).sum(),
            "approx_entropy": (-curr * mask).sum(),
            "importance_sampling_weight": (weight * mask).sum(),
            # over valid tokens (-inf / inf when there are none: `accumulate` keeps the other micro-batches' value)
            "importance_sampling_weight_max": _masked_extreme(weight, mask, largest=True),
            "importance_sampling_weight_min": _masked_extreme(weight, mask, largest=False),
            "valid_toks": mask.sum(),
        }
    return loss, sums


def _masked_extreme(x: torch.Tensor, mask: torch.Tensor, *, largest: bool) -> torch.Tensor:
    """max (``largest``) or min of ``x`` where ``mask``; -inf / inf when nothing is valid. No host sync."""
    fill = float("-inf") if largest else float("inf")
    if not x.numel():
        return x.new_tensor(fill)
    kept = x.masked_fill(~mask.bool(), fill)
    return kept.max() if largest else kept.min()


def accumulate(totals: dict[str, float], part: dict[str, float]) -> None:
    """Fold one micro-batch's (or rank's) metric values into ``totals`` in place: a key ending in ``_max`` keeps the
    largest value, one ending in ``_min`` the smallest, any other is a sum (divided by the valid tokens at the end)."""
    for k, v in part.items():
        v = float(v)
        if k.endswith("_max"):
            totals[k] = max(totals.get(k, v), v)
        elif k.endswith("_min"):
            totals[k] = min(totals.get(k, v), v)
        else:
            totals[k] = totals.get(k, 0.0) + v


def accumulate_on_device(totals: dict[str, torch.Tensor], part: dict[str, torch.Tensor]) -> None:
    """:func:`accumulate` without leaving the device: ``totals`` holds float64 0-dim tensors on ``part``'s device, so a
    training loop reads its metrics once per step instead of once per micro-batch and metric. float64 sums of the
    float32 values give the same numbers as :func:`accumulate`'s Python floats."""
    for k, v in part.items():
        v = v.detach().double()
        old = totals.get(k)
        if old is None:
            totals[k] = v
        elif k.endswith("_max"):
            totals[k] = torch.fmax(old, v)  # a NaN never wins over a number
        elif k.endswith("_min"):
            totals[k] = torch.fmin(old, v)
        else:
            totals[k] = old + v


def clipped_pg_loss_with(batch: LossInputs, cfg: LossConfig, *, global_valid_toks: float, global_valid_seqs: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`clipped_pg_loss` with the settings of a run's ``loss`` config section (every policy back-end calls this)."""
    return clipped_pg_loss(
        batch,
        ratio_clip_min=cfg.ratio_clip_min,
        ratio_clip_max=cfg.ratio_clip_max,
        ratio_clip_c=cfg.ratio_clip_c,
        reference_policy_kl_penalty=cfg.reference_policy_kl_penalty,
        reference_policy_kl_type=cfg.reference_policy_kl_type,
        token_level_loss=cfg.token_level_loss,
        global_valid_toks=global_valid_toks,
        global_valid_seqs=global_valid_seqs,
        use_importance_sampling_correction=cfg.use_importance_sampling_correction,
        truncated_importance_sampling_ratio=cfg.truncated_importance_sampling_ratio,
    )
