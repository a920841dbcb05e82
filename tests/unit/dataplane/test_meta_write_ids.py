"""Write ids and the puts a meta names, on a local folder and a real S3 server on loopback (moto):

- a delta write whose field set equals a put's (the same rows, the same fields) must get its own write id, not replace
  the put's commit record (which holds the rows' ids and lengths: every later write under the meta would fail with
  "sample ids ... were never put");
- a meta that names no put (``KVBatchMeta.puts`` None: made by hand, or before metas named their puts) cannot be
  checked for staleness, so reads and delta writes refuse it instead of reading rows that were put again since;
  ``DataPlane.meta_for`` makes a checked meta for rows by their ids.
"""

from __future__ import annotations

import pytest
import torch

from dataplane import commits
from dataplane.client import DataPlane, StaleMetaError
from dataplane.meta import KVBatchMeta

PART = "step_000001"
SCHEMA = {"a": "float32", "b": "float32", "c": "float32"}


@pytest.fixture
def dp(store):
    root, options = store
    plane = DataPlane(root, "run-ids", storage_options=options)
    plane.register_partition(PART, fields=SCHEMA)
    return plane


def test_a_delta_write_of_a_puts_fields_keeps_the_put(dp, store):
    meta = dp.put(
        PART, {"a": torch.tensor([1.0, 2.0, 3.0, 4.0]), "b": torch.tensor([5.0, 6.0, 7.0, 8.0])}, group_size=2
    )
    again = dp.write_columns(
        meta, {"a": torch.tensor([-1.0, -2.0, -3.0, -4.0]), "b": torch.tensor([0.0, 0.5, 1.0, 1.5])}
    )
    records = dp._commits(dp._part(PART))
    assert len(records) == 2  # the put's record and the delta write's, side by side
    put, delta = records
    assert put["sample_ids"] == meta.sample_ids and "sample_ids" not in delta
    assert put["write_id"] != delta["write_id"]
    assert meta.puts == [f"{put['write_id']}:{put['crc32']}"]

    last = dp.write_columns(again, {"c": torch.tensor([9.0, 9.5, 10.0, 10.5])})  # "were never put" before the fix
    assert last.fields == ["a", "b", "c"]
    root, options = store
    out = DataPlane(root, "run-ids", storage_options=options).read(last, ["a", "b", "c"])
    assert out["a"].tolist() == [-1.0, -2.0, -3.0, -4.0]  # the delta write's values: the newest record wins
    assert out["b"].tolist() == [0.0, 0.5, 1.0, 1.5]
    assert out["c"].tolist() == [9.0, 9.5, 10.0, 10.5]
    assert dp.read(meta.subset([3, 0]), ["a", "c"])["c"].tolist() == [10.5, 9.0]  # the put's own meta still reads

    # a retry of the delta write is the same write: it replaces its own record, not the put's
    dp.write_columns(meta, {"b": torch.tensor([2.0, 2.0, 2.0, 2.0]), "a": torch.tensor([3.0, 3.0, 3.0, 3.0])})
    assert [r["write_id"] for r in dp._commits(dp._part(PART))].count(delta["write_id"]) == 1
    assert len(dp._commits(dp._part(PART))) == 3
    assert dp.read(last, ["a", "b"])["a"].tolist() == [3.0] * 4


def test_write_ids_differ_by_kind_and_are_stable():
    ids = ["x_g0", "x_g1"]
    put = commits.write_id(["b", "a"], ids, put=True)
    delta = commits.write_id(["a", "b"], ids, put=False)
    assert put != delta and len(put) == len(delta) == 32
    assert put == commits.write_id(["a", "b"], ids, put=True)  # field order does not matter; a retry maps to it
    assert delta == commits.write_id(["b", "a"], ids, put=False)
    assert commits.write_id(["a"], ids, put=False) != delta


# ---------------------------------------------------------------- a meta that names no put
def test_a_meta_that_names_no_put_is_refused(dp, store):
    first = dp.put(PART, {"a": torch.tensor([1.0, 2.0])}, group_size=2, id_key="rollout")
    legacy = KVBatchMeta(PART, list(first.sample_ids))  # puts=None: made by hand, or before metas named their puts
    dp.clear(PART)  # the step is redone: the same ids, other content
    dp.register_partition(PART, fields=SCHEMA)
    second = dp.put(PART, {"a": torch.tensor([7.0, 8.0])}, group_size=2, id_key="rollout")
    assert second.sample_ids == first.sample_ids and second.puts != first.puts
    commits_before = len(dp._commits(dp._part(PART)))
    for attempt in (
        lambda: dp.read(legacy, ["a"]),  # read [7.0, 8.0] for a meta of [1.0, 2.0] before the fix
        lambda: dp.write_columns(legacy, {"b": torch.tensor([0.0, 0.0])}),
    ):
        with pytest.raises(ValueError, match=r"names no put \(KVBatchMeta.puts is None.*DataPlane.meta_for") as err:
            attempt()
        assert PART in str(err.value) and first.sample_ids[0] in str(err.value)
    assert len(dp._commits(dp._part(PART))) == commits_before  # nothing written
    with pytest.raises(StaleMetaError):
        dp.read(first, ["a"])  # the put's own meta: stale, as before

    # normal metas still work, and meta_for makes one for the rows as they are now
    assert dp.read(second, ["a"])["a"].tolist() == [7.0, 8.0]
    now = dp.meta_for(PART, legacy.sample_ids[::-1], task_name="adopted")
    assert now.puts == second.puts and now.task_name == "adopted" and now.fields is None
    assert now.sequence_lengths is None  # the put stored no input_lengths
    assert dp.read(now, ["a"])["a"].tolist() == [8.0, 7.0]
    assert dp.write_columns(now, {"b": torch.tensor([0.5, 1.5])}).puts == second.puts
    assert dp.read(second, ["a", "b"])["b"].tolist() == [1.5, 0.5]
    with pytest.raises(ValueError, match=r"sample ids \['nope_g0'\] were never put \(1 of 2\)"):
        dp.meta_for(PART, [legacy.sample_ids[0], "nope_g0"])


def test_meta_for_takes_the_stored_lengths(dp):
    dp.register_partition("val_000001", fields={"input_lengths": "int64", "a": "float32"})
    meta = dp.put("val_000001", {"input_lengths": torch.tensor([3, 5]), "a": torch.tensor([1.0, 2.0])})
    made = dp.meta_for("val_000001", meta.sample_ids)
    assert made.sequence_lengths == [3, 5] and made.puts == meta.puts
    assert dp.read(made, ["a"])["a"].tolist() == [1.0, 2.0]
