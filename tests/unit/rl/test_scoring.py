"""Scoring through the environments (`rl.scoring`): the default run's rewards equal today's scorer's, sample by sample;
rows are routed by task; reward functions see the dataset's columns; per-task metrics."""

from __future__ import annotations

import math

import pytest

from rl.config import config_from_dict
from rl.data import Problem, score, train_problems
from rl.rollout import Groups, per_task_rewards
from rl.scoring import all_reward_names, environments, reward_names, score_completions


def _default_cfg():
    return config_from_dict({})


def test_the_default_run_scores_exactly_as_the_reasoning_gym_scorer_did():
    """Real chain_sum problems of the default stream; right, wrong, tagged, garbled and empty completions: the
    environment path (worker processes included) gives the rewards `rl.data.score` gives."""
    cfg = _default_cfg()
    d = cfg.data
    problems = train_problems(
        dataset=d.dataset, dataset_kwargs=d.dataset_kwargs, seed=d.seed, val_fraction=d.val_fraction, start=0, count=8
    )
    responses = []
    for i, p in enumerate(problems):
        responses += [p.answer, f"The sum is {int(p.answer) + 1 + i}", f"<answer>{p.answer}</answer>", "banana", ""]
    owners = [p for p in problems for _ in range(5)]
    got = score_completions(environments(cfg), owners, responses, [[1, 2]] * len(responses), cfg)
    want = [score(p, r, d.dataset, d.dataset_kwargs, d.seed) for p, r in zip(owners, responses)]
    assert got.rewards == want
    assert sum(want) >= 16  # the right answers were rewarded: the comparison is not between zeros
    assert [c["reasoning_gym"] for c in got.components] == want


def _two_task_cfg():
    return config_from_dict(
        {
            "data": {"train": "unused.jsonl", "task_key": "task", "answer_key": "solution"},
            "env": {
                "tasks": {
                    "even": {"reward_functions": [{"function": "tests.rewards:earnable", "weight": 2.0}]},
                    "number": {
                        "reward_functions": [
                            {"function": "examples/rewards.py:number_match", "weight": 1.0},
                            {"function": "examples/rewards.py:brevity", "weight": 0.5},
                        ]
                    },
                }
            },
        }
    )


def _problem(task: str, question: str, answer: str, i: int) -> Problem:
    return Problem(
        question=question,
        answer=answer,
        entry={"solution": answer, "task": task, "source": "hand"},
        task=task,
        row_id=f"train:{i}",
    )


def test_rows_go_to_their_task_and_rewards_are_the_weighted_sum_of_trl_style_functions():
    cfg = _two_task_cfg()
    problems = [_problem("even", "q0", "1", 0), _problem("number", "What is 2+2?", "4", 1)]
    owners = [p for p in problems for _ in range(2)]  # two groups of G = 2, group-contiguous
    responses = ["ab", "abc", "It is 4", "I would say the answer is 5"]
    got = score_completions(environments(cfg), owners, responses, [[1]] * 4, cfg)
    # even: 2 * earnable (even length); number: number_match + 0.5 * brevity (at most 3 words)
    assert got.rewards == [2.0, 0.0, 1.0 + 0.5, 0.0 + 0.0]
    assert all_reward_names(cfg) == ["brevity", "earnable", "number_match"]
    assert got.components[0]["earnable"] == 1.0 and math.isnan(got.components[0]["number_match"])
    assert got.components[2]["number_match"] == 1.0 and got.components[2]["brevity"] == 1.0
    assert math.isnan(got.components[2]["earnable"])
    assert reward_names(cfg) == {"even": {"earnable": 2.0}, "number": {"number_match": 1.0, "brevity": 0.5}}

    groups = Groups(problems=problems, rewards=got.rewards, reward_components=got.components)
    metrics = per_task_rewards(groups, group_size=2)
    assert metrics == {
        "reward/even": 1.0,
        "reward/number": 0.75,
        "reward/even/earnable": 0.5,
        "reward/number/number_match": 0.5,
        "reward/number/brevity": 0.5,
    }


def test_a_row_whose_task_has_no_environment_is_refused_naming_it():
    cfg = _two_task_cfg()
    with pytest.raises(ValueError, match=r"row 'train:7' has task 'poetry', which no environment scores"):
        score_completions(environments(cfg), [_problem("poetry", "q", "a", 7)], ["x"], [[1]], cfg)
