"""`DataPlane`: the object-store client (register, put, delta write, read, discard, clear).

Owns every read and write of partition data; the layout itself is `dataplane.paths`, the
tensor<->Arrow codec is `dataplane.codec`. Works over any fsspec URL (local folder, ``s3://``, ...).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Mapping, Sequence
import dataclasses
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from dataplane import paths
from dataplane.codec import DTYPE_KEY, Layout, column_from_arrow, column_to_arrow, materialize, nested_lengths
from dataplane.fields import SAMPLE_ID, TOKEN_FIELDS
from dataplane.meta import GLOBAL_FORWARD_PAD_SEQLEN, KVBatchMeta


class DataPlaneError(KeyError):
    """A read of something that is not there: unknown partition, field, or sample id."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""


def _write_id(fields: Sequence[str], sample_ids: Sequence[str]) -> str:
    """Deterministic id of a write: the same fields for the same rows (a retry) map to the same commit."""
    digest = hashlib.sha256()
    digest.update("\n".join(sorted(fields)).encode())
    digest.update(b"\0")
    digest.update("\n".join(sample_ids).encode())
    return digest.hexdigest()[:32]


class DataPlane:
    """Client of one run's partitions under ``{root}/{run_id}/``.

    A write is one immutable Parquet file (``sample_id`` + the written columns) that becomes visible
    only when its commit record (``_commits/{write_id}.json``, written last and atomically) exists.
    A write id is a hash of the field names and sample ids, so a retried task that rewrites the same
    columns replaces its commit and leaves exactly one visible copy; writes of different fields never
    touch the same object, so concurrent writers both land.

    Args:
        root: fsspec URL of the data plane root (``/tmp/dp``, ``file:///tmp/dp``, ``s3://bucket/prefix``).
        run_id: the run whose partitions this client reads and writes.
        storage_options: passed to fsspec (credentials, ``endpoint_url``); never logged or stored.
    """

    def __init__(self, root: str, run_id: str, *, storage_options: Mapping[str, Any] | None = None) -> None:
        self.root_url = root
        self.run_id = paths.check_name("run_id", run_id)
        # No listings cache: s3fs would answer ls/exists/open from listings made before other processes
        # committed (a read then misses their writes, or an open fails on a file that is there).
        options = {"use_listings_cache": False, **dict(storage_options or {})}
        self.fs, self._root = fsspec.core.url_to_fs(root, **options)
        self._local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    def __repr__(self) -> str:
        return f"DataPlane(root={self.root_url!r}, run_id={self.run_id!r})"

    # ---------------------------------------------------------------- layout
    def _part(self, partition_id: str) -> str:
        return paths.partition_dir(self._root, self.run_id, partition_id)

    def _put_atomic(self, path: str, payload: bytes) -> None:
        """Write a small object so that readers see all of it or nothing."""
        if self._local:
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(tmp, payload)
            self.fs.mv(tmp, path)
        else:  # an object-store PUT is atomic
            self.fs.pipe_file(path, payload)

    # ---------------------------------------------------------------- partitions
    def register_partition(
        self, partition_id: str, *, fields: Mapping[str, str], consumers: Sequence[str] = ()
    ) -> None:
        """Declare a partition's fields (name -> dtype name: ``int64``, ``float32``, ``bool``, ``bfloat16``,
        ``str``, ``struct``) and its consumer tasks. Idempotent; re-registering replaces the schema.

        Raises:
            ValueError: an invalid partition or field name.
        """
        part = self._part(partition_id)
        for name in fields:
            paths.check_name("field", name)
        doc = {"partition_id": partition_id, "fields": dict(fields), "consumers": list(consumers)}
        self._put_atomic(paths.schema_path(part), json.dumps(doc, sort_keys=True).encode())

    def schema(self, partition_id: str) -> dict[str, str]:
        """Registered fields of a partition (name -> dtype name).

        Raises:
            DataPlaneError: the partition was never registered or was cleared.
        """
        path = paths.schema_path(self._part(partition_id))
        try:  # one GET, never a cached listing: another process may have cleared or registered it
            blob = self.fs.cat_file(path, start=0)  # start=0: s3fs sizes a whole-object read with a HEAD first
        except FileNotFoundError:
            raise DataPlaneError(self._missing(partition_id)) from None
        return json.loads(blob)["fields"]

    def _missing(self, partition_id: str) -> str:
        return (
            f"partition {partition_id!r} of run {self.run_id!r} under {self.root_url!r} does not exist: "
            "it was never registered or it was cleared"
        )

    def exists(self, partition_id: str) -> bool:
        return self.fs.exists(paths.schema_path(self._part(partition_id)))

    def clear(self, partition_id: str) -> None:
        """Delete a partition and everything in it; later reads of it raise DataPlaneError."""
        try:
            self.fs.rm(self._part(partition_id), recursive=True)
        except FileNotFoundError:  # never registered, or already cleared
            pass

    # ---------------------------------------------------------------- writes
    def put(
        self,
        partition_id: str,
        columns: Mapping[str, Any],
        *,
        group_size: int = 1,
        task_name: str | None = None,
        id_key: str | None = None,
    ) -> KVBatchMeta:
        """First put: mint sample ids ``f"{uid}_g{i}"`` (one uid per group of ``group_size`` consecutive
        rows) and write ``columns`` under them.

        With ``id_key``, uid ``b`` is a hash of (partition, ``id_key``, ``b``): a retried task that puts the
        same rows again mints the same ids, so its write replaces the failed attempt's instead of adding
        rows beside it. Without it, uids are random (two puts never collide).

        Args:
            partition_id: a registered partition.
            columns: name -> jagged nested tensor [N, j] (per-token), 1-D tensor [N], list[str] or
                list[dict]. Every column has N rows; N is a multiple of ``group_size``.
            group_size: rows per prompt (G); rows are group-contiguous.
            task_name: tag carried by the returned meta.
            id_key: makes the ids deterministic (see above); unique per put within a partition.

        Returns:
            a meta naming the new rows, with ``fields`` and, if ``input_lengths`` was written,
            ``sequence_lengths``.

        Raises:
            ValueError: N not a multiple of ``group_size``, or a column that does not match the schema.
        """
        n = _num_rows(columns)
        if group_size < 1 or n % group_size:
            msg = f"put of {n} rows with group_size={group_size}: rows must come in whole groups"
            raise ValueError(msg)
        if id_key is None:
            uids = [uuid.uuid4().hex for _ in range(n // group_size)]
        else:
            uids = [hashlib.sha256(f"{partition_id}\0{id_key}\0{b}".encode()).hexdigest()[:32] for b in range(n // group_size)]
        sample_ids = [f"{u}_g{i}" for u in uids for i in range(group_size)]
        lengths = columns.get("input_lengths")
        meta = KVBatchMeta(
            partition_id=partition_id,
            sample_ids=sample_ids,
            task_name=task_name,
            fields=[],
            sequence_lengths=None if lengths is None else [int(x) for x in lengths],
        )
        return self.write_columns(meta, columns, task_name=task_name)

    def write_columns(
        self, meta: KVBatchMeta, columns: Mapping[str, Any], *, task_name: str | None = None
    ) -> KVBatchMeta:
        """Delta write: add ``columns`` under the existing ids of ``meta`` (one row per id, same order).

        Everything is checked before anything is written: row counts, registered fields and dtypes, and
        per-token row lengths against ``meta.sequence_lengths``.

        Returns:
            ``meta`` with the written fields added to ``fields``.

        Raises:
            ValueError: a row count, dtype or length mismatch, or an unregistered field.
            DataPlaneError: the partition does not exist.
        """
        if not columns:
            msg = "write_columns needs at least one column"
            raise ValueError(msg)
        schema = self.schema(meta.partition_id)
        n = meta.size()
        arrow_fields = [pa.field(SAMPLE_ID, pa.large_string(), nullable=False)]
        arrays: list[pa.Array] = [pa.array(meta.sample_ids, type=pa.large_string())]
        for name, value in columns.items():
            f, arr = _checked_column(meta, schema, name, value, n)
            arrow_fields.append(f)
            arrays.append(arr)
        table = pa.Table.from_arrays(arrays, schema=pa.schema(arrow_fields))
        write_id = _write_id(list(columns), meta.sample_ids)
        part = self._part(meta.partition_id)
        file_name = f"{write_id}-{uuid.uuid4().hex[:8]}"
        data = paths.data_path(part, file_name)
        if self._local:  # object stores have no folders (s3fs would HEAD the bucket on every write)
            self.fs.makedirs(data.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(data, "wb") as fh:
            pq.write_table(table, fh, **_parquet_options(table.schema))
        record = {
            "write_id": write_id,
            "file": f"data/{file_name}.parquet",
            "fields": {name: schema[name] for name in columns},
            "num_rows": n,
            "task_name": task_name,
            "created_unix_ns": time.time_ns(),
        }
        self._put_atomic(paths.commit_path(part, write_id), json.dumps(record).encode())
        self._drop_superseded(part, write_id, keep=data)
        written = list(dict.fromkeys([*(meta.fields or []), *columns]))
        return KVBatchMeta(
            partition_id=meta.partition_id,
            sample_ids=list(meta.sample_ids),
            task_name=task_name if task_name is not None else meta.task_name,
            fields=written,
            sequence_lengths=meta.sequence_lengths,
            extra_info=dict(meta.extra_info),
            tags=meta.tags,
        )

    def _drop_superseded(self, part: str, write_id: str, *, keep: str) -> None:
        """Delete data files of earlier attempts of ``write_id`` (committed or not): after a retried write the
        partition holds the same objects as after a clean one."""
        stale = [p for p in self.fs.glob(paths.join(part, "data", f"{write_id}-*.parquet")) if p.rstrip("/") != keep.rstrip("/")]
        if stale:
            self.fs.rm(stale)

    def discard(self, partition_id: str, sample_ids: Sequence[str]) -> None:
        """Drop samples mid-step (dynamic sampling): later reads naming them raise DataPlaneError."""
        if not sample_ids:
            return
        part = self._part(partition_id)
        self.schema(partition_id)
        doc = json.dumps({"sample_ids": list(sample_ids)}).encode()
        self._put_atomic(paths.join(paths.discards_dir(part), f"{uuid.uuid4().hex}.json"), doc)

    # ---------------------------------------------------------------- reads
    def _snapshot(self, part: str, partition_id: str) -> _Snapshot:
        """What a read of partition folder ``part`` needs: one listing of the partition, then the schema,
        commit and discard records in one batch of reads.

        Raises:
            DataPlaneError: the partition was never registered or was cleared.
        """
        try:
            listing = self.fs.find(part)  # one LIST on an object store
        except FileNotFoundError:
            listing = []
        folder = {p: p[len(part) :].strip("/").split("/")[0] for p in listing}  # "_commits", "data", ...
        schema = paths.schema_path(part)
        if self.fs._strip_protocol(schema) not in folder:
            raise DataPlaneError(self._missing(partition_id))
        records = [p for p, f in folder.items() if f in ("_commits", "_discards") and p.endswith(".json")]
        try:  # start=0: one GET each (s3fs sizes a whole-object read with a HEAD first)
            blobs = self.fs.cat([schema, *records], start=0)
        except FileNotFoundError:  # cleared between the listing and the reads
            raise DataPlaneError(self._missing(partition_id)) from None
        snap = _Snapshot(part=part)
        for path, blob in blobs.items():
            doc = json.loads(blob)
            kind = folder.get(path)
            if kind == "_commits":
                snap.commits.append(doc)
            elif kind == "_discards":
                snap.discarded.update(doc["sample_ids"])
            else:
                snap.fields = doc["fields"]
        snap.commits.sort(key=lambda r: (r["created_unix_ns"], r["write_id"]))
        return snap

    def _commits(self, part: str) -> list[dict[str, Any]]:
        """Commit records of partition folder ``part``, oldest first ([] if it does not exist)."""
        try:
            return self._snapshot(part, part).commits
        except DataPlaneError:
            return []

    def read(
        self,
        meta: KVBatchMeta,
        select_fields: Sequence[str],
        *,
        layout: Layout = "padded",
        pad_value_dict: Mapping[str, float | int] | None = None,
        pad_to_seqlen: int | None = None,
    ) -> dict[str, Any]:
        """Read ``select_fields`` for the rows of ``meta``, in the meta's order.

        Args:
            meta: the rows to read.
            select_fields: required; the columns to return.
            layout: ``"padded"`` -> per-token fields as dense [N, S] tensors; ``"jagged"`` -> nested.
            pad_value_dict: per-field pad values (default 0).
            pad_to_seqlen: width S for padded per-token fields; default: the meta's
                ``global_forward_pad_seqlen`` if stamped, else the longest row.

        Returns:
            name -> tensor ([N] per-sample, [N, S] or jagged [N, j] per-token) or list (text, structs).

        Raises:
            ValueError: ``select_fields`` empty.
            DataPlaneError: the partition does not exist, a field was never written, or an id is unknown
                or was discarded; the message names the partition, the field and the ids.
        """
        if not select_fields:
            msg = "select_fields is required: name the columns to read (e.g. dataplane.fields.LP_SEED_FIELDS)"
            raise ValueError(msg)
        snap = self._snapshot(self._part(meta.partition_id), meta.partition_id)
        schema = snap.fields
        unknown = [f for f in select_fields if f not in schema]
        if unknown:
            msg = f"fields {unknown} are not registered in partition {meta.partition_id!r}; registered: {sorted(schema)}"
            raise DataPlaneError(msg)
        discarded = snap.discarded & set(meta.sample_ids)
        if discarded:
            msg = f"partition {meta.partition_id!r}: samples {sorted(discarded)[:5]} were discarded ({len(discarded)} in all)"
            raise DataPlaneError(msg)
        commits = list(reversed(snap.commits))  # newest first: a later write of a field wins
        wanted = pa.array(meta.sample_ids, type=pa.large_string())
        tables: dict[str, pa.Table] = {}
        columns: dict[str, Any] = {}
        for name in select_fields:
            sources = [c for c in commits if name in c["fields"]]
            if not sources:
                msg = f"field {name!r} was never written in partition {meta.partition_id!r} (ids {meta.sample_ids[:3]}...)"
                raise DataPlaneError(msg)
            pieces = []
            for c in sources:
                if c["file"] not in tables:
                    cols = [SAMPLE_ID, *[f for f in select_fields if f in c["fields"]]]
                    with self.fs.open(paths.join(snap.part, c["file"]), "rb") as fh:
                        tables[c["file"]] = pq.read_table(fh, columns=cols)
                pieces.append(tables[c["file"]].select([SAMPLE_ID, name]))
            merged = pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)
            ids = merged.column(SAMPLE_ID)
            if len(ids) == len(wanted) and ids.combine_chunks().equals(wanted):
                column, field = merged.column(name), merged.schema.field(name)
            else:
                idx = pc.index_in(wanted, value_set=ids)
                if idx.null_count:
                    missing = [s for s, i in zip(meta.sample_ids, idx.to_pylist()) if i is None]
                    msg = (
                        f"partition {meta.partition_id!r}, field {name!r}: no value for sample ids {missing[:5]} "
                        f"({len(missing)} of {meta.size()} missing)"
                    )
                    raise DataPlaneError(msg)
                column, field = merged.column(name).take(idx), merged.schema.field(name)
            columns[name] = column_from_arrow(field, column)
        if pad_to_seqlen is None:
            pad_to_seqlen = int(meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN, 0))
        return materialize(columns, layout=layout, pad_value_dict=pad_value_dict, pad_to_seqlen=pad_to_seqlen)


@dataclasses.dataclass
class _Snapshot:
    """One read's view of a partition (folder ``part``): registered fields, commit records (oldest first),
    discarded sample ids."""

    part: str
    fields: dict[str, str] = dataclasses.field(default_factory=dict)
    commits: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    discarded: set[str] = dataclasses.field(default_factory=set)


def _parquet_options(schema: pa.Schema) -> dict[str, Any]:
    """Write options: lz4 pages; floats BYTE_STREAM_SPLIT (their exponent bytes then compress), integers
    DELTA_BINARY_PACKED (token ids take ~17 bits, not 64). Both are standard Parquet encodings that pyarrow,
    DuckDB and polars read; unlike dictionary encoding, they do not give up on large vocabularies."""
    encoding = {}
    for f in schema:
        value_type, path = f.type, f.name
        if pa.types.is_large_list(value_type) or pa.types.is_list(value_type):
            value_type, path = value_type.value_type, f"{f.name}.list.element"
        if pa.types.is_float32(value_type) or pa.types.is_float64(value_type):
            encoding[path] = "BYTE_STREAM_SPLIT"
        elif pa.types.is_integer(value_type):
            encoding[path] = "DELTA_BINARY_PACKED"
    return {"compression": "lz4", "use_dictionary": False, "column_encoding": encoding}


def _num_rows(columns: Mapping[str, Any]) -> int:
    if not columns:
        msg = "put needs at least one column"
        raise ValueError(msg)
    first = next(iter(columns.values()))
    return int(first.size(0)) if isinstance(first, torch.Tensor) else len(first)


def _checked_column(
    meta: KVBatchMeta, schema: Mapping[str, str], name: str, value: Any, n: int
) -> tuple[pa.Field, pa.Array]:
    """``value`` as an Arrow column of field ``name``; ValueError, before any write, if it does not fit the partition."""
    where = f"partition {meta.partition_id!r}, field {name!r}"
    if name == SAMPLE_ID or name not in schema:
        msg = f"{where}: not a registered field; register it with register_partition(fields=...) first"
        raise ValueError(msg)
    rows = int(value.size(0)) if isinstance(value, torch.Tensor) else len(value)
    if rows != n:
        msg = f"{where}: {rows} rows for {n} sample ids; write one row per id"
        raise ValueError(msg)
    f, arr = column_to_arrow(name, value)  # zero-copy for numeric tensors: converted once, checked, written
    got = (f.metadata or {}).get(DTYPE_KEY, b"").decode()
    if got != schema[name]:
        msg = f"{where}: dtype {got} but the partition registered {schema[name]}; cast the column"
        raise ValueError(msg)
    if name in TOKEN_FIELDS and isinstance(value, torch.Tensor) and meta.sequence_lengths is not None:
        if not value.is_nested:
            msg = f"{where}: per-token fields are written jagged (dataplane.codec.to_nested_by_length)"
            raise ValueError(msg)
        lengths = nested_lengths(value).tolist()
        if lengths != list(meta.sequence_lengths):
            bad = [i for i, (a, b) in enumerate(zip(lengths, meta.sequence_lengths)) if a != b]
            msg = f"{where}: row lengths differ from input_lengths at rows {bad[:5]}; per-token fields align with input_ids"
            raise ValueError(msg)
    return f, arr
