"""The policy loss of a GRPO update and its variants (PPO-clip/GRPO, GSPO, CISPO; token-, sequence- and constant-
normalized aggregation), with the KL penalty to the reference policy and its estimators. Pure tensor maths, no I/O.

Sources: PPO clip (arXiv 1707.06347), GRPO objective (DeepSeekMath 2402.03300 eq. 3), DAPO token-level loss and
clip-higher (2503.14476), Dr. GRPO constant normalizer (2503.20783), GSPO and GSPO-token (2507.18071 eqs. 5-7 and
10-11), CISPO (MiniMax-M1, 2506.13585 eq. 4), dual clip (1912.09729), k1/k2/k3 (joschu.net/blog/kl-approx); NeMo-RL
`loss_functions.ClippedPGLossFn` (clamps, global normalization, the importance-sampling correction, the metrics) and
TRL `GRPOTrainer` (the ``loss_type`` and ``importance_sampling_level`` names, the clip fractions). Deviations:
- The KL term's gradient is a choice (``reference_policy_kl_gradient``). ``estimator`` (our default) back-propagates
  the per-token estimator as a loss, as DeepSeekMath, TRL and verl do; NeMo-RL (since its PR #2506) weights it by
  ``exp(curr - sg(curr))``, our ``reverse_kl`` (see :func:`kl_penalty`). The loss values are the same.
- ``loss_type: dr_grpo`` divides by the global valid sequences times ``generation.max_new_tokens``; TRL by the
  micro-batch's rows times ``max_completion_length``, which depends on how the batch is split.
- ``cispo`` clips its weight to ``[1 - ratio_clip_min, 1 + ratio_clip_max]`` (MiniMax-M1's, NeMo-RL's ``use_cispo``);
  TRL's ``cispo`` clamps at ``epsilon_high`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rl.config.sections import IMPORTANCE_SAMPLING_LEVELS, KL_GRADIENTS, KL_TYPES, LOSS_TYPES

if TYPE_CHECKING:
    from rl.config import LossConfig

KL_INPUT_CLAMP = 20.0
KL_OUTPUT_CLAMP = 10.0


def kl_penalty(
    logprobs: torch.Tensor, reference_logprobs: torch.Tensor, kl_type: str = "k3", *, gradient: str = "estimator"
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token logprobs, and the gradient it carries.

    With ``logr = ref - curr`` clamped to +-20: k1 = ``-logr``, k2 = ``logr^2 / 2``, k3 = ``exp(logr) - 1 - logr``;
    the result is clamped to +-10 (NeMo-RL ``calculate_kl``). On samples y ~ pi, ``E[k1] = E[k3] = KL(pi || pi_ref)``
    and ``E[k2]`` is KL to second order.

    ``gradient`` picks what back-propagates (arXiv 2506.09477 compares the two):
    - ``estimator``: the estimator itself, as a loss (DeepSeekMath's "k3 as a loss", TRL, verl). Its expected
      gradient on-policy is ``grad KL(pi_ref || pi)`` for k3 (a first-order approximation of the reverse KL's),
      ``grad KL(pi || pi_ref)`` for k2, and 0 for k1 (``E_pi[grad log pi] = 0``: the config refuses k1 with it).
    - ``reverse_kl``: ``w * k`` with ``w = exp(curr - sg(curr))`` (1 in value; detached where the input clamp binds),
      so the gradient adds the score-function term ``k * grad log pi``: the expected gradient is that of
      ``E_pi[k]``, i.e. ``grad KL(pi || pi_ref)`` for k1 and k3 (for k2, of its second-order approximation).
      NeMo-RL ``ClippedPGLossFn`` since its PR #2506.

    Example:
        >>> curr, ref = torch.tensor([-1.0]), torch.tensor([-0.5])  # logr = 0.5
        >>> kl_penalty(curr, ref, "k3")  # exp(0.5) - 1 - 0.5
        tensor([0.1487])

    Args:
        logprobs: [...] float, log pi(y_t) of the current policy, nats (with grad).
        reference_logprobs: [...] float, log pi_ref(y_t), nats.
        kl_type: ``k1``, ``k2`` or ``k3``.
        gradient: ``estimator`` or ``reverse_kl``.

    Returns:
        [...] float per-token KL estimate, nats.

    Raises:
        ValueError: unknown ``kl_type`` or ``gradient``.
    """
    logr = reference_logprobs - logprobs
    clamped = logr.clamp(-KL_INPUT_CLAMP, KL_INPUT_CLAMP)
    if kl_type not in KL_TYPES:
        msg = f"unknown kl_type {kl_type!r}; use one of {KL_TYPES}"
        raise ValueError(msg)
    if kl_type == "k1":
        kl = -clamped
    elif kl_type == "k2":
        kl = clamped.square() / 2
    else:
        kl = torch.exp(clamped) - 1 - clamped
    if gradient == "reverse_kl":
        weight = torch.nan_to_num(torch.exp(logprobs - logprobs.detach()), nan=0.0, posinf=0.0, neginf=0.0)
        weight = torch.where(logr == clamped, weight, weight.detach())  # a clamped input gets no gradient at all
        kl = weight * kl
    elif gradient not in KL_GRADIENTS:
        msg = f"unknown KL gradient {gradient!r}; use one of {KL_GRADIENTS}"
        raise ValueError(msg)
    return kl.clamp(-KL_OUTPUT_CLAMP, KL_OUTPUT_CLAMP)


def importance_ratio(
    logprobs: torch.Tensor, prev_logprobs: torch.Tensor, token_mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """The ratio pi / pi_old the clip acts on, per response token.

    - ``token`` (PPO, GRPO): ``r_t = exp(curr_t - prev_t)``.
    - ``sequence`` (GSPO, arXiv 2507.18071 eq. 7): ``s_i = exp(mean_t (curr_t - prev_t))`` over the sequence's
      response tokens, the same on each of its tokens.
    - ``sequence_token`` (GSPO-token, eq. 10): ``s_i,t = sg[s_i] * pi_t / sg[pi_t]``: ``s_i`` in value, the token's own
      gradient. With one advantage per sequence it trains exactly as ``sequence`` does.

    Example:
        >>> curr, prev = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.5]])
        >>> importance_ratio(curr, prev, torch.tensor([[True, True]]), "sequence")  # exp(mean(0.5, 0.5))
        tensor([[1.6487, 1.6487]])

    Args:
        logprobs: [M, T] float, current policy (with grad); prediction-aligned.
        prev_logprobs: [M, T] float, pi_old.
        token_mask: [M, T] bool, True on response tokens.
        level: ``token``, ``sequence`` or ``sequence_token``.

    Returns:
        [M, T] float ratios (meaningful where ``token_mask``).

    Raises:
        ValueError: unknown ``level``.
    """
    log_ratio = logprobs - prev_logprobs  # [M, T]
    if level == "token":
        return torch.exp(log_ratio)
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        msg = f"unknown importance_sampling_level {level!r}; use one of {IMPORTANCE_SAMPLING_LEVELS}"
        raise ValueError(msg)
    tokens = token_mask.sum(-1, keepdim=True).clamp(min=1)  # [M, 1]
    seq = log_ratio.masked_fill(~token_mask.bool(), 0.0).sum(-1, keepdim=True) / tokens  # [M, 1]
    if level == "sequence":
        return torch.exp(seq).expand_as(log_ratio)  # [M, T]
    return torch.exp(seq.detach() + logprobs - logprobs.detach())  # [M, T]


def sampling_importance_ratio(
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    truncation: float | None = None,
) -> torch.Tensor:
    """The off-policy weight of each response token: how much likelier pi_old makes the sample than the back-end that
    generated it did. Detached; a non-finite weight becomes 0; truncated at ``truncation`` when given (TIS,
    fengyao.notion.site/off-policy-rl).

    ``token``: ``w_t = exp(prev_t - gen_t)``; ``sequence`` and ``sequence_token``: ``w_i = exp(sum_t (prev_t - gen_t))``
    over the sequence's valid tokens, on each of them (NeMo-RL ``ClippedPGLossFn`` with
    ``sequence_level_importance_ratios``).

    Args:
        prev_logprobs, generation_logprobs: [M, T] float, prediction-aligned.
        mask: [M, T] float 0/1, the loss mask.
        level: as :func:`importance_ratio`.
        truncation: upper bound of the weight, or None.

    Returns:
        [M, T] float weights.
    """
    diff = prev_logprobs - generation_logprobs  # [M, T]
    if level == "token":
        weight = torch.exp(diff)
    else:
        weight = torch.exp(diff.masked_fill(~mask.bool(), 0.0).sum(-1, keepdim=True)).expand_as(diff)  # [M, T]
    weight = torch.nan_to_num(weight.detach(), nan=0.0, posinf=0.0, neginf=0.0)
    return weight if truncation is None else weight.clamp(max=truncation)


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
    """[M, S-1] float: response tokens (shifted to prediction positions) of valid samples.

    Example:
        >>> token_mask = torch.tensor([[False, False, True, True], [False, True, True, False]])  # [M=2, S=4]
        >>> sample_mask = torch.tensor([True, False])  # the second sample does not count
        >>> loss_mask(token_mask, sample_mask)  # [M, S-1]: position t predicts token t+1
        tensor([[0., 1., 1.],
                [0., 0., 0.]])
    """
    return token_mask[:, 1:].float() * sample_mask.float()[:, None]  # [M, S-1]


def clipped_pg_loss(
    batch: LossInputs,
    *,
    ratio_clip_min: float,
    ratio_clip_max: float,
    ratio_clip_c: float | None,
    reference_policy_kl_penalty: float,
    reference_policy_kl_type: str,
    global_valid_toks: float,
    global_valid_seqs: float,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    reference_policy_kl_gradient: str = "estimator",
    max_response_tokens: int | None = None,
    use_importance_sampling_correction: bool = False,
    truncated_importance_sampling_ratio: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of a micro-batch, normalized by global counts so micro-batch losses sum to the batch loss.

    Per response token t of sample i, with ``r`` the ratio of ``importance_sampling_level`` (:func:`importance_ratio`)
    and ``clip(r) = clamp(r, 1 - eps_min, 1 + eps_max)``:
    - PPO-clip (every ``loss_type`` but ``cispo``): ``L_pg = max(-A r, -A clip(r))``; with the dual clip,
      ``L_pg = min(L_pg, -A c)`` where ``A < 0``. GRPO, DAPO and Dr. GRPO with token ratios, GSPO with sequence ones.
    - CISPO: ``L_pg = -sg(clip(r)) A log pi_t`` (a REINFORCE term with a clipped, stop-gradient weight).
    - With the importance-sampling correction, ``L_pg`` is multiplied by the detached ``w`` of
      :func:`sampling_importance_ratio`: the samples came from the generation back-end's distribution, not exactly
      pi_old's (NeMo-RL ClippedPGLossFn).
    - ``L = L_pg + beta * k(curr, ref)`` (:func:`kl_penalty` with ``reference_policy_kl_gradient``).

    Aggregation (``loss_type``), over the valid tokens of the whole global batch:
    - ``dapo`` and ``cispo``: ``sum_{i,t} L / global_valid_toks`` (token-level; NeMo-RL ``token_level_loss: true``).
    - ``grpo``: ``sum_i (mean_t L_i,t) / global_valid_seqs`` (sequence-mean; ``token_level_loss: false``).
    - ``dr_grpo``: ``sum_{i,t} L / (global_valid_seqs * max_response_tokens)`` (a constant per sequence).

    Example:
        >>> b = LossInputs(
        ...     logprobs=torch.tensor([[0.0, -1.0, -1.0]]),
        ...     prev_logprobs=torch.tensor([[0.0, -1.1, -1.5]]),
        ...     reference_policy_logprobs=torch.tensor([[0.0, -1.0, -1.0]]),
        ...     generation_logprobs=torch.tensor([[0.0, -1.1, -1.5]]),
        ...     advantages=torch.tensor([[0.0, 1.0, 1.0]]),
        ...     token_mask=torch.tensor([[False, True, True]]),
        ...     sample_mask=torch.tensor([True]),
        ... )
        >>> clipped_pg_loss(
        ...     b, ratio_clip_min=0.2, ratio_clip_max=0.2, ratio_clip_c=None, reference_policy_kl_penalty=0.0,
        ...     reference_policy_kl_type="k3", global_valid_toks=2, global_valid_seqs=1,
        ... )[0]  # (-exp(0.1) - 1.2) / 2
        tensor(-1.1526)

    Args:
        batch: the micro-batch (see :class:`LossInputs`).
        ratio_clip_min, ratio_clip_max: clip range of the ratio (of CISPO's weight).
        ratio_clip_c: dual-clip constant (> 1) or None.
        reference_policy_kl_penalty: beta.
        reference_policy_kl_type: ``k1``/``k2``/``k3``.
        global_valid_toks: valid response tokens in the whole global batch (> 0).
        global_valid_seqs: valid samples in the whole global batch (> 0).
        loss_type: ``dapo``, ``grpo``, ``dr_grpo`` or ``cispo`` (see above).
        importance_sampling_level: ``token``, ``sequence`` or ``sequence_token``.
        reference_policy_kl_gradient: ``estimator`` or ``reverse_kl``.
        max_response_tokens: the constant of ``dr_grpo`` (``generation.max_new_tokens``).
        use_importance_sampling_correction: weight ``L_pg`` by :func:`sampling_importance_ratio`.
        truncated_importance_sampling_ratio: upper bound of that weight, or None.

    Returns:
        ``(loss, sums)``: scalar loss (with grad) and detached per-micro-batch *sums* over valid tokens for exact
        aggregation across micro-batches (:func:`accumulate`): ``pg_loss``, ``probs_ratio``, ``probs_ratio_clamped``,
        ``kl_penalty``, ``token_mult_prob_error`` (``exp(|gen - prev|)``), ``approx_entropy``
        (``-exp(curr - gen) * curr``, the entropy of pi estimated on samples of the generator), ``clip_fraction/low``
        and ``clip_fraction/high`` (tokens whose ratio the clip cut: below ``1 - eps_min`` with ``A < 0``, above
        ``1 + eps_max`` with ``A > 0`` or above ``c`` with ``A < 0``; for CISPO, tokens whose weight was clamped),
        ``sampling_importance_ratio`` (computed whether or not the correction is on; a sum over valid *sequences*
        at the sequence levels), ``valid_toks`` and ``valid_seqs``; and the extremes
        ``sampling_importance_ratio_max`` / ``_min`` over valid tokens.

    Raises:
        ValueError: an unknown ``loss_type``, level or KL setting; ``dr_grpo`` without ``max_response_tokens``.
    """
    if loss_type not in LOSS_TYPES:
        msg = f"unknown loss_type {loss_type!r}; use one of {LOSS_TYPES}"
        raise ValueError(msg)
    if loss_type == "dr_grpo" and not max_response_tokens:
        msg = "loss_type 'dr_grpo' needs max_response_tokens (the generation budget, generation.max_new_tokens)"
        raise ValueError(msg)
    mask = loss_mask(batch.token_mask, batch.sample_mask)  # [M, S-1]
    curr = batch.logprobs[:, 1:]  # [M, S-1]
    prev = batch.prev_logprobs[:, 1:]  # [M, S-1]
    ref = batch.reference_policy_logprobs[:, 1:]  # [M, S-1]
    gen = batch.generation_logprobs[:, 1:]  # [M, S-1]
    adv = batch.advantages[:, 1:]  # [M, S-1]

    ratio = importance_ratio(curr, prev, batch.token_mask[:, 1:], importance_sampling_level)  # [M, S-1]
    ratio_clamped = ratio.clamp(1 - ratio_clip_min, 1 + ratio_clip_max)  # [M, S-1]
    if loss_type == "cispo":
        pg = -adv * ratio_clamped.detach() * curr  # [M, S-1]
    else:
        pg = torch.maximum(-adv * ratio, -adv * ratio_clamped)  # [M, S-1]
    if ratio_clip_c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * ratio_clip_c), pg)
    weight = sampling_importance_ratio(
        prev, gen, mask, level=importance_sampling_level, truncation=truncated_importance_sampling_ratio
    )  # [M, S-1]
    if use_importance_sampling_correction:
        pg = pg * weight
    kl = kl_penalty(curr, ref, reference_policy_kl_type, gradient=reference_policy_kl_gradient)  # [M, S-1]
    per_token = pg + reference_policy_kl_penalty * kl  # [M, S-1]

    if loss_type == "grpo":
        seq_toks = mask.sum(-1).clamp(min=1)  # [M]
        loss = ((per_token * mask).sum(-1) / seq_toks).sum() / global_valid_seqs
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (global_valid_seqs * max_response_tokens)  # type: ignore[operator]
    else:
        loss = (per_token * mask).sum() / global_valid_toks

    with torch.no_grad():
        sums = _metric_sums(
            curr=curr,
            prev=prev,
            gen=gen,
            adv=adv,
            mask=mask,
            sample_mask=batch.sample_mask,
            ratio=ratio,
            ratio_clamped=ratio_clamped,
            pg=pg,
            kl=kl,
            weight=weight,
            cispo=loss_type == "cispo",
            clip=(1 - ratio_clip_min, 1 + ratio_clip_max, ratio_clip_c),
            per_sequence=importance_sampling_level != "token",
        )
    return loss, sums


def _metric_sums(
    *,
    curr: torch.Tensor,
    prev: torch.Tensor,
    gen: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    sample_mask: torch.Tensor,
    ratio: torch.Tensor,
    ratio_clamped: torch.Tensor,
    pg: torch.Tensor,
    kl: torch.Tensor,
    weight: torch.Tensor,
    cispo: bool,
    clip: tuple[float, float, float | None],
    per_sequence: bool,
) -> dict[str, torch.Tensor]:
    """:func:`clipped_pg_loss`'s metric sums (every argument [M, S-1] but ``sample_mask`` [M]). A masked-out token
    enters no exp: a gap of 100 nats there would make ``exp(100) * 0`` NaN in float32."""
    valid = mask.bool()  # [M, S-1]
    zero = torch.zeros((), dtype=curr.dtype, device=curr.device)

    def total(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x, zero).sum()

    low_bound, high_bound, c = clip
    if cispo:
        low, high = ratio < low_bound, ratio > high_bound
    else:
        low, high = (ratio < low_bound) & (adv < 0), (ratio > high_bound) & (adv > 0)
        if c is not None:
            high = high | ((ratio > c) & (adv < 0))
    seqs = sample_mask.to(curr.dtype)  # [M]
    return {
        "pg_loss": total(pg),
        "probs_ratio": total(ratio),
        "probs_ratio_clamped": total(ratio_clamped),
        "kl_penalty": total(kl),
        "token_mult_prob_error": total(torch.exp(torch.where(valid, (gen - prev).abs(), zero))),
        "approx_entropy": total(-torch.exp(torch.where(valid, curr - gen, zero)) * curr),
        "clip_fraction/low": total(low.to(curr.dtype)),
        "clip_fraction/high": total(high.to(curr.dtype)),
        "sampling_importance_ratio": (weight[:, 0] * seqs).sum() if per_sequence and weight.shape[1] else total(weight),
        # over valid tokens (-inf / inf when there are none: `accumulate` keeps the other micro-batches' value)
        "sampling_importance_ratio_max": _masked_extreme(weight, mask, largest=True),
        "sampling_importance_ratio_min": _masked_extreme(weight, mask, largest=False),
        "valid_toks": mask.sum(),
        "valid_seqs": seqs.sum(),
    }


def _masked_extreme(x: torch.Tensor, mask: torch.Tensor, *, largest: bool) -> torch.Tensor:
    """max (``largest``) or min of ``x`` where ``mask``; -inf / inf when nothing is valid. No host sync."""
    fill = float("-inf") if largest else float("inf")
    if not x.numel():
        return x.new_tensor(fill)
    kept = x.masked_fill(~mask.bool(), fill)
    return kept.max() if largest else kept.min()


def accumulate(totals: dict[str, float], part: dict[str, float]) -> None:
    """Fold one micro-batch's (or rank's) metric values into ``totals`` in place: a key ending in ``_max`` keeps the
    largest value, one ending in ``_min`` the smallest, any other is a sum (divided by the valid tokens or sequences at
    the end, `rl.backends.engine.combine_step_metrics`)."""
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


def per_sequence_metrics(cfg: LossConfig) -> frozenset[str]:
    """The metric sums of :func:`clipped_pg_loss` that are over valid sequences rather than tokens under ``cfg``."""
    return frozenset() if cfg.importance_sampling_level == "token" else frozenset({"sampling_importance_ratio"})


def clipped_pg_loss_with(
    batch: LossInputs, cfg: LossConfig, *, global_valid_toks: float, global_valid_seqs: float, max_response_tokens: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`clipped_pg_loss` with the settings of a run's ``loss`` config section (every policy back-end calls this);
    ``max_response_tokens`` is ``generation.max_new_tokens`` (``dr_grpo``'s constant)."""
    return clipped_pg_loss(
        batch,
        ratio_clip_min=cfg.ratio_clip_min,
        ratio_clip_max=cfg.ratio_clip_max,
        ratio_clip_c=cfg.ratio_clip_c,
        reference_policy_kl_penalty=cfg.reference_policy_kl_penalty,
        reference_policy_kl_type=cfg.reference_policy_kl_type,
        global_valid_toks=global_valid_toks,
        global_valid_seqs=global_valid_seqs,
        loss_type=cfg.loss_type,
        importance_sampling_level=cfg.importance_sampling_level,
        reference_policy_kl_gradient=cfg.reference_policy_kl_gradient,
        max_response_tokens=max_response_tokens,
        use_importance_sampling_correction=cfg.use_importance_sampling_correction,
        truncated_importance_sampling_ratio=cfg.truncated_importance_sampling_ratio,
    )
