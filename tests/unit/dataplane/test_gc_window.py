"""Garbage collection beside writers in flight: `DataPlane.collect_garbage` run between a writer's data-file upload and
its commit must not take the uploaded file for an orphan and leave a write that returned success unreadable ("the
write is lost"). On a local folder and on a real S3 server on loopback (moto), each test:

1. ``test_collection_between_upload_and_commit_keeps_the_write``: a collection forced into that window, 12 times per
   store and setting (6 puts, 6 delta writes), with the default grace period (nothing young is removed) and with
   ``grace_s=0`` (the file is removed, its claim marked so; the writer finds the mark after its commit and uploads
   the file again).
2. ``test_a_writer_paused_past_the_commit_deadline_does_not_commit``: a writer that reaches its commit too late
   raises a transient ``TimeoutError`` and commits nothing.
3. ``test_a_write_whose_file_stays_gone_raises``: a data file removed after each upload: the writer raises
   ``IntegrityError`` instead of returning.
4. ``test_a_partition_cleared_during_a_collection``: a train task clears its step while a collection reads it.
5. ``test_writers_beside_a_collector_in_a_loop``: 200 writes (puts, delta writes, rewrites, files of "killed" writers)
   from 2 threads while a third collects garbage in a loop, on a compressed time scale (a grace period of seconds,
   the commit deadline 3 s under it); every write that returned reads back exactly, every commit names a file that is
   there, and the collector removed orphans while the writers ran.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from dataplane import client, gc
from dataplane import fields as F
from dataplane.client import DataPlane, IntegrityError
from dataplane.codec import nested_from_values
from dataplane.errors import is_transient

PART = "step_000001"
LENGTHS = [3, 5, 4, 6]
WINDOW_TRIALS = 6  # per write kind, store and grace setting
STRESS_WRITES = 200  # writes of the stress loop per store (2 writer threads)
STRESS_FIELDS = 20  # per partition
PER_PARTITION = 20  # writes of one thread in one partition (a step's) before it moves to the next
MARGIN_S = 3.0  # s: grace period less commit deadline (and S3's rounding of times) in the stress loop
SCHEMA = {
    F.INPUT_IDS: "int64",
    F.INPUT_LENGTHS: "int64",
    F.REWARDS: "float32",
    F.PREV_LOGPROBS: "float32",
    **{f"f{j:03d}": "float32" for j in range(STRESS_FIELDS)},
}


def _rows(seed: int, n: int = len(LENGTHS)) -> dict[str, torch.Tensor]:
    lens = torch.tensor((LENGTHS * n)[:n], dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    return {
        F.INPUT_IDS: nested_from_values(torch.randint(0, 1000, (int(lens.sum()),), generator=g), lens),
        F.INPUT_LENGTHS: lens,
        F.REWARDS: torch.rand(n, generator=g),
    }


def _logprobs(seed: int, lens: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + seed)
    return nested_from_values(-torch.rand(sum(lens), generator=g), torch.tensor(lens))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if b.is_nested:
        return a.is_nested and torch.equal(a.offsets(), b.offsets()) and torch.equal(a.values(), b.values())
    return torch.equal(a, b)


def _dangling(dp: DataPlane, partition: str) -> list[str]:
    """Files that commit records of ``partition`` name and that are not there."""
    part = dp._part(partition)
    return [c["file"] for c in dp._commits(part) if not dp.fs.exists(f"{part}/{c['file']}")]


@pytest.fixture
def dp(store):
    root, options = store
    plane = DataPlane(root, "run-gc", storage_options=options)
    plane.register_partition(PART, fields=SCHEMA)
    return plane


def _collect_before_commits(monkeypatch, collector: DataPlane, **kwargs) -> list[dict[str, int]]:
    """Run ``collector.collect_garbage(**kwargs)`` before every commit record is written (after the write's data
    file is uploaded); returns the list its results go to."""
    results: list[dict[str, int]] = []
    real = DataPlane._put_atomic

    def put_atomic(self, path, payload):
        if "/_commits/" in path:
            results.append(collector.collect_garbage(**kwargs))
        real(self, path, payload)

    monkeypatch.setattr(DataPlane, "_put_atomic", put_atomic)
    return results


@pytest.mark.parametrize("grace", ["default", "zero"])
def test_collection_between_upload_and_commit_keeps_the_write(dp, store, monkeypatch, grace):
    root, options = store
    collector = DataPlane(root, "run-gc", storage_options=options)  # another process's client, as in finish_run
    kwargs = {} if grace == "default" else {"grace_s": 0}
    results = _collect_before_commits(monkeypatch, collector, **kwargs)
    for trial in range(WINDOW_TRIALS):
        cols = _rows(trial)
        meta = dp.put(PART, cols, group_size=2, id_key=f"window-{trial}")  # collected between its upload and commit
        lp = _logprobs(trial, LENGTHS)
        meta = dp.write_columns(meta, {F.PREV_LOGPROBS: lp})  # and this one
        out = DataPlane(root, "run-gc", storage_options=options).read(
            meta, [F.INPUT_IDS, F.REWARDS, F.PREV_LOGPROBS], layout="jagged"
        )
        assert _same(out[F.INPUT_IDS], cols[F.INPUT_IDS]) and _same(out[F.REWARDS], cols[F.REWARDS]), f"trial {trial}"
        assert _same(out[F.PREV_LOGPROBS], lp), f"trial {trial}"
        assert not _dangling(dp, PART), f"trial {trial}: commit records name missing files"
    assert len(results) == 2 * WINDOW_TRIALS  # the collector really ran in every window
    removed = sum(r["orphan_data_files"] for r in results)
    if grace == "default":
        assert removed == 0  # a file younger than the grace period is never an orphan
    else:
        assert removed == 2 * WINDOW_TRIALS  # it took each in-flight file, and the writer put it back
        # each removed file's claim stays beside it, marked (dataplane.gc); the file is there again, under its name
        data = dp.fs.find(f"{dp._part(PART)}/data", detail=True)
        marked = {p.rsplit(gc.CLAIM_MARK, 1)[0] + gc.DATA_SUFFIX for p, i in data.items() if gc.CLAIM_MARK in p}
        assert len(marked) == removed and marked <= set(data)
        assert all(i["size"] == len(gc.REMOVED) for p, i in data.items() if gc.CLAIM_MARK in p)


def test_a_writer_paused_past_the_commit_deadline_does_not_commit(dp, monkeypatch):
    meta = dp.put(PART, _rows(0), group_size=2)
    monkeypatch.setattr(client, "COMMIT_DEADLINE_S", 0.2)
    real = DataPlane._put_atomic

    def put_atomic(self, path, payload):
        if "/_commits/" in path:
            raise AssertionError("a writer past its deadline wrote its commit record")
        real(self, path, payload)

    real_pipe = dp.fs.pipe_file

    def pipe_file(path, *args, **kwargs):
        real_pipe(path, *args, **kwargs)
        if "/data/" in path:
            time.sleep(0.3)  # the writer is paused (or starved) between its upload and its commit

    monkeypatch.setattr(DataPlane, "_put_atomic", put_atomic)
    monkeypatch.setattr(dp.fs, "pipe_file", pipe_file)
    commits = len(dp._commits(dp._part(PART)))
    with pytest.raises(TimeoutError, match="COMMIT_DEADLINE_S") as err:
        dp.write_columns(meta, {F.PREV_LOGPROBS: _logprobs(0, LENGTHS)})
    assert is_transient(err.value)  # Flyte retries the task; the retry uploads afresh
    assert len(dp._commits(dp._part(PART))) == commits
    monkeypatch.undo()
    with pytest.raises(client.DataPlaneError, match="never written"):
        dp.read(meta, [F.PREV_LOGPROBS])
    assert dp.collect_garbage(grace_s=0) == {"orphan_data_files": 1, "temp_files": 0}  # its file: an orphan


def test_a_write_whose_file_stays_gone_raises(dp, monkeypatch):
    """A data file removed after each of its uploads (a collector with too short a grace period, twice): the writer
    must not return it as written."""
    meta = dp.put(PART, _rows(0), group_size=2)
    real_pipe = dp.fs.pipe_file
    uploads = []

    def pipe_file(path, *args, **kwargs):
        real_pipe(path, *args, **kwargs)
        if "/data/" in path:
            uploads.append(path)
            dp.fs.rm(path)

    monkeypatch.setattr(dp.fs, "pipe_file", pipe_file)
    with pytest.raises(IntegrityError, match="removed after the upload, twice.*the write is lost"):
        dp.write_columns(meta, {F.PREV_LOGPROBS: _logprobs(0, LENGTHS)})
    assert len(uploads) == 2 and uploads[0] == uploads[1]


def test_a_partition_cleared_during_a_collection(dp, store, monkeypatch):
    """A train task clears its step while a collection runs: the collection skips the partition, and still takes
    the old orphans of the others."""
    root, options = store
    meta = dp.put(PART, _rows(0), group_size=2)
    dp.register_partition("step_000002", fields=SCHEMA)
    dp.put("step_000002", _rows(1), group_size=2)
    stray = f"{dp._part(PART)}/data/{'0' * 32}-deadbeef.parquet"
    dp.fs.pipe_file(stray, b"a killed writer's file")
    real = DataPlane._snapshot

    def snapshot(self, part, partition_id, **kwargs):
        if partition_id == "step_000002":
            dp.clear("step_000002")  # between the collection's listing and its reading of the commit records
        return real(self, part, partition_id, **kwargs)

    monkeypatch.setattr(DataPlane, "_snapshot", snapshot)
    assert DataPlane(root, "run-gc", storage_options=options).collect_garbage(grace_s=0) == {
        "orphan_data_files": 1,
        "temp_files": 0,
    }
    monkeypatch.undo()
    assert not dp.fs.exists(stray) and not dp.fs.exists(f"{dp._part('step_000002')}/_schema.json")
    assert dp.read(meta, [F.INPUT_LENGTHS])[F.INPUT_LENGTHS].tolist() == LENGTHS


def test_writers_beside_a_collector_in_a_loop(dp, store, monkeypatch):
    """``STRESS_WRITES`` writes from 2 threads, paced over two grace periods, while a third thread runs
    ``collect_garbage(grace_s=grace)`` in a loop. Time is compressed: the grace period is seconds and the commit
    deadline under it (as ``GC_GRACE_S`` = 1 h is over ``COMMIT_DEADLINE_S`` = 10 min).

    The guarantee holds as long as a writer that passed its deadline check has its commit record written within
    ``grace - deadline`` (less 1 s on S3, whose modification times are whole seconds); in production that margin is
    50 minutes. Here it is ``MARGIN_S`` = 3 s, so that a writer thread starved for a second or two on a loaded machine
    (CPU shared with other processes, the GIL with the collector and, on S3, the server) still commits in time: the
    test checks the collector against the writers, not the machine's scheduling. A write that misses the
    (compressed) deadline raises ``TimeoutError`` and is retried, as Flyte would retry its task."""
    root, options = store
    s3 = root.startswith("s3://")
    deadline = 1.5 if s3 else 1.0
    grace = deadline + MARGIN_S + (1.0 if s3 else 0.0)  # 5.5 s on S3, 4 s on a local folder
    monkeypatch.setattr(client, "COMMIT_DEADLINE_S", deadline)
    pace = 2 * grace / (STRESS_WRITES / 2)  # s between the starts of one thread's writes
    rest = 1.0 if s3 else 0.0  # s between two collections
    parts: set[str] = set()
    done = threading.Event()
    passes: list[tuple[bool, dict[str, int]]] = []  # (writers still running, result)
    errors: list[str] = []
    expected: dict[tuple[str, str], tuple[object, torch.Tensor]] = {}  # (partition, field) -> (meta, values)
    counts = [dict.fromkeys(("strays", "puts", "deltas", "rewrites", "timeouts"), 0) for _ in range(2)]  # per writer
    lock = threading.Lock()

    def collector() -> None:
        gc = DataPlane(root, "run-gc", storage_options=options)
        try:
            while not done.is_set():
                passes.append((True, gc.collect_garbage(grace_s=grace)))
                done.wait(rest)  # on S3 a pass is ~300 requests to a server in this process: leave the writers some
        except Exception as err:  # noqa: BLE001  (reported by the main thread)
            errors.append(f"collector: {type(err).__name__}: {err}")

    def with_retries(fn):
        for _ in range(20):
            try:
                return fn()
            except TimeoutError:  # past the (compressed) commit deadline: Flyte would retry the task
                counts[int(threading.current_thread().name[-1])]["timeouts"] += 1
        raise AssertionError("20 writes in a row missed the commit deadline")

    def writer(index: int) -> None:
        w = DataPlane(root, "run-gc", storage_options=options)
        mine: dict[tuple[str, str], tuple[object, torch.Tensor]] = {}  # what this thread wrote last, by field or put
        metas: list = []
        fresh = 0
        t0 = time.monotonic()
        try:
            for k in range(STRESS_WRITES // 2):
                time.sleep(max(0.0, t0 + k * pace - time.monotonic()))
                i = 2 * k + index  # this write's number, over both threads
                part = f"stress_{index}_{k // PER_PARTITION}"  # a step's partition, then the next step's
                if k % PER_PARTITION == 0:
                    w.register_partition(part, fields=SCHEMA)
                    metas = [with_retries(lambda part=part: w.put(part, _rows(index), group_size=2, id_key="base"))]
                if k % 7 == 3:  # a writer killed after its upload: a file no commit will ever name
                    w.fs.pipe_file(
                        f"{w._part(part)}/data/{uuid.uuid4().hex}-{uuid.uuid4().hex[:8]}.parquet", b"half a file"
                    )
                    counts[index]["strays"] += 1
                    continue
                if k % 11 == 5:  # new rows
                    cols = _rows(1000 + i)
                    meta = with_retries(
                        lambda part=part, cols=cols, i=i: w.put(part, cols, group_size=2, id_key=f"put-{i}")
                    )
                    metas.append(meta)
                    got = w.read(meta, [F.INPUT_IDS], layout="jagged")[F.INPUT_IDS]
                    assert _same(got, cols[F.INPUT_IDS]), f"put {i} read back other rows"
                    mine[(part, f"put-{i}")] = (meta, cols[F.INPUT_IDS])
                    counts[index]["puts"] += 1
                    continue
                fields = sorted(n for p, n in mine if p == part and not n.startswith("put-"))
                if k % 5 == 4 and fields:  # a retry of an earlier write (other values): its old file becomes an orphan
                    name = fields[k % len(fields)]
                    meta = mine[(part, name)][0]  # the same rows as the write it redoes
                    kind = "rewrites"
                else:  # a new field, for the rows of one of the partition's puts
                    name, meta, kind = f"f{fresh % STRESS_FIELDS:03d}", metas[k % len(metas)], "deltas"
                    fresh += 1
                values = _logprobs(i, LENGTHS)
                with_retries(lambda meta=meta, name=name, values=values: w.write_columns(meta, {name: values}))
                got = w.read(meta, [name], layout="jagged")[name]
                assert _same(got, values), f"write {i} ({name}) read back other values"
                mine[(part, name)] = (meta, values)
                counts[index][kind] += 1
        except Exception as err:  # noqa: BLE001  (reported by the main thread)
            errors.append(f"writer {index}: {type(err).__name__}: {err}")
        with lock:
            expected.update(mine)
            parts.update(p for p, _ in mine)

    gc_thread = threading.Thread(target=collector, name="collector")
    gc_thread.start()
    writers = [threading.Thread(target=writer, args=(i,), name=f"writer-{i}") for i in range(2)]
    for t in writers:
        t.start()
    started = time.monotonic()
    for t in writers:
        t.join(timeout=600)
    writing_s = time.monotonic() - started
    during = len(passes)
    done.set()
    gc_thread.join(timeout=120)
    assert not errors, errors
    total = {key: counts[0][key] + counts[1][key] for key in counts[0]}
    assert sum(v for key, v in total.items() if key != "timeouts") == STRESS_WRITES, total
    removed_during = sum(r["orphan_data_files"] for _, r in passes[:during])
    assert during >= 3 and removed_during > 0, (
        f"the collector ran {during} passes, removed {removed_during} files beside the writers"
    )

    # later: every write that returned reads back exactly, through a new client; every commit names a file that is there
    time.sleep(grace + (1.5 if s3 else 0.2))
    final = DataPlane(root, "run-gc", storage_options=options)
    final.collect_garbage(grace_s=grace)
    assert len(parts) == STRESS_WRITES // PER_PARTITION, sorted(parts)
    for p in sorted(parts):
        assert not _dangling(final, p), f"{p}: commit records name missing files"
        named = {f"{final._part(p)}/{c['file']}" for c in final._commits(final._part(p))}
        on_disk = set(final.fs.glob(f"{final._part(p)}/data/*.parquet"))
        assert on_disk == {final.fs._strip_protocol(x) for x in named}, (
            f"{p}: orphans older than the grace period remain"
        )
    by_rows: dict[tuple[str, tuple[str, ...]], list[tuple[str, object, torch.Tensor]]] = {}  # one read per rows
    for (p, name), (meta, values) in sorted(expected.items(), key=lambda kv: kv[0]):
        field = F.INPUT_IDS if name.startswith("put-") else name
        by_rows.setdefault((p, tuple(meta.sample_ids)), []).append((field, meta, values))
    for (p, _), group in by_rows.items():
        got = final.read(group[0][1], [field for field, _, _ in group], layout="jagged")
        bad = [field for field, _, values in group if not _same(got[field], values)]
        assert not bad, f"{p}: fields {bad} lost or changed"
    print(
        f"\n{'s3' if s3 else 'local'}: {STRESS_WRITES} writes {total}; {len(passes)} collections ({during} beside the "
        f"writers, removing {removed_during} orphans then, in {writing_s:.1f} s); {len(expected)} writes checked at "
        "the end"
    )
