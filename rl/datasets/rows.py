"""Rows of a user dataset as `rl.data.Problem`: which columns hold what (`ColumnKeys`), the checks on a batch of rows
(the prompt is a non-empty string or a non-empty list of ``{role, content}`` messages, the task is known), and the
conversion of checked rows. Pure functions over pyarrow batches, no I/O."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rl.data import Problem
from rl.datasets.errors import DatasetError

__all__ = ["ROW_COLUMN", "ColumnKeys", "check_batch", "check_columns", "prompt_texts", "to_problems"]

ROW_COLUMN = "__grpoflow_row"
"""Column of a prepared copy holding each row's index in the source (int64); never part of ``Problem.entry``."""

Locate = Callable[[int], str]
"""Maps a row's index in its batch to where it is, e.g. ``"file 'a.jsonl', line 4 (row 3)"``."""


@dataclass(frozen=True)
class ColumnKeys:
    """Which columns of a dataset hold the prompt, the answer and the task.

    Attributes:
        prompt_key: a string column, or a column of chat messages ``[{"role": str, "content": str}, ...]``.
        answer_key: the reference answer's column (any type, turned into ``Problem.answer`` with ``str``), or None:
            ``Problem.answer`` is ``""``.
        task_key: the column naming each row's environment (``Problem.task``), or None: every row gets
            ``default_task``.
        default_task: ``Problem.task`` when ``task_key`` is None.
    """

    prompt_key: str = "prompt"
    answer_key: str | None = None
    task_key: str | None = None
    default_task: str = "default"


def check_columns(schema: pa.Schema, keys: ColumnKeys, where: str) -> None:
    """Raise unless every column named by ``keys`` is in ``schema`` and none is named ``ROW_COLUMN``.

    Raises:
        DatasetError: naming ``where``, the missing column, the key that names it and the available columns.
    """
    names = list(schema.names)
    if ROW_COLUMN in names:
        msg = f"{where}: column {ROW_COLUMN!r} is reserved for the prepared copy's row numbers; rename it in the data"
        raise DatasetError(msg)
    for key in ("prompt_key", "answer_key", "task_key"):
        name = getattr(keys, key)
        if name is not None and name not in names:
            msg = (
                f"{where}: there is no column {name!r} (data.{key}); the columns are {names}; set data.{key} to one "
                f"of them or add the column to the data"
            )
            raise DatasetError(msg)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t)


def _message_problem(value: Any) -> str | None:
    """Why ``value`` is not a usable chat-messages prompt, or None when it is."""
    if not isinstance(value, list) or not value:
        return "is not a non-empty list of chat messages"
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {i} is not a {{'role': str, 'content': str}} object (it is {m!r:.120})"
    users = [m["content"] for m in value if m["role"] == "user"]
    if not users:
        return "has no message with role 'user'"
    if not users[-1].strip():
        return "its last 'user' message is empty"
    return None


def check_batch(
    batch: pa.RecordBatch, keys: ColumnKeys, locate: Locate, *, tasks: Collection[str] | None = None
) -> None:
    """Check the prompt (and, with ``tasks``, the task) of every row of ``batch``.

    A string prompt must be non-null with non-whitespace text; a messages prompt a non-empty list of
    ``{"role": str, "content": str}`` with a non-empty last ``user`` message. With ``keys.task_key`` and ``tasks``,
    each row's task value must be one of ``tasks``.

    Raises:
        DatasetError: the first bad row, naming its place (``locate(i)``), the column and the fix.
    """
    col = batch.column(keys.prompt_key)
    name = keys.prompt_key
    if _is_text(col.type):
        bad = pc.or_kleene(pc.is_null(col), pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(col)), 0))
        bad = pc.fill_null(bad, True)
        if pc.any(bad).as_py():
            i = pc.index(bad, True).as_py()
            value = col[i].as_py()
            what = "is missing (null)" if value is None else f"is empty ({value!r})"
            msg = f"{locate(i)}, column {name!r}: the prompt {what}; give every row a non-empty prompt or drop the row"
            raise DatasetError(msg)
    elif _is_list(col.type):
        for i, value in enumerate(col.to_pylist()):
            why = _message_problem(value)
            if why is not None:
                msg = (
                    f"{locate(i)}, column {name!r}: the chat-messages prompt {why}; write it as "
                    f"[{{'role': 'user', 'content': '...'}}, ...] or as a string"
                )
                raise DatasetError(msg)
    else:
        valid = pc.is_valid(col)
        i = pc.index(valid, True).as_py() if pc.any(valid).as_py() else 0
        msg = (
            f"{locate(i)}, column {name!r}: the prompt is {col[i].as_py()!r:.80} of type {col.type}, not a string or "
            f"a list of chat messages; set data.prompt_key to the text column or convert the column to strings"
        )
        raise DatasetError(msg)
    if keys.task_key is not None and tasks is not None:
        known = sorted(set(tasks))
        values = batch.column(keys.task_key).to_pylist()
        for i, value in enumerate(values):
            if value is None or str(value) not in known:
                msg = (
                    f"{locate(i)}, column {keys.task_key!r}: task {value!r} is not a known task (the known tasks are "
                    f"{known}); fix the row's {keys.task_key!r} value or add an environment for {value!r}"
                )
                raise DatasetError(msg)


def _last_user(messages: Sequence[dict[str, Any]]) -> str:
    return [m["content"] for m in messages if m["role"] == "user"][-1]


def prompt_texts(batch: pa.RecordBatch, keys: ColumnKeys) -> list[str]:
    """Each row's prompt text (a messages prompt: its last ``user`` message), from a batch `check_batch` passed."""
    values = batch.column(keys.prompt_key).to_pylist()
    if values and not isinstance(values[0], str):
        return [_last_user(v) for v in values]
    return values


def to_problems(rows: Sequence[dict[str, Any]], keys: ColumnKeys, row_ids: Sequence[str]) -> list[Problem]:
    """Problems from checked rows (``pyarrow`` ``to_pylist`` dicts), one per row.

    ``question`` is the prompt text (a messages prompt: its last ``user`` message's content), ``messages`` the
    prompt's ``(role, content)`` dicts (None for a text prompt), ``answer`` ``str(row[answer_key])`` (``""`` when
    None or no answer column), ``entry`` every column but the prompt (and ``ROW_COLUMN``), ``task`` the task
    column's value as ``str`` or ``keys.default_task``.
    """
    out = []
    for row, row_id in zip(rows, row_ids, strict=True):
        prompt = row[keys.prompt_key]
        entry = {k: v for k, v in row.items() if k != keys.prompt_key and k != ROW_COLUMN}
        messages = None
        if isinstance(prompt, str):
            question = prompt
        else:
            messages = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
            question = _last_user(messages)
        answer = row.get(keys.answer_key) if keys.answer_key is not None else None
        task = keys.default_task if keys.task_key is None else str(row[keys.task_key])
        out.append(
            Problem(
                question=question,
                answer="" if answer is None else str(answer),
                entry=entry,
                task=task,
                row_id=row_id,
                messages=messages,
            )
        )
    return out
