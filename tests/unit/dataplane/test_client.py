"""The data plane client, against a local folder and a real S3 server on loopback (same suite)."""

from __future__ import annotations

import pyarrow.dataset as pads
import pytest
import torch

from dataplane import fields as F
from dataplane.client import DataPlane, DataPlaneError
from dataplane.codec import nested_from_values

SCHEMA = {
    F.INPUT_IDS: "int64",
    F.INPUT_LENGTHS: "int64",
    F.TOKEN_MASK: "bool",
    F.REWARDS: "float32",
    F.PROMPT_TEXT: "str",
    F.PREV_LOGPROBS: "float32",
    F.ADVANTAGES: "bfloat16",
}


def _columns(lengths):
    lens = torch.tensor(lengths, dtype=torch.int64)
    total = int(lens.sum())
    return {
        F.INPUT_IDS: nested_from_values(torch.arange(total, dtype=torch.int64), lens),
        F.INPUT_LENGTHS: lens,
        F.TOKEN_MASK: nested_from_values(torch.arange(total) % 3 == 0, lens),
        F.REWARDS: torch.arange(len(lengths), dtype=torch.float32) / 10,
        F.PROMPT_TEXT: [f"q{i}" for i in range(len(lengths))],
    }


@pytest.fixture
def dp(store):
    root, options = store
    plane = DataPlane(root, "run-1", storage_options=options)
    plane.register_partition("step_000001", fields=SCHEMA, consumers=["prev_lp", "train"])
    return plane


def test_put_read_roundtrip_padded_and_jagged(dp):
    lengths = [5, 0, 3, 8]
    cols = _columns(lengths)
    meta = dp.put("step_000001", cols, group_size=2)
    assert meta.size() == 4 and meta.sequence_lengths == lengths
    assert meta.sample_ids[0].endswith("_g0") and meta.sample_ids[1].endswith("_g1")
    assert meta.sample_ids[0].split("_g")[0] == meta.sample_ids[1].split("_g")[0]
    out = dp.read(meta, [F.INPUT_IDS, F.TOKEN_MASK, F.REWARDS, F.PROMPT_TEXT], pad_value_dict={F.INPUT_IDS: -1})
    assert out[F.INPUT_IDS].shape == (4, 8)
    assert out[F.INPUT_IDS][0].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    assert out[F.INPUT_IDS][1].tolist() == [-1] * 8
    assert torch.equal(out[F.REWARDS], cols[F.REWARDS])
    assert out[F.PROMPT_TEXT] == ["q0", "q1", "q2", "q3"]
    jag = dp.read(meta, [F.TOKEN_MASK], layout="jagged")[F.TOKEN_MASK]
    assert torch.equal(jag.values(), cols[F.TOKEN_MASK].values())
    wide = dp.read(meta.stamp_pad_seqlen().with_extra_info(global_forward_pad_seqlen=16), [F.INPUT_IDS])
    assert wide[F.INPUT_IDS].shape == (4, 16)


def test_delta_write_subset_and_reorder(dp):
    meta = dp.put("step_000001", _columns([2, 3, 4]))
    lp = nested_from_values(torch.linspace(-1, 0, 9), torch.tensor([2, 3, 4]))
    adv = nested_from_values(torch.ones(9, dtype=torch.bfloat16) * 0.5, torch.tensor([2, 3, 4]))
    meta2 = dp.write_columns(meta, {F.PREV_LOGPROBS: lp, F.ADVANTAGES: adv})
    assert set(meta2.fields) >= {F.INPUT_IDS, F.PREV_LOGPROBS, F.ADVANTAGES}
    rev = meta2.subset([2, 0])
    out = dp.read(rev, [F.PREV_LOGPROBS, F.INPUT_LENGTHS, F.ADVANTAGES], layout="jagged")
    assert out[F.INPUT_LENGTHS].tolist() == [4, 2]
    assert torch.equal(out[F.PREV_LOGPROBS].values(), torch.cat([lp.values()[5:], lp.values()[:2]]))
    assert out[F.ADVANTAGES].dtype == torch.bfloat16


def test_retried_write_leaves_one_copy(dp):
    meta = dp.put("step_000001", _columns([2, 2]))
    first = nested_from_values(torch.zeros(4), torch.tensor([2, 2]))
    second = nested_from_values(torch.ones(4), torch.tensor([2, 2]))
    dp.write_columns(meta, {F.PREV_LOGPROBS: first})
    dp.write_columns(meta, {F.PREV_LOGPROBS: second})  # the retry
    commits = dp._commits(dp._part("step_000001"))
    assert sum(F.PREV_LOGPROBS in c["fields"] for c in commits) == 1
    assert dp.read(meta, [F.PREV_LOGPROBS], layout="jagged")[F.PREV_LOGPROBS].values().tolist() == [1.0] * 4


def test_writes_of_different_fields_both_land(dp):
    from concurrent.futures import ThreadPoolExecutor

    meta = dp.put("step_000001", _columns([3, 1]))
    lens = torch.tensor([3, 1])
    jobs = [
        {F.PREV_LOGPROBS: nested_from_values(torch.full((4,), -0.5), lens)},
        {F.ADVANTAGES: nested_from_values(torch.full((4,), 2.0, dtype=torch.bfloat16), lens)},
    ]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda cols: dp.write_columns(meta, cols), jobs))
    out = dp.read(meta, [F.PREV_LOGPROBS, F.ADVANTAGES], layout="jagged")
    assert out[F.PREV_LOGPROBS].values().tolist() == [-0.5] * 4
    assert out[F.ADVANTAGES].values().float().tolist() == [2.0] * 4


def test_bad_writes_raise_before_anything_is_written(dp):
    meta = dp.put("step_000001", _columns([2, 3]))
    before = len(dp._commits(dp._part("step_000001")))
    with pytest.raises(ValueError, match="3 rows for 2 sample ids"):
        dp.write_columns(meta, {F.PREV_LOGPROBS: nested_from_values(torch.zeros(6), torch.tensor([2, 3, 1]))})
    with pytest.raises(ValueError, match="dtype float64 but the partition registered float32"):
        dp.write_columns(meta, {F.PREV_LOGPROBS: nested_from_values(torch.zeros(5, dtype=torch.float64), torch.tensor([2, 3]))})
    with pytest.raises(ValueError, match="row lengths differ from input_lengths"):
        dp.write_columns(meta, {F.PREV_LOGPROBS: nested_from_values(torch.zeros(5), torch.tensor([3, 2]))})
    with pytest.raises(ValueError, match="not a registered field"):
        dp.write_columns(meta, {"values": torch.zeros(2)})
    assert len(dp._commits(dp._part("step_000001"))) == before


def test_read_errors_name_partition_field_and_ids(dp):
    meta = dp.put("step_000001", _columns([2, 3]))
    with pytest.raises(ValueError, match="select_fields is required"):
        dp.read(meta, [])
    with pytest.raises(DataPlaneError, match="'prev_logprobs' was never written in partition 'step_000001'"):
        dp.read(meta, [F.PREV_LOGPROBS])
    with pytest.raises(DataPlaneError, match="not registered"):
        dp.read(meta, ["nope"])
    ghost = meta.concat(type(meta)("step_000001", ["ghost_g0"]))
    with pytest.raises(DataPlaneError, match="ghost_g0"):
        dp.read(ghost, [F.REWARDS])
    dp.discard("step_000001", [meta.sample_ids[0]])
    with pytest.raises(DataPlaneError, match="discarded"):
        dp.read(meta, [F.REWARDS])
    assert dp.read(meta.drop([0]), [F.REWARDS])[F.REWARDS].tolist() == pytest.approx([0.1])
    dp.clear("step_000001")
    with pytest.raises(DataPlaneError, match="never registered or it was cleared"):
        dp.read(meta, [F.REWARDS])


@pytest.mark.parametrize("bad", ["..", "../x", "/abs", "a/b", "a\x00b", "", ".hidden", "x" * 201])
def test_names_cannot_escape_the_root(dp, bad):
    with pytest.raises(ValueError, match="invalid"):
        dp.register_partition(bad, fields=SCHEMA)
    with pytest.raises(ValueError, match="invalid"):
        DataPlane("/tmp/x", bad)


def test_shards_are_plain_parquet(store):
    root, options = store
    dp = DataPlane(root, "run-1", storage_options=options)
    dp.register_partition("step_000001", fields=SCHEMA)
    dp.put("step_000001", _columns([2, 3]))
    files = dp.fs.glob(f"{dp._part('step_000001')}/data/*.parquet")
    table = pads.dataset(files, filesystem=dp.fs, format="parquet").to_table()
    assert table.num_rows == 2
    assert table.column(F.INPUT_IDS).to_pylist()[1] == [2, 3, 4]
    assert "testing" not in repr(dp) and "secret" not in repr(dp).lower()
