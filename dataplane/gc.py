"""Garbage collection of a run's data plane: data files that no commit record names, and what interrupted writes
left, once older than a grace period on the store's own clock. ``DataPlane.collect_garbage`` is the entry point;
this module holds no client state (the caller passes its filesystem, retry wrapper and commit-record reader).

Removal beside writers, without relying on clocks: a collection *claims* each data file it means to remove (an empty
object beside it, ``{partition}/data/{file stem}.gc-{collection id}``, :func:`claim_path`) before it reads the commit
records again, removes only the files that those records still do not name, then withdraws its claims on the files
it kept and marks those on the files it removed (rewrites them as :data:`REMOVED`; they stay until the partition is
cleared). A writer, after writing its commit record, lists its file's stem (:func:`file_state`): one listing shows the
claims on its file, with their marks, and the file. Whatever the pauses of either party, and in whatever order the
listing sees these names (it needs only to show every write completed before it began, as S3's do):

- a collection whose claim the writer does not see read the records again after the commit (the writer looked
  before the claim was written; a claim is withdrawn only from a kept file), and keeps the file;
- a claim seen unmarked: its collection may still remove the file, so the writer commits a copy under a new name;
- a claim seen marked, or no file: the file was removed (whatever the listing saw of the file), and the writer
  uploads it again under its name, which that collection no longer touches.

A claim left unmarked by a collection killed midway stays until its partition is cleared; it only ever makes a
writer of that file commit a copy.
"""

from __future__ import annotations

import datetime
import math
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from dataplane import paths
from dataplane.errors import DataPlaneWarning

GC_GRACE_S = 3600.0
"""Default grace period of :func:`collect_garbage` (s): a data file or temporary object younger than this (by its
store's clock) is never removed, whether or not a commit record names it yet, so a write in flight (data file
uploaded, commit record not yet written) is never taken for an orphan. It must exceed the writers' commit deadline
(``dataplane.client.COMMIT_DEADLINE_S``) plus the commit's own retries (``dataplane.errors.RETRY_DEADLINE_S``, 2
minutes): one hour leaves a factor of 5 over both, and a zombie attempt that has not committed an hour after its
upload started has missed that deadline and does not commit."""

LEFTOVER_MARKS = (".tmp-", ".old-")
"""Name parts of temporary objects that an interrupted write leaves (commit temps, checkpoint staging folders)."""

CLAIM_MARK = ".gc-"
"""What follows a data file's stem in the name of a claim on it (see the module docstring): one listing of the names
that start with ``{stem}.`` finds the file and its claims; a claim is neither a data file (``*.parquet``) nor a
temporary object (:data:`LEFTOVER_MARKS`)."""

REMOVED = b"removed"
"""Content of a claim whose collection removed the file (an unmarked claim is empty): :func:`file_state` tells them
apart by size, in the same listing."""

DATA_SUFFIX = ".parquet"
"""Suffix of a data file's name (``dataplane.paths.data_path``)."""


def collect_garbage(
    fs: Any,
    run: str,
    *,
    grace_s: float,
    io: Callable[[str, Callable[[], Any]], Any],
    commits_of: Callable[[str], Sequence[Mapping[str, Any]] | None],
    run_id: str,
) -> dict[str, int]:
    """Remove the orphan data files and leftover temporary objects under ``run`` last modified at least ``grace_s``
    seconds ago (see ``DataPlane.collect_garbage`` for what is removed and why it is safe beside writers).

    The run is listed (with modification times) before any commit record is read, and ages are taken on the store's
    clock (:func:`store_now`) after the listing: a data file listed, at least ``grace_s`` old, and named by no record
    read after the listing belongs to no write that can still commit.

    Args:
        fs: the fsspec filesystem.
        run: the run's folder (``dataplane.paths.run_dir``).
        grace_s: minimum age (s) of what is removed; 0 removes every orphan.
        io: runs a storage operation with transient failures retried (``io(what, fn)``, as ``DataPlane._io``).
        commits_of: the commit records of a partition folder; None when it was cleared since the listing.
        run_id: the run's id, for messages.

    Returns:
        ``{"orphan_data_files": n, "temp_files": m}`` removed.

    Raises:
        ValueError: ``grace_s`` negative or not finite.
    """
    if not (isinstance(grace_s, (int, float)) and math.isfinite(grace_s) and grace_s >= 0):
        msg = f"grace_s must be a finite number of seconds >= 0, got {grace_s!r}"
        raise ValueError(msg)
    try:
        listing = io(f"list {run}", lambda: fs.find(run, withdirs=True, detail=True))
    except FileNotFoundError:
        listing = {}
    if not listing:
        return {"orphan_data_files": 0, "temp_files": 0}
    now = store_now(fs, run, io)  # after the listing: ages err towards the old side by the listing's duration only
    unknown: list[str] = []

    def old_enough(paths_: Sequence[str]) -> bool:
        times = [t for t in (mtime(listing[p]) for p in paths_) if t is not None]
        if not times:
            unknown.append(paths_[0])
            return False
        return now - max(times) >= grace_s

    names = sorted(listing)
    temps = [p for p in names if any(m in p.rsplit("/", 1)[-1] for m in LEFTOVER_MARKS)]
    temps = [p for p in temps if not any(p.startswith(t + "/") for t in temps)]  # a temp folder goes whole
    temps = [t for t in temps if old_enough([t, *(p for p in names if p.startswith(t + "/"))])]
    orphans: list[str] = []
    parts = {p.rsplit("/", 1)[0] for p in names if p.endswith("/_schema.json")}
    for part in sorted(parts):  # commit records read after the listing: a file listed and unnamed here stays
        commits = commits_of(part)  # unnamed only if its write had not committed when it was listed
        if commits is None:  # cleared since the listing: nothing of it to keep
            continue
        named = {paths.join(part, c["file"]) for c in commits}
        candidates = [p for p in names if p.startswith(part + "/data/") and p.endswith(DATA_SUFFIX) and p not in named]
        orphans += remove_unnamed(fs, part, [p for p in candidates if old_enough([p])], io=io, commits_of=commits_of)
    if unknown:
        warnings.warn(
            f"data plane: collect_garbage kept {len(unknown)} objects whose store reports no modification time "
            f"(e.g. {unknown[0]}): their age is unknown; remove them by hand once no task of run {run_id!r} writes",
            DataPlaneWarning,
            stacklevel=3,
        )
    for path in temps:
        io(f"delete {path}", lambda path=path: rm_quiet(fs, path))
    return {"orphan_data_files": len(orphans), "temp_files": len(temps)}


def remove_unnamed(
    fs: Any,
    part: str,
    candidates: Sequence[str],
    *,
    io: Callable[[str, Callable[[], Any]], Any],
    commits_of: Callable[[str], Sequence[Mapping[str, Any]] | None],
) -> list[str]:
    """Remove those of ``candidates`` (data files of partition folder ``part``) that no commit record names, safely
    beside writers: claim them all, read the commit records again, remove the files still unnamed, then withdraw the
    claims on the files kept and mark those on the files removed (also when a step fails; a file whose removal failed
    keeps its claim unmarked; see the module docstring). Requests: two per file kept (its claim written and removed),
    three per file removed.

    Returns:
        the files removed.
    """
    if not candidates:
        return []
    claims = {p: claim_path(p, uuid.uuid4().hex) for p in candidates}
    tried: list[str] = []  # removals sent; a failed one (done or not) leaves its claim unmarked
    removed: list[str] = []
    try:
        for claim in claims.values():
            io(f"write {claim}", lambda claim=claim: _touch(fs, claim))
        commits = commits_of(part)  # after the claims: a commit not seen here sees a claim
        named = set() if commits is None else {paths.join(part, c["file"]) for c in commits}
        for path in candidates:
            if path not in named:
                tried.append(path)
                io(f"delete {path}", lambda path=path: rm_quiet(fs, path))
                removed.append(path)
    finally:  # after the removals: a writer that sees a marked claim uploads its file again
        for path, claim in claims.items():
            if path in removed:
                io(f"mark {claim}", lambda claim=claim: fs.pipe_file(claim, REMOVED))
            elif path not in tried:
                io(f"delete {claim}", lambda claim=claim: rm_quiet(fs, claim))
    return removed


def claim_path(data: str, collection: str) -> str:
    """The claim of collection ``collection`` (hex id) on data file ``data`` (``{partition}/data/{stem}.parquet``):
    ``{partition}/data/{stem}.gc-{collection}``."""
    return f"{data.removesuffix(DATA_SUFFIX)}{CLAIM_MARK}{collection}"


class FileState(NamedTuple):
    """What one listing of a data file's stem found (:func:`file_state`)."""

    claims: list[str]
    """the unmarked claims on the file: collections that may still remove it ([] when none)"""
    removed: list[str]
    """the marked claims on the file: collections that removed it ([] when none)"""
    present: bool
    """whether the listing saw the file"""


def file_state(fs: Any, data: str, io: Callable[[str, Callable[[], Any]], Any]) -> FileState:
    """The claims on data file ``data`` and whether it is there, from one listing (with sizes) of the names that
    start with its stem: on S3 one LIST request; a local folder is read whole. Needs no order or snapshot of the
    listing (see the module docstring)."""
    folder, name = data.rsplit("/", 1)
    stem = name.removesuffix(DATA_SUFFIX)
    try:  # prefix "{stem}.": the file and its claims, no other file (a stem is unique: commits.new_file_name)
        found = io(f"list {data}", lambda: fs.find(folder, prefix=f"{stem}.", detail=True))
    except FileNotFoundError:
        found = {}
    sizes = {p.rsplit("/", 1)[-1]: info.get("size") for p, info in found.items()}  # s3fs names lack the protocol
    claims = sorted(n for n in sizes if n.startswith(f"{stem}{CLAIM_MARK}"))
    return FileState(
        claims=[f"{folder}/{n}" for n in claims if not sizes[n]],
        removed=[f"{folder}/{n}" for n in claims if sizes[n]],
        present=name in sizes,
    )


def _is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _touch(fs: Any, path: str) -> None:
    """Write an empty object at ``path`` (its folder made first on a local filesystem)."""
    if _is_local(fs):
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, b"")


def store_now(fs: Any, run: str, io: Callable[[str, Callable[[], Any]], Any]) -> float:
    """The store's current time (s since the epoch): the modification time of a probe object written under
    ``run`` (and removed); this process's clock where the store reports none."""
    probe = paths.join(run, f".gc-clock.tmp-{uuid.uuid4().hex}")  # a leftover (killed here) is a temp like any
    try:
        io(f"write {probe}", lambda: fs.pipe_file(probe, b""))
        try:
            stamp = mtime(io(f"check {probe}", lambda: fs.info(probe)))
        except FileNotFoundError:  # removed by a collection beside this one (grace 0)
            stamp = None
    finally:
        io(f"delete {probe}", lambda: rm_quiet(fs, probe))
    return time.time() if stamp is None else stamp


def mtime(info: Mapping[str, Any]) -> float | None:
    """Modification time (s since the epoch) in an fsspec ``info`` dict: ``mtime`` (local), ``LastModified`` (s3fs),
    ``last_modified`` (adlfs), ``updated`` (gcsfs), ...; None when it has none (an S3 "folder")."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def rm_quiet(fs: Any, path: str) -> None:
    """Remove ``path`` (recursively); one that is already gone is no error."""
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
