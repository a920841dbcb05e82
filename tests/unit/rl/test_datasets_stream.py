"""The training order over a prepared copy: seeded and deterministic, each epoch a permutation of the rows, positions
spanning epochs, and only the row groups holding the rows asked for read (counted)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

import rl.datasets.stream as stream_module
from rl.datasets import ColumnKeys, DatasetError, PromptStream, first_rows, prepare_split

KEYS = ColumnKeys(prompt_key="prompt", answer_key="answer", task_key="env")
N = 5000


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """A prepared copy of N rows (5 row groups: 4 x 1024 + 904); row i: prompt ``Q{i}``, answer ``i``."""
    root = tmp_path_factory.mktemp("stream")
    source = root / "a.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"Q{i}", "answer": i, "env": "math"}) + "\n" for i in range(N)))
    return prepare_split(
        str(source), out_url=str(root / "out"), split="train", keys=KEYS, storage_options={}, keep="all"
    )


@pytest.fixture
def reads(monkeypatch):
    """Indices of the row groups read from storage, with the per-process caches emptied first."""
    stream_module._GROUPS.clear()
    stream_module._METADATA.clear()
    seen: list[int] = []
    real = pq.ParquetFile.read_row_group

    def read_row_group(self, i, *args, **kwargs):
        seen.append(i)
        return real(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", read_row_group)
    return seen


def test_positions_follow_seeded_permutations(split):
    stream = PromptStream(split, seed=11, keys=KEYS, storage_options={})
    assert stream.num_rows == N
    for epoch in range(3):
        rows = stream.rows(epoch * N, N)
        assert np.array_equal(rows, np.random.default_rng([11, epoch]).permutation(N))
        assert sorted(rows.tolist()) == list(range(N))  # every row exactly once per epoch
    assert not np.array_equal(stream.rows(0, N), stream.rows(N, N))  # epochs differ
    assert [stream.epoch(p) for p in (0, N - 1, N, 3 * N + 7)] == [0, 0, 1, 3]


def test_the_same_seed_gives_the_same_problems(split):
    a = PromptStream(split, seed=5, keys=KEYS, storage_options={}).problems(100, 64)
    b = PromptStream(split, seed=5, keys=KEYS, storage_options={}).problems(100, 64)
    c = PromptStream(split, seed=6, keys=KEYS, storage_options={}).problems(100, 64)
    assert a == b and [p.row_id for p in a] != [p.row_id for p in c]
    for p in a:
        i = int(p.row_id.removeprefix("train:"))
        assert (p.question, p.answer, p.entry, p.task) == (f"Q{i}", str(i), {"answer": i, "env": "math"}, "math")


def test_a_call_spans_an_epoch_boundary(split):
    stream = PromptStream(split, seed=2, keys=KEYS, storage_options={})
    problems = stream.problems(N - 3, 6)
    want = list(np.random.default_rng([2, 0]).permutation(N)[-3:]) + list(
        np.random.default_rng([2, 1]).permutation(N)[:3]
    )
    assert [p.row_id for p in problems] == [f"train:{i}" for i in want]


def test_only_the_needed_row_groups_are_read(split, reads):
    stream = PromptStream(split, seed=0, keys=KEYS, storage_options={}, shuffle=False)
    assert [p.question for p in stream.problems(0, 10)] == [f"Q{i}" for i in range(10)]
    assert reads == [0]
    assert [p.question for p in stream.problems(1020, 10)] == [f"Q{i}" for i in range(1020, 1030)]
    assert reads == [0, 1]  # group 0 came from the cache
    stream.problems(4990, 20)  # the last group, then the first again (epoch 1): cached
    assert reads == [0, 1, 4]
    shuffled = PromptStream(split, seed=0, keys=KEYS, storage_options={})
    rows = shuffled.rows(0, 3)
    stream_module._GROUPS.clear()
    reads.clear()
    shuffled.problems(0, 3)
    assert sorted(reads) == sorted({int(r) // 1024 for r in rows})


def test_first_rows(split):
    assert [p.row_id for p in first_rows(split, 3, keys=KEYS, storage_options={})] == ["train:0", "train:1", "train:2"]
    assert len(first_rows(split, 10 * N, keys=KEYS, storage_options={})) == N


def test_a_changed_copy_or_wrong_keys_are_refused(split):
    with pytest.raises(DatasetError, match=r"changed since it was opened .* open it again with open_split"):
        PromptStream(type(split)(**{**split.__dict__, "digest": "0" * 64}), seed=0, keys=KEYS, storage_options={})
    with pytest.raises(DatasetError, match=r"no column 'question' \(data.prompt_key\); the columns are \['prompt'"):
        first_rows(split, 1, keys=ColumnKeys(prompt_key="question"), storage_options={})
    with pytest.raises(ValueError, match="start=-1, count=2; both must be >= 0"):
        PromptStream(split, seed=0, keys=KEYS, storage_options={}).problems(-1, 2)
