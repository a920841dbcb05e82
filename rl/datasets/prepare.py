"""Prepare a user dataset once per run: stream the source, check every row, keep a split's rows, and write them in
source order as a Parquet copy that training pods read row group by row group (`rl.datasets.stream`).

The copy is committed by its ``index.json`` (written last; see `rl.datasets.layout`). A copy already at the target from
the same source (files' sizes and ETags/mtimes or the ``datasets`` fingerprint), keys and split settings is returned
as it is: a retried task or a resumed run does not read the source again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from dataplane.urls import redact
from rl.data import Problem, split_of
from rl.datasets.errors import DatasetError
from rl.datasets.layout import FORMAT, INDEX, read_index, write_index
from rl.datasets.rows import ROW_COLUMN, ColumnKeys, check_batch, check_columns, prompt_texts, to_problems
from rl.datasets.sources import SourceBatch, SourceInfo, describe_source, iter_batches, locate

__all__ = ["PreparedSplit", "open_split", "prepare_split"]

ROW_GROUP_ROWS = 1024
GROUPS_PER_FILE = 256
_KEEP = ("train", "val", "all")
_OVERLONG = ("refuse", "skip")


@dataclass(frozen=True)
class PreparedSplit:
    """A prepared copy of one split of a user dataset.

    Attributes:
        url: the folder of the copy (Parquet files and ``index.json``).
        num_rows: rows kept.
        source: the source spec, credentials redacted.
        digest: sha256 hex of the rows' content in order (each row group's rows as JSON), the same for every
            preparation of the same rows.
        schema: source column name -> Arrow type string.
        counts: ``rows_read`` (rows of the source), ``held_out`` (rows of the other split), ``skipped_overlong``
            (prompts ``fits`` refused, with ``on_overlong_prompt="skip"``).
    """

    url: str
    num_rows: int
    source: str
    digest: str
    schema: dict[str, str]
    counts: dict[str, int]


def _from_index(url: str, index: dict[str, Any]) -> PreparedSplit:
    return PreparedSplit(
        url=url,
        num_rows=int(index["num_rows"]),
        source=index["source"],
        digest=index["digest"],
        schema=dict(index["schema"]),
        counts={k: int(v) for k, v in index["counts"].items()},
    )


def open_split(url: str, *, storage_options: dict) -> PreparedSplit:
    """The prepared copy at ``url``.

    Raises:
        DatasetError: ``url`` holds no complete copy (no ``index.json``: never prepared, or preparing stopped early).
    """
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    index = read_index(fs, root.rstrip("/"), url)
    if index is None:
        msg = (
            f"prepared dataset {redact(url)!r}: no {INDEX} there (never prepared, or preparing did not finish); "
            f"run prepare_split for it again"
        )
        raise DatasetError(msg)
    return _from_index(url, index)


class _Writer:
    """Rows to Parquet files of exact ``ROW_GROUP_ROWS``-row groups, hashing each group's rows."""

    def __init__(self, fs: Any, root: str, schema: pa.Schema, rows_per_group: int, groups_per_file: int) -> None:
        self.fs, self.root, self.schema = fs, root, schema
        self.rows_per_group, self.groups_per_file = rows_per_group, groups_per_file
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.files: list[dict[str, Any]] = []
        self.sha = hashlib.sha256()
        self._file: Any = None
        self._writer: pq.ParquetWriter | None = None

    def add(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.pending_rows += table.num_rows
        if self.pending_rows >= self.rows_per_group:
            self._flush(final=False)

    def _flush(self, *, final: bool) -> None:
        rows = pa.concat_tables(self.pending) if self.pending else self.schema.empty_table()
        full = rows.num_rows if final else rows.num_rows - rows.num_rows % self.rows_per_group
        for start in range(0, full, self.rows_per_group):
            self._write_group(rows.slice(start, min(self.rows_per_group, full - start)))
        rest = rows.slice(full)
        self.pending, self.pending_rows = ([rest] if rest.num_rows else []), rest.num_rows

    def _write_group(self, group: pa.Table) -> None:
        if self._writer is None or self.files[-1]["row_groups"] == self.groups_per_file:
            self._close_file()
            name = f"part-{len(self.files):05d}.parquet"
            self._file = self.fs.open(f"{self.root}/{name}", "wb")
            self._writer = pq.ParquetWriter(self._file, self.schema, compression="zstd")
            self.files.append({"name": name, "num_rows": 0, "row_groups": 0})
        group = group.combine_chunks()
        self._writer.write_table(group, row_group_size=group.num_rows)
        self.files[-1]["num_rows"] += group.num_rows
        self.files[-1]["row_groups"] += 1
        self.sha.update(json.dumps(group.to_pylist(), default=repr, ensure_ascii=False).encode())

    def _close_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._file.close()
            self._writer = self._file = None

    def close(self) -> None:
        self._flush(final=True)
        self._close_file()

    def abort(self) -> None:
        """Close the open file after a failure (a failure to close chains the first); the copy stays uncommitted."""
        self._close_file()


def _identity(info: SourceInfo, spec: str, split: str, keys: ColumnKeys, options: dict[str, Any]) -> str:
    parts = {"source": redact(spec), "fingerprint": info.fingerprint, "split": split, "keys": asdict(keys), **options}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def prepare_split(
    spec: str,
    *,
    out_url: str,
    split: str,
    keys: ColumnKeys,
    storage_options: dict,
    hf_split: str | None = None,
    hf_config_name: str | None = None,
    val_fraction: float | None = None,
    keep: str = "train",
    tasks: Collection[str] | None = None,
    fits: Callable[[list[Problem]], list[bool]] | None = None,
    on_overlong_prompt: str = "refuse",
    progress: Callable[[int], None] | None = None,
    fits_key: str = "",
    batch_size: int = 65536,
    out_storage_options: dict | None = None,
) -> PreparedSplit:
    """Check a dataset's rows and write those of one split, in source order, as a Parquet copy at ``out_url``.

    Streams the source in batches of ``batch_size`` rows (`rl.datasets.sources.iter_batches`), never whole in memory.
    Each row is checked (`rl.datasets.rows.check_batch`); with ``val_fraction``, a row belongs to ``"val"`` when
    ``rl.data.split_of(prompt text, val_fraction)`` says so (SHA-256 of the text: a prompt is in one split only),
    else to ``"train"``; ``keep`` picks which rows are written (``"all"``: every row, e.g. a separate validation
    file). Rows kept are checked by ``fits`` in batches. The copy holds the source's columns and ``ROW_COLUMN`` (the
    row's index in the source, from 0, files in name order: row ids are ``f"{split}:{index}"``); row groups of
    ``ROW_GROUP_ROWS`` rows, ``GROUPS_PER_FILE`` groups per file; ``index.json`` is written last and commits it.

    Args:
        spec: the source (see `rl.datasets.sources.describe_source`).
        out_url: the folder of the copy (local or fsspec URL); a complete copy there from the same source, keys,
            ``split``, ``hf_split``, ``hf_config_name``, ``val_fraction``, ``keep``, ``tasks``,
            ``on_overlong_prompt`` and ``fits_key`` is returned without reading the source; another copy there is
            replaced.
        split: the name in row ids (``"train"``, ``"val"``).
        keys: which columns hold the prompt, answer and task.
        storage_options: fsspec options of the source's filesystem (and of ``out_url``'s unless
            ``out_storage_options`` is given).
        hf_split: the ``datasets`` split of a ``save_to_disk`` folder or Hub dataset.
        hf_config_name: the Hub dataset's configuration.
        val_fraction: share of prompts held out for validation (0..1), or None: no hold-out.
        keep: ``"train"`` or ``"val"`` (that side of the hold-out; every row when ``val_fraction`` is None for
            ``"train"``), or ``"all"``.
        tasks: the known task names; with ``keys.task_key``, every row's task must be one of them.
        fits: ``fits(problems) -> [bool]``, whether each prompt fits the model's context (called on batches).
        on_overlong_prompt: ``"refuse"`` (raise on the first prompt ``fits`` refuses) or ``"skip"`` (drop, count).
        progress: called with the number of source rows read so far, after each batch.
        fits_key: names what ``fits`` checks (tokenizer, prompt-token limit); part of the copy's identity, so a copy
            checked against another model is prepared again.
        batch_size: rows per batch read from the source.
        out_storage_options: fsspec options of ``out_url``'s filesystem when it differs from the source's.

    Returns:
        The `PreparedSplit`.

    Raises:
        DatasetError: the source cannot be read (see `describe_source` and `iter_batches`); a missing column; an
            empty or malformed prompt; an unknown task; a prompt that does not fit with ``"refuse"``; no row kept.
            Each names the file, the line or row and the column.
        ValueError: ``keep``, ``on_overlong_prompt``, ``val_fraction`` or ``batch_size`` out of range.
    """
    if keep not in _KEEP:
        raise ValueError(f"prepare_split: keep={keep!r}; use one of {list(_KEEP)}")
    if on_overlong_prompt not in _OVERLONG:
        msg = f"data.on_overlong_prompt={on_overlong_prompt!r}; use one of {list(_OVERLONG)}"
        raise ValueError(msg)
    if val_fraction is not None and not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"data.val_fraction={val_fraction}; use a share between 0 and 1, or null for no hold-out")
    if keep == "val" and val_fraction is None:
        raise ValueError("prepare_split: keep='val' needs a val_fraction (the share of prompts held out)")
    if batch_size < 1:
        raise ValueError(f"prepare_split: batch_size={batch_size}; use a positive number of rows")
    info = describe_source(spec, split=hf_split, hf_config_name=hf_config_name, storage_options=storage_options)
    check_columns(info.schema, keys, f"data source {info.url!r}")
    options = {
        "hf_split": hf_split,
        "hf_config_name": hf_config_name,
        "val_fraction": val_fraction,
        "keep": keep,
        "tasks": sorted(tasks) if tasks is not None else None,
        "on_overlong_prompt": on_overlong_prompt,
        "fits_key": fits_key,
    }
    identity = _identity(info, spec, split, keys, options)
    out_fs, root = fsspec.core.url_to_fs(
        out_url, **(storage_options if out_storage_options is None else out_storage_options)
    )
    root = root.rstrip("/")
    index = read_index(out_fs, root, out_url)
    if index is not None and index.get("identity") == identity:
        return _from_index(out_url, index)
    _clear(out_fs, root)

    schema = info.schema.append(pa.field(ROW_COLUMN, pa.int64(), nullable=False))
    writer = _Writer(out_fs, root, schema, ROW_GROUP_ROWS, GROUPS_PER_FILE)
    counts = {"rows_read": 0, "held_out": 0, "skipped_overlong": 0}
    try:
        for part in iter_batches(info, batch_size=batch_size):
            kept = _keep_rows(part, info, split, keys, tasks, val_fraction, keep, fits, on_overlong_prompt, counts)
            if kept is not None and kept.num_rows:
                writer.add(kept)
            counts["rows_read"] += part.batch.num_rows
            if progress is not None:
                progress(counts["rows_read"])
    except BaseException:
        writer.abort()
        raise
    writer.close()
    num_rows = sum(f["num_rows"] for f in writer.files)
    if num_rows == 0:
        msg = (
            f"data source {info.url!r}: no row kept for split {split!r} ({counts['rows_read']} read, "
            f"{counts['held_out']} in the other split, {counts['skipped_overlong']} overlong prompts skipped); "
            f"add rows, lower data.val_fraction, or allow longer prompts"
        )
        raise DatasetError(msg)
    index = {
        "format": FORMAT,
        "identity": identity,
        "source": info.url,
        "kind": info.kind,
        "split": split,
        "num_rows": num_rows,
        "digest": writer.sha.hexdigest(),
        "schema": {f.name: str(f.type) for f in info.schema},
        "counts": counts,
        "row_group_rows": ROW_GROUP_ROWS,
        "files": writer.files,
        "keys": asdict(keys),
        "options": options,
    }
    write_index(out_fs, root, index)
    return _from_index(out_url, index)


def _clear(fs: Any, root: str) -> None:
    """Uncommit and remove a copy at ``root`` (its index first), and make the folder."""
    if fs.exists(f"{root}/{INDEX}"):
        fs.rm_file(f"{root}/{INDEX}")
    if fs.exists(root):
        old = [p for p in fs.ls(root, detail=False) if p.rstrip("/").rsplit("/", 1)[-1].startswith("part-")]
        if old:
            fs.rm(old)
    fs.makedirs(root, exist_ok=True)


def _keep_rows(
    part: SourceBatch,
    info: SourceInfo,
    split: str,
    keys: ColumnKeys,
    tasks: Collection[str] | None,
    val_fraction: float | None,
    keep: str,
    fits: Callable[[list[Problem]], list[bool]] | None,
    on_overlong_prompt: str,
    counts: dict[str, int],
) -> pa.Table | None:
    """The rows of one source batch to write (with ``ROW_COLUMN``), after the checks; updates ``counts``."""
    batch = part.batch
    check_batch(batch, keys, lambda i: locate(info, part.file, part.file_row + i), tasks=tasks)
    rows = list(range(batch.num_rows))
    if val_fraction is not None and keep != "all":
        texts = prompt_texts(batch, keys)
        rows = [i for i in rows if split_of(texts[i], val_fraction) == keep]
        counts["held_out"] += batch.num_rows - len(rows)
    if fits is not None and rows:
        taken = batch.take(pa.array(rows, pa.int64()))
        problems = to_problems(taken.to_pylist(), keys, [f"{split}:{part.source_row + i}" for i in rows])
        ok = list(fits(problems))
        if len(ok) != len(rows):
            raise ValueError(f"fits returned {len(ok)} answers for {len(rows)} prompts; return one bool per prompt")
        if not all(ok):
            if on_overlong_prompt == "refuse":
                i = rows[ok.index(False)]
                explain = getattr(fits, "explain", None)  # rl.prompts.fits_checker's: the lengths and the fixes
                why = (
                    explain(problems[ok.index(False)])
                    if explain is not None
                    else "the prompt does not fit the model's context with room for generation.max_new_tokens; "
                    "shorten the prompt, lower generation.max_new_tokens (or use a model with a longer context), or "
                    "set data.on_overlong_prompt: skip to drop such prompts"
                )
                msg = f"{locate(info, part.file, part.file_row + i)}, column {keys.prompt_key!r}: {why}"
                raise DatasetError(msg)
            counts["skipped_overlong"] += ok.count(False)
            rows = [i for i, fit in zip(rows, ok, strict=True) if fit]
    if not rows:
        return None
    table = pa.Table.from_batches([batch])
    if len(rows) < batch.num_rows:
        table = table.take(pa.array(rows, pa.int64()))
    return table.append_column(
        pa.field(ROW_COLUMN, pa.int64(), nullable=False), pa.array([part.source_row + i for i in rows], pa.int64())
    )
