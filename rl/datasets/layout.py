"""The on-storage layout of a prepared copy: Parquet files ``part-NNNNN.parquet`` of row groups of
``row_group_rows`` rows (each file's last group may be shorter) and ``index.json``, written last, that commits them.
`write_index`/`read_index` move the index; `Layout` maps a row of the copy to its file and row group."""

from __future__ import annotations

import bisect
import json
import uuid
from dataclasses import dataclass
from typing import Any

from dataplane.urls import redact
from rl.datasets.errors import DatasetError

__all__ = ["FORMAT", "INDEX", "Layout", "read_index", "write_index"]

FORMAT = "grpoflow.prepared-prompts/1"
"""The ``format`` value of an index this code writes and reads."""
INDEX = "index.json"


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def write_index(fs: Any, root: str, index: dict[str, Any]) -> None:
    """Write ``root/index.json`` so that readers see all of it or nothing: write-then-rename on a local disk; one PUT
    (atomic) on an object store."""
    payload = json.dumps(index, indent=1).encode()
    path = f"{root}/{INDEX}"
    if _is_local(fs):
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        fs.pipe_file(tmp, payload)
        fs.mv(tmp, path)
    else:
        fs.pipe_file(path, payload)


def read_index(fs: Any, root: str, url: str) -> dict[str, Any] | None:
    """The index at ``root``, or None when there is none (no copy, or one whose writing did not finish).

    Raises:
        DatasetError: the index is not one this code wrote (another format, or not JSON).
    """
    path = f"{root}/{INDEX}"
    if not fs.exists(path):
        return None
    try:
        index = json.loads(fs.cat_file(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        msg = f"prepared dataset {redact(url)!r}: {INDEX} is not JSON ({err}); delete the folder and prepare it again"
        raise DatasetError(msg) from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        got = index.get("format") if isinstance(index, dict) else type(index).__name__
        msg = (
            f"prepared dataset {redact(url)!r}: {INDEX} has format {got!r}, not {FORMAT!r}; delete the folder and "
            f"prepare it again"
        )
        raise DatasetError(msg)
    return index


@dataclass(frozen=True)
class Layout:
    """Row groups of a prepared copy in row order.

    Attributes:
        groups: ``(file name, row group index in the file, first row of the copy, rows)`` per row group.
        starts: the first row of each group, ascending.
    """

    groups: tuple[tuple[str, int, int, int], ...]
    starts: tuple[int, ...]

    @classmethod
    def from_index(cls, index: dict[str, Any]) -> Layout:
        size = int(index["row_group_rows"])
        groups, start = [], 0
        for entry in index["files"]:
            rows = int(entry["num_rows"])
            for g in range(int(entry["row_groups"])):
                n = min(size, rows - g * size)
                groups.append((entry["name"], g, start, n))
                start += n
        return cls(tuple(groups), tuple(g[2] for g in groups))

    def group_of(self, row: int) -> int:
        """The index in ``groups`` of the row group holding row ``row`` of the copy (from 0)."""
        return bisect.bisect_right(self.starts, row) - 1
