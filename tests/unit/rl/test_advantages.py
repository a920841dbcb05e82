from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from rl.advantages import (
    advantages_for_step,
    baseline_and_std,
    compute_advantages,
    overlong_penalty,
    reinforce_plus_plus_advantages,
)
from rl.config import config_from_dict


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
    adv, _, _ = compute_advantages(
        rewards, mask, group_size=g, leave_one_out=loo, normalize_rewards=normalize, advantage_clip=clip
    )
    ref = _loop_reference(rewards.tolist(), mask.tolist(), g, loo, normalize, clip)
    if clip is not None:
        assert adv.abs().max() == pytest.approx(clip)  # the clip binds on this data
    assert adv.tolist() == pytest.approx(ref, abs=1e-9)


def test_mean_baseline_advantages_sum_to_zero_per_group():
    rewards = torch.rand(32, dtype=torch.float64)
    adv, _, _ = compute_advantages(
        rewards, torch.ones(32, dtype=torch.bool), group_size=8, leave_one_out=False, normalize_rewards=False
    )
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


# ------------------------------------------------------------------- all-equal rewards: exact, in both dtypes
def _exact_advantages(values: list[Fraction], g: int, loo: bool, eps: Fraction) -> list[tuple[Fraction, bool]]:
    """Per sample of one group: ``(A, exact)``. Where the set behind a sample's baseline holds one value, A = r - that
    value with no division (std 0), exactly; elsewhere A = (r - mean) / (std + eps) with the Bessel std as a float64
    square root of the exact variance (then only close)."""
    out = []
    for i in range(g):
        others = [values[j] for j in range(g) if not (loo and j == i)]
        mean = sum(others, Fraction(0)) / len(others)
        if len(set(others)) == 1:
            out.append((values[i] - others[0], True))
            continue
        var = sum(((x - mean) ** 2 for x in others), Fraction(0)) / (len(others) - 1)
        out.append(((values[i] - mean) / (Fraction(math.sqrt(var)) + eps), False))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("loo", [True, False])
def test_equal_partial_credit_sweep_is_exact(dtype, loo):
    # every credit k/m (m <= 9) as the reward of a whole group, and of a group with one 0 or one 1 among them, for
    # G = 4, 8, 16: a set of equal rewards divides by nothing and takes its value exactly as its baseline (summed and
    # divided, the float32 mean of [2/3] * 7 is one ulp off, its std ~1e-8 passes `std > 0`, and [1, 2/3 x 7] gives
    # A = 313,171)
    credits = sorted({Fraction(k, m) for m in range(1, 10) for k in range(m + 1)})
    groups = []
    for g in (4, 8, 16):
        for c in credits:
            groups += [(g, [c] * g), (g, [Fraction(1)] + [c] * (g - 1)), (g, [Fraction(0)] + [c] * (g - 1))]
    checked = 0
    for g, exact_values in groups:
        rewards = torch.tensor([float(x) for x in exact_values], dtype=dtype)  # each credit rounded to the dtype, once
        stored = [Fraction(x) for x in rewards.tolist()]  # the rounded values, exactly
        adv, _, std = compute_advantages(rewards, torch.ones(g, dtype=torch.bool), group_size=g, leave_one_out=loo)
        for i, (want, exact) in enumerate(_exact_advantages(stored, g, loo, Fraction(1e-6))):
            got = adv[i].item()
            if exact:
                rounded = (
                    torch.tensor(float(want), dtype=torch.float64).to(dtype).item()
                )  # the exact value, rounded once
                assert got == rounded and std[i].item() == 0.0, (
                    g,
                    [float(x) for x in exact_values],
                    i,
                    got,
                    float(want),
                )
                checked += 1
            else:
                assert got == pytest.approx(float(want), rel=2e-5 if dtype == torch.float32 else 1e-12), (g, i)
    assert checked >= 3 * 28 * 4  # every sample of every all-equal group, at least


def test_sets_of_equal_partial_credit_give_exact_advantages():
    # the comments give what summing and dividing (NeMo-RL's baseline) yields for the same rewards
    ones = torch.ones(16, dtype=torch.bool)
    adv, _, _ = compute_advantages(torch.tensor([1.0] + [2 / 3] * 7), ones[:8], group_size=8)
    assert adv[0].item() == pytest.approx(1 / 3, rel=1e-6)  # sum-and-divide: 313,171
    adv, _, _ = compute_advantages(torch.tensor([0.0] + [0.1] * 15), ones, group_size=16)
    assert adv[0].item() == pytest.approx(-0.1, rel=1e-6)  # sum-and-divide: -99,235
    adv, _, _ = compute_advantages(torch.tensor([0.7] * 8), ones[:8], group_size=8)
    assert torch.equal(adv, torch.zeros(8))  # sum-and-divide: +0.056 each


def test_binary_rewards_give_the_sum_and_divide_advantages_bit_for_bit():
    # with 0/1 rewards every sum is exact: the constant-set rule changes no bit (the default run's batches)
    gen = torch.Generator().manual_seed(0)
    rewards = (torch.rand(64, generator=gen) > 0.6).float()
    mask = torch.rand(64, generator=gen) > 0.1
    for loo in (True, False):
        adv, _, _ = compute_advantages(rewards, mask, group_size=8, leave_one_out=loo)
        r, v = rewards.view(-1, 8), mask.float().view(-1, 8)
        w = v[:, None, :].expand(-1, 8, -1).clone() * ((1 - torch.eye(8))[None] if loo else 1)
        count = w.sum(-1)
        mean = (w * r[:, None, :]).sum(-1) / count.clamp(min=1)
        std = torch.where(
            count > 1, ((w * (r[:, None, :] - mean[..., None]) ** 2).sum(-1) / (count - 1).clamp(min=1)).sqrt(), 0.0
        )
        degenerate = (v.sum(-1, keepdim=True) <= 1) | (count < 1)
        base = torch.where(degenerate, r, mean)
        std = torch.where(degenerate, 0.0, std)
        summed = (
            torch.where(std > 0, (r - base) / (std + 1e-6), r - base).reshape(-1) * mask.float()
        )  # sum and divide, without the constant-set rule
        assert torch.equal(adv, summed)


# ------------------------------------------------------------------- REINFORCE++ and overlong shaping
def test_reinforce_plus_plus_hand_computed():
    # groups [1, 0] and [1, 1] (G = 2), 2 response tokens each: a = r - group mean = [0.5, -0.5, 0, 0]
    # token-weighted batch mean 0, variance (2 * 0.25 * 2) / 8 = 0.125: A = a / sqrt(0.125) = [1.41421, -1.41421, 0, 0]
    r = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    adv, base, std = reinforce_plus_plus_advantages(
        r, torch.ones(4, dtype=torch.bool), torch.tensor([2, 2, 2, 2]), group_size=2
    )
    assert adv.tolist() == pytest.approx([math.sqrt(2), -math.sqrt(2), 0.0, 0.0])
    assert base.tolist() == [0.5, 0.5, 1.0, 1.0] and std.tolist() == pytest.approx([math.sqrt(0.125)] * 4)
    # longer responses weigh more: lengths [3, 1, 1, 1]: mean (1.5 - 0.5) / 6 = 1/6, A_0 = (0.5 - 1/6) / sqrt(var)
    adv, _, _ = reinforce_plus_plus_advantages(
        r, torch.ones(4, dtype=torch.bool), torch.tensor([3, 1, 1, 1]), group_size=2
    )
    mu = 1 / 6
    var = (3 * (0.5 - mu) ** 2 + (-0.5 - mu) ** 2 + 2 * mu**2) / 6
    assert adv.tolist() == pytest.approx(
        [(0.5 - mu) / math.sqrt(var), (-0.5 - mu) / math.sqrt(var), -mu / math.sqrt(var), -mu / math.sqrt(var)]
    )


def test_reinforce_plus_plus_matches_a_loop_and_skips_invalid_samples():
    gen = torch.Generator().manual_seed(4)
    r = torch.rand(24, generator=gen, dtype=torch.float64).round(decimals=1)
    mask = torch.rand(24, generator=gen) > 0.2
    lengths = torch.randint(0, 9, (24,), generator=gen)
    adv, _, _ = reinforce_plus_plus_advantages(r, mask, lengths, group_size=4, advantage_clip=2.5)
    a = []
    for i in range(24):
        grp = [j for j in range(i // 4 * 4, i // 4 * 4 + 4) if mask[j]]
        a.append(float(r[i]) - sum(float(r[j]) for j in grp) / len(grp) if len(grp) > 1 else 0.0)
    w = [int(lengths[i]) if mask[i] else 0 for i in range(24)]
    mu = sum(wi * ai for wi, ai in zip(w, a)) / sum(w)
    sd = math.sqrt(max(sum(wi * (ai - mu) ** 2 for wi, ai in zip(w, a)) / sum(w), 1e-8))
    want = [min(max((ai - mu) / sd, -2.5), 2.5) if mask[i] else 0.0 for i, ai in enumerate(a)]
    assert adv.tolist() == pytest.approx(want, abs=1e-12)


def test_overlong_penalty_hand_computed():
    # L_max 32, L_cache 8: no penalty up to 24 tokens, then -(len - 24) / 8 * 0.5
    lengths = torch.tensor([0, 24, 25, 28, 32])
    got = overlong_penalty(lengths, max_response_length=32, overlong_buffer_length=8, overlong_buffer_penalty=0.5)
    assert got.tolist() == [0.0, 0.0, -0.0625, -0.25, -0.5]


def test_the_step_applies_shaping_then_the_chosen_estimator():
    r = torch.tensor([1.0, 1.0, 0.0, 0.0])
    lengths = torch.tensor([32, 4, 4, 4])
    mask = torch.ones(4, dtype=torch.bool)
    cfg = config_from_dict({"grpo": {"num_generations_per_prompt": 4, "reward_shaping": {"enabled": True}}})
    step = advantages_for_step(r, mask, lengths, cfg)
    assert step.overlong_penalty.tolist() == [-1.0, 0.0, 0.0, 0.0]  # the first response used the whole budget
    assert torch.equal(step.advantages, compute_advantages(torch.tensor([0.0, 1.0, 0.0, 0.0]), mask, group_size=4)[0])
    plain = advantages_for_step(r, mask, lengths, config_from_dict({"grpo": {"num_generations_per_prompt": 4}}))
    assert torch.equal(plain.overlong_penalty, torch.zeros(4)) and torch.equal(
        plain.advantages, compute_advantages(r, mask, group_size=4)[0]
    )
    rpp = advantages_for_step(
        r,
        mask,
        lengths,
        config_from_dict({"grpo": {"num_generations_per_prompt": 4, "adv_estimator": "reinforce_plus_plus"}}),
    )
    assert torch.equal(rpp.advantages, reinforce_plus_plus_advantages(r, mask, lengths, group_size=4)[0])
    dr = advantages_for_step(
        r,
        mask,
        lengths,
        config_from_dict(
            {"grpo": {"num_generations_per_prompt": 4, "use_leave_one_out_baseline": False, "normalize_rewards": False}}
        ),
    )
    assert dr.advantages.tolist() == [0.5, 0.5, -0.5, -0.5]  # Dr. GRPO: r - group mean


def test_reinforce_plus_plus_edges_equal_group_invalid_sample_and_empty_response():
    # groups (G = 2): [1, 0] with 2 tokens each; [0.5, 0.5] (equal: a = 0); [1, <invalid>];
    #   [0 with no response token, 1 with 4]
    #   a = [0.5, -0.5, 0, 0, 0, -, -0.5, 0.5]; the group of one valid sample gets a = 0; the empty response weighs 0
    #   weights n = [2, 2, 2, 2, 2, 0, 0, 4]: mu = (1 - 1 + 0 + 0 + 0 + 0 + 2) / 14 = 1/7
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 7.0, 0.0, 1.0], dtype=torch.float64)
    mask = torch.tensor([True, True, True, True, True, False, True, True])
    n = torch.tensor([2, 2, 2, 2, 2, 2, 0, 4])
    adv, _, _ = reinforce_plus_plus_advantages(r, mask, n, group_size=2)
    a = [0.5, -0.5, 0.0, 0.0, 0.0, 0.0, -0.5, 0.5]
    w = [2, 2, 2, 2, 2, 0, 0, 4]
    mu = sum(x * y for x, y in zip(w, a)) / 14
    sd = math.sqrt(sum(x * (y - mu) ** 2 for x, y in zip(w, a)) / 14)
    want = [(y - mu) / sd for y in a]
    want[5] = 0.0  # invalid
    assert mu == pytest.approx(1 / 7)
    assert adv.tolist() == pytest.approx(want, abs=1e-12)
    assert adv[2] == adv[3] == adv[4] < 0  # an equal group is not 0 here: -mu / sigma (unlike GRPO)


def test_gdpo_normalizes_each_named_reward_in_its_group_then_the_weighted_sum_over_the_batch():
    """Two groups of G = 3 with rewards correct (weight 1) and format (weight 0.5). By hand: group 0's correct
    [1, 0, 0] normalizes to [2, -1, -1] / sqrt(3) (mean 1/3, Bessel std 1/sqrt(3)), its format [1, 1, 0] to
    [1, 1, -2] / sqrt(3); group 1's correct is all 1 (std 0: contributes 0) and format [0, 1, 0] gives [-1, 2, -1] /
    sqrt(3). The weighted sums, then the batch's (Bessel) normalization."""
    from rl.advantages import gdpo_advantages

    comps = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    weights = torch.tensor([[1.0, 0.5]]).expand(6, 2)
    adv, mean, std = gdpo_advantages(comps, weights, torch.ones(6, dtype=torch.bool), group_size=3)
    s3 = 3**0.5
    a_sum = torch.tensor([2 + 0.5, -1 + 0.5, -1 - 1.0, -0.5, 1.0, -0.5]) / s3
    want = (a_sum - a_sum.mean()) / a_sum.std()
    assert torch.allclose(adv, want, atol=1e-5)
    assert mean[0].item() == pytest.approx(a_sum.mean().item(), abs=1e-6)
    assert std[0].item() == pytest.approx(a_sum.std().item(), rel=1e-5)


def test_gdpo_leaves_out_rewards_that_do_not_apply_and_masked_samples():
    """NaN (a reward function's None, or another task's reward) adds nothing and stays out of the group's statistics;
    a masked sample gets 0 and stays out of the batch's."""
    from rl.advantages import gdpo_advantages

    nan = float("nan")
    comps = torch.tensor([[1.0, nan], [0.0, nan], [nan, 3.0], [nan, 1.0]])  # task a: reward 0; task b: reward 1
    weights = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 2.0], [0.0, 2.0]])
    mask = torch.tensor([True, True, True, True])
    adv, _, _ = gdpo_advantages(comps, weights, mask, group_size=2)
    # a group of two, [1, 0] or [3, 1]: mean halfway, Bessel std |r0 - r1| / sqrt(2), so +-0.7071 before the weights
    a_sum = torch.tensor([0.7071068, -0.7071068, 2 * 0.7071068, -2 * 0.7071068])
    assert torch.allclose(adv, (a_sum - a_sum.mean()) / a_sum.std(), atol=1e-5)
    assert not torch.isnan(adv).any()
    masked = gdpo_advantages(comps, weights, torch.tensor([True, True, True, False]), group_size=2)[0]
    assert masked[3].item() == 0.0


def test_the_gdpo_estimator_needs_the_named_rewards():
    from rl.advantages import advantages_for_step
    from rl.config import config_from_dict

    cfg = config_from_dict({"grpo": {"adv_estimator": "gdpo", "num_generations_per_prompt": 2}})
    r = torch.tensor([1.0, 0.0])
    with pytest.raises(ValueError, match="'gdpo' needs the named rewards"):
        advantages_for_step(r, torch.ones(2, dtype=torch.bool), torch.tensor([3, 4]), cfg)
    out = advantages_for_step(
        r,
        torch.ones(2, dtype=torch.bool),
        torch.tensor([3, 4]),
        cfg,
        reward_components=r[:, None],
        reward_weights=torch.ones(2, 1),
    )
    assert torch.allclose(out.advantages, torch.tensor([0.7071068, -0.7071068]), atol=1e-5)
