"""`DataPlane`: the object-store client (register, seal, put, delta write, read, clear, collect garbage).

Owns every read and write of partition data. The layout itself is `dataplane.paths`, the tensor<->Arrow codec
`dataplane.codec`, the partition records (schema, seal) `dataplane.partitions`, the commit-record format
`dataplane.commits`, and garbage collection `dataplane.gc`. Works over any fsspec URL (local folder, ``s3://``, ...).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from dataplane import commits, gc, partitions, paths
from dataplane.codec import DTYPE_KEY, Layout, column_from_arrow, column_to_arrow, materialize, nested_lengths
from dataplane.commits import Snapshot, checksum
from dataplane.errors import DataPlaneError, DataPlaneWarning, IntegrityError, StaleMetaError, retry_transient
from dataplane.fields import INPUT_LENGTHS, SAMPLE_ID, TOKEN_FIELDS
from dataplane.gc import GC_GRACE_S
from dataplane.meta import GLOBAL_FORWARD_PAD_SEQLEN, KVBatchMeta
from dataplane.urls import check_root, redact

if TYPE_CHECKING:  # tensordict costs ~1.7 s to import: only the model tasks load it
    from tensordict import TensorDict


__all__ = [
    "COMMIT_DEADLINE_S",
    "GC_GRACE_S",
    "DataPlane",
    "DataPlaneError",
    "DataPlaneWarning",
    "IntegrityError",
    "StaleMetaError",
]

COMMIT_DEADLINE_S = 600.0
"""Longest time (s) from the start of a write's data-file upload to the start of its commit: a writer that gets
there later (a process paused or starved, an upload retried for minutes) raises ``TimeoutError`` instead of committing
(Flyte retries the task; the retry uploads afresh), because a garbage collection may by then count its file as old
enough to remove. Keep it well under ``GC_GRACE_S`` (``dataplane.gc``)."""


class DataPlane:
    """Client of one run's partitions under ``{root}/{run_id}/``.

    A write is one immutable Parquet file (``sample_id`` + the written columns) that becomes visible
    only when its commit record (``_commits/{write_id}.json``, written last and atomically) exists. The
    record names the file, its size and CRC-32, and every read verifies them. A write id is a hash of the
    write's kind (put or delta write), field names and sample ids, so a retried task that rewrites the same columns
    replaces its commit (and a delta write never a put's) and
    leaves exactly one visible copy; writes of different fields never touch the same object, so concurrent
    writers both land. No write deletes a data file: two attempts of the same write (a retry beside a
    zombie) may both commit, the last record wins, and the file it names is always there. The losers' files
    are orphans, removed by :meth:`collect_garbage` once older than its grace period (and with the partition by
    :meth:`clear`); a writer commits within ``COMMIT_DEADLINE_S`` of its upload or not at all, and checks after
    committing that no collection has claimed or removed its file (``dataplane.gc``: a collection claims what it will
    remove before its last read of the commit records), so no collection removes a write that returns, whatever the
    pauses of either.

    A put records its rows' ids and ``input_lengths``; the meta it returns names it (``KVBatchMeta.puts``). Later
    writes check per-token fields against the stored lengths, and reads and writes under a meta whose rows were put
    again since (other content) raise ``StaleMetaError``.

    Every storage operation retries transient failures (a refused connection, a timeout, throttling) with
    backoff for up to ``dataplane.errors.RETRY_DEADLINE_S``; permanent ones raise at once.

    Args:
        root: fsspec URL of the data plane root (``/tmp/dp``, ``file:///tmp/dp``, ``s3://bucket/prefix``).
        run_id: the run whose partitions this client reads and writes.
        storage_options: passed to fsspec (credentials, ``endpoint_url``); never logged or stored.

    Raises:
        ValueError: an invalid ``run_id`` or a malformed ``root`` (``s3:/bucket``, an unknown protocol).
    """

    def __init__(self, root: str, run_id: str, *, storage_options: Mapping[str, Any] | None = None) -> None:
        self.root_url = check_root(root)
        self.run_id = paths.check_name("run_id", run_id)
        # No listings cache: s3fs would answer ls/exists/open from listings made before other processes
        # committed (a read then misses their writes, or an open fails on a file that is there).
        options = {"use_listings_cache": False, **dict(storage_options or {})}
        self.fs, self._root = fsspec.core.url_to_fs(root, **options)
        self._local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    def __repr__(self) -> str:
        return f"DataPlane(root={redact(self.root_url)!r}, run_id={self.run_id!r})"

    # ---------------------------------------------------------------- layout
    def _part(self, partition_id: str) -> str:
        return paths.partition_dir(self._root, self.run_id, partition_id)

    def _io(self, what: str, fn: Any) -> Any:
        """``fn()`` with transient storage failures retried (see ``dataplane.errors.retry_transient``)."""
        return retry_transient(fn, what=f"data plane {self.root_url}/{self.run_id}: {what}")

    def _put_atomic(self, path: str, payload: bytes) -> None:
        """Write a small object so that readers see all of it or nothing."""
        if self._local:

            def put() -> None:
                tmp = f"{path}.tmp-{uuid.uuid4().hex}"  # a killed writer's temp: removed by collect_garbage
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                self.fs.pipe_file(tmp, payload)
                self.fs.mv(tmp, path)

            self._io(f"write {path}", put)
        else:  # an object-store PUT is atomic
            self._io(f"write {path}", lambda: self.fs.pipe_file(path, payload))

    # ---------------------------------------------------------------- partitions
    def register_partition(self, partition_id: str, *, fields: Mapping[str, str]) -> None:
        """Declare a partition's fields (name -> dtype name: ``int64``, ``float32``, ``bool``, ``bfloat16``,
        ``str``, ``struct``). Idempotent; re-registering replaces the schema.

        Raises:
            ValueError: an invalid partition or field name.
        """
        part = self._part(partition_id)
        for name in fields:
            paths.check_name("field", name)
        self._put_atomic(paths.schema_path(part), partitions.encode_schema(partition_id, fields))

    def schema(self, partition_id: str) -> dict[str, str]:
        """Registered fields of a partition (name -> dtype name).

        Raises:
            DataPlaneError: the partition was never registered or was cleared.
            IntegrityError: the schema file is malformed.
        """
        path = paths.schema_path(self._part(partition_id))
        try:  # one GET, never a cached listing: another process may have cleared or registered it
            blob = self._io(f"read {path}", lambda: self.fs.cat_file(path, start=0))  # start=0: no HEAD first on s3fs
        except FileNotFoundError:
            raise DataPlaneError(self._missing(partition_id)) from None
        return partitions.parse_schema(path, blob)

    def _missing(self, partition_id: str) -> str:
        return (
            f"partition {partition_id!r} of run {self.run_id!r} under {redact(self.root_url)!r} does not exist: "
            "it was never registered or it was cleared"
        )

    def seal(self, meta: KVBatchMeta) -> None:
        """Record ``meta`` as its partition's finished batch (its rows all written): a later process finds it with
        :meth:`sealed` instead of producing the batch again. Written atomically, after the writes it names."""
        path = paths.sealed_path(self._part(meta.partition_id))
        self._put_atomic(path, partitions.encode_sealed(meta))

    def sealed(self, partition_id: str) -> KVBatchMeta | None:
        """The meta :meth:`seal` recorded for ``partition_id``; None when the partition was never sealed (a producer
        killed before it finished) or was cleared.

        Raises:
            IntegrityError: the record is not a meta.
        """
        path = paths.sealed_path(self._part(partition_id))
        try:
            blob = self._io(f"read {path}", lambda: self.fs.cat_file(path, start=0))
        except FileNotFoundError:
            return None
        return partitions.parse_sealed(path, blob, partition_id)

    def clear(self, partition_id: str) -> None:
        """Delete a partition and everything in it; later reads of it raise DataPlaneError."""
        part = self._part(partition_id)

        def rm() -> None:
            try:
                self.fs.rm(part, recursive=True)
            except FileNotFoundError:  # never registered, already cleared, or a retry of a half-done rm
                pass

        self._io(f"delete {part}", rm)

    def collect_garbage(self, *, grace_s: float = GC_GRACE_S) -> dict[str, int]:
        """Remove what no reader can see and no writer can still need: data files that no commit record names (the
        files of killed writers and of the losing attempts of a write) in every partition of the run, and what
        interrupted writes left anywhere under the run: commit temps (``*.tmp-*``), checkpoint staging and
        swapped-out folders (``.step_N.tmp-*``, ``.step_N.old-*``, see ``rl/checkpoint.py``); of these, only objects
        last modified at least ``grace_s`` seconds ago (a folder: its newest object).

        Safe while tasks of the run write (``finish_run`` calls it while a zombie attempt of a task may still be
        writing): a write's data file is uploaded before its commit record, so a file that no record names may be a
        write in flight. The run is listed (with modification times) before the commit records are read, ages are
        taken on the store's own clock (the modification time of a probe object written first, so a skewed task
        clock does not matter), and a writer never commits more than :data:`COMMIT_DEADLINE_S` after its upload
        started: a file at least ``grace_s`` old that no record named when it was listed belongs to no write that can
        still commit, as long as ``grace_s`` exceeds that deadline. That argument needs sane clocks; what does not is
        the claim protocol of ``dataplane.gc``: each file is claimed, the records are read again, only files they
        still do not name are removed, and a writer that finds its file claimed or removed after its commit commits a
        copy or uploads it again before it returns. Objects whose store reports no modification time are kept.
        Orphans younger than ``grace_s`` stay until a later collection; a step's partition goes whole when its train
        task clears it.

        Args:
            grace_s: minimum age (s) of what is removed (default :data:`GC_GRACE_S`, one hour). Smaller values are
                for when no task of the run writes (tests, a manual clean-up); 0 removes every orphan.

        Returns:
            ``{"orphan_data_files": n, "temp_files": m}`` removed.

        Raises:
            ValueError: ``grace_s`` negative or not finite.
        """

        def commits_of(part: str) -> list[dict[str, Any]] | None:
            try:
                return self._snapshot(part, part.rsplit("/", 1)[-1], strict=False).commits
            except DataPlaneError:  # cleared since the listing
                return None

        run = paths.run_dir(self._root, self.run_id)
        return gc.collect_garbage(self.fs, run, grace_s=grace_s, io=self._io, commits_of=commits_of, run_id=self.run_id)

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

        With ``id_key``, uid ``b`` is a hash of (run, partition, ``id_key``, ``b``): a retried task that puts the
        same rows again mints the same ids, so its write replaces the failed attempt's instead of adding
        rows beside it; another run's ids differ, so a meta read through the wrong run's client fails. Without
        it, uids are random (two puts never collide).

        Args:
            partition_id: a registered partition.
            columns: name -> jagged nested tensor [N, j] (per-token), 1-D tensor [N], list[str] or
                list[dict]. Every column has N rows; N is a multiple of ``group_size``.
            group_size: rows per prompt (G); rows are group-contiguous.
            task_name: tag carried by the returned meta.
            id_key: makes the ids deterministic (see above); unique per put within a partition.

        The put record keeps the rows' ids and, if ``input_lengths`` is written, their lengths: every later write of
        a per-token field is checked against those, never against a meta's copy.

        Returns:
            a meta naming the new rows, with ``fields``, ``puts`` (this put, by write id and data-file checksum: see
            ``KVBatchMeta.puts``) and, if ``input_lengths`` was written, ``sequence_lengths``.

        Raises:
            ValueError: N not a multiple of ``group_size``, or a column that does not match the schema.
            TimeoutError: more than ``COMMIT_DEADLINE_S`` passed between the upload's start and the commit; nothing
                was committed (transient: retry).
            IntegrityError: the data file was removed after the commit and again after a second upload (a garbage
                collection with too short a grace period beside the writer); the write is lost.
        """
        n = _num_rows(columns)
        if group_size < 1 or n % group_size:
            msg = f"put of {n} rows with group_size={group_size}: rows must come in whole groups"
            raise ValueError(msg)
        if id_key is None:
            uids = [uuid.uuid4().hex for _ in range(n // group_size)]
        else:
            key = f"{self.run_id}\0{partition_id}\0{id_key}"
            uids = [hashlib.sha256(f"{key}\0{b}".encode()).hexdigest()[:32] for b in range(n // group_size)]
        sample_ids = [f"{u}_g{i}" for u in uids for i in range(group_size)]
        lengths = columns.get("input_lengths")
        meta = KVBatchMeta(
            partition_id=partition_id,
            sample_ids=sample_ids,
            task_name=task_name,
            fields=[],
            sequence_lengths=None if lengths is None else [int(x) for x in lengths],
        )
        return self._write(meta, columns, task_name=task_name, is_put=True)

    def write_columns(
        self, meta: KVBatchMeta, columns: Mapping[str, Any], *, task_name: str | None = None
    ) -> KVBatchMeta:
        """Delta write: add ``columns`` under the existing ids of ``meta`` (one row per id, same order).

        Everything is checked before anything is written: the ids were put in this partition (by the puts that
        ``meta.puts`` names), row counts, registered fields and dtypes, per-token fields jagged with
        the rows' lengths as stored by their put (the partition's ``input_lengths``; ``meta.sequence_lengths`` only
        where the partition has none, and a meta whose ``sequence_lengths`` differ from the stored ones is refused),
        and each field's Arrow type against its earlier writes. A delta write of ``input_lengths`` itself must repeat
        the stored values.

        Returns:
            ``meta`` with the written fields added to ``fields``.

        Raises:
            ValueError: unknown sample ids, a row count, dtype, shape or length mismatch, an unregistered field,
                ``meta.sequence_lengths`` that differ from the stored ``input_lengths`` (an altered meta), or a meta
                whose ``puts`` is None (see :meth:`meta_for`).
            StaleMetaError: (a ``DataPlaneError``) rows of ``meta`` were put again, with other content, since.
            DataPlaneError: the partition does not exist.
            TimeoutError, IntegrityError: as for :meth:`put`.
        """
        return self._write(meta, columns, task_name=task_name, is_put=False)

    def _write(
        self, meta: KVBatchMeta, columns: Mapping[str, Any], *, task_name: str | None, is_put: bool
    ) -> KVBatchMeta:
        if not columns:
            msg = "write_columns needs at least one column"
            raise ValueError(msg)
        part = self._part(meta.partition_id)
        snap = self._snapshot(part, meta.partition_id)
        if is_put:
            lengths = meta.sequence_lengths  # the put's own input_lengths column, if it writes one
        else:
            self._check_put(snap, meta)
            lengths = self._stored_lengths(snap, meta, writes_tokens=any(name in TOKEN_FIELDS for name in columns))
            if INPUT_LENGTHS in columns and lengths is not None:
                given = [int(x) for x in columns[INPUT_LENGTHS]]
                if given != lengths:
                    bad = [i for i, (a, b) in enumerate(zip(given, lengths)) if a != b]
                    msg = (
                        f"partition {meta.partition_id!r}, field {INPUT_LENGTHS!r}: rows {bad[:5]} differ from the "
                        "lengths the put stored; the rows' per-token fields are aligned with those: put the rows "
                        "again instead"
                    )
                    raise ValueError(msg)
        n = meta.size()
        arrow_fields = [pa.field(SAMPLE_ID, pa.large_string(), nullable=False)]
        arrays: list[pa.Array] = [pa.array(meta.sample_ids, type=pa.large_string())]
        for name, value in columns.items():
            f, arr = _checked_column(meta, snap, name, value, n, lengths)
            arrow_fields.append(f)
            arrays.append(arr)
        table = pa.Table.from_arrays(arrays, schema=pa.schema(arrow_fields))
        write_id = commits.write_id(list(columns), meta.sample_ids, put=is_put)
        file_name = commits.new_file_name(write_id)
        data = paths.data_path(part, file_name)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, **_parquet_options(table.schema))
        blob = sink.getvalue()  # [bytes] the whole file, hashed once and sent in one PUT

        def upload(path: str) -> None:
            if self._local:  # object stores have no folders (s3fs would HEAD the bucket on every write)
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(path, memoryview(blob) if self._local else blob.to_pybytes())

        started = time.monotonic()  # before the upload: a store dates an object no earlier than its upload's start
        self._io(f"write {data}", lambda: upload(data))
        crc32 = checksum(memoryview(blob))
        record = commits.new_record(
            write_id=write_id,
            file_name=file_name,
            size=blob.size,
            crc32=crc32,
            fields={name: snap.fields[name] for name in columns},
            arrow_types={f.name: str(f.type) for f in arrow_fields[1:]},
            num_rows=n,
            task_name=task_name,
            sample_ids=meta.sample_ids if is_put else None,
            # a put's lengths: what later writes of per-token fields are checked against
            input_lengths=lengths if is_put and INPUT_LENGTHS in columns else None,
        )
        elapsed = time.monotonic() - started
        if elapsed > COMMIT_DEADLINE_S:  # a collection may count the file as old enough to remove by now
            msg = (
                f"data plane write {write_id} of {sorted(columns)} to partition {meta.partition_id!r}: {elapsed:.0f} "
                f"s since its upload started, over COMMIT_DEADLINE_S = {COMMIT_DEADLINE_S:.0f} s (was the process "
                "paused?); not committed, since a garbage collection may have removed its data file: retry the write"
            )
            raise TimeoutError(msg)
        self._put_atomic(paths.commit_path(part, write_id), commits.encode(record))
        self._check_landed(part, record, upload, sorted(columns))
        written = list(dict.fromkeys([*(meta.fields or []), *columns]))
        return KVBatchMeta(
            partition_id=meta.partition_id,
            sample_ids=list(meta.sample_ids),
            task_name=task_name if task_name is not None else meta.task_name,
            fields=written,
            sequence_lengths=meta.sequence_lengths,
            extra_info=dict(meta.extra_info),
            tags=meta.tags,
            puts=[f"{write_id}:{crc32}"] if is_put else (None if meta.puts is None else list(meta.puts)),
        )

    def _check_landed(self, part: str, record: dict[str, Any], upload: Any, fields: list[str]) -> None:
        """After a commit: make sure that no garbage collection removes, or has removed, the data file it names
        (``dataplane.gc``: a collection claims a file, with an object beside it, before its last read of the commit
        records, then withdraws the claim from a file it kept or marks it on a file it removed; one listing of the
        file's stem shows the claims and the file). An unmarked claim: upload the same bytes under a new name and
        commit that instead (the claim's collection may remove the old name whatever it read); a claim marked since
        the last look, or no file: upload it again under its name. Then check once more. ``upload(path)`` writes the
        write's bytes to ``path``.

        Raises:
            IntegrityError: the file is claimed or gone again after the second upload (the write is lost; never
                returned as done).
        """
        write_id = record["write_id"]
        seen: set[str] = set()  # marked claims already answered by an upload: their collections are done
        for attempt in range(2):
            data = paths.join(part, record["file"])
            state = gc.file_state(self.fs, data, self._io)  # one listing: the claims on the file, and the file
            removed = set(state.removed) - seen
            if state.claims:
                if attempt:
                    break
                name = commits.new_file_name(write_id)
                copy = paths.data_path(part, name)
                self._io(f"write {copy}", lambda copy=copy: upload(copy))
                record = {**record, "file": f"data/{name}.parquet"}  # same bytes: same size and checksum
                self._put_atomic(paths.commit_path(part, write_id), commits.encode(record))
            elif state.present and not removed:  # a file seen beside a marked claim may be gone by now
                return
            elif attempt:
                break
            else:
                seen |= removed
                self._io(f"write {data}", lambda data=data: upload(data))
        msg = (
            f"data plane write {write_id} of {fields}: its data file {data} was removed after the upload, twice (or "
            "claimed for removal: a collect_garbage with a grace period shorter than a write, beside this writer?); "
            f"the write is lost: retry it, and collect garbage with the default grace period (GC_GRACE_S = "
            f"{GC_GRACE_S:.0f} s)"
        )
        raise IntegrityError(msg)

    def _check_put(self, snap: Snapshot, meta: KVBatchMeta) -> None:
        """ValueError unless every id of ``meta`` was minted by a put of this partition; and what
        :meth:`_check_meta` raises."""
        known = snap.put_ids()
        unknown = [s for s in meta.sample_ids if s not in known]
        if unknown:
            hint = " (none of them: is the meta of another run or partition?)" if len(unknown) == meta.size() else ""
            msg = (
                f"partition {meta.partition_id!r} of run {self.run_id!r}: sample ids {unknown[:3]} were never put "
                f"({len(unknown)} of {meta.size()}){hint}; write under the ids a put of this partition returned"
            )
            raise ValueError(msg)
        self._check_meta(snap, meta)

    def _check_meta(self, snap: Snapshot, meta: KVBatchMeta) -> None:
        """Check ``meta`` against what the partition's puts stored for its rows (rows no put names are left to the
        caller's own checks).

        Raises:
            StaleMetaError: a row was put again, with other content, since the put that ``meta.puts`` names.
            ValueError: ``meta.puts`` is None (nothing to check the rows against), or ``meta.sequence_lengths``
                differ from the rows' stored ``input_lengths`` (an altered meta).
        """
        if meta.puts is None:
            msg = (
                f"partition {meta.partition_id!r} of run {self.run_id!r}: the meta of rows {meta.sample_ids[:3]} names "
                "no put (KVBatchMeta.puts is None: a meta made by hand, or before metas named their puts), so whether "
                "its rows were put again since, with other content, cannot be checked; use the meta that the put (or "
                "a delta write after it) returned, or make one for the rows as they are now with "
                "DataPlane.meta_for(partition_id, sample_ids)"
            )
            raise ValueError(msg)
        keys, lengths = snap.put_rows()
        mine = set(meta.puts)
        stale = [s for s in meta.sample_ids if s in keys and keys[s] not in mine]
        if stale:
            newer = sorted({keys[s] for s in stale})
            msg = (
                f"stale meta: partition {meta.partition_id!r} of run {self.run_id!r}: rows {stale[:3]} "
                f"({len(stale)} of {meta.size()}) were put again with other content (put {newer[:2]}) after the "
                f"put this meta came from ({meta.puts[:2]}), e.g. after a clear and a re-put with the same "
                "id_key; reading or writing under it would mix two batches: use the meta that the latest put "
                "returned, or re-run the task that made this one"
            )
            raise StaleMetaError(msg)
        if meta.sequence_lengths is not None:
            bad = [
                i
                for i, (s, n) in enumerate(zip(meta.sample_ids, meta.sequence_lengths))
                if s in lengths and lengths[s] != n
            ]
            if bad:
                i = bad[0]
                msg = (
                    f"partition {meta.partition_id!r}: the meta's sequence_lengths differ from the input_lengths its "
                    f"put stored at rows {bad[:5]} ({len(bad)} of {meta.size()}; row {i}: meta "
                    f"{meta.sequence_lengths[i]}, stored {lengths[meta.sample_ids[i]]}): the meta was altered; use "
                    "the meta the put returned"
                )
                raise ValueError(msg)

    def meta_for(self, partition_id: str, sample_ids: Sequence[str], *, task_name: str | None = None) -> KVBatchMeta:
        """A meta for rows that puts of ``partition_id`` minted, as they are now: ``puts`` names the puts that last
        wrote them, ``sequence_lengths`` are the ``input_lengths`` those stored (None when one stored none) and
        ``fields`` is None (unknown). For rows whose ids are known but whose meta is not (lost, or made before metas
        named their puts): reads and writes under it raise ``StaleMetaError`` once its rows are put again.

        Raises:
            DataPlaneError: the partition does not exist.
            ValueError: an id that no put of the partition minted, or an id given twice.
        """
        snap = self._snapshot(self._part(partition_id), partition_id)
        keys, lengths = snap.put_rows()
        ids = list(sample_ids)
        unknown = [s for s in ids if s not in keys]
        if unknown:
            msg = (
                f"partition {partition_id!r} of run {self.run_id!r}: sample ids {unknown[:3]} were never put "
                f"({len(unknown)} of {len(ids)}); give ids that a put of this partition returned"
            )
            raise ValueError(msg)
        return KVBatchMeta(
            partition_id=partition_id,
            sample_ids=ids,
            task_name=task_name,
            sequence_lengths=[lengths[s] for s in ids] if all(s in lengths for s in ids) else None,
            puts=sorted({keys[s] for s in ids}),
        )

    def _stored_lengths(self, snap: Snapshot, meta: KVBatchMeta, *, writes_tokens: bool) -> list[int] | None:
        """The token lengths of ``meta``'s rows that per-token fields must have: the ``input_lengths`` their puts
        stored (in the put records; read from the data files for records that predate that), else, when the
        partition has none, ``meta.sequence_lengths``. None when neither exists and ``writes_tokens`` is false.

        Raises:
            DataPlaneError: ``writes_tokens`` and no lengths anywhere (``input_lengths`` never written).
        """
        _, stored = snap.put_rows()
        if all(s in stored for s in meta.sample_ids):
            return [stored[s] for s in meta.sample_ids]
        if any(INPUT_LENGTHS in c["fields"] for c in snap.commits) or (writes_tokens and meta.sequence_lengths is None):
            return [int(x) for x in self._read_snapshot(snap, meta, [INPUT_LENGTHS])[INPUT_LENGTHS]]
        return meta.sequence_lengths

    # ---------------------------------------------------------------- reads
    def _snapshot(self, part: str, partition_id: str, *, strict: bool = True) -> Snapshot:
        """What a read of partition folder ``part`` needs (``dataplane.commits.load_snapshot``): its schema and
        well-formed commit records; a malformed or stray commit record is skipped with a :class:`DataPlaneWarning`
        naming it (``strict=False``: silently).

        Raises:
            DataPlaneError: the partition was never registered or was cleared.
            IntegrityError: the schema is malformed (named).
        """
        snap = commits.load_snapshot(self.fs, part, io=self._io, strict=strict)
        if snap is None:
            raise DataPlaneError(self._missing(partition_id))
        return snap

    def _commits(self, part: str) -> list[dict[str, Any]]:
        """Commit records of partition folder ``part``, oldest first ([] if it does not exist)."""
        try:
            return self._snapshot(part, part, strict=False).commits
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

        Every data file read is checked against its commit record (size and CRC-32) before it is decoded.

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
            DataPlaneError: the partition does not exist, a field was never written, or an id is unknown; the
                message names the partition, the field and the ids.
            StaleMetaError: (a ``DataPlaneError``) rows of ``meta`` were put again, with other content, after the put
                that ``meta.puts`` names (a clear and a re-put with the same ``id_key``).
            ValueError: also when ``meta.sequence_lengths`` differ from the ``input_lengths`` the rows' put stored,
                or ``meta.puts`` is None (its rows cannot be checked: see :meth:`meta_for`).
            IntegrityError: a committed data file is missing, fails its checksum or cannot be decoded; the
                message names the file.
        """
        if not select_fields:
            msg = "select_fields is required: name the columns to read (e.g. dataplane.fields.LP_SEED_FIELDS)"
            raise ValueError(msg)
        snap = self._snapshot(self._part(meta.partition_id), meta.partition_id)
        self._check_meta(snap, meta)
        columns = self._read_snapshot(snap, meta, select_fields)
        if pad_to_seqlen is None:
            pad_to_seqlen = int(meta.extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN, 0))
        return materialize(columns, layout=layout, pad_value_dict=pad_value_dict, pad_to_seqlen=pad_to_seqlen)

    def read_batch(
        self,
        meta: KVBatchMeta,
        select_fields: Sequence[str],
        *,
        pad_value_dict: Mapping[str, float | int] | None = None,
    ) -> TensorDict:
        """:meth:`read` of tensor fields as a ``tensordict.TensorDict`` with ``batch_size=[N]`` (the wire type of
        NeMo-RL's ``materialize``): per-token fields [N, S] padded to the meta's ``global_forward_pad_seqlen``,
        per-sample fields [N]. Split it per rank or micro-batch and move it to a device with its own methods
        (``split``, indexing, ``to``).

        Raises:
            TypeError: a selected field is not a tensor (text, records): read those with :meth:`read`.
            and what :meth:`read` raises.
        """
        from tensordict import TensorDict

        columns = self.read(meta, select_fields, pad_value_dict=pad_value_dict)
        loose = sorted(k for k, v in columns.items() if not isinstance(v, torch.Tensor))
        if loose:
            msg = f"read_batch reads tensor fields only; {loose} are not tensors: read them with DataPlane.read"
            raise TypeError(msg)
        return TensorDict(columns, batch_size=[meta.size()])

    def _read_snapshot(self, snap: Snapshot, meta: KVBatchMeta, select_fields: Sequence[str]) -> dict[str, Any]:
        """``select_fields`` of ``meta``'s rows from the files that ``snap``'s commits name (unpadded columns)."""
        schema = snap.fields
        unknown = [f for f in select_fields if f not in schema]
        if unknown:
            msg = (
                f"fields {unknown} are not registered in partition {meta.partition_id!r}; registered: {sorted(schema)}"
            )
            raise DataPlaneError(msg)
        commits = list(reversed(snap.commits))  # newest first: a later write of a field wins
        sources = {}
        for name in select_fields:
            sources[name] = [c for c in commits if name in c["fields"]]
            if not sources[name]:
                skipped = f"; skipped malformed commit records: {snap.skipped[:3]}" if snap.skipped else ""
                msg = (
                    f"field {name!r} was never written in partition {meta.partition_id!r} (ids "
                    f"{meta.sample_ids[:3]}...){skipped}"
                )
                raise DataPlaneError(msg)
        needed = list({c["file"]: c for cs in sources.values() for c in cs}.values())
        tables = self._read_files(snap.part, needed, select_fields)
        wanted = pa.array(meta.sample_ids, type=pa.large_string())
        columns: dict[str, Any] = {}
        for name in select_fields:
            pieces = [tables[c["file"]].select([SAMPLE_ID, name]) for c in sources[name]]
            try:
                merged = pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)
            except pa.ArrowInvalid as err:
                files = [paths.join(snap.part, c["file"]) for c in sources[name]]
                msg = (
                    f"partition {meta.partition_id!r}, field {name!r}: its writes have different types ({err}); files "
                    f"{files}"
                )
                raise IntegrityError(msg) from None
            ids = merged.column(SAMPLE_ID)
            if len(ids) == len(wanted) and ids.combine_chunks().equals(wanted):
                column, field = merged.column(name), merged.schema.field(name)
            else:
                idx = pc.index_in(wanted, value_set=ids)
                if idx.null_count:
                    missing = [s for s, i in zip(meta.sample_ids, idx.to_pylist()) if i is None]
                    hint = ""
                    if len(missing) == meta.size() and not set(meta.sample_ids) & snap.put_ids():
                        hint = (
                            f"; none of the meta's ids were put in this partition of run {self.run_id!r}: is the meta "
                            "of another run?"
                        )
                    msg = (
                        f"partition {meta.partition_id!r}, field {name!r}: no value for sample ids {missing[:5]} "
                        f"({len(missing)} of {meta.size()} missing){hint}"
                    )
                    raise DataPlaneError(msg)
                column, field = merged.column(name).take(idx), merged.schema.field(name)
            columns[name] = column_from_arrow(field, column)
        return columns

    def _read_files(
        self, part: str, commits: Sequence[dict[str, Any]], select_fields: Sequence[str]
    ) -> dict[str, pa.Table]:
        """The tables of the data files ``commits`` name (``sample_id`` and the selected fields each holds), each
        verified against its record.

        Raises:
            IntegrityError: a file missing, of another size or checksum, or not decodable (named).
        """
        locations = [paths.join(part, c["file"]) for c in commits]
        if self._local:  # memory-mapped: hashed and decoded from the page cache, no copy into a bytes object
            blobs = {loc: _map_file(loc) for loc in locations}
        else:

            def fetch() -> dict[str, Any]:
                got = self.fs.cat(locations, start=0, on_error="return")  # errors come back per file, not raised
                for value in got.values():
                    if isinstance(value, BaseException) and not isinstance(value, FileNotFoundError):
                        raise value  # so that a refused or dropped connection is retried like any other
                return got

            try:  # one batch of whole-object GETs (start=0: no HEAD before each): the checksum covers the whole file
                blobs = self._io(f"read {len(locations)} data files of {part}", fetch)
            except FileNotFoundError:
                blobs = {}
        tables = {}
        for c, location in zip(commits, locations):
            blob = blobs.get(self.fs._strip_protocol(location), blobs.get(location))
            if blob is None or isinstance(blob, FileNotFoundError):
                msg = (
                    f"commit record {c['write_id']} of {part} names data file {location}, which is missing; the write "
                    f"is lost: re-run the task that wrote {sorted(c['fields'])}"
                )
                raise IntegrityError(msg)
            if isinstance(blob, BaseException):
                raise blob
            if len(blob) != c["size"] or checksum(blob) != c["crc32"]:
                msg = (
                    f"data file {location} fails its checksum (size {len(blob)}, crc32 {checksum(blob)}; its commit "
                    f"record says {c['size']}, {c['crc32']}): it was changed or replaced after its write; re-run the "
                    f"task that wrote {sorted(c['fields'])}"
                )
                raise IntegrityError(msg)
            cols = [SAMPLE_ID, *[f for f in select_fields if f in c["fields"]]]
            try:
                table = pq.read_table(pa.BufferReader(blob), columns=cols)
            except (pa.ArrowException, OSError) as err:
                msg = (
                    f"data file {location} cannot be decoded ({err}); re-run the task that wrote {sorted(c['fields'])}"
                )
                raise IntegrityError(msg) from None
            if table.num_rows != c["num_rows"]:
                msg = f"data file {location} holds {table.num_rows} rows, its commit record {c['num_rows']}"
                raise IntegrityError(msg)
            tables[c["file"]] = table
        return tables


def _map_file(path: str) -> pa.Buffer | FileNotFoundError:
    """A local file as a read-only memory-mapped buffer (the error instead when it is missing)."""
    try:
        with pa.memory_map(path, "r") as source:
            return source.read_buffer()
    except FileNotFoundError as err:
        return err


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
    meta: KVBatchMeta, snap: Snapshot, name: str, value: Any, n: int, lengths: Sequence[int] | None
) -> tuple[pa.Field, pa.Array]:
    """``value`` as an Arrow column of field ``name``; ValueError, before any write, if it does not fit the partition:
    unregistered, another row count or dtype, a per-token field not jagged or not of the rows' ``lengths``, or an
    Arrow type other than the field's earlier writes (a later read would have to merge them)."""
    schema = snap.fields
    where = f"partition {meta.partition_id!r}, field {name!r}"
    if name == SAMPLE_ID or name not in schema:
        msg = f"{where}: not a registered field; register it with register_partition(fields=...) first"
        raise ValueError(msg)
    rows = int(value.size(0)) if isinstance(value, torch.Tensor) else len(value)
    if rows != n:
        msg = f"{where}: {rows} rows for {n} sample ids; write one row per id"
        raise ValueError(msg)
    if isinstance(value, torch.Tensor) and value.is_nested and value.values().dim() != 1:
        msg = (
            f"{where}: a jagged tensor of shape [N, j, ...] ({value.values().dim() - 1} trailing dims); store one "
            "value per token"
        )
        raise ValueError(msg)
    if name in TOKEN_FIELDS and not (isinstance(value, torch.Tensor) and value.is_nested):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        msg = f"{where}: per-token fields are written jagged [N, j] (dataplane.codec.to_nested_by_length), got {shape}"
        raise ValueError(msg)
    f, arr = column_to_arrow(name, value)  # zero-copy for numeric tensors: converted once, checked, written
    got = (f.metadata or {}).get(DTYPE_KEY, b"").decode()
    if got != schema[name]:
        msg = f"{where}: dtype {got} but the partition registered {schema[name]}; cast the column"
        raise ValueError(msg)
    if name in TOKEN_FIELDS and lengths is not None:
        got_lengths = nested_lengths(value).tolist()
        if got_lengths != list(lengths):
            bad = [i for i, (a, b) in enumerate(zip(got_lengths, lengths)) if a != b]
            msg = (
                f"{where}: row lengths differ from input_lengths at rows {bad[:5]}; per-token fields align with "
                "input_ids"
            )
            raise ValueError(msg)
    earlier = snap.arrow_type(name)
    if earlier is not None and earlier[0] != str(f.type):
        msg = (
            f"{where}: Arrow type {f.type} but write {earlier[1]} stored it as {earlier[0]}; write it in the same shape"
        )
        raise ValueError(msg)
    return f, arr
