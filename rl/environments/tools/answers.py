"""The final answer of a tool-using completion and its comparison with the reference: pure text logic."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def final_answer(text: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>`` in ``text`` if there is one, else the last number
    (``1,234.5`` style thousands separators allowed), else None."""
    tags = _ANSWER.findall(text)
    if tags:
        return tags[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def as_number(text: str) -> Decimal | None:
    """``text`` as an exact decimal (commas, underscores and spaces removed), or None when it is not a number."""
    cleaned = re.sub(r"[,_\s]", "", text)
    if not cleaned:
        return None
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def answers_match(predicted: str | None, reference: object) -> bool:
    """Whether ``predicted`` (``final_answer``'s) equals ``reference``.

    A numeric reference is compared numerically and exactly (``Decimal``: ``"83810205.0" == 83810205``); when the
    predicted text is not itself a number its last number is used, so ``<answer>x = 42</answer>`` matches 42. Any
    other reference is compared as stripped text.
    """
    if predicted is None:
        return False
    ref_text = str(reference).strip()
    ref_num = as_number(ref_text) if not isinstance(reference, bool) else None
    if ref_num is None:
        return predicted.strip() == ref_text
    got = as_number(predicted)
    if got is None:
        numbers = _NUMBER.findall(predicted)
        got = as_number(numbers[-1]) if numbers else None
    return got is not None and got == ref_num
