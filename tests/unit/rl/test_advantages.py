from __future__ import annotations

import math

import pytest
import torch

from rl.advantages import baseline_and_std, compute_advantages


def _loop_reference(rewards, mask, g, loo, normalize, clip=None, eps=1e-6):
    """Plain-loop reference of the same definitions (one sample at a time)."""
    adv = []
    for i in range(len(rewards)):
        grp = range(i // g * g, i // g * g + g)
        valid = [j for j in grp if mask[j]]
        others = [j for j in valid if not (loo and j == i)]
        if len(valid) <= 1 or not others:
            adv.append(0.0)
            continue
        b = sum(rewards[j] for j in others) / len(others)
        s = math.sqrt(sum((rewards[j] - b) ** 2 for j in others) / (len(others) - 1)) if len(others) > 1 else 0.0
        a = rewards[i] - b
        if normalize and s > 0:
            a = a / (s + eps)
        if clip is not None:
            a = min(max(a, -clip), clip)
        adv.append(a if mask[i] else 0.0)
    return adv


def test_leave_one_out_hand_computed():
    # group [1, 0, 0, 0]:
    #  sample 0: others [0,0,0] -> baseline 0, std 0 -> A = 1 - 0 = 1 (no normalization: std == 0)
    #  sample 1: others [1,0,0] -> baseline 1/3; std = sqrt(((2/3)^2 + 2*(1/3)^2) / 2) = sqrt(1/3) = 0.57735
    #            A = (0 - 1/3) / (0.57735 + 1e-6) = -0.57735
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    adv, base, std = compute_advantages(rewards, torch.ones(4, dtype=torch.bool), group_size=4)
    assert base.tolist() == pytest.approx([0.0, 1 / 3, 1 / 3, 1 / 3])
    assert std.tolist() == pytest.approx([0.0, math.sqrt(1 / 3), math.sqrt(1 / 3), math.sqrt(1 / 3)])
    assert adv.tolist() == pytest.approx([1.0, -0.57735, -0.57735, -0.57735], abs=1e-5)


def test_group_mean_hand_computed():
    # group [1, 1, 0, 0]: mean 0.5, Bessel std = sqrt((4 * 0.25) / 3) = 0.57735; A = +-0.5 / 0.57735 = +-0.86603
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    adv, base, std = compute_advantages(rewards, torch.ones(4, dtype=torch.bool), group_size=4, leave_one_out=False)
    assert base.tolist() == pytest.approx([0.5] * 4)
    assert std.tolist() == pytest.approx([math.sqrt(1 / 3)] * 4)
    assert adv.tolist() == pytest.approx([0.86603, 0.86603, -0.86603, -0.86603], abs=1e-5)


def test_all_equal_rewards_give_zero_advantages():
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4 + [0.3] * 4)
    adv, _, std = compute_advantages(rewards, torch.ones(12, dtype=torch.bool), group_size=4)
    assert torch.equal(adv, torch.zeros(12))
    assert torch.equal(std, torch.zeros(12))


def test_group_with_one_valid_sample_gets_zero():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    mask = torch.tensor([True, False, False, False])
    adv, base, _ = compute_advantages(rewards, mask, group_size=4)
    assert torch.equal(adv, torch.zeros(4))
    assert base[0] == 1.0


@pytest.mark.parametrize("loo", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("clip", [None, 0.3])
def test_vectorized_matches_loop(loo, normalize, clip):
    gen = torch.Generator().manual_seed(3)
    g = 5
    rewards = torch.rand(40, generator=gen, dtype=torch.float64).round(decimals=1)
    mask = torch.rand(40, generator=gen) > 0.2
    adv, _, _ = compute_advantages(rewards, mask, group_size=g, leave_one_out=loo, normalize_rewards=normalize, advantage_clip=clip)
    ref = _loop_reference(rewards.tolist(), mask.tolist(), g, loo, normalize, clip)
    if clip is not None:
        assert adv.abs().max() == pytest.approx(clip)  # the clip binds on this data
    assert adv.tolist() == pytest.approx(ref, abs=1e-9)


def test_mean_baseline_advantages_sum_to_zero_per_group():
    rewards = torch.rand(32, dtype=torch.float64)
    adv, _, _ = compute_advantages(rewards, torch.ones(32, dtype=torch.bool), group_size=8, leave_one_out=False, normalize_rewards=False)
    assert adv.view(4, 8).sum(1).abs().max() < 1e-12


def test_shape_errors():
    with pytest.raises(ValueError, match="G=3"):
        baseline_and_std(torch.zeros(8), torch.ones(8), group_size=3)


def test_advantage_clip_hand_computed():
    # group-mean baseline, 1 success among 16: mean 1/16, Bessel std sqrt(16 * (1/16) * (15/16) / 15) = 0.25
    #   success: (1 - 1/16) / 0.25 = 3.75 -> clipped to 2.0;  failures: (0 - 1/16) / 0.25 = -0.25 (inside)
    rewards = torch.zeros(16, dtype=torch.float64)
    rewards[0] = 1.0
    mask = torch.ones(16, dtype=torch.bool)
    free, _, _ = compute_advantages(rewards, mask, group_size=16, leave_one_out=False, eps=0.0)
    clipped, _, _ = compute_advantages(rewards, mask, group_size=16, leave_one_out=False, advantage_clip=2.0, eps=0.0)
    assert free[0].item() == pytest.approx(3.75)
    assert clipped[0].item() == pytest.approx(2.0)
    assert clipped[1:].tolist() == pytest.approx([-0.25] * 15)
