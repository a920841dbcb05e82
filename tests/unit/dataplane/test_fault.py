"""Fault test: a writer process killed with SIGKILL mid-write leaves the partition readable and consistent.

A child process registers a partition, puts a first batch and then delta-writes big columns in a loop;
the parent SIGKILLs it while a write is in flight (local folder and loopback S3, same test).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dataplane import fields as F
from dataplane import paths
from dataplane.client import DataPlane, DataPlaneError
from dataplane.codec import nested_from_values
from dataplane.fields import SAMPLE_ID
from dataplane.meta import KVBatchMeta

REPO = Path(__file__).resolve().parents[3]
RUN, PART = "run-1", "step_000001"
N, GROUP = 64, 4  # samples, group size
NUM_DELTAS = 40  # delta writes the child attempts; it is killed long before the last one
TRIP_AT = 3  # hooked modes: delta writes 0..2 commit, write 3 is the one in flight at the kill
TRIP_BYTES = 128 << 10  # "data" mode stops write TRIP_AT this far into its file (the file is ~0.7 MB)
SCHEMA = {
    F.INPUT_IDS: "int64",
    F.INPUT_LENGTHS: "int64",
    F.TOKEN_MASK: "bool",
    F.REWARDS: "float32",
    **{f"lp_{k:02d}": "float32" for k in range(NUM_DELTAS)},
    **{f"ids_{k:02d}": "int64" for k in range(NUM_DELTAS)},
}


# ---------------------------------------------------------------- deterministic columns (child and parent)
def _lengths() -> torch.Tensor:
    return torch.randint(1024, 4096, (N,), generator=torch.Generator().manual_seed(7))  # [N], ~2.5k tokens


def first_columns() -> dict[str, torch.Tensor]:
    lens = _lengths()
    total = int(lens.sum())
    return {
        F.INPUT_IDS: nested_from_values(torch.arange(total, dtype=torch.int64) % 49152, lens),
        F.INPUT_LENGTHS: lens,
        F.TOKEN_MASK: nested_from_values(torch.arange(total) % 5 != 0, lens),
        F.REWARDS: torch.arange(N, dtype=torch.float32) / N,
    }


def delta_columns(k: int) -> dict[str, torch.Tensor]:
    """Delta write ``k``: two per-token columns (~1.9 MB in memory), a function of ``k`` only."""
    lens = _lengths()
    total = int(lens.sum())
    lp = torch.randn(total, generator=torch.Generator().manual_seed(1000 + k))  # float32, incompressible
    ids = torch.arange(total, dtype=torch.int64) * 7 + k * 1_000_000_007
    return {f"lp_{k:02d}": nested_from_values(lp, lens), f"ids_{k:02d}": nested_from_values(ids, lens)}


# ---------------------------------------------------------------- the child (a separate Python process)
def _say(*words: object) -> None:
    sys.stdout.write(" ".join(str(w) for w in words) + "\n")
    sys.stdout.flush()


def _hang() -> None:
    _say("tripped")
    time.sleep(600)  # the parent SIGKILLs us here


def _arm(dp: DataPlane, mode: str, current: dict[str, int]) -> None:
    """Make delta write ``TRIP_AT`` stop, and tell the parent, at the kill point of ``mode``:
    ``data``: ~``TRIP_BYTES`` into its Parquet file; ``commit``: data file closed, no commit yet."""
    if mode == "data":
        real_open = dp.fs.open

        def open_(path: str, mode: str = "rb", **kwargs: object):  # noqa: ANN202
            fh = real_open(path, mode, **kwargs)
            if "w" in mode and "/data/" in path and current["k"] == TRIP_AT:
                real_write, written = fh.write, [0]

                def write(buf: bytes) -> int:
                    if written[0] + len(buf) < TRIP_BYTES:
                        written[0] += len(buf)
                        return real_write(buf)
                    real_write(bytes(memoryview(buf)[: len(buf) // 2]))  # into the column data, footer unwritten
                    fh.flush()
                    _hang()
                    return len(buf)

                fh.write = write
            return fh

        dp.fs.open = open_
    elif mode == "commit":
        real_put = dp._put_atomic

        def put_atomic(path: str, payload: bytes) -> None:
            if "/_commits/" in path and current["k"] == TRIP_AT:
                _hang()
            real_put(path, payload)

        dp._put_atomic = put_atomic


def child_main(root: str, options_json: str, mode: str) -> None:
    """Register, put, wait for the parent's go, then delta-write ``NUM_DELTAS`` times, printing ``begin k``
    before each write."""
    torch.set_num_threads(1)
    dp = DataPlane(root, RUN, storage_options=json.loads(options_json))
    dp.register_partition(PART, fields=SCHEMA)
    meta = dp.put(PART, first_columns(), group_size=GROUP)
    _say("meta", json.dumps(meta.sample_ids))
    sys.stdin.readline()  # the parent reads the first put before any delta write starts
    current = {"k": -1}
    _arm(dp, mode, current)
    for k in range(NUM_DELTAS):
        current["k"] = k
        _say("begin", k)
        dp.write_columns(meta, delta_columns(k))
    _say("finished")


# ---------------------------------------------------------------- the parent
class _Lines:
    """Lines of a child's stdout, read with a deadline (never blocks past it)."""

    def __init__(self, proc: subprocess.Popen, err: Path) -> None:
        self.proc, self.err, self.buf, self.lines = proc, err, b"", []

    def until(self, pred, deadline: float) -> str:  # noqa: ANN001
        while True:
            for line in self.lines:
                if pred(line):
                    return line
            left = deadline - time.monotonic()
            chunk = None
            if left > 0 and select.select([self.proc.stdout], [], [], min(left, 0.05))[0]:
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)  # b"": the child is gone
            if left <= 0 or chunk == b"":
                msg = f"child said {self.lines}, rc {self.proc.poll()}, stderr:\n{self.err.read_text()[-3000:]}"
                raise AssertionError(msg)
            if chunk:
                self.buf += chunk
                *done, self.buf = self.buf.split(b"\n")
                self.lines += [d.decode() for d in done]

    def drain(self) -> None:
        """Everything left, once the child is dead (its end of the pipe is closed: read to EOF)."""
        self.buf += self.proc.stdout.read()
        self.lines += [d.decode() for d in self.buf.split(b"\n") if d]
        self.buf = b""


def _commit_records(dp: DataPlane) -> list[dict]:
    cdir = paths.commits_dir(dp._part(PART))
    files = [p for p in dp.fs.ls(cdir, detail=False, refresh=True) if p.endswith(".json")]
    return [json.loads(dp.fs.cat_file(p)) for p in files]


def _delta_ks(records: list[dict]) -> list[int]:
    return sorted(int(name[3:]) for r in records for name in r["fields"] if name.startswith("lp_"))


def _check(out: dict, expected: dict, order: list[int] | None = None) -> None:
    """``out`` (read jagged) holds exactly ``expected``, rows in ``order`` (default: as written)."""
    for name, value in expected.items():
        got = out[name]
        assert got.dtype == value.dtype, name
        rows = value.unbind() if value.is_nested else value
        want = [rows[i] for i in order] if order is not None else rows
        if value.is_nested:
            assert len(got.unbind()) == len(want) and all(map(torch.equal, got.unbind(), want)), name
        else:
            assert torch.equal(got, torch.stack(list(want)) if order is not None else want), name


def _run_child_and_kill(root: str, options: dict, mode: str, tmp_path: Path, dp: DataPlane) -> tuple[KVBatchMeta, int]:
    """Start the child, SIGKILL it with a write in flight; return the meta of its rows and the in-flight write.

    ``dp`` reads the first put before the child starts its delta writes: a client that listed the partition
    before those commits landed must still see them."""
    err = tmp_path / "child.err"
    code = "import sys; from tests.unit.dataplane.test_fault import child_main; child_main(*sys.argv[1:])"
    with open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, root, json.dumps(options), mode],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    try:
        lines = _Lines(proc, err)
        deadline = time.monotonic() + 60
        sample_ids = json.loads(lines.until(lambda s: s.startswith("meta "), deadline)[5:])
        meta = KVBatchMeta(PART, sample_ids, sequence_lengths=_lengths().tolist())
        first = first_columns()
        _check(dp.read(meta, list(first), layout="jagged"), first)
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        if mode == "timing":  # kill as soon as a delta commit shows up: the next write is under way
            cdir = paths.commits_dir(dp._part(PART))
            while len(dp.fs.ls(cdir, detail=False, refresh=True)) < 2:
                assert time.monotonic() < deadline and proc.poll() is None, err.read_text()
                time.sleep(0.005)
        else:
            lines.until(lambda s: s == "tripped", deadline)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        lines.drain()
        assert "finished" not in lines.lines, "the child finished every write before the kill"
        return meta, max(int(s.split()[1]) for s in lines.lines if s.startswith("begin "))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
        proc.stdout.close()


@pytest.mark.parametrize("mode", ["data", "commit", "timing"])
def test_sigkill_mid_write_leaves_partition_consistent(store, tmp_path, mode):
    root, options = store
    dp = DataPlane(root, RUN, storage_options=options)
    meta, in_flight = _run_child_and_kill(root, options, mode, tmp_path, dp)
    if mode != "timing":
        assert in_flight == TRIP_AT

    # 1. the same client (which read the partition before these commits landed) sees every finished write
    done = {n: v for k in range(in_flight) for n, v in delta_columns(k).items()}
    if done:  # timing mode can kill before the child announced write 1 (commit 0 landed): nothing to check yet
        _check(dp.read(meta, list(done), layout="jagged"), done)

    # 2. every commit record names a data file that exists, is whole, and holds the fields it lists
    records = _commit_records(dp)
    part = dp._part(PART)
    for r in records:
        with dp.fs.open(paths.join(part, r["file"]), "rb") as fh:
            table = pq.read_table(fh)
        assert table.num_rows == r["num_rows"] == N
        assert set(table.column_names) == {SAMPLE_ID, *r["fields"]}
    committed = _delta_ks(records)
    assert committed == list(range(len(committed)))
    # commit k lands between "begin k" and "begin k+1"; the hooked modes stop write TRIP_AT before its commit
    assert len(committed) in ((in_flight, in_flight + 1) if mode == "timing" else (in_flight,)) and committed
    named = {paths.join(part, r["file"]).split("://")[-1] for r in records}
    data_files = dp.fs.ls(paths.join(part, "data"), detail=False, refresh=True)
    orphans = [p for p in data_files if p.split("://")[-1] not in named]
    if mode == "data" and root.startswith("s3://"):  # an upload cut short never becomes an object
        assert orphans == []
    elif mode == "data":  # the killed write left a truncated file behind
        assert len(orphans) == 1 and dp.fs.size(orphans[0]) >= TRIP_BYTES // 2
        with pytest.raises(pa.ArrowInvalid), dp.fs.open(orphans[0], "rb") as fh:
            pq.read_table(fh)
    if mode == "commit":  # a whole data file without its commit record
        assert len(orphans) == 1

    # 3. every committed field reads back exactly what the child wrote, for all sample ids
    expected = {**first_columns(), **{n: v for k in committed for n, v in delta_columns(k).items()}}
    _check(dp.read(meta, list(expected), layout="jagged"), expected)

    # 4. fields of the interrupted write (and of a write never started) are not visible
    for k in (len(committed), NUM_DELTAS - 1):
        for name in (f"lp_{k:02d}", f"ids_{k:02d}"):
            with pytest.raises(DataPlaneError, match=f"'{name}' was never written"):
                dp.read(meta, [name])

    # 5. a new client carries on: redo the interrupted write, read everything back (rows reversed), clear
    fresh = DataPlane(root, RUN, storage_options=options)
    redo = len(committed)
    fresh.write_columns(meta, delta_columns(redo))
    expected.update(delta_columns(redo))
    backwards = list(range(N - 1, -1, -1))
    _check(fresh.read(meta.subset(backwards), list(expected), layout="jagged"), expected, backwards)
    assert sum(f"lp_{redo:02d}" in r["fields"] for r in _commit_records(fresh)) == 1
    fresh.clear(PART)
    with pytest.raises(DataPlaneError, match="never registered or it was cleared"):
        fresh.read(meta, [F.REWARDS])
