"""Problems and rewards: reasoning-gym datasets, split by question content into train and validation,
rendered with the model's chat template, scored with the dataset's own ``score_answer``.

Owns the problem stream and answer extraction; no model code.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

_CHUNK = 1000
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class Problem:
    """One prompt of a dataset, as the rollout renders it and the environments score it.

    Attributes:
        question: the prompt text (a chat-messages prompt: the content of its last user message), the ``prompt``
            column of the rollout.
        answer: the reference answer as text, ``""`` when the dataset has none.
        entry: what the environment receives besides the completion: a reasoning-gym problem's entry
            (``question``, ``answer``, ``metadata``); a file dataset's row, every column but the prompt, untouched.
        task: the name of the environment that scores it (``data.task_key``'s value, or the run's one task).
        row_id: the dataset row it came from (``"train:41"``: split and row number in the source, from 0), kept with
            the rollouts.
        messages: the prompt as chat messages (``[{"role", "content"}, ...]``) used as they are, or None for a text
            prompt (rendered with ``data.system_prompt`` and the chat template, or raw).
    """

    question: str
    answer: str
    entry: dict[str, Any]
    task: str = ""
    row_id: str = ""
    messages: tuple[dict[str, str], ...] | None = None


def split_of(question: str, val_fraction: float) -> str:
    """``"val"`` for a fixed share of the question space (by SHA-256 of the text), else ``"train"``.

    A question is in exactly one split whatever the seed, so no validation question is ever trained on.
    """
    bucket = int.from_bytes(hashlib.sha256(question.encode()).digest()[:4], "big") / 2**32
    return "val" if bucket < val_fraction else "train"


@lru_cache(maxsize=64)
def _dataset(name: str, kwargs: tuple[tuple[str, int], ...], seed: int) -> Any:
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=_CHUNK, **dict(kwargs))
    except (KeyError, ValueError) as err:
        msg = f"data.dataset={name!r} with dataset_kwargs={dict(kwargs)} is not a valid reasoning-gym dataset ({err})"
        raise ValueError(msg) from None


@lru_cache(maxsize=64)
def _chunk(name: str, kwargs: tuple[tuple[str, int], ...], seed: int, split: str, val_fraction: float) -> list[Problem]:
    ds = _dataset(name, kwargs, seed)
    out = []
    for i in range(len(ds)):
        entry = ds[i]
        if split_of(entry["question"], val_fraction) == split:
            row_id = f"{split}:{name}:{seed}:{i}"  # the dataset, the chunk's seed and the item in it
            out.append(
                Problem(question=entry["question"], answer=str(entry["answer"]), entry=entry, task=name, row_id=row_id)
            )
    return out


def train_problems(
    *, dataset: str, dataset_kwargs: Mapping[str, Any], seed: int, val_fraction: float, start: int, count: int
) -> list[Problem]:
    """Problems ``start .. start+count-1`` of the training stream (deterministic, unbounded).

    The stream is chunk after chunk of reasoning-gym problems, keeping only questions of the train split.
    reasoning-gym seeds item i of a dataset with ``seed + i``, so chunk c is drawn with seed
    ``seed + c * chunk_size``: consecutive chunks continue the sequence instead of repeating it shifted.
    """
    kwargs = tuple(sorted(dataset_kwargs.items()))
    out: list[Problem] = []
    chunk, offset = 0, start
    while len(out) < count:
        items = _chunk(dataset, kwargs, seed + chunk * _CHUNK, "train", val_fraction)
        if not items:
            msg = f"no training questions in {dataset} chunk {chunk}; lower data.val_fraction"
            raise ValueError(msg)
        if offset >= len(items):
            offset -= len(items)
        else:
            take = items[offset : offset + count - len(out)]
            out.extend(take)
            offset = 0
        chunk += 1
    return out


def val_problems(
    *, dataset: str, dataset_kwargs: Mapping[str, Any], seed: int, val_fraction: float, count: int
) -> list[Problem]:
    """``count`` distinct validation-split questions.

    Raises:
        ValueError: fewer distinct validation questions exist than asked for.
    """
    kwargs = tuple(sorted(dataset_kwargs.items()))
    seen: dict[str, Problem] = {}
    for chunk in range(20):
        for p in _chunk(dataset, kwargs, seed + chunk * _CHUNK, "val", val_fraction):
            seen.setdefault(p.question, p)
            if len(seen) == count:
                return list(seen.values())
    msg = (
        f"only {len(seen)} distinct validation questions exist for {dataset} {dict(kwargs)} at "
        f"val_fraction={val_fraction}; lower data.num_val_problems to {len(seen)} or widen the task"
    )
    raise ValueError(msg)


def prompt_token_ids(tokenizer: Any, question: str, system_prompt: str) -> list[int]:
    """Chat-template token ids of ``[system, user]`` with the assistant turn opened."""
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def extract_answer(response: str) -> str:
    """The text inside ``<answer>...</answer>`` if present, else the last number, else the stripped text."""
    tag = _ANSWER_TAG.search(response)
    if tag:
        return tag.group(1).strip()
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else response.strip()


def score(problem: Problem, response: str, dataset: str, dataset_kwargs: Mapping[str, Any], seed: int) -> float:
    """Reward in [0, 1] from the dataset's own ``score_answer`` on the extracted answer."""
    ds = _dataset(dataset, tuple(sorted(dataset_kwargs.items())), seed)
    return float(ds.score_answer(answer=extract_answer(response), entry=problem.entry))
