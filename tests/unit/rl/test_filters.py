from __future__ import annotations

import math

import torch

from rl.advantages import compute_advantages
from rl.data import Problem
from rl.filters import informative_groups, overlong_mask, seq_mult_prob_error


def test_one_correct_of_four_keeps_the_whole_group():
    # [1, 0, 0, 0]: under a leave-one-out std the correct sample's own std is 0 (its others are all 0), so a
    # row-wise filter drops it and keeps its three wrong siblings. The group as a whole is informative.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    mask = torch.ones(8, dtype=torch.bool)
    _, _, std = compute_advantages(rewards, mask, group_size=4)
    assert std[0] == 0 and (std[1:4] > 0).all()  # what a row-wise filter would see
    assert informative_groups(rewards, mask, group_size=4).tolist() == [True, False]


def test_masked_samples_do_not_count():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    mask = torch.tensor([True, False, False, False])
    assert informative_groups(rewards, mask, group_size=4).tolist() == [False]


def test_overlong_mask():
    assert overlong_mask(torch.tensor([True, False])).tolist() == [False, True]


def test_seq_mult_prob_error_hand_computed():
    # row 0: response tokens at t=1,2 with |gen - prev| = 0 and ln 2 -> mean(1, 2) = 1.5
    gen = torch.tensor([[0.0, -1.0, -1.0, 9.0]])
    prev = torch.tensor([[5.0, -1.0, -1.0 - math.log(2.0), 0.0]])
    mask = torch.tensor([[False, True, True, False]])
    assert seq_mult_prob_error(gen, prev, mask).tolist() == [1.5]


def test_dynamic_sampling_keeps_one_correct_of_four_whole():
    # groups [1, 0, 0, 0] (informative) and [0, 0, 0, 0] (no signal): the first is kept with all four samples
    from rl.rollout import Groups, keep_informative

    groups = Groups(
        problems=[Problem("q0", "1", {}), Problem("q1", "2", {})],
        input_ids=[torch.tensor([i]) for i in range(8)],
        generation_logprobs=[torch.zeros(1)] * 8,
        token_mask=[torch.ones(1, dtype=torch.bool)] * 8,
        responses=[f"r{i}" for i in range(8)],
        rewards=[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        reward_components=[{"score": r} for r in (1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)],
        truncated=[False] * 8,
        prompt_lengths=[1] * 8,
        response_lengths=[1] * 8,
    )
    kept, discarded = keep_informative(groups, torch.ones(8, dtype=torch.bool), group_size=4)
    assert [p.question for p in kept.problems] == ["q0"]
    assert kept.responses == ["r0", "r1", "r2", "r3"] and kept.rewards == [1.0, 0.0, 0.0, 0.0]
    assert kept.reward_components == [{"score": 1.0}, {"score": 0.0}, {"score": 0.0}, {"score": 0.0}]
    assert discarded == 4
