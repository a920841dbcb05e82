"""Advantage estimators of a GRPO step (GRPO with its leave-one-out and mean baselines, RLOO and Dr. GRPO as settings of
it, REINFORCE++) and the rewards they start from (DAPO's soft overlong punishment). Pure tensor maths, no I/O.

Sources: DeepSeekMath (arXiv 2402.03300) outcome supervision ``A = (r - mean) / std``; leave-one-out baseline from RLOO
(arXiv 2402.14740); Dr. GRPO (arXiv 2503.20783) drops the std; REINFORCE++ (arXiv 2501.03262) normalizes over the
batch; NeMo-RL `nemo_rl/algorithms/utils.calculate_baseline_and_std_per_prompt` and `advantage_estimator.py`.
Deviations from NeMo-RL:
- A set of rewards whose max equals its min has std exactly 0 and its value as an exact baseline. NeMo-RL sums and
  divides, so ``[2/3] * 7`` gets a mean one ulp off and a std of rounding residue (~1e-8 in float32) that passes its
  ``std > 0`` guard: ``[1, 2/3 x 7]`` then gives sample 0 ``A = 313,171`` instead of 1/3.
- An invalid sample's own baseline excludes itself from the count as well (NeMo divides by n_valid - 1 for every
  row); its loss is masked either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rl.config import GRPOConfig


def baseline_and_std(
    rewards: torch.Tensor,
    sample_mask: torch.Tensor,
    *,
    group_size: int,
    leave_one_out: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and std of a set of its group's valid rewards.

    Leave-one-out: the set of sample i is the valid others of its group, ``b_i = mean_{j != i, valid} r_j`` and ``s_i``
    their Bessel-corrected std. Otherwise the set is the group's valid samples. A set whose rewards are all equal has
    that value as its baseline and std 0, exactly (no rounding residue). A group with at most one valid sample gets
    ``b_i = r_i`` and ``s_i = 0`` (zero advantage).

    Example:
        >>> r = torch.tensor([1.0, 0.0, 0.0, 0.0])  # one group of G = 4
        >>> baseline_and_std(r, torch.ones(4, dtype=torch.bool), group_size=4)
        (tensor([0.0000, 0.3333, 0.3333, 0.3333]), tensor([0.0000, 0.5774, 0.5774, 0.5774]))

    Args:
        rewards: [N] float, N = B * G, group-contiguous.
        sample_mask: [N] bool/0-1, True where the sample counts.
        group_size: G.
        leave_one_out: use the leave-one-out baseline (NeMo-RL default).

    Returns:
        ``(baseline, std)``, each [N] of ``rewards``' dtype.

    Raises:
        ValueError: N not a multiple of ``group_size`` or shape mismatch.
    """
    if rewards.dim() != 1 or rewards.shape != sample_mask.shape or rewards.numel() % group_size:
        msg = (
            f"rewards {tuple(rewards.shape)} and sample_mask {tuple(sample_mask.shape)} must be [B*G] with "
            f"G={group_size}"
        )
        raise ValueError(msg)
    r = rewards.view(-1, group_size)  # [B, G]
    v = sample_mask.to(rewards.dtype).view(-1, group_size)  # [B, G]
    g = group_size
    # w[b, i, j]: weight of sample j in the statistics of sample i
    w = v[:, None, :].expand(-1, g, -1).clone()  # [B, G, G]
    if leave_one_out:
        w = w * (1 - torch.eye(g, dtype=rewards.dtype))[None]  # [B, G, G]
    count = w.sum(-1)  # [B, G]
    safe = count.clamp(min=1)
    others = r[:, None, :].expand(-1, g, -1)  # [B, G, G]
    mean = (w * others).sum(-1) / safe  # [B, G]
    sq_dev = w * (others - mean[..., None]) ** 2  # [B, G, G]
    var = sq_dev.sum(-1) / (count - 1).clamp(min=1)  # [B, G]
    std = torch.where(count > 1, var.sqrt(), torch.zeros_like(var))  # [B, G]
    in_set = w > 0  # [B, G, G]
    big = torch.finfo(rewards.dtype).max
    hi = torch.where(in_set, others, -big).amax(-1)  # [B, G]
    lo = torch.where(in_set, others, big).amin(-1)  # [B, G]
    constant = (count >= 1) & (hi == lo)  # [B, G]: every reward of the set is the same number
    mean = torch.where(constant, hi, mean)
    std = torch.where(constant, torch.zeros_like(std), std)
    group_valid = v.sum(-1, keepdim=True).expand(-1, g)  # [B, G]
    degenerate = (group_valid <= 1) | (count < 1)
    baseline = torch.where(degenerate, r, mean)  # [B, G]
    std = torch.where(degenerate, torch.zeros_like(std), std)
    return baseline.reshape(-1), std.reshape(-1)


def compute_advantages(
    rewards: torch.Tensor,
    sample_mask: torch.Tensor,
    *,
    group_size: int,
    leave_one_out: bool = True,
    normalize_rewards: bool = True,
    advantage_clip: float | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GRPO: ``A_i = r_i - b_i``, divided by ``(s_i + eps)`` where ``s_i > 0`` when ``normalize_rewards``, then clamped
    to ``[-advantage_clip, advantage_clip]`` when given. RLOO is ``leave_one_out`` without normalization; Dr. GRPO the
    group mean without normalization.

    Source: DeepSeekMath 2402.03300 (``(r - mean) / std``), NeMo-RL ``GRPOAdvantageEstimator`` (std > 0 guard, eps
    1e-6: "don't sharpen the ones with no variation"), RLOO 2402.14740, Dr. GRPO 2503.20783. The clamp bounds the step
    one rare outcome can take: with the group-mean baseline, one success among G = 16 gets
    ``A = (1 - 1/16) / 0.25 = 3.75`` (Bessel std ``sqrt(16 * 1/16 * 15/16 / 15) = 0.25``).

    Example:
        >>> r = torch.tensor([1.0, 1.0, 0.0, 0.0])  # one group: mean 0.5, Bessel std sqrt(1/3) = 0.5774
        >>> compute_advantages(r, torch.ones(4, dtype=torch.bool), group_size=4, leave_one_out=False)[0]
        tensor([ 0.8660,  0.8660, -0.8660, -0.8660])

    Args:
        rewards: [N] float, group-contiguous (N = B * G).
        sample_mask: [N] bool/0-1.
        group_size: G.
        leave_one_out: see :func:`baseline_and_std`.
        normalize_rewards: divide by the std where it is positive.
        advantage_clip: symmetric bound (> 0) on ``|A|`` after normalization; None: no clipping.
        eps: added to the std.

    Returns:
        ``(advantages, baseline, std)``, each [N]; advantages are 0 where ``sample_mask`` is 0.

    Raises:
        ValueError: as :func:`baseline_and_std`.
    """
    baseline, std = baseline_and_std(rewards, sample_mask, group_size=group_size, leave_one_out=leave_one_out)
    adv = rewards - baseline  # [N]
    if normalize_rewards:
        adv = torch.where(std > 0, adv / (std + eps), adv)
    if advantage_clip is not None:
        adv = adv.clamp(-advantage_clip, advantage_clip)
    adv = adv * sample_mask.to(adv.dtype)
    return adv, baseline, std


def reinforce_plus_plus_advantages(
    rewards: torch.Tensor,
    sample_mask: torch.Tensor,
    response_lengths: torch.Tensor,
    *,
    group_size: int,
    advantage_clip: float | None = None,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """REINFORCE++ with the group-mean baseline ("REINFORCE++-baseline"): ``a_i = r_i - mean_group(r)``, then
    normalized over the whole batch's response tokens, ``A_i = (a_i - mu) / sqrt(max(var, eps))`` with
    ``mu = sum_i n_i a_i / sum_i n_i`` and ``var = sum_i n_i (a_i - mu)^2 / sum_i n_i`` over valid samples (n_i their
    response tokens), then clamped to ``[-advantage_clip, advantage_clip]`` when given.

    Source: REINFORCE++ (arXiv 2501.03262) global advantage normalization; NeMo-RL
    ``ReinforcePlusPlusAdvantageEstimator`` (``minus_baseline: true``, token-weighted batch mean and variance, variance
    clamped at 1e-8). Unlike GRPO's, a group whose rewards are all equal gets ``-mu / sigma``, not 0.

    Example:
        >>> r = torch.tensor([1.0, 0.0, 1.0, 1.0])  # two groups of G = 2: a = [0.5, -0.5, 0, 0]
        >>> lengths = torch.tensor([2, 2, 2, 2])  # response tokens: equal weights
        >>> reinforce_plus_plus_advantages(r, torch.ones(4, dtype=torch.bool), lengths, group_size=2)[0]
        tensor([ 1.4142, -1.4142,  0.0000,  0.0000])

    Args:
        rewards: [N] float, group-contiguous (N = B * G).
        sample_mask: [N] bool/0-1.
        response_lengths: [N] int, response tokens of each sample (its weight in the batch statistics).
        group_size: G.
        advantage_clip: symmetric bound (> 0) on ``|A|`` after normalization; None: no clipping.
        eps: floor of the variance.

    Returns:
        ``(advantages, baseline, std)``, each [N]: the group baseline and the batch std (one value repeated);
        advantages are 0 where ``sample_mask`` is 0.

    Raises:
        ValueError: as :func:`baseline_and_std`, or ``response_lengths`` not [N].
    """
    if response_lengths.shape != rewards.shape:
        msg = f"response_lengths {tuple(response_lengths.shape)} must be [N] like rewards {tuple(rewards.shape)}"
        raise ValueError(msg)
    baseline, _ = baseline_and_std(rewards, sample_mask, group_size=group_size, leave_one_out=False)
    valid = sample_mask.to(rewards.dtype)  # [N]
    adv = rewards - baseline  # [N]
    weight = response_lengths.to(rewards.dtype) * valid  # [N]
    total = weight.sum().clamp(min=1)
    mu = (weight * adv).sum() / total
    var = (weight * (adv - mu) ** 2).sum() / total
    adv = (adv - mu) * var.clamp(min=eps).rsqrt()  # [N]
    if advantage_clip is not None:
        adv = adv.clamp(-advantage_clip, advantage_clip)
    return adv * valid, baseline, var.sqrt().expand_as(adv)


def gdpo_advantages(
    reward_components: torch.Tensor,
    reward_weights: torch.Tensor,
    sample_mask: torch.Tensor,
    *,
    group_size: int,
    advantage_clip: float | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GDPO: each named reward normalized within its group, the weighted sum of those, normalized over the batch.

    ``A_k = (r_k - mean_group(r_k)) / (std_group(r_k) + eps)`` (``r_k - mean`` where the group's ``r_k`` are all
    equal), ``A_sum = sum_k w_k A_k``, ``A = (A_sum - mean_batch(A_sum)) / (std_batch(A_sum) + eps)`` over the valid
    samples, then clamped to ``[-advantage_clip, advantage_clip]`` when given. A reward that does not apply to a sample
    (NaN: a reward function returned None, or the reward belongs to another task's environment) contributes 0 to its
    ``A_sum`` and is left out of its group's statistics. Group statistics as :func:`baseline_and_std` without
    leave-one-out (Bessel-corrected std); the batch std is Bessel-corrected too.

    Source: GDPO (arXiv 2601.05242) eqs. for ``A_k``, ``A_sum`` and the batch normalization; NVlabs/GDPO's NeMo-RL and
    TRL implementations (TRL's ``multi_objective_aggregation="normalize_then_sum"``). With one reward and G > 1 it is
    GRPO's group-normalized advantage, re-normalized over the batch.

    Example:
        >>> comps = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]])  # one group, K = 2 rewards
        >>> w = torch.tensor([[1.0, 0.5]]).expand(4, 2)
        >>> gdpo_advantages(comps, w, torch.ones(4, dtype=torch.bool), group_size=4)[0]
        tensor([ 0.3873, -1.1619,  1.1619, -0.3873])

    Args:
        reward_components: [N, K] float32, the named rewards of each sample (NaN: does not apply), group-contiguous.
        reward_weights: [N, K] float32, each sample's weight of each named reward (its task's weights).
        sample_mask: [N] bool/0-1.
        group_size: G.
        advantage_clip: symmetric bound (> 0) on ``|A|`` after normalization; None: no clipping.
        eps: added to the stds.

    Returns:
        ``(advantages, baseline, std)``, each [N]: the batch mean and the batch std of ``A_sum`` (one value each,
        repeated); advantages are 0 where ``sample_mask`` is 0.

    Raises:
        ValueError: shapes disagree, or N is not a multiple of ``group_size``.
    """
    if reward_components.dim() != 2 or reward_components.shape != reward_weights.shape:
        msg = (
            f"reward_components {tuple(reward_components.shape)} and reward_weights {tuple(reward_weights.shape)} "
            "must both be [N, K]"
        )
        raise ValueError(msg)
    valid = sample_mask.to(torch.bool)  # [N]
    total = torch.zeros(reward_components.shape[0], dtype=reward_components.dtype)  # [N]
    for k in range(reward_components.shape[1]):
        r = reward_components[:, k]  # [N]
        applies = ~torch.isnan(r)  # [N]
        filled = torch.where(applies, r, torch.zeros_like(r))
        mean, std = baseline_and_std(filled, valid & applies, group_size=group_size, leave_one_out=False)
        a_k = torch.where(std > 0, (filled - mean) / (std + eps), filled - mean)  # [N]
        total = total + torch.where(applies, reward_weights[:, k] * a_k, torch.zeros_like(a_k))
    v = valid.to(total.dtype)
    count = v.sum().clamp(min=1)
    mu = (v * total).sum() / count
    var = (v * (total - mu) ** 2).sum() / (count - 1).clamp(min=1)
    sigma = var.sqrt()
    adv = (total - mu) / (sigma + eps) if float(sigma) > 0 else total - mu  # [N]
    if advantage_clip is not None:
        adv = adv.clamp(-advantage_clip, advantage_clip)
    return adv * v, mu.expand_as(adv), sigma.expand_as(adv)


def overlong_penalty(
    response_lengths: torch.Tensor,
    *,
    max_response_length: int,
    overlong_buffer_length: int,
    overlong_buffer_penalty: float,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to ``L_max - L_cache`` response tokens, then falling
    linearly to ``-overlong_buffer_penalty`` at ``L_max`` (and below it past ``L_max``).

    ``R_length(y) = min(0, ((L_max - L_cache) - |y|) / L_cache) * penalty`` with ``L_max = max_response_length`` and
    ``L_cache = overlong_buffer_length``. Source: DAPO (arXiv 2503.14476) eq. 13; NeMo-RL ``apply_reward_shaping``.

    Example:
        >>> lengths = torch.tensor([20, 24, 28, 32])  # L_max - L_cache = 24
        >>> overlong_penalty(lengths, max_response_length=32, overlong_buffer_length=8, overlong_buffer_penalty=1.0)
        tensor([ 0.0000,  0.0000, -0.5000, -1.0000])

    Args:
        response_lengths: [N] int, response tokens per sample.
        max_response_length: L_max, tokens (``generation.max_new_tokens``).
        overlong_buffer_length: L_cache, tokens (1..L_max).
        overlong_buffer_penalty: the penalty at L_max (>= 0).

    Returns:
        [N] float32, <= 0.
    """
    exceed = response_lengths.to(torch.float32) - (max_response_length - overlong_buffer_length)  # [N]
    return torch.where(exceed > 0, -exceed / overlong_buffer_length * overlong_buffer_penalty, 0.0)  # [N]


@dataclass(frozen=True)
class StepAdvantages:
    """What :func:`advantages_for_step` gives the advantages task.

    Attributes:
        advantages: [N] float, each sample's A (0 where ``sample_mask`` is 0).
        baseline: [N] float, each sample's baseline.
        std: [N] float, the std its advantage was divided by (or would have been).
        overlong_penalty: [N] float32, the reward added by overlong shaping (zeros when it is off).
    """

    advantages: torch.Tensor
    baseline: torch.Tensor
    std: torch.Tensor
    overlong_penalty: torch.Tensor


def advantages_for_step(
    rewards: torch.Tensor,
    sample_mask: torch.Tensor,
    response_lengths: torch.Tensor,
    cfg: GRPOConfig,
    *,
    reward_components: torch.Tensor | None = None,
    reward_weights: torch.Tensor | None = None,
) -> StepAdvantages:
    """A step's advantages as a run's config asks for them: ``grpo.reward_shaping`` added to the rewards, then the
    ``grpo.adv_estimator`` (:func:`compute_advantages` or :func:`reinforce_plus_plus_advantages`).

    Example:
        >>> from rl.config import config_from_dict
        >>> cfg = config_from_dict({"grpo": {"num_generations_per_prompt": 4}})  # GRPO, leave-one-out, std-normalized
        >>> rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])  # one prompt's group of G = 4
        >>> step = advantages_for_step(rewards, torch.ones(4, dtype=torch.bool), torch.tensor([5, 7, 3, 8]), cfg)
        >>> step.baseline  # mean reward of the other three
        tensor([0.3333, 0.3333, 0.6667, 0.6667])
        >>> step.advantages  # (r - baseline) / (std of the other three + 1e-6)
        tensor([ 1.1547,  1.1547, -1.1547, -1.1547])

    Args:
        rewards: [N] float32, the scorers' rewards, group-contiguous.
        sample_mask: [N] bool.
        response_lengths: [N] int64, response tokens per sample.
        cfg: the run's config.
        reward_components: [N, K] float32, the named rewards (NaN: does not apply); the ``gdpo`` estimator's input.
        reward_weights: [N, K] float32, their weights per sample.

    Returns:
        the step's :class:`StepAdvantages`.

    Raises:
        ValueError: the ``gdpo`` estimator without ``reward_components`` and ``reward_weights``.
    """
    g = cfg.grpo
    shaping = g.reward_shaping
    penalty = torch.zeros_like(rewards)
    if shaping.enabled:
        penalty = overlong_penalty(
            response_lengths,
            max_response_length=cfg.generation.max_new_tokens,
            overlong_buffer_length=shaping.overlong_buffer_length,
            overlong_buffer_penalty=shaping.overlong_buffer_penalty,
        ).to(rewards.dtype)
        rewards = rewards + penalty
    if g.adv_estimator == "gdpo":
        if reward_components is None or reward_weights is None:
            msg = "grpo.adv_estimator 'gdpo' needs the named rewards: pass reward_components and reward_weights"
            raise ValueError(msg)
        if shaping.enabled:  # the overlong penalty is one more named reward, of weight 1
            reward_components = torch.cat([reward_components, penalty[:, None]], dim=1)
            reward_weights = torch.cat([reward_weights, torch.ones_like(penalty)[:, None]], dim=1)
        adv, baseline, std = gdpo_advantages(
            reward_components,
            reward_weights,
            sample_mask,
            group_size=g.num_generations_per_prompt,
            advantage_clip=g.advantage_clip,
        )
    elif g.adv_estimator == "reinforce_plus_plus":
        adv, baseline, std = reinforce_plus_plus_advantages(
            rewards,
            sample_mask,
            response_lengths,
            group_size=g.num_generations_per_prompt,
            advantage_clip=g.advantage_clip,
        )
    else:
        adv, baseline, std = compute_advantages(
            rewards,
            sample_mask,
            group_size=g.num_generations_per_prompt,
            leave_one_out=g.use_leave_one_out_baseline,
            normalize_rewards=g.normalize_rewards,
            advantage_clip=g.advantage_clip,
        )
    return StepAdvantages(advantages=adv, baseline=baseline, std=std, overlong_penalty=penalty)
