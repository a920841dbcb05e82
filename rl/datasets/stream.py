"""Training order over a prepared copy: `PromptStream` maps a position (prompts drawn so far) to a row through
per-epoch permutations and reads only the row groups holding the rows asked for; `first_rows` reads the copy's first
rows in order (validation). Reads go through fsspec, with a small per-process LRU of row groups."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dataplane.urls import redact
from rl.data import Problem
from rl.datasets.errors import DatasetError
from rl.datasets.layout import INDEX, Layout, read_index
from rl.datasets.prepare import PreparedSplit
from rl.datasets.rows import ROW_COLUMN, ColumnKeys, check_columns, to_problems

__all__ = ["PromptStream", "first_rows"]

_CACHE_GROUPS = 32
_READERS = 8
_GROUPS: OrderedDict[tuple[str, str, str, int], pa.Table] = OrderedDict()
_METADATA: OrderedDict[tuple[str, str, str], pq.FileMetaData] = OrderedDict()
_LOCK = threading.Lock()


def _cached(cache: OrderedDict, key: tuple, size: int, load: Any) -> Any:
    with _LOCK:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
    value = load()
    with _LOCK:
        cache[key] = value
        while len(cache) > size:
            cache.popitem(last=False)
    return value


class _Copy:
    """A prepared copy opened for reading: its index, layout and filesystem."""

    def __init__(self, split: PreparedSplit, keys: ColumnKeys, storage_options: dict) -> None:
        self.url, self.digest = split.url, split.digest
        self.fs, root = fsspec.core.url_to_fs(split.url, **storage_options)
        self.root = root.rstrip("/")
        index = read_index(self.fs, self.root, split.url)
        if index is None:
            msg = f"prepared dataset {redact(split.url)!r}: no {INDEX} there; run prepare_split for it again"
            raise DatasetError(msg)
        if index["digest"] != split.digest:
            msg = (
                f"prepared dataset {redact(split.url)!r} changed since it was opened (digest {index['digest'][:12]} "
                f"there, {split.digest[:12]} expected); open it again with open_split, or prepare it again"
            )
            raise DatasetError(msg)
        check_columns(
            pa.schema([(name, pa.null()) for name in index["schema"]]), keys, f"prepared dataset {redact(split.url)!r}"
        )
        self.split_name: str = index["split"]
        self.num_rows = int(index["num_rows"])
        self.layout = Layout.from_index(index)

    def _group(self, g: int) -> pa.Table:
        name, rg, _, _ = self.layout.groups[g]
        path = f"{self.root}/{name}"

        def metadata() -> pq.FileMetaData:
            with self.fs.open(path, "rb") as f:
                return pq.ParquetFile(f).metadata

        def load() -> pa.Table:
            md = _cached(_METADATA, (self.url, self.digest, name), 8, metadata)
            with self.fs.open(path, "rb") as f:
                return pq.ParquetFile(f, metadata=md).read_row_group(rg)

        return _cached(_GROUPS, (self.url, self.digest, name, rg), _CACHE_GROUPS, load)

    def problems(self, rows: np.ndarray, keys: ColumnKeys) -> list[Problem]:
        """Problems of rows ``rows`` of the copy (from 0), in that order; each row group read once, up to
        ``_READERS`` at a time (object-store reads wait on the network)."""
        groups = np.searchsorted(np.asarray(self.layout.starts), rows, side="right") - 1
        needed = [int(g) for g in np.unique(groups)]
        if len(needed) > 1:
            with ThreadPoolExecutor(min(_READERS, len(needed))) as pool:
                tables = dict(zip(needed, pool.map(self._group, needed), strict=True))
        else:
            tables = {g: self._group(g) for g in needed}
        out: list[Any] = [None] * len(rows)
        for g in needed:
            where = np.flatnonzero(groups == g)
            local = rows[where] - self.layout.starts[g]
            table = tables[g].take(pa.array(local, pa.int64()))
            records = table.to_pylist()
            ids = [f"{self.split_name}:{r[ROW_COLUMN]}" for r in records]
            for i, p in zip(where, to_problems(records, keys, ids), strict=True):
                out[i] = p
        return out


class PromptStream:
    """The training order over a prepared split.

    Epoch ``e`` is the permutation ``numpy.random.default_rng([seed, e]).permutation(n)`` of the ``n`` rows (the
    identity with ``shuffle=False``); epochs follow each other, so position ``p`` (0-based count of prompts drawn)
    is row ``perm_e[p % n]`` of epoch ``e = p // n``. The same seed gives the same order on every pod.

    Raises:
        DatasetError: (at construction) the copy has no index, another digest than ``split.digest``, or no column
            named by ``keys``.
    """

    def __init__(
        self, split: PreparedSplit, *, seed: int, keys: ColumnKeys, storage_options: dict, shuffle: bool = True
    ) -> None:
        self._copy = _Copy(split, keys, storage_options)
        self._seed, self._keys, self._shuffle = int(seed), keys, shuffle
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    @property
    def num_rows(self) -> int:
        """Rows of the copy (the epoch length)."""
        return self._copy.num_rows

    def epoch(self, position: int) -> int:
        """The epoch (from 0) of position ``position``."""
        return position // self.num_rows

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            n = self.num_rows
            self._perms[epoch] = (
                np.random.default_rng([self._seed, epoch]).permutation(n) if self._shuffle else np.arange(n)
            )
            while len(self._perms) > 2:
                self._perms.popitem(last=False)
        return self._perms[epoch]

    def rows(self, start: int, count: int) -> np.ndarray:
        """Rows of the copy (int64, shape ``(count,)``) at positions ``start .. start+count-1``."""
        if start < 0 or count < 0:
            raise ValueError(f"PromptStream: start={start}, count={count}; both must be >= 0")
        out = np.empty(count, dtype=np.int64)
        done, n = 0, self.num_rows
        while done < count:
            p = start + done
            e, offset = divmod(p, n)
            take = min(count - done, n - offset)
            out[done : done + take] = self._perm(e)[offset : offset + take]
            done += take
        return out

    def problems(self, start: int, count: int) -> list[Problem]:
        """Problems at positions ``start .. start+count-1`` (may span epochs), reading only their row groups.

        Raises:
            ValueError: negative ``start`` or ``count``.
        """
        return self._copy.problems(self.rows(start, count), self._keys)


def first_rows(split: PreparedSplit, count: int, *, keys: ColumnKeys, storage_options: dict) -> list[Problem]:
    """The first ``count`` rows of the copy in order (all of them if fewer), e.g. the validation prompts."""
    copy = _Copy(split, keys, storage_options)
    return copy.problems(np.arange(min(count, copy.num_rows), dtype=np.int64), keys)
