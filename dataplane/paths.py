"""The only code that knows the data plane's URI layout, and the validation of names placed in it.

Layout under a root (any fsspec URL; local folder by default):
``{root}/{run_id}/{partition_id}/{_schema.json, data/{write_id}.parquet, _commits/{write_id}.json}``.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=-]{0,199}$")


def check_name(kind: str, value: str) -> str:
    """Return ``value`` if it is safe as one path component of the data plane.

    Allowed: letters, digits, ``_ . = -``, at most 200 characters, not starting with ``.``/``_``/``-``,
    no ``..``. This keeps every write inside the root (no separators, no absolute paths, no control
    characters).

    Raises:
        ValueError: naming ``kind`` and the offending value.
    """
    if (
        not isinstance(value, str) or not _NAME.fullmatch(value) or ".." in value
    ):  # fullmatch: "$" would accept a trailing newline
        msg = (
            f"invalid {kind} {value!r}: use 1-200 letters, digits, '_', '.', '=' or '-', starting with a letter "
            "or digit, with no '..', path separators or control characters"
        )
        raise ValueError(msg)
    return value


def join(*parts: str) -> str:
    """Join URL/path parts with single slashes (fsspec paths always use ``/``)."""
    head, *rest = parts
    return "/".join([head.rstrip("/"), *(p.strip("/") for p in rest)])


def run_dir(root: str, run_id: str) -> str:
    return join(root, check_name("run_id", run_id))


def partition_dir(root: str, run_id: str, partition_id: str) -> str:
    return join(run_dir(root, run_id), check_name("partition_id", partition_id))


def schema_path(part_dir: str) -> str:
    return join(part_dir, "_schema.json")


def data_path(part_dir: str, write_id: str) -> str:
    return join(part_dir, "data", f"{check_name('write_id', write_id)}.parquet")


def sealed_path(part_dir: str) -> str:
    return join(part_dir, "_sealed.json")


def commits_dir(part_dir: str) -> str:
    return join(part_dir, "_commits")


def commit_path(part_dir: str, write_id: str) -> str:
    return join(commits_dir(part_dir), f"{check_name('write_id', write_id)}.json")


def checkpoints_dir(root: str, run_id: str) -> str:
    return join(run_dir(root, run_id), "checkpoints")


def checkpoint_dir(root: str, run_id: str, step: int) -> str:
    return join(checkpoints_dir(root, run_id), f"step_{step:06d}")


def step_partition(step: int) -> str:
    return f"step_{step:06d}"


def weights_dir(root: str, run_id: str) -> str:
    return join(run_dir(root, run_id), "weights")


def weights_step_dir(root: str, run_id: str, step: int) -> str:
    return join(weights_dir(root, run_id), f"step_{step:06d}")
