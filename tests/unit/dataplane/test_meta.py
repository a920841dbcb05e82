from __future__ import annotations

from dataclasses import replace

import pytest

from dataplane.meta import GLOBAL_FORWARD_PAD_SEQLEN, PAD_TO_MULTIPLE, KVBatchMeta
from dataplane.sharding import shard_meta_for_dp


def _meta(n=6):
    return KVBatchMeta(
        "step_000001",
        [f"u{i // 2}_g{i % 2}" for i in range(n)],
        fields=["input_ids"],
        sequence_lengths=[10, 3, 7, 7, 1, 20][:n],
    )


def test_transforms_keep_rows_aligned():
    m = _meta()
    s = m.subset([4, 0])
    assert s.sample_ids == ["u2_g0", "u0_g0"] and s.sequence_lengths == [1, 10]
    assert m.slice(1, 3).sample_ids == ["u0_g1", "u1_g0"]
    c = m.slice(0, 2).concat(m.slice(2, 6))
    assert c.sample_ids == m.sample_ids and c.sequence_lengths == m.sequence_lengths
    tagged = m.stamp_tags({"std": [0.5] * 6})
    assert tagged.tags[3] == {"std": 0.5} and m.tags is None
    assert tagged.subset([3]).tags == [{"std": 0.5}]


def test_errors():
    m = _meta()
    with pytest.raises(ValueError, match="one partition"):
        m.concat(KVBatchMeta("other", ["x_g0"]))
    with pytest.raises(ValueError, match="duplicates"):
        m.concat(m)
    with pytest.raises(IndexError):
        m.subset([6])
    with pytest.raises(ValueError, match="3 values for 6 rows"):
        m.stamp_tags({"x": [1, 2, 3]})
    with pytest.raises(ValueError, match="same rows"):
        m.join(m.slice(0, 2))


def test_join_unions_fields_and_info():
    m = _meta().with_extra_info(a=1.0)
    other = replace(m, fields=["prev_logprobs"]).with_extra_info(b=2.0)
    j = m.join(other)
    assert j.fields == ["input_ids", "prev_logprobs"] and j.extra_info == {"a": 1.0, "b": 2.0}


def test_global_forward_pad_seqlen():
    m = _meta().with_extra_info(**{PAD_TO_MULTIPLE: 8})
    assert m.global_forward_pad_seqlen() == 24  # round_up(20, 8)
    stamped = m.stamp_pad_seqlen()
    assert stamped.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 24
    assert stamped.subset([1]).global_forward_pad_seqlen() == 24  # inherited, not recomputed


def test_shard_meta_for_dp_balances_tokens_and_inverts():
    m = _meta()
    shards, inverse = shard_meta_for_dp(m, dp_world=2)
    assert [s.size() for s in shards] == [3, 3]
    loads = [sum(s.sequence_lengths) for s in shards]
    assert abs(loads[0] - loads[1]) <= 20 and sum(loads) == 48
    flat = [sid for s in shards for sid in s.sample_ids]
    assert [flat[inverse[i]] for i in range(6)] == m.sample_ids
    assert all(s.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 20 for s in shards)
    with pytest.raises(ValueError, match="dp_world"):
        shard_meta_for_dp(m, dp_world=0)
