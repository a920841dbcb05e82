"""Every interleaving of one delta write and one garbage collection, forced step by step: no schedule may end with the
write returned and its data file gone ("... which is missing; the write is lost" on every later read).

The collection runs with ``grace_s=0``: the writer's data file counts as old enough to remove as soon as it is listed,
as it would on a store with a skewed clock or beside a writer paused between its deadline check and its commit. The
two parties run in two threads; each stops at a gate before each of its steps until a schedule (one of all the merges
of the two step sequences) lets it on, so a step runs while the other party waits at a gate:

- the writer (``DataPlane.write_columns``): ``U`` upload its data file, ``D`` check its commit deadline, ``C`` write
  its commit record, then its one listing of its file's stem (``dataplane.gc.file_state``) as two steps, ``K`` see
  the claims on the file and ``F`` see the file, ``R`` return;
- the collection (``DataPlane.collect_garbage``): ``l`` list the run, ``r`` read the commit records, ``c`` claim the
  files it means to remove, ``e`` read the commit records again, ``d`` remove the files still unnamed, ``x`` withdraw
  its claims on the files it kept, mark those on the files it removed.

The listing's two steps run in both orders (``UDCKFR`` and ``UDCFKR``: 924 schedules each), since a listing need not
see the names it returns at one instant nor in any order. A step that a party skips in a schedule (the collection has
nothing to claim when the commit was read first) drops out of it. What
a party does between two gates (the writer's repair: a copy committed under a new name, or the file uploaded again,
and its second check) runs whole while the other waits.
"""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace

import pytest
import torch

from dataplane import client, gc
from dataplane.client import DataPlane

PART = "step_000001"
WRITERS = {"claims_first": ("U", "D", "C", "K", "F", "R"), "file_first": ("U", "D", "C", "F", "K", "R")}
COLLECTOR = ("l", "r", "c", "e", "d", "x")


def _merges(writer: tuple[str, ...]) -> list[str]:
    """Every merge of ``writer``'s steps with the collection's, each party's steps in their order."""
    n = len(writer) + len(COLLECTOR)
    return [
        "".join(writer[mine.index(i)] if i in mine else COLLECTOR[i - sum(j < i for j in mine)] for i in range(n))
        for mine in itertools.combinations(range(n), len(writer))
    ]


SCHEDULES = [(listing, order) for listing, writer in WRITERS.items() for order in _merges(writer)]
GATE_TIMEOUT_S = 30.0  # a party waiting longer than this at a gate means the schedule is stuck (a bug in the test)


class Schedule:
    """Lets the two parties' steps run one at a time, in the order of ``order`` (one letter per step, see the module
    docstring; the writer's letters are upper case)."""

    def __init__(self, order: str, writer: tuple[str, ...]) -> None:
        self.order = list(order)
        self.writer = writer
        self.running: dict[str, str | None] = {"writer": None, "collector": None}
        self.seen: dict[str, set[str]] = {"writer": set(), "collector": set()}
        self.cond = threading.Condition()

    def steps(self, party: str) -> tuple[str, ...]:
        return self.writer if party == "writer" else COLLECTOR

    def _finish_step(self, party: str) -> None:
        step = self.running[party]
        if step is not None:
            assert self.order[0] == step, (party, step, self.order)
            self.order.pop(0)
            self.running[party] = None

    def gate(self, party: str, step: str) -> None:
        """Wait until ``step`` of ``party`` is next (only its first time: a repeat runs within the current step)."""
        if step in self.seen[party]:
            return
        self.seen[party].add(step)
        steps = self.steps(party)
        with self.cond:
            self._finish_step(party)
            skipped = set(steps[: steps.index(step)]) - self.seen[party]  # steps this party did not take
            self.order = [s for s in self.order if s not in skipped]
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: self.order[0] == step, timeout=GATE_TIMEOUT_S):
                raise AssertionError(f"{party} stuck before {step}: schedule left {''.join(self.order)}")
            self.running[party] = step

    def finish(self, party: str) -> None:
        """``party`` is done: its remaining steps drop out of the schedule."""
        with self.cond:
            self._finish_step(party)
            mine = set(self.steps(party))
            self.order = [s for s in self.order if s not in mine]
            self.cond.notify_all()


def _party() -> str:
    return threading.current_thread().name


def _is_claim(path: str) -> bool:
    return "/data/" in path and gc.CLAIM_MARK in path.rsplit("/", 1)[-1]


def _install_gates(monkeypatch, fs, schedule: Schedule) -> None:
    """Gates before each step of the writer and the collection, told apart by their threads' names."""
    real_pipe, real_rm, real_find = fs.pipe_file, fs.rm, fs.find

    def pipe_file(path, value, *args, **kwargs):
        if _party() == "writer" and "/data/" in path and path.endswith(gc.DATA_SUFFIX):
            schedule.gate("writer", "U")
        elif _party() == "collector" and _is_claim(path):
            schedule.gate("collector", "x" if value == gc.REMOVED else "c")
        return real_pipe(path, value, *args, **kwargs)

    def rm(path, *args, **kwargs):
        if _party() == "collector" and "/data/" in path and path.endswith(gc.DATA_SUFFIX):
            schedule.gate("collector", "d")
        elif _party() == "collector" and _is_claim(path):
            schedule.gate("collector", "x")
        return real_rm(path, *args, **kwargs)

    def find(path, *args, **kwargs):
        if _party() == "collector" and kwargs.get("withdirs"):
            schedule.gate("collector", "l")
        if not (_party() == "writer" and kwargs.get("prefix")):  # not the writer's check: the partition's listing
            return real_find(path, *args, **kwargs)
        seen = {}  # the check's listing, as its two steps: what it returns of each kind, seen at the step's turn
        for step in (s for s in schedule.writer if s in "KF"):
            schedule.gate("writer", step)
            seen[step] = {p: i for p, i in real_find(path, *args, **kwargs).items() if _is_claim(p) == (step == "K")}
        return {**seen["K"], **seen["F"]}

    monkeypatch.setattr(fs, "pipe_file", pipe_file)
    monkeypatch.setattr(fs, "rm", rm)
    monkeypatch.setattr(fs, "find", find)

    real_put_atomic, real_snapshot = DataPlane._put_atomic, DataPlane._snapshot

    def put_atomic(self, path, payload):
        if _party() == "writer" and "/_commits/" in path:
            schedule.gate("writer", "C")
        return real_put_atomic(self, path, payload)

    reads = []

    def snapshot(self, part, partition_id, **kwargs):
        if _party() == "collector":
            reads.append(part)
            schedule.gate("collector", "r" if len(reads) == 1 else "e")
        return real_snapshot(self, part, partition_id, **kwargs)

    monkeypatch.setattr(DataPlane, "_put_atomic", put_atomic)
    monkeypatch.setattr(DataPlane, "_snapshot", snapshot)

    calls = []

    def monotonic():  # the writer's second reading of its clock is its deadline check
        if _party() == "writer":
            calls.append(None)
            if len(calls) == 2:
                schedule.gate("writer", "D")
        return real_monotonic()

    real_monotonic = client.time.monotonic
    monkeypatch.setattr(client, "time", SimpleNamespace(monotonic=monotonic))


def test_the_schedules_are_every_merge():
    """C(12, 6) merges of the writer's 6 steps with the collection's 6, for each order of the listing's two steps."""
    assert {listing: sum(s == listing for s, _ in SCHEDULES) for listing in WRITERS} == {
        "claims_first": 924,
        "file_first": 924,
    }
    assert len(set(SCHEDULES)) == len(SCHEDULES)
    assert all(sorted(order) == sorted(WRITERS[listing] + COLLECTOR) for listing, order in SCHEDULES)


@pytest.mark.parametrize(("listing", "order"), SCHEDULES)
def test_no_interleaving_loses_a_write_that_returned(tmp_path, monkeypatch, listing, order):
    root = str(tmp_path / "dp")
    dp = DataPlane(root, "run-interleave")
    dp.register_partition(PART, fields={"a": "float32", "b": "float32"})
    meta = dp.put(PART, {"a": torch.tensor([1.0, 2.0, 3.0, 4.0])}, group_size=2)
    values = torch.tensor([0.5, -1.5, 2.5, -3.5])
    collector = DataPlane(root, "run-interleave")
    schedule = Schedule(order, WRITERS[listing])
    _install_gates(monkeypatch, dp.fs, schedule)
    outcome: dict[str, object] = {}

    def write() -> None:
        try:
            outcome["meta"] = dp.write_columns(meta, {"b": values})
            schedule.gate("writer", "R")
        except Exception as err:  # noqa: BLE001  (asserted on by the main thread)
            outcome["writer"] = err
        finally:
            schedule.finish("writer")

    def collect() -> None:
        try:
            outcome["collected"] = collector.collect_garbage(grace_s=0)
        except Exception as err:  # noqa: BLE001  (asserted on by the main thread)
            outcome["collector"] = err
        finally:
            schedule.finish("collector")

    threads = [threading.Thread(target=write, name="writer"), threading.Thread(target=collect, name="collector")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * GATE_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), f"{order}: stuck"
    monkeypatch.undo()
    assert "writer" not in outcome and "collector" not in outcome, f"{order}: {outcome}"

    # the write returned: it reads back, through a new client; every commit names a file that is there
    reader = DataPlane(root, "run-interleave")
    out = reader.read(outcome["meta"], ["a", "b"])  # IntegrityError "... which is missing; the write is lost"
    assert out["b"].tolist() == values.tolist() and out["a"].tolist() == [1.0, 2.0, 3.0, 4.0], order
    part = reader._part(PART)
    assert all(reader.fs.exists(f"{part}/{c['file']}") for c in reader._commits(part)), order
    # the claims left are the marks of the removals: no writer of a file commits a copy for nothing
    claims = {p: i["size"] for p, i in reader.fs.find(f"{part}/data", detail=True).items() if _is_claim(p)}
    assert all(size == len(gc.REMOVED) for size in claims.values()), (order, claims)
    assert len(claims) == outcome["collected"]["orphan_data_files"], (order, claims, outcome["collected"])
    # what the collection took is what the writer no longer names: at most the one file of the write's first upload
    assert outcome["collected"]["orphan_data_files"] <= 1, (order, outcome["collected"])
