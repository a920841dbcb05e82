"""Reward functions the tests configure (``env.reward_functions: [{function: "tests.rewards:<name>"}]``), written to
TRL's ``GRPOTrainer`` reward-function signature. Light on purpose: the reward worker processes import this module."""

from __future__ import annotations


def earnable(completions: list, **kwargs) -> list[float]:
    """A reward a tiny random model earns: 1 for a completion of an even number of characters, else 0. Its groups mix
    both, so the advantages are not zero and every update moves the policy (the dataset's own reward is always 0 for
    it: only the KL term and weight decay would move it, by ~1e-5)."""
    return [float(len(c) % 2 == 0) for c in completions]


EARNABLE = {"reward_functions": [{"function": "tests.rewards:earnable"}]}
"""``env`` overrides of a run rewarded by :func:`earnable`."""
