"""Fault tests of the data plane: writers SIGKILLed mid-write, two attempts of one write racing, an S3 outage.

Writers run in worker processes forked from one long-lived "zygote" process (``zygote_main``), which imports torch,
pyarrow, s3fs and the data plane once; forking a worker then costs milliseconds instead of the ~2 s of a fresh
interpreter, so a test can kill and restart writers dozens of times. The kill and race tests run on a local folder
and on loopback S3 (moto); the outage tests put ``tests.tcp_proxy.TcpProxy`` between the client and the S3 server.

1. ``test_sigkill_during_writes``: 50 SIGKILLs per store (100 in all), each landing during a put or a delta write:
   part-way into the data file, between the data file and the commit record, in the middle of the commit (local:
   the temporary record written, the rename not done; S3: the record's PUT done, the write not returned), or at a
   seeded random time. After each kill, and before the next writer retries the interrupted write: every commit
   record names a data file that exists, each write has at most one record, the committed writes are exactly the
   ones finished (plus possibly the one in flight), every committed field reads back exactly the values written,
   and the fields of the interrupted write are invisible.
2. ``test_concurrent_attempts_of_one_write``: two processes (a retried task beside its zombie attempt) delta-write
   the same field for the same ids at the same moment, 20 times (half of them with both data files written before
   either attempt commits); both must succeed and the field must read back from a commit record whose file exists.
3. ``test_s3_outage_mid_run``: the S3 endpoint is down for 30 s in the middle of a sequence of puts, delta writes
   and reads; the sequence completes and every column reads back as written. ``test_is_transient_on_real_errors``
   checks ``dataplane.errors.is_transient`` on the errors the outage really produces, and on permanent ones.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import multiprocessing
import os
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import dataplane.errors
from dataplane import errors, paths
from dataplane.client import DataPlane, DataPlaneError
from dataplane.codec import nested_from_values
from dataplane.errors import IntegrityError, is_transient, retry_transient
from dataplane.meta import KVBatchMeta
from tests.tcp_proxy import TcpProxy

REPO = Path(__file__).resolve().parents[3]
RUN, PART = "run-1", "step_000001"
N, GROUP = 16, 4  # rows of every write, group size of the puts
KILLS_PER_STORE = 50
KILLS_PER_PARTITION = 5  # the kill test writes 10 partitions (steps) one after the other
MAX_OPS = 3 * KILLS_PER_PARTITION  # writes one partition may reach (schema slots): at most 3 more per kill
MODES = ("data", "between", "commit", "timing")
TRIP_BYTES = 6 << 10  # "data" kills stop the data file this far in (a data file is ~20 kB)
RACE_TRIALS = 20
OUTAGE_S = 30.0
OUTAGE_OPS = 30
BASE = {"input_lengths": "int64", "b_val": "float32"}
SCHEMA = {
    **BASE,
    "p_val": "float32",  # every put writes p_val and p_txt, for its own rows
    "p_txt": "str",
    **{f"d{j:03d}": "float32" for j in range(max(MAX_OPS, OUTAGE_OPS))},  # delta write j: d{j}, e{j} of the base rows
    **{f"e{j:03d}": "int64" for j in range(max(MAX_OPS, OUTAGE_OPS))},
}


# ---------------------------------------------------------------- deterministic content (workers and parent)
def _lengths() -> torch.Tensor:
    return torch.randint(128, 512, (N,), generator=torch.Generator().manual_seed(7))  # [N], ~5k values per column


def base_columns() -> dict[str, Any]:
    lens = _lengths()
    vals = torch.randn(int(lens.sum()), generator=torch.Generator().manual_seed(3))
    return {"input_lengths": lens, "b_val": nested_from_values(vals, lens)}


def is_put(j: int) -> bool:
    return j % 3 == 2


def op_name(j: int) -> str:
    return f"op{j:03d}"


def op_columns(j: int, salt: int = 0) -> dict[str, Any]:
    """What write ``j`` (of the partition numbered ``salt``) writes: a put of new rows (``p_val``, ``p_txt``) or a
    delta write of ``d{j}``, ``e{j}`` for the base rows; a function of ``j`` and ``salt`` only (float values random,
    so the files do not compress)."""
    lens = _lengths()
    vals = torch.randn(int(lens.sum()), generator=torch.Generator().manual_seed(1000 + j + 100_000 * salt))
    if is_put(j):
        return {
            "p_val": nested_from_values(vals, lens),
            "p_txt": [f"{salt}/{op_name(j)} row {i} " + "x" * (i % 5) for i in range(N)],
        }
    ints = torch.arange(N, dtype=torch.int64) * 7 + j * 1_000_003 + salt * 100_000_007
    return {f"d{j:03d}": nested_from_values(vals, lens), f"e{j:03d}": ints}


def race_columns(trial: int) -> dict[str, Any]:
    lens = _lengths()
    vals = torch.randn(int(lens.sum()), generator=torch.Generator().manual_seed(50_000 + trial))
    return {"d000": nested_from_values(vals, lens), "e000": torch.arange(N, dtype=torch.int64) + trial}


def outage_columns(j: int) -> dict[str, Any]:
    """Write ``j`` of the outage sequence: delta fields ``d{j}``, ``e{j}`` of the base rows."""
    lens = _lengths()
    vals = torch.randn(int(lens.sum()), generator=torch.Generator().manual_seed(90_000 + j))
    return {f"d{j:03d}": nested_from_values(vals, lens), f"e{j:03d}": torch.arange(N, dtype=torch.int64) - j}


def _equal(got: Any, want: Any) -> bool:
    if isinstance(want, list):
        return got == want
    if want.is_nested:
        return (
            got.is_nested
            and got.values().dtype == want.values().dtype
            and torch.equal(got.offsets(), want.offsets())
            and torch.equal(got.values(), want.values())
        )
    return got.dtype == want.dtype and torch.equal(got, want)


def _cat(columns: list[Any]) -> Any:
    """Rows of several columns of one field, one after the other."""
    if isinstance(columns[0], list):
        return [x for c in columns for x in c]
    lens = torch.cat([c.offsets().diff() for c in columns])
    return nested_from_values(torch.cat([c.values() for c in columns]), lens)


def _mismatches(out: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    return [name for name, want in expected.items() if not _equal(out[name], want)]


# ---------------------------------------------------------------- the zygote and its workers
def _say(*words: object) -> None:
    """One line on stdout, tagged with our pid, in one write (atomic on a pipe: workers share the zygote's)."""
    os.write(1, (" ".join([str(os.getpid()), *map(str, words)]) + "\n").encode())


def zygote_main() -> None:
    """Import everything once, then fork a worker per ``fork`` command (``{"cmd": "fork", "fn", "args", "count"}``:
    ``count`` workers sharing a barrier) and reap one per ``wait`` command, answering on stdout."""
    torch.set_num_threads(1)
    _warm_up()
    _say("ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "fork":
            count = cmd.get("count", 1)
            barrier = multiprocessing.get_context("fork").Barrier(count) if count > 1 else None
            pids = []
            for index in range(count):
                pid = os.fork()
                if pid == 0:
                    code = 0
                    try:
                        WORKERS[cmd["fn"]](index, barrier, **cmd["args"])
                    except BaseException as err:  # noqa: BLE001  (the parent gets the error as a line)
                        traceback.print_exc()
                        _say("error", json.dumps(f"{type(err).__name__}: {err}"[:2000]))
                        code = 1
                    finally:
                        os._exit(code)
                pids.append(pid)
            _say("forked", *pids)
        elif cmd["cmd"] == "wait":
            try:
                _, status = os.waitpid(cmd["pid"], 0)
                code = os.waitstatus_to_exitcode(status)
            except ChildProcessError:  # reaped already (a wait sent twice after a failure)
                code = "gone"
            _say("exited", cmd["pid"], code)
        else:
            break


def _warm_up() -> None:
    """Do once, before any fork, what every worker would otherwise do on its first write (~2 s of lazy imports and
    first-call set-up in torch, pyarrow, s3fs and botocore): a put, a delta write and a read in a scratch folder."""

    import botocore.loaders
    import botocore.session
    import s3fs  # noqa: F401

    # every botocore session (one per S3 client a worker makes) shares one loader, with the S3 model parsed here
    loader = botocore.loaders.create_loader()
    botocore.session.create_loader = lambda *args, **kwargs: loader
    botocore.session.get_session().create_client(
        "s3", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    with tempfile.TemporaryDirectory() as scratch:
        dp = DataPlane(scratch, RUN)
        dp.register_partition(PART, fields=SCHEMA)
        base = dp.put(PART, base_columns(), group_size=GROUP, id_key="base")
        for j in (0, 2):
            meta = _do_op(dp, base, j)
        dp.read(meta, list(op_columns(2)), layout="jagged")
        dp.read(base, list(op_columns(0)), layout="padded")


def _stall(mode: str) -> None:
    _say("tripped", mode)
    time.sleep(600)  # the parent SIGKILLs us here
    os._exit(3)


def _destinations(method: str, args: tuple, kwargs: dict) -> list[str]:
    """The paths a filesystem call ``method(*args, **kwargs)`` writes."""
    if method == "open":
        mode = args[1] if len(args) > 1 else kwargs.get("mode", "rb")
        if not any(c in mode for c in "wax"):
            return []
    if method in ("open", "pipe_file", "pipe", "touch"):
        target = args[0] if args else kwargs.get("path")
    else:  # mv, copy, put, ...: (source, destination)
        target = args[1] if len(args) > 1 else kwargs.get("path2", kwargs.get("rpath"))
    if isinstance(target, dict):
        target = list(target)
    return [str(t) for t in (target if isinstance(target, (list, tuple)) else [target])]


def _kinds(targets: list[str]) -> set[str]:
    """Which data-plane objects ``targets`` are: ``data`` files, ``commit`` records (temporaries included)."""
    return {"commit" if "/_commits/" in t else "data" for t in targets if "/_commits/" in t or "/data/" in t}


def _hook_writes(fs: Any, *, before: Any = None, after: Any = None, opened: Any = None) -> None:
    """Wrap the methods of ``fs`` that write (whatever client method makes the calls): ``before(method, kinds)`` and
    ``after(method, kinds)`` run around each outermost call (not the ``open`` inside a local ``pipe_file``), and
    ``opened(handle, kinds, outermost)`` sees every handle opened for writing and returns the handle to use."""
    depth = [0]

    def wrap(method: str) -> None:
        real = getattr(fs, method)

        def call(*args: Any, **kwargs: Any) -> Any:
            found = _kinds(_destinations(method, args, kwargs))
            outermost = depth[0] == 0
            if outermost and found and before:
                before(method, found)
            depth[0] += 1
            try:
                result = real(*args, **kwargs)
            finally:
                depth[0] -= 1
            if outermost and found and after:
                after(method, found)
            if method == "open" and found and opened:
                result = opened(result, found, outermost)
            return result

        setattr(fs, method, call)

    for method in ("open", "pipe_file", "pipe", "touch", "put_file", "put", "mv", "move", "rename", "copy", "cp_file"):
        if hasattr(fs, method):
            wrap(method)


def _arm(fs: Any, local: bool, mode: str, current: dict[str, int], trip_op: int) -> None:
    """Make write ``trip_op`` stop (``_stall``) at the kill point of ``mode``:

    ``data``: part-way into the data file (local: ``TRIP_BYTES`` of it on disk; S3: before its PUT);
    ``between``: the data file written, before the first write of the commit record;
    ``commit``: just after the first write of the commit record returns (local: the temporary record, not yet
    renamed into place; S3: the record's PUT).
    """
    tripped = [False]

    def armed() -> bool:
        return current["op"] == trip_op and not tripped[0]

    def trip() -> None:
        tripped[0] = True
        _stall(mode)

    def before(method: str, kinds: set[str]) -> None:
        if armed() and mode == "between" and "commit" in kinds:
            trip()
        if armed() and mode == "data" and "data" in kinds and not local and method != "open":
            trip()  # an object-store upload is one PUT: stop before it

    def after(method: str, kinds: set[str]) -> None:
        if armed() and mode == "commit" and "commit" in kinds:
            trip()

    def opened(fh: Any, kinds: set[str], outermost: bool) -> Any:
        if not (armed() and mode == "data" and "data" in kinds):
            return fh
        real_write, written = fh.write, [0]

        def write(buf: Any) -> int:
            view = memoryview(buf).cast("B")
            if armed() and written[0] + len(view) >= TRIP_BYTES:
                real_write(bytes(view[: TRIP_BYTES - written[0]]))
                fh.flush()
                trip()
            written[0] += len(view)
            return real_write(buf)

        fh.write = write
        return fh

    _hook_writes(fs, before=before, after=after, opened=opened)


def _align_before_commit(fs: Any, barrier: Any, enabled: dict[str, bool]) -> None:
    """While ``enabled["on"]``: before this attempt's first write of its commit record (its data file is written
    by then), wait on ``barrier`` for the other attempt to get there too: both data files exist before either
    attempt commits."""

    def before(method: str, kinds: set[str]) -> None:
        if enabled["on"] and "commit" in kinds:
            enabled.update(on=False, synced=True)
            barrier.wait(timeout=120)

    _hook_writes(fs, before=before)


def _salt(partition_id: str) -> int:
    return int(partition_id.rsplit("_", 1)[1])


def _do_op(dp: DataPlane, base: KVBatchMeta, j: int) -> KVBatchMeta:
    """Write ``j`` of partition ``base.partition_id`` (a put, or a delta write for the rows of ``base``)."""
    part = base.partition_id
    if is_put(j):
        return dp.put(part, op_columns(j, _salt(part)), group_size=GROUP, id_key=op_name(j), task_name=op_name(j))
    return dp.write_columns(base, op_columns(j, _salt(part)), task_name=op_name(j))


def _kill_worker(
    index: int,
    barrier: Any,
    *,
    root: str,
    options: dict,
    part: str,
    start: int,
    trip_op: int,
    mode: str,
    base_ids: list[str],
) -> None:
    """Write ``start``, ``start + 1``, ..., ``trip_op`` (saying ``begin j`` and ``done j ...`` around each); in a
    hooked ``mode``, stall in write ``trip_op`` at its kill point; in ``timing`` mode, write ``trip_op`` again and
    again (a retried task) until the parent kills us."""
    dp = DataPlane(root, RUN, storage_options=options)
    base = dp.meta_for(part, base_ids)
    current = {"op": -1}
    if mode != "timing":
        _arm(dp.fs, dp._local, mode, current, trip_op)
    j = start
    while True:
        current["op"] = j
        _say("begin", j)
        t0 = time.monotonic()
        meta = _do_op(dp, base, j)
        _say("done", j, f"{time.monotonic() - t0:.4f}", json.dumps(meta.sample_ids if is_put(j) else None))
        if j == trip_op and mode != "timing":
            _say("missed", j)  # the kill point was never reached: the client writes through calls we do not wrap
            return
        j = min(j + 1, trip_op)  # timing: once at trip_op, retry it until killed (every kill lands in a write)


def _race_worker(index: int, barrier: Any, *, root: str, options: dict, ids: dict[str, list[str]]) -> None:
    """Attempt ``index`` of every race trial: wait for the other attempt, then delta-write the trial's columns. In
    the even trials the attempts also wait for each other once their data files are written (the schedule in
    which both uploads finish before either commits); the odd trials race freely."""
    dp = DataPlane(root, RUN, storage_options=options)
    align = {"on": False, "synced": False}
    _align_before_commit(dp.fs, barrier, align)
    for trial in range(RACE_TRIALS):
        part = f"race_{trial:02d}"
        meta = dp.meta_for(part, ids[part])
        columns = race_columns(trial)
        barrier.wait(timeout=120)
        align.update(on=trial % 2 == 0, synced=False)
        try:
            dp.write_columns(meta, columns, task_name=f"attempt-{index}")
            _say("ok", trial, "aligned" if align["synced"] else "free")
        except Exception as err:  # noqa: BLE001  (reported; the parent asserts on it)
            _say("failed", trial, json.dumps(f"{type(err).__name__}: {err}"[:2000]))


def _outage_worker(index: int, barrier: Any, *, root: str, options: dict, base_ids: list[str]) -> None:
    """The outage sequence: delta writes ``d{j}`` of the base rows, with a put and reads of everything so far
    in between; every read is checked here, and ``done j`` said after each step."""
    dp = DataPlane(root, RUN, storage_options=options)
    base = dp.meta_for(PART, base_ids)
    written: dict[str, Any] = dict(base_columns())
    for j in range(OUTAGE_OPS):
        if j % 5 == 4:  # a read of everything written so far
            out = dp.read(base, list(written), layout="jagged")
            bad = _mismatches(out, written)
            if bad:
                raise AssertionError(f"step {j}: fields {bad} read back other values than written")
        elif j % 5 == 2:  # a put of new rows, read straight back
            meta = dp.put(PART, op_columns(2), group_size=GROUP, task_name=f"outage-put-{j}")
            out = dp.read(meta, ["p_val", "p_txt"], layout="jagged")
            bad = _mismatches(out, op_columns(2))
            if bad:
                raise AssertionError(f"step {j}: put fields {bad} read back other values than written")
        else:
            dp.write_columns(base, outage_columns(j), task_name=f"outage-{j}")
            written.update(outage_columns(j))
        _say("done", j, f"{time.time():.3f}")
    _say("finished")


WORKERS = {"kill": _kill_worker, "race": _race_worker, "outage": _outage_worker}


class Zygote:
    """The parent's end of a zygote process: fork workers, read their lines, kill and reap them."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.err = workdir / "zygote.err"
        code = "from tests.unit.dataplane.test_fault import zygote_main; zygote_main()"
        with open(self.err, "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env,
            )
        self.pid = self.proc.pid
        self.buf = b""
        self.pending: dict[int, collections.deque] = collections.defaultdict(collections.deque)  # pid -> (t, words)
        self.said: dict[int, list[str]] = collections.defaultdict(list)  # pid -> lines read so far
        self.live: set[int] = set()
        self.expect(self.pid, "ready", timeout=120)

    def stderr_tail(self, n: int = 4000) -> str:
        return self.err.read_text(errors="replace")[-n:]

    def _read(self, timeout: float) -> None:
        if not select.select([self.proc.stdout], [], [], max(timeout, 0))[0]:
            return
        chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not chunk:
            msg = f"the zygote died (rc {self.proc.poll()}); stderr:\n{self.stderr_tail()}"
            raise AssertionError(msg)
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        now = time.monotonic()
        for line in lines:
            pid, _, text = line.decode(errors="replace").partition(" ")
            if pid.isdigit():  # else something a library printed: not ours
                self.pending[int(pid)].append((now, text))
                self.said[int(pid)].append(text)

    def expect(
        self, pid: int, first_word: str, *, timeout: float, allow: tuple[str, ...] = ()
    ) -> tuple[float, list[str]]:
        """Consume ``pid``'s lines up to the first starting with ``first_word``; return (when it came, its words).
        A line starting with a word in ``allow`` is skipped; any other line fails the test."""
        deadline = time.monotonic() + timeout
        while True:
            queue = self.pending[pid]
            while queue:
                t, text = queue.popleft()
                words = text.split(" ")
                if words[0] == first_word:
                    return t, words
                if words[0] not in allow:
                    msg = (
                        f"worker {pid} said {text!r} while we waited for {first_word!r}; it said "
                        f"{self.said[pid][-8:]}; stderr:\n{self.stderr_tail()}"
                    )
                    raise AssertionError(msg)
            left = deadline - time.monotonic()
            if left <= 0:
                msg = (
                    f"worker {pid} did not say {first_word!r} in {timeout} s; it said {self.said[pid][-8:]}; "
                    f"stderr:\n{self.stderr_tail()}"
                )
                raise AssertionError(msg)
            self._read(min(left, 0.05))

    def poll(self, pid: int) -> list[str]:
        """Lines of ``pid`` that came so far and were not consumed (consumes them)."""
        self._read(0)
        out = [text for _, text in self.pending[pid]]
        self.pending[pid].clear()
        return out

    def _send(self, cmd: dict) -> None:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def fork(self, fn: str, count: int = 1, **args: Any) -> list[int]:
        self._send({"cmd": "fork", "fn": fn, "count": count, "args": args})
        _, words = self.expect(self.pid, "forked", timeout=60)
        pids = [int(w) for w in words[1:]]
        self.live.update(pids)
        return pids

    def reap(self, pid: int, timeout: float = 60) -> int | None:
        """Wait for worker ``pid`` to end; its exit code (``-9``: SIGKILL; None: reaped before)."""
        self._send({"cmd": "wait", "pid": pid})
        while True:  # skip the answer to a wait that timed out earlier
            _, words = self.expect(self.pid, "exited", timeout=timeout)
            if int(words[1]) == pid:
                break
        self.live.discard(pid)
        return None if words[2] == "gone" else int(words[2])

    def kill(self, pid: int) -> int | None:
        os.kill(pid, signal.SIGKILL)
        return self.reap(pid)

    def close(self) -> None:
        for pid in list(self.live):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self._send({"cmd": "exit"})
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture(autouse=True)
def _quiet_s3_server():
    """moto's HTTP server logs every request; hundreds per test, each captured by pytest, slow the server down."""
    logger = logging.getLogger("werkzeug")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


@pytest.fixture(scope="module")
def zygote(s3_server, tmp_path_factory):
    """One zygote for the module (started after the S3 server, so that it has its credentials)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPOFLOW_NUM_THREADS": "1", "GRPOFLOW_IO_RETRY_S": "120"}
    z = Zygote(tmp_path_factory.mktemp("zygote"), env)
    yield z
    z.close()


@pytest.fixture
def workers(zygote):
    """The zygote, with every worker a test forked killed when it ends (even when it fails)."""
    yield zygote
    for pid in list(zygote.live):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        zygote.reap(pid)


# ---------------------------------------------------------------- the parent's view of a partition
def _records(dp: DataPlane, part: str) -> list[dict]:
    """Every commit record of partition folder ``part`` (read raw, not through the client)."""
    cdir = paths.commits_dir(part)
    try:
        found = [p for p in dp.fs.find(cdir) if p.endswith(".json")]
    except FileNotFoundError:
        return []
    blobs = dp.fs.cat(found, start=0) if found else {}  # start=0: one GET each (no HEAD first on s3fs)
    return [json.loads(b) for b in blobs.values()]


def _data_files(dp: DataPlane, part: str) -> set[str]:
    try:
        return {p.split("://")[-1] for p in dp.fs.find(paths.join(part, "data"))}
    except FileNotFoundError:
        return set()


def _missing_files(dp: DataPlane, part: str, records: list[dict]) -> list[str]:
    """The files that commit records name and that are not there."""
    present = _data_files(dp, part)
    return [r["file"] for r in records if paths.join(part, r["file"]).split("://")[-1] not in present]


class _PutIds(dict):
    """The ids that put ``j`` mints (computed when first asked): a put with ``id_key`` mints its ids from (run,
    partition, id_key) alone, so a put on a scratch local folder mints the same ones (the test also checks them
    against the ids the workers' puts return)."""

    def __init__(self, tmp_path: Path, part: str) -> None:
        super().__init__()
        self.part = part
        self.scratch = DataPlane(str(tmp_path / f"scratch-{part}"), RUN)
        self.scratch.register_partition(part, fields={"p_txt": "str"})

    def __missing__(self, j: int) -> list[str]:
        self[j] = self.scratch.put(self.part, {"p_txt": [""] * N}, group_size=GROUP, id_key=op_name(j)).sample_ids
        self.scratch.clear(self.part)  # keeps the scratch partition small
        self.scratch.register_partition(self.part, fields={"p_txt": "str"})
        return self[j]


class _Partition:
    """The parent's knowledge of one partition of the kill test: its base rows, the ids its puts mint, the columns
    of its writes, how many writes have committed and which one the last kill interrupted."""

    def __init__(self, dp: DataPlane, tmp_path: Path, index: int) -> None:
        part = paths.step_partition(index)
        dp.register_partition(part, fields=SCHEMA)
        self.base = dp.put(part, base_columns(), group_size=GROUP, id_key="base", task_name="base")
        self.put_ids = _PutIds(tmp_path, part)
        self.salt = index
        self.cache: dict[int, dict[str, Any]] = {}
        self.start = self.committed = 0  # the next writer starts at write `start`
        self.in_flight = -1

    def __getitem__(self, j: int) -> dict[str, Any]:
        """The columns of write ``j``."""
        if j not in self.cache:
            self.cache[j] = op_columns(j, self.salt)
        return self.cache[j]


def _check_partition(dp: DataPlane, p: _Partition, in_flight: int, allowed: set[int], why: str) -> int:
    """Everything a reader may rely on after a kill; returns how many writes of ``p`` are committed (0..c-1).

    ``allowed``: the possible counts of committed writes (``in_flight``: the interrupted write has no commit, from
    this attempt or an earlier one)."""
    base, put_ids = p.base, p.put_ids
    part = dp._part(base.partition_id)
    records = _records(dp, part)
    missing = _missing_files(dp, part, records)
    assert not missing, f"{why}: commit records name data files that are not there: {missing}"
    per_write = collections.Counter(r["task_name"] for r in records)
    assert all(n == 1 for n in per_write.values()), f"{why}: writes with more than one commit record: {per_write}"
    committed = sorted(int(name[2:]) for name in per_write if name.startswith("op"))
    assert committed == list(range(len(committed))), f"{why}: committed writes are not a prefix: {committed}"
    assert len(committed) in allowed, f"{why}: {len(committed)} writes committed, expected one of {sorted(allowed)}"
    assert "base" in per_write, f"{why}: the base put's commit record is gone"

    # every committed field reads back exactly what was written, for all its rows
    deltas = [j for j in committed if not is_put(j)]
    want = {**base_columns(), **{k: v for j in deltas for k, v in p[j].items()}}
    out = dp.read(base, list(want), layout="jagged")
    bad = _mismatches(out, want)
    assert not bad, f"{why}: fields {bad} read back other values than written"
    puts = [j for j in committed if is_put(j)]
    if puts:
        rows = dp.meta_for(base.partition_id, [s for j in puts for s in put_ids[j]])
        want = {name: _cat([p[j][name] for j in puts]) for name in ("p_val", "p_txt")}
        out = dp.read(rows, list(want), layout="jagged")
        bad = _mismatches(out, want)
        assert not bad, f"{why}: put fields {bad} read back other values than written"

    # the interrupted write, if it did not commit, is invisible
    if 0 <= in_flight and in_flight not in committed:
        if is_put(in_flight):
            with pytest.raises(DataPlaneError, match="no value for sample ids|never written"):
                dp.read(KVBatchMeta(base.partition_id, put_ids[in_flight], puts=[]), ["p_val"])
        else:
            with pytest.raises(DataPlaneError, match="never written"):
                dp.read(base, [f"d{in_flight:03d}"])
    return len(committed)


# ---------------------------------------------------------------- 1. SIGKILLs during writes
@pytest.mark.slow
def test_sigkill_during_writes(store, tmp_path, workers):
    """50 writers killed with SIGKILL during a put or a delta write (seeded mix of kill points), 5 in each of 10
    partitions written one after the other (the steps of a run). After every kill the partition is checked in full,
    and the next writer retries the interrupted write; at the end every partition is checked again with a new
    client."""
    root, options = store
    rng = random.Random(20261125 + (0 if root.startswith("s3://") else 1))
    modes = [MODES[i % len(MODES)] for i in range(KILLS_PER_STORE)]
    rng.shuffle(modes)
    dp = DataPlane(root, RUN, storage_options=options)  # one client throughout: it must see later commits
    parts: list[_Partition] = []
    durations = [0.05]
    landed: collections.Counter = collections.Counter()
    spent: collections.Counter = collections.Counter()  # seconds: writers (fork to kill), checks
    for kill in range(KILLS_PER_STORE):
        if kill % KILLS_PER_PARTITION == 0:
            parts.append(_Partition(dp, tmp_path, len(parts) + 1))
        p, mode = parts[-1], modes[kill]
        t0 = time.monotonic()
        start = p.start
        trip_op = start + rng.choice((0, 0, 1, 2))
        delay = rng.random() * sorted(durations)[len(durations) // 2]  # timing mode: up to one typical write
        (pid,) = workers.fork(
            "kill",
            root=root,
            options=options,
            part=p.base.partition_id,
            start=start,
            trip_op=trip_op,
            mode=mode,
            base_ids=p.base.sample_ids,
        )
        if mode == "timing":
            while f"begin {trip_op}" not in workers.said[pid]:
                workers.expect(pid, "begin", timeout=60, allow=("done",))
            time.sleep(delay)
        else:
            workers.expect(pid, "tripped", timeout=60, allow=("begin", "done"))
        assert workers.kill(pid) == -signal.SIGKILL, workers.stderr_tail()
        said = workers.said[pid]
        in_flight = max(int(s.split()[1]) for s in said if s.startswith("begin "))
        done = {}
        for s in said:
            if s.startswith("done "):
                _, j, dt, ids = s.split(" ", 3)
                done[int(j)] = json.loads(ids)
                durations.append(float(dt))
        for j, ids in done.items():
            if ids is not None:
                assert ids == p.put_ids[j], (
                    f"put {j} minted other ids than a retry of it would: {ids[:2]} vs {p.put_ids[j][:2]}"
                )
        assert set(done) == set(range(start, in_flight + (in_flight in done))), (start, in_flight, sorted(done))
        if mode != "timing":
            assert in_flight == trip_op and in_flight not in done and any(s == f"tripped {mode}" for s in said), said
        why = (
            f"kill {kill} ({mode}, {p.base.partition_id} write {in_flight}, {'put' if is_put(in_flight) else 'delta'})"
        )
        # writes before in_flight all returned; in_flight may have committed in an earlier attempt, or (commit and
        # timing kills) in this one, never in a "data" or "between" kill; nothing committed is ever lost
        low = max(p.committed, in_flight + (in_flight in done))
        high = low if mode in ("data", "between") else in_flight + 1
        before = p.committed
        t1 = time.monotonic()
        p.committed = _check_partition(dp, p, in_flight, set(range(low, max(low, high) + 1)), why)
        attempt = "retry" if before > in_flight or in_flight in done else "first attempt"
        landed[f"{mode}, {attempt}, {'committed' if p.committed > in_flight else 'not committed'}"] += 1
        p.start, p.in_flight = in_flight + (in_flight in done), in_flight
        spent["writers"] += t1 - t0
        spent["checks"] += time.monotonic() - t1
    assert sum(landed.values()) == KILLS_PER_STORE
    times = ", ".join(f"{k} {v:.1f} s" for k, v in spent.items())
    writes = sum(p.start for p in parts)
    print(
        f"\n{root.split(':')[0]}: {KILLS_PER_STORE} kills, {writes} writes ({times}); where they landed: "
        f"{dict(sorted(landed.items()))}"
    )

    # a new client sees every partition as the checks after their last kills did
    fresh = DataPlane(root, RUN, storage_options=options)
    for p in parts:
        assert (
            _check_partition(fresh, p, p.in_flight, {p.committed}, f"{p.base.partition_id} at the end") == p.committed
        )
    # and carries on: redo the interrupted write, read everything back (rows reversed), clear
    p = parts[-1]
    _do_op(fresh, p.base, p.start)
    assert _check_partition(fresh, p, p.start, {p.start + 1}, "after the redo") == p.start + 1
    backwards = p.base.subset(list(range(N - 1, -1, -1)))
    written = {k: v for j in range(p.start + 1) if not is_put(j) for k, v in p[j].items()}
    out = fresh.read(backwards, list(written), layout="jagged")
    for name, want in written.items():
        rows = want.unbind() if want.is_nested else want
        got = out[name].unbind() if out[name].is_nested else out[name]
        assert all(torch.equal(got[i], rows[N - 1 - i]) for i in range(N)), name
    fresh.clear(p.base.partition_id)
    with pytest.raises(DataPlaneError, match="never registered or it was cleared"):
        fresh.read(p.base, ["b_val"])


# ---------------------------------------------------------------- 2. two attempts of the same write at once
def test_concurrent_attempts_of_one_write(store, workers):
    """A retried task and its zombie attempt delta-write the same field for the same ids at the same moment (a
    barrier per trial, identical content, so either may win; in the even trials both data files are written before
    either commits, the odd ones race freely); both succeed and the field stays readable."""
    root, options = store
    dp = DataPlane(root, RUN, storage_options=options)
    ids = {}
    for trial in range(RACE_TRIALS):
        part = f"race_{trial:02d}"
        dp.register_partition(part, fields={**BASE, "d000": "float32", "e000": "int64"})
        ids[part] = dp.put(part, base_columns(), group_size=GROUP, id_key="base", task_name="base").sample_ids
    pids = workers.fork("race", count=2, root=root, options=options, ids=ids)
    codes = [workers.reap(pid, timeout=300) for pid in pids]
    assert codes == [0, 0], f"attempts exited {codes}: {[workers.said[p][-3:] for p in pids]}\n{workers.stderr_tail()}"
    problems = []
    for trial in range(RACE_TRIALS):
        part = f"race_{trial:02d}"
        schedule = "both data files first" if trial % 2 == 0 else "free race"
        failed = [s for p in pids for s in workers.said[p] if s.startswith(f"failed {trial} ")]
        ok = [s for p in pids for s in workers.said[p] if s.startswith(f"ok {trial} ")]
        assert len(ok) + len(failed) == 2, (trial, ok, failed)
        if trial % 2 == 0:  # the schedule was enforced (else the client no longer writes through the calls we wrap)
            assert all(s.endswith(" aligned") for s in ok), (
                f"trial {trial}: an attempt did not wait before its commit: {ok}"
            )
        if failed:
            problems.append(f"trial {trial} ({schedule}): an attempt failed: {failed[0]}")
            continue
        part_dir = dp._part(part)
        records = [r for r in _records(dp, part_dir) if "d000" in r["fields"]]
        missing = _missing_files(dp, part_dir, records)
        if len(records) != 1 or missing:
            problems.append(
                f"trial {trial} ({schedule}): {len(records)} commit records of the write, naming missing files "
                f"{missing}"
            )
            continue
        try:
            out = dp.read(dp.meta_for(part, ids[part]), ["d000", "e000"], layout="jagged")
        except Exception as err:  # noqa: BLE001  (collected: the message lists every trial that failed)
            problems.append(f"trial {trial} ({schedule}): read failed: {type(err).__name__}: {err}")
            continue
        bad = _mismatches(out, race_columns(trial))
        if bad:
            problems.append(f"trial {trial} ({schedule}): fields {bad} read back other values than written")
    assert not problems, f"{len(problems)} of {RACE_TRIALS} trials lost the write:\n" + "\n".join(problems)


# ---------------------------------------------------------------- 3. an S3 outage
@pytest.mark.slow
def test_s3_outage_mid_run(s3_server, s3_proxy, workers):
    """The endpoint goes down for 30 s (refusing connections, open ones reset) a few steps into a sequence of
    writes and reads; the sequence completes and everything reads back as written."""
    root = f"s3://grpoflow/outage-{random.randrange(1 << 30)}"
    direct = DataPlane(root, RUN, storage_options={"endpoint_url": s3_server})
    direct.register_partition(PART, fields=SCHEMA)
    base = direct.put(PART, base_columns(), group_size=GROUP, id_key="base", task_name="base")
    (pid,) = workers.fork("outage", root=root, options={"endpoint_url": s3_proxy.url}, base_ids=base.sample_ids)
    workers.expect(pid, "done", timeout=60)
    workers.expect(pid, "done", timeout=60)
    workers.expect(pid, "done", timeout=60)
    s3_proxy.down()
    down_at = time.time()
    before = workers.poll(pid)
    assert not any(s == "finished" for s in before), "the sequence finished before the outage"
    while time.time() < down_at + OUTAGE_S:  # a writer that gives up during the outage fails the test now
        news = workers.poll(pid)
        before += news
        failed = [s for s in news if s.startswith("error")]
        assert not failed, f"the sequence failed during the outage: {failed}\n{workers.stderr_tail()}"
        time.sleep(0.2)
    s3_proxy.up()
    up_at = time.time()
    workers.expect(pid, "finished", timeout=180, allow=("done",))
    assert workers.reap(pid) == 0
    steps = {int(s.split()[1]): float(s.split()[2]) for s in workers.said[pid] if s.startswith("done ")}
    assert sorted(steps) == list(range(OUTAGE_OPS))
    assert any(t >= up_at for t in steps.values()), "no step finished after the outage"
    assert sum(t < down_at for t in steps.values()) >= 3

    # everything the sequence wrote is there, read through the endpoint directly
    part = direct._part(PART)
    records = _records(direct, part)
    assert not _missing_files(direct, part, records)
    want = {
        **base_columns(),
        **{k: v for j in range(OUTAGE_OPS) if j % 5 not in (2, 4) for k, v in outage_columns(j).items()},
    }
    assert not _mismatches(direct.read(base, list(want), layout="jagged"), want)
    assert sum(r["task_name"].startswith("outage-put-") for r in records) == OUTAGE_OPS // 5


def test_is_transient_on_real_errors(s3_server, s3_proxy, tmp_path, monkeypatch):
    """``is_transient`` on the errors an unreachable endpoint really raises (refused, reset at connect, reset
    mid-request; through s3fs and through ``DataPlane.put``), and on permanent ones."""
    import s3fs

    # no retries inside botocore or s3fs: each call fails at once
    fast = {
        "endpoint_url": s3_proxy.url,
        "config_kwargs": {"connect_timeout": 1, "read_timeout": 5, "retries": {"total_max_attempts": 1}},
    }
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **fast)
    fs.retries = 1
    fs.pipe_file("grpoflow/transient/a", b"a")

    def fail(fn: Any) -> BaseException:
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            retry_transient(fn, what="test", deadline_s=0)
        assert time.monotonic() - t0 < 20
        return info.value

    outages = {
        "down": s3_proxy.down,
        "reset on accept": s3_proxy.resetting,
        "reset mid-request": lambda: s3_proxy.resetting(on_request=True),
    }
    for state, enter in outages.items():
        enter()
        for what, fn in (
            ("write", lambda: fs.pipe_file("grpoflow/transient/b", b"b")),
            ("read", lambda: fs.cat_file("grpoflow/transient/a")),
        ):
            err = fail(fn)
            assert is_transient(err), f"{state}, {what}: {type(err).__name__}: {err} is not transient"
        s3_proxy.up()
    assert fs.cat_file("grpoflow/transient/a") == b"a"

    # the same through the client, with the retry deadline at 0
    for module in (errors, sys.modules["dataplane.client"]):
        monkeypatch.setattr(module, "RETRY_DEADLINE_S", 0.0, raising=False)
    monkeypatch.setenv("GRPOFLOW_IO_RETRY_S", "0")
    dp = DataPlane("s3://grpoflow/transient-dp", RUN, storage_options=fast)
    dp.fs.retries = 1
    dp.register_partition(PART, fields=BASE)
    s3_proxy.down()
    err = fail(lambda: dp.put(PART, base_columns(), group_size=GROUP))
    assert is_transient(err), f"DataPlane.put with the endpoint down: {type(err).__name__}: {err} is not transient"
    s3_proxy.up()

    # permanent: a corrupt Parquet file (local and S3), missing files, denied access, integrity, bad arguments
    bad = tmp_path / "corrupt.parquet"
    bad.write_bytes(b"not a parquet file")
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": list(range(1000))}), sink)
    blob = sink.getvalue().to_pybytes()
    fs.pipe_file("grpoflow/transient/corrupt.parquet", blob[: len(blob) // 2])  # cut short: no footer
    permanent = {
        "corrupt local Parquet": lambda: pq.read_table(bad),
        "truncated Parquet on S3": lambda: pq.read_table(
            pa.BufferReader(fs.cat_file("grpoflow/transient/corrupt.parquet"))
        ),
        "missing S3 object": lambda: fs.cat_file("grpoflow/transient/missing"),
        "missing local file": lambda: open(tmp_path / "missing", "rb"),  # noqa: SIM115
        "denied": lambda: _raise(PermissionError(errno.EACCES, "Permission denied", str(tmp_path))),
        "integrity": lambda: _raise(IntegrityError("data file x fails its checksum")),
        "value": lambda: int("not a number"),
    }
    for what, fn in permanent.items():
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            retry_transient(fn, what="test", deadline_s=2.0)  # a permanent error is raised at once, never retried
        assert time.monotonic() - t0 < 0.45, f"{what}: retried"
        assert not is_transient(info.value), f"{what}: {type(info.value).__name__}: {info.value} is transient"
    assert isinstance(_raised(permanent["corrupt local Parquet"]), pa.ArrowInvalid)
    assert isinstance(_raised(permanent["missing S3 object"]), FileNotFoundError)

    # the outermost error of known meaning decides: a missing file is permanent even with a reset in its chain
    try:
        try:
            raise ConnectionResetError(errno.ECONNRESET, "reset")
        except ConnectionResetError as inner:
            raise FileNotFoundError(errno.ENOENT, "gone") from inner
    except FileNotFoundError as err:
        assert not is_transient(err)


def _raise(err: BaseException) -> None:
    raise err


def _raised(fn: Any) -> BaseException:
    try:
        fn()
    except Exception as err:  # noqa: BLE001
        return err
    raise AssertionError("did not raise")


def test_tcp_proxy_refuses_and_resets_while_down():
    """The proxy the outage tests rely on: while down, connects are refused and open connections are reset; up
    again, on the same port; ``resetting()`` resets connections at accept or at the first request bytes."""

    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the proxy resets its upstream connections too
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def serve() -> None:
        server.settimeout(0.05)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = server.accept()
                threading.Thread(target=echo, args=(conn,), daemon=True).start()

    server_thread = threading.Thread(target=serve, daemon=True)
    server_thread.start()

    def roundtrip(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(b"ping")
            return c.recv(16)

    try:
        with TcpProxy(server.getsockname(), seed=1) as proxy:
            port = proxy.port
            assert roundtrip(port) == b"ping"
            held = socket.create_connection(("127.0.0.1", port), timeout=5)
            held.sendall(b"a")
            assert held.recv(16) == b"a"
            proxy.down()
            with pytest.raises((ConnectionResetError, BrokenPipeError)):  # the open connection: reset, not closed
                held.sendall(b"b")
                got = held.recv(16)
                pytest.fail(f"read {got!r} from a connection the proxy should have reset")
            held.close()
            with pytest.raises(ConnectionRefusedError):
                roundtrip(port)
            proxy.up()
            assert proxy.port == port and roundtrip(port) == b"ping"
            for on_request in (False, True):
                proxy.resetting(on_request=on_request)
                with pytest.raises((ConnectionResetError, BrokenPipeError)):
                    got = roundtrip(port)  # b"" would be a clean close: not a reset either
                    pytest.fail(f"read {got!r} instead of a reset (on_request={on_request})")
            proxy.up()
            assert roundtrip(port) == b"ping"
    finally:
        stop.set()
        server_thread.join()
        server.close()


def test_a_read_retries_a_connection_refused_mid_batch(s3_server, s3_proxy, monkeypatch):
    """A data-plane read on S3 fetches its files with ``fs.cat(..., on_error="return")``, which hands back each
    file's error instead of raising it; a refused connection there is retried like any other transient error
    (it does not escape the retry and fail the task, as it would if the 30 s outage of ``test_outage.py`` began
    during a read)."""

    fast = {
        "endpoint_url": s3_proxy.url,
        "config_kwargs": {"connect_timeout": 1, "read_timeout": 5, "retries": {"total_max_attempts": 1}},
    }
    dp = DataPlane(f"s3://grpoflow/mid-batch-{random.randrange(1 << 30)}", RUN, storage_options=fast)
    dp.fs.retries = 1
    dp.register_partition(PART, fields=BASE)
    meta = dp.put(PART, base_columns(), group_size=GROUP)
    expected = base_columns()["b_val"]
    waits: list[float] = []
    pause = time.sleep
    monkeypatch.setattr(dataplane.errors.time, "sleep", lambda s: (waits.append(s), pause(0.05)))
    real, calls = dp.fs.cat, []

    def cat_in_an_outage(*args: Any, **kwargs: Any) -> Any:  # the endpoint goes down for 1 s as the batch starts
        if kwargs.get("on_error") == "return" and not calls:  # the batch of data files (records are read raising)
            s3_proxy.down()
            threading.Timer(1.0, s3_proxy.up).start()
        if kwargs.get("on_error") == "return":
            calls.append(kwargs.get("on_error"))
        return real(*args, **kwargs)

    monkeypatch.setattr(dp.fs, "cat", cat_in_an_outage)
    got = dp.read(meta, ["b_val"], layout="jagged")["b_val"]
    assert len(calls) > 1 and waits, "the read did not meet the outage in its batch fetch"
    assert torch.equal(got.values(), expected.values())
