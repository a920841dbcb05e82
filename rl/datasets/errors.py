"""The one exception of user datasets: every bad input (a missing file or column, a malformed line, an empty prompt,
a prompt that does not fit) raises `DatasetError`, whose message says what is wrong, where and how to fix it."""

from __future__ import annotations

__all__ = ["DatasetError"]


class DatasetError(ValueError):
    """A user dataset cannot be used as it is.

    The message is one paragraph: what is wrong, where (the file or dataset with credentials redacted, the line or
    row, the column) and how to fix it.
    """
