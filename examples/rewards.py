"""The example's reward functions, written for TRL's ``GRPOTrainer`` (``reward_funcs``): each takes the completions
and the dataset's columns as keyword arguments and returns one float (or None: "does not apply") per completion.
grpoflow calls them unchanged (``env.reward_functions`` / ``env.tasks.<task>.reward_functions``)."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def number_match(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 when the last number in the completion equals the ``answer`` column, else 0.0."""
    out = []
    for completion, truth in zip(completions, answer):
        numbers = _NUMBER.findall(completion)
        out.append(float(bool(numbers) and numbers[-1] == str(truth).strip()))
    return out


def brevity(completions: list[str], **kwargs) -> list[float]:
    """1.0 for a completion of at most three words (the system prompt asks for the number only), else 0.0."""
    return [float(len(c.split()) <= 3) for c in completions]
