"""A meta that does not match its partition, on a local folder and a real S3 server on loopback (moto):

- an altered meta (``sequence_lengths`` all 1) must not let a per-token write of length-1 rows commit beside
  ``input_ids`` rows of 3-6 tokens: per-token writes are checked against the lengths the put stored, and reads and
  writes under a meta whose ``sequence_lengths`` differ from them are refused;
- a stale meta (made before a ``clear`` and a re-put with the same ``id_key``) must not read the new rows without an
  error: a meta names its put (``KVBatchMeta.puts``: write id and data-file checksum), and reads and writes under a
  stale one raise ``StaleMetaError``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dataplane import fields as F
from dataplane.client import DataPlane, DataPlaneError, StaleMetaError
from dataplane.codec import nested_from_values
from dataplane.meta import KVBatchMeta
from dataplane.sharding import shard_meta_for_dp

PART = "step_000001"
LENGTHS = [3, 4, 5, 6]
SCHEMA = {
    F.INPUT_IDS: "int64",
    F.INPUT_LENGTHS: "int64",
    F.REWARDS: "float32",
    F.PREV_LOGPROBS: "float32",
    F.REFERENCE_POLICY_LOGPROBS: "float32",
}


def _rows(seed: int, lengths=LENGTHS) -> dict[str, torch.Tensor]:
    lens = torch.tensor(lengths, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    return {
        F.INPUT_IDS: nested_from_values(torch.randint(0, 1000, (int(lens.sum()),), generator=g), lens),
        F.INPUT_LENGTHS: lens,
        F.REWARDS: torch.rand(len(lengths), generator=g),
    }


def _per_token(lengths, value: float = -0.5) -> torch.Tensor:
    return nested_from_values(torch.full((sum(lengths),), value), torch.tensor(lengths))


def _commit_count(dp: DataPlane) -> int:
    return len(dp._commits(dp._part(PART)))


@pytest.fixture
def dp(store):
    root, options = store
    plane = DataPlane(root, "run-meta", storage_options=options)
    plane.register_partition(PART, fields=SCHEMA)
    return plane


# ---------------------------------------------------------------- an altered meta
def test_a_per_token_write_under_an_altered_meta_is_checked_against_the_stored_lengths(dp):
    meta = dp.put(PART, _rows(0), group_size=2)
    tampered = dataclasses.replace(meta, sequence_lengths=[1] * meta.size())
    before = _commit_count(dp)
    with pytest.raises(ValueError, match="input_lengths"):
        dp.write_columns(tampered, {F.REFERENCE_POLICY_LOGPROBS: _per_token([1] * meta.size())})
    stripped = dataclasses.replace(meta, sequence_lengths=None)  # a meta without lengths: the stored ones still hold
    with pytest.raises(ValueError, match="row lengths differ from input_lengths"):
        dp.write_columns(stripped, {F.REFERENCE_POLICY_LOGPROBS: _per_token([1] * meta.size())})
    assert _commit_count(dp) == before  # nothing committed
    with pytest.raises(DataPlaneError, match="never written"):
        dp.read(meta, [F.REFERENCE_POLICY_LOGPROBS])
    dp.write_columns(stripped, {F.REFERENCE_POLICY_LOGPROBS: _per_token(LENGTHS)})  # the right lengths: fine
    out = dp.read(meta, [F.INPUT_IDS, F.REFERENCE_POLICY_LOGPROBS], layout="jagged")
    assert (
        out[F.INPUT_IDS].offsets().diff().tolist()
        == out[F.REFERENCE_POLICY_LOGPROBS].offsets().diff().tolist()
        == LENGTHS
    )


def test_an_altered_meta_is_refused_even_with_well_formed_rows(dp):
    meta = dp.put(PART, _rows(0), group_size=2)
    altered = dataclasses.replace(meta, sequence_lengths=[4, 4, 5, 6])
    with pytest.raises(
        ValueError, match=r"sequence_lengths differ from the input_lengths its put stored at rows \[0\].*altered"
    ):
        dp.write_columns(altered, {F.PREV_LOGPROBS: _per_token(LENGTHS)})
    with pytest.raises(ValueError, match="the meta was altered"):
        dp.read(altered, [F.INPUT_IDS])
    assert dp.read(meta.subset([3, 1]), [F.INPUT_LENGTHS])[F.INPUT_LENGTHS].tolist() == [6, 4]  # the real one reads


def test_a_delta_write_of_input_lengths_must_repeat_the_stored_ones(dp):
    meta = dp.put(PART, _rows(0), group_size=2)
    with pytest.raises(ValueError, match="differ from the lengths the put stored"):
        dp.write_columns(meta, {F.INPUT_LENGTHS: torch.tensor([1, 1, 1, 1])})
    dp.write_columns(meta, {F.INPUT_LENGTHS: torch.tensor(LENGTHS)})


def test_put_records_from_before_the_stored_lengths_are_checked_against_the_data(dp):
    """A put record written before put records kept ``input_lengths``: the lengths come from its data file."""
    meta = dp.put(PART, _rows(0), group_size=2)
    part = dp._part(PART)
    (path,) = [p for p in dp.fs.find(f"{part}/_commits")]
    record = json.loads(dp.fs.cat_file(path))
    del record["input_lengths"]
    dp.fs.pipe_file(path, json.dumps(record).encode())
    tampered = dataclasses.replace(meta, sequence_lengths=[1] * meta.size())
    with pytest.raises(ValueError, match="row lengths differ from input_lengths"):
        dp.write_columns(tampered, {F.REFERENCE_POLICY_LOGPROBS: _per_token([1] * meta.size())})
    dp.write_columns(tampered, {F.REFERENCE_POLICY_LOGPROBS: _per_token(LENGTHS)})


# ---------------------------------------------------------------- a stale meta
def test_a_meta_from_before_a_clear_and_re_put_fails_clearly(dp):
    old = dp.put(PART, _rows(0), group_size=2, id_key="rollout")
    dp.write_columns(old, {F.PREV_LOGPROBS: _per_token(LENGTHS)})
    dp.clear(PART)
    dp.register_partition(PART, fields=SCHEMA)
    new_rows = _rows(1, lengths=[6, 5, 4, 3])
    new = dp.put(PART, new_rows, group_size=2, id_key="rollout")
    assert new.sample_ids == old.sample_ids  # same ids (same id_key): only the meta's put tells them apart
    for stale in (old, old.subset([2, 0]), shard_meta_for_dp(old, dp_world=2)[0][1]):
        with pytest.raises(
            StaleMetaError, match="stale meta.*put again with other content.*use the meta that the latest put returned"
        ):
            dp.read(stale, [F.INPUT_IDS])
    assert new.puts != old.puts
    with pytest.raises(StaleMetaError):
        dp.read_batch(old, [F.REWARDS])
    with pytest.raises(StaleMetaError):
        dp.write_columns(dataclasses.replace(old, sequence_lengths=None), {F.PREV_LOGPROBS: _per_token([6, 5, 4, 3])})
    assert isinstance(StaleMetaError("x"), DataPlaneError)  # callers catching DataPlaneError see it too
    out = dp.read(new, [F.INPUT_IDS, F.REWARDS], layout="jagged")
    assert torch.equal(out[F.INPUT_IDS].values(), new_rows[F.INPUT_IDS].values())


def test_a_retried_put_keeps_the_meta_of_identical_rows_and_stales_that_of_other_rows(dp):
    first = dp.put(PART, _rows(0), group_size=2, id_key="rollout")
    again = dp.put(PART, _rows(0), group_size=2, id_key="rollout")  # a retry that wrote the same bytes: the same put
    assert again.puts == first.puts
    assert dp.read(first, [F.REWARDS])[F.REWARDS].tolist() == _rows(0)[F.REWARDS].tolist()
    resampled = dp.put(PART, _rows(2), group_size=2, id_key="rollout")  # a retry that sampled other rows
    with pytest.raises(StaleMetaError):
        dp.read(first, [F.REWARDS])
    assert dp.read(resampled, [F.REWARDS])[F.REWARDS].tolist() == _rows(2)[F.REWARDS].tolist()


def test_metas_of_several_puts_and_hand_made_metas(dp):
    a = dp.put(PART, _rows(0), group_size=2)
    b = dp.put(PART, _rows(1), group_size=2)
    both = a.concat(b)
    assert sorted(both.puts) == sorted(a.puts + b.puts)
    assert dp.read(both, [F.INPUT_LENGTHS])[F.INPUT_LENGTHS].tolist() == LENGTHS * 2
    delta = dp.write_columns(both, {F.PREV_LOGPROBS: _per_token(LENGTHS * 2)})
    assert delta.puts == both.puts and delta.join(both).puts == both.puts
    by_hand = KVBatchMeta(PART, both.sample_ids)  # names no put: cannot be checked, refused
    with pytest.raises(ValueError, match="names no put"):
        dp.read(by_hand, [F.PREV_LOGPROBS], layout="jagged")
    adopted = dp.meta_for(PART, both.sample_ids)  # the rows as they are now
    got = dp.read(adopted, [F.PREV_LOGPROBS], layout="jagged")[F.PREV_LOGPROBS]
    assert got.offsets().diff().tolist() == LENGTHS * 2
    assert a.concat(by_hand.slice(4, 8)).puts is None
    with pytest.raises(ValueError, match="puts must be a list of strings"):
        KVBatchMeta(PART, ["x_g0"], puts="abc")  # type: ignore[arg-type]


def test_a_sealed_meta_keeps_its_put(dp):
    meta = dp.put(PART, _rows(0), group_size=2, id_key="rollout")
    dp.seal(meta)
    assert dp.sealed(PART) == meta and dp.sealed(PART).puts == meta.puts
    path = f"{dp._part(PART)}/_sealed.json"
    legacy = json.loads(dp.fs.cat_file(path))
    del legacy["puts"]  # a record sealed before metas named their put
    dp.fs.pipe_file(path, json.dumps(legacy).encode())
    assert dp.sealed(PART).puts is None


def test_a_meta_with_puts_crosses_flyte():
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    ctx = FlyteContextManager.current_context()
    lt = TypeEngine.to_literal_type(KVBatchMeta)
    for meta in (
        KVBatchMeta(PART, ["a_g0", "a_g1"], sequence_lengths=[3, 4], puts=["0" * 32 + ":deadbeef"]),
        KVBatchMeta(PART, ["a_g0"]),
    ):
        back = TypeEngine.to_python_value(ctx, TypeEngine.to_literal(ctx, meta, KVBatchMeta, lt), KVBatchMeta)
        assert back == meta
