"""GRPO advantages: per-group baseline (leave-one-out or mean) and optional std normalization.

Pure tensor maths, no I/O. Sources: DeepSeekMath (arXiv 2402.03300) eq. for outcome supervision;
leave-one-out baseline from RLOO (arXiv 2402.14740); NeMo-RL
`nemo_rl/algorithms/utils.calculate_baseline_and_std_per_prompt` (Bessel-corrected std of the others).
Deviation from the reference: an invalid sample's own baseline excludes itself from the count as well
(NeMo divides by n_valid - 1 for every row); its loss is masked either way.
"""

from __future__ import annotations

import torch


def baseline_and_std(
    rewards: torch.Tensor,
    sample_mask: torch.Tensor,
    *,
    group_size: int,
    leave_one_out: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and std of its group's valid rewards.

    Leave-one-out: ``b_i = mean_{j != i, valid} r_j`` and ``s_i`` the Bessel-corrected std of those
    others. Otherwise ``b_i = mean_{valid} r_j`` and ``s_i`` the Bessel-corrected std of the group.
    A group with at most one valid sample gets ``b_i = r_i`` and ``s_i = 0`` (zero advantage).

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
        msg = f"rewards {tuple(rewards.shape)} and sample_mask {tuple(sample_mask.shape)} must be [B*G] with G={group_size}"
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
    mean = (w * r[:, None, :]).sum(-1) / safe  # [B, G]
    sq_dev = w * (r[:, None, :] - mean[..., None]) ** 2  # [B, G, G]
    var = sq_dev.sum(-1) / (count - 1).clamp(min=1)  # [B, G]
    std = torch.where(count > 1, var.sqrt(), torch.zeros_like(var))  # [B, G]
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
    """``A_i = r_i - b_i``, divided by ``(s_i + eps)`` where ``s_i > 0`` when ``normalize_rewards``, then
    clamped to ``[-advantage_clip, advantage_clip]`` when given.

    Source: DeepSeekMath 2402.03300 (``(r - mean) / std``), NeMo-RL grpo.py (std > 0 guard, eps 1e-6);
    the clamp bounds the step one rare outcome can take: with the group-mean baseline, one success among
    G = 16 gets ``A = (1 - 1/16) / 0.25 = 3.75`` (Bessel std ``sqrt(16 * 1/16 * 15/16 / 15) = 0.25``).

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
    """
    baseline, std = baseline_and_std(rewards, sample_mask, group_size=group_size, leave_one_out=leave_one_out)
    adv = rewards - baseline  # [N]
    if normalize_rewards:
        adv = torch.where(std > 0, adv / (std + eps), adv)
    if advantage_clip is not None:
        adv = adv.clamp(-advantage_clip, advantage_clip)
    adv = adv * sample_mask.to(adv.dtype)
    return adv, baseline, std
