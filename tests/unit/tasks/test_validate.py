"""`tasks.validate.sampled_accuracy`: the share of sampled validation completions that are correct, overall and per
task, from hand-built groups."""

from __future__ import annotations

import pytest

from rl.data import Problem
from rl.groups import Groups
from tasks.validate import sampled_accuracy


def test_sampled_accuracy_is_the_correct_share_of_all_completions_and_of_each_tasks():
    problems = [
        Problem(question=f"q{i}", answer="1", entry={}, task=t) for i, t in enumerate(("sum", "product", "sum"))
    ]
    # G = 2 per problem, row-major: sum q0 -> 1, 0; product q1 -> 0.5 (partial: not correct), 1; sum q2 -> 1, 1
    groups = Groups(problems=problems, rewards=[1.0, 0.0, 0.5, 1.0, 1.0, 1.0])
    assert sampled_accuracy(groups, "validation") == {
        "validation/sampled_accuracy": pytest.approx(4 / 6),
        "validation/sampled_accuracy/product": pytest.approx(1 / 2),
        "validation/sampled_accuracy/sum": pytest.approx(3 / 4),
    }
    assert list(sampled_accuracy(groups, "evaluation")) == [
        "evaluation/sampled_accuracy",
        "evaluation/sampled_accuracy/product",
        "evaluation/sampled_accuracy/sum",
    ]
