"""The commit-record format: how a write's data file and commit record are named, how a record is built, encoded
and parsed, and how one listing of a partition reads all of its records (:class:`Snapshot`).

A write is one immutable Parquet file ``data/{write_id}-{8 hex}.parquet`` that becomes visible only when its commit
record ``_commits/{write_id}.json`` exists (``dataplane.paths.commit_path``). The record is one JSON object:

- ``write_id`` (str): :func:`write_id` of the write's kind (put or delta write), fields and sample ids; a retry of the
  same write has the same id and replaces the record, and no delta write replaces a put's;
- ``file`` (str): the data file, relative to the partition (matches :data:`DATA_FILE`);
- ``size`` (int, bytes) and ``crc32`` (str, 8 hex digits, :func:`checksum`) of the data file: every read checks them;
- ``fields`` (name -> dtype name) and ``arrow_types`` (name -> Arrow type string) of the written columns;
- ``num_rows`` (int), ``task_name`` (str or null), ``created_unix_ns`` (int, the writer's clock: orders the records);
- a put's record also: ``sample_ids`` (the ids it minted) and, when it wrote ``input_lengths``, ``input_lengths``
  (one int per sample id: what later per-token writes are checked against).

I/O goes through the caller's filesystem and retry wrapper; this module holds no client state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
import uuid
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dataplane import paths
from dataplane.errors import DataPlaneWarning
from dataplane.partitions import parse_schema

DATA_FILE = re.compile(r"data/[0-9a-f]{32}-[0-9a-f]{8}\.parquet")
"""What a commit record's ``file`` may name: a data file of its own partition."""

_RECORD_KEYS = {
    "write_id": str,
    "file": str,
    "size": int,
    "crc32": str,
    "fields": dict,
    "num_rows": int,
    "created_unix_ns": int,
}


def checksum(data: Any) -> str:
    """CRC-32 of a file's bytes, as 8 hex digits (zlib; 2.2 GB/s here against sha256's 1.5 GB/s: the data plane
    guards against corruption and swapped files, not against an adversary)."""
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def write_id(fields: Sequence[str], sample_ids: Sequence[str], *, put: bool) -> str:
    """Deterministic id of a write (32 hex digits of a SHA-256): the same kind of write of the same fields for the same
    rows (a retry) maps to the same commit; a delta write never maps to a put's commit, whatever its fields (it would
    replace the record that holds the rows' ids and lengths). A put's id is the hash of its fields and ids alone."""
    digest = hashlib.sha256()
    if not put:
        digest.update(b"\0delta\0")  # no field name is empty: no put's hash starts so
    digest.update("\n".join(sorted(fields)).encode())
    digest.update(b"\0")
    digest.update("\n".join(sample_ids).encode())
    return digest.hexdigest()[:32]


def new_file_name(write_id: str) -> str:
    """Name (without ``.parquet``) of a new data file of write ``write_id``: ``{write_id}-{8 random hex}``, so two
    attempts of one write never upload to the same object."""
    return f"{write_id}-{uuid.uuid4().hex[:8]}"


def new_record(
    *,
    write_id: str,
    file_name: str,
    size: int,
    crc32: str,
    fields: Mapping[str, str],
    arrow_types: Mapping[str, str],
    num_rows: int,
    task_name: str | None,
    sample_ids: Sequence[str] | None = None,
    input_lengths: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The commit record of a write (see the module docstring), stamped ``created_unix_ns`` now. ``sample_ids``
    (and ``input_lengths``) only for a put."""
    record: dict[str, Any] = {
        "write_id": write_id,
        "file": f"data/{file_name}.parquet",
        "size": size,
        "crc32": crc32,
        "fields": dict(fields),
        "arrow_types": dict(arrow_types),
        "num_rows": num_rows,
        "task_name": task_name,
        "created_unix_ns": time.time_ns(),
    }
    if sample_ids is not None:
        record["sample_ids"] = list(sample_ids)
        if input_lengths is not None:
            record["input_lengths"] = [int(x) for x in input_lengths]
    return record


def encode(record: Mapping[str, Any]) -> bytes:
    """A commit record as the bytes of its object (JSON)."""
    return json.dumps(record).encode()


def parse(blob: bytes) -> tuple[dict[str, Any], str]:
    """``(record, "")`` for a well-formed commit record, else ``({}, what is wrong)``."""
    try:
        record = json.loads(blob)
    except ValueError as err:
        return {}, f"not JSON ({err})"
    if not isinstance(record, dict):
        return {}, "not a JSON object"
    bad = [k for k, t in _RECORD_KEYS.items() if not isinstance(record.get(k), t)]
    if bad:
        return {}, f"missing or mistyped keys {bad}"
    if not DATA_FILE.fullmatch(record["file"]):
        return {}, f"names {record['file']!r}, not a data file of its partition"
    if "sample_ids" in record and not isinstance(record["sample_ids"], list):
        return {}, "sample_ids is not a list"
    if "input_lengths" in record:
        stored = record["input_lengths"]
        if not (
            isinstance(stored, list)
            and len(stored) == len(record.get("sample_ids", ()))
            and all(type(x) is int for x in stored)
        ):
            return {}, "input_lengths is not a list of ints, one per sample id"
    return record, ""


@dataclasses.dataclass
class Snapshot:
    """One read's view of a partition (folder ``part``): registered fields, well-formed commit records (oldest
    first), and the paths of skipped commit records."""

    part: str
    fields: dict[str, str] = dataclasses.field(default_factory=dict)
    commits: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)

    _rows: tuple[dict[str, str], dict[str, int]] | None = dataclasses.field(default=None, repr=False)

    def put_ids(self) -> set[str]:
        """Sample ids minted by the partition's puts."""
        return set(self.put_rows()[0])

    def put_rows(self) -> tuple[dict[str, str], dict[str, int]]:
        """``(put, lengths)``: for each sample id of the partition's puts, the newest put that wrote it (as
        ``"{write_id}:{crc32}"``, see ``KVBatchMeta.puts``) and the ``input_lengths`` that put stored for it (ids of
        puts that stored none are absent from ``lengths``). Computed once per snapshot."""
        if self._rows is None:
            keys: dict[str, str] = {}
            lengths: dict[str, int] = {}
            for c in self.commits:  # oldest first: a later put of an id wins
                ids = c.get("sample_ids")
                if ids is None:
                    continue
                keys.update(dict.fromkeys(ids, f"{c['write_id']}:{c['crc32']}"))
                stored = c.get("input_lengths")
                if stored is not None:
                    lengths.update(zip(ids, stored))
                else:
                    for s in ids:
                        lengths.pop(s, None)
            self._rows = (keys, lengths)
        return self._rows

    def arrow_type(self, name: str) -> tuple[str, str] | None:
        """``(arrow type, write id)`` of the newest earlier write of ``name``, if any."""
        for c in reversed(self.commits):
            if name in c.get("arrow_types", {}):
                return c["arrow_types"][name], c["write_id"]
        return None


def load_snapshot(
    fs: Any, part: str, *, io: Callable[[str, Callable[[], Any]], Any], strict: bool = True
) -> Snapshot | None:
    """What a read of partition folder ``part`` needs: one listing of the partition, then the schema and every
    commit record in one batch of reads. A malformed or stray commit record is skipped with a
    ``DataPlaneWarning`` naming it (``strict=False``: silently).

    Args:
        fs: the fsspec filesystem.
        part: the partition's folder (``dataplane.paths.partition_dir``).
        io: runs a storage operation with transient failures retried (``io(what, fn)``, as ``DataPlane._io``).
        strict: warn about skipped records.

    Returns:
        the snapshot; None when the partition has no schema (never registered, or cleared).

    Raises:
        IntegrityError: the schema is malformed (named).
    """
    try:
        listing = io(f"list {part}", lambda: fs.find(part))  # one LIST on an object store
    except FileNotFoundError:
        listing = []
    folder = {p: p[len(part) :].strip("/").split("/")[0] for p in listing}  # "_commits", "data", ...
    schema = paths.schema_path(part)
    if fs._strip_protocol(schema) not in folder:
        return None
    records = [p for p, f in folder.items() if f == "_commits" and p.endswith(".json")]
    try:  # start=0: one GET each (s3fs sizes a whole-object read with a HEAD first)
        blobs = io(f"read the records of {part}", lambda: fs.cat([schema, *records], start=0))
    except FileNotFoundError:  # cleared between the listing and the reads
        return None
    snap = Snapshot(part=part, fields=parse_schema(schema, blobs.pop(schema)))
    for path, blob in sorted(blobs.items()):
        record, problem = parse(blob)
        if problem:
            snap.skipped.append(path)
            if strict:  # stacklevel: the caller of the DataPlane method that read the partition
                warnings.warn(f"data plane: skipped commit record {path}: {problem}", DataPlaneWarning, stacklevel=4)
            continue
        snap.commits.append(record)
    snap.commits.sort(key=lambda r: (r["created_unix_ns"], r["write_id"]))
    return snap
