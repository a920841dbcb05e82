"""Built-in reward functions, written to TRL's ``GRPOTrainer`` reward-function signature: use them in a config as
``"rl.environments.rewards:<name>"``.

Each takes ``completions`` (strings, or TRL's conversational ``[{"role": "assistant", "content": str}]``) and the
dataset columns it needs as lists over the batch, accepts every other column in ``**kwargs``, and returns one float per
completion, or None where the reward does not apply.
"""

from __future__ import annotations

import re
from typing import Any

from rl.data import extract_answer

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FORMAT = re.compile(
    r"\s*(?:<think>(?:(?!<think>|</think>).)*</think>\s*)?<answer>(?:(?!<answer>|</answer>).)*</answer>\s*", re.DOTALL
)


def text_of(completion: Any) -> str:
    """A completion's text: the string itself, or the content of the first message of a conversational completion."""
    if isinstance(completion, str):
        return completion
    return completion[0]["content"]


def math_verify_accuracy(completions: list, answer: list, **kwargs: Any) -> list[float | None]:
    """1.0 if math-verify finds the completion's answer equal to the reference ``answer``, else 0.0; None where the
    reference does not parse (TRL's ``accuracy_reward`` skips those too).

    The completion's answer is parsed from inside ``<answer>...</answer>`` when there is one, else from the whole text,
    with math-verify's default extraction (LaTeX, ``\\boxed{}`` first, then plain expressions: the last number of
    "The answer is 3"). Equality is ``math_verify.verify(parse(answer), parse(completion))``: symbolic and numeric, so
    ``\\frac{1}{2}`` equals ``0.5``. Source: TRL ``trl/rewards/accuracy_rewards.py:accuracy_reward``, math-verify.
    """
    from math_verify import parse, verify

    rewards: list[float | None] = []
    for completion, ref in zip(completions, answer, strict=True):
        gold = parse(str(ref)) if ref is not None else []
        if not gold:
            rewards.append(None)
            continue
        text = text_of(completion)
        tag = _ANSWER.search(text)
        predicted = parse(tag.group(1) if tag else text)
        rewards.append(float(verify(gold, predicted)))
    return rewards


def answer_tag_format(completions: list, **kwargs: Any) -> list[float]:
    """1.0 if the completion is exactly one ``<answer>...</answer>``, optionally after one ``<think>...</think>``
    (whitespace around them allowed, no text outside, no nested or repeated tags), else 0.0.

    The R1 format reward ``^<think>.*?</think>\\s*<answer>.*?</answer>$`` with the think block optional; sources:
    TRL ``trl/rewards/format_rewards.py:think_format_reward``, open-r1 ``format_reward``.
    """
    return [1.0 if _FORMAT.fullmatch(text_of(c)) else 0.0 for c in completions]


def exact_match(completions: list, answer: list, **kwargs: Any) -> list[float | None]:
    """1.0 if the extracted answer equals the stripped reference ``answer`` as text, else 0.0; None where the reference
    is None.

    The extracted answer is ``rl.data.extract_answer``'s: the text inside ``<answer>...</answer>``, else the last
    number, else the stripped completion.
    """
    return [
        None if ref is None else float(extract_answer(text_of(c)) == str(ref).strip())
        for c, ref in zip(completions, answer, strict=True)
    ]


def completion_length(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Minus the completion's length in thousands of tokens, ``-len(ids) / 1000``: with a small weight, a penalty on
    length (the linear form of TRL's ``get_soft_overlong_punishment``, without its free interval)."""
    return [-len(ids) / 1000.0 for ids in completion_ids]
