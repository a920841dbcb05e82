"""The data plane client, against a local folder and a real S3 server on loopback (same suite)."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pyarrow.dataset as pads
import pytest
import torch

import dataplane.errors
from dataplane import fields as F
from dataplane.client import DataPlane, DataPlaneError, DataPlaneWarning, IntegrityError
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
    plane.register_partition("step_000001", fields=SCHEMA)
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


def _data_files(dp, part="step_000001"):
    return sorted(dp.fs.glob(f"{dp._part(part)}/data/*.parquet"))


def test_retried_write_leaves_one_copy_and_garbage_collection_removes_the_other(dp):
    meta = dp.put("step_000001", _columns([2, 2]))
    first = nested_from_values(torch.zeros(4), torch.tensor([2, 2]))
    second = nested_from_values(torch.ones(4), torch.tensor([2, 2]))
    dp.write_columns(meta, {F.PREV_LOGPROBS: first})
    dp.write_columns(meta, {F.PREV_LOGPROBS: second})  # the retry
    commits = dp._commits(dp._part("step_000001"))
    assert sum(F.PREV_LOGPROBS in c["fields"] for c in commits) == 1
    assert dp.read(meta, [F.PREV_LOGPROBS], layout="jagged")[F.PREV_LOGPROBS].values().tolist() == [1.0] * 4
    assert len(_data_files(dp)) == 3  # put, the retry, and the first attempt's file: no write deletes a file
    assert dp.collect_garbage() == {"orphan_data_files": 0, "temp_files": 0}  # too young for the default grace period
    assert dp.collect_garbage(grace_s=0) == {"orphan_data_files": 1, "temp_files": 0}
    assert len(_data_files(dp)) == 2
    assert dp.read(meta, [F.PREV_LOGPROBS], layout="jagged")[F.PREV_LOGPROBS].values().tolist() == [1.0] * 4


def test_two_attempts_of_one_write_never_leave_a_commit_on_a_deleted_file(dp, monkeypatch):
    """Attempt A commits, then attempt B uploads and commits while A finishes: no attempt deletes a file that the
    winning commit record names (deleting every other file of the write id after committing would let A delete the
    file B's winning record names)."""

    meta = dp.put("step_000001", _columns([2, 2]))
    a_committed, b_committed = threading.Event(), threading.Event()
    real = DataPlane._put_atomic

    def put_atomic(self, path, payload):
        real(self, path, payload)
        if "/_commits/" in path:
            if threading.current_thread().name == "A":
                a_committed.set()
                assert b_committed.wait(30)  # A's commit is followed by B's before A goes on
            else:
                b_committed.set()

    monkeypatch.setattr(DataPlane, "_put_atomic", put_atomic)

    def attempt(value):
        dp.write_columns(meta, {F.PREV_LOGPROBS: nested_from_values(torch.full((4,), value), torch.tensor([2, 2]))})

    a = threading.Thread(target=attempt, args=(1.0,), name="A")
    a.start()
    assert a_committed.wait(30)
    attempt(2.0)  # B, in this thread
    a.join()
    assert dp.read(meta, [F.PREV_LOGPROBS], layout="jagged")[F.PREV_LOGPROBS].values().tolist() == [2.0] * 4
    (record,) = [c for c in dp._commits(dp._part("step_000001")) if F.PREV_LOGPROBS in c["fields"]]
    assert dp.fs.exists(f"{dp._part('step_000001')}/{record['file']}")


def test_writes_of_different_fields_both_land(dp):
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
        dp.write_columns(
            meta, {F.PREV_LOGPROBS: nested_from_values(torch.zeros(5, dtype=torch.float64), torch.tensor([2, 3]))}
        )
    with pytest.raises(ValueError, match="row lengths differ from input_lengths"):
        dp.write_columns(meta, {F.PREV_LOGPROBS: nested_from_values(torch.zeros(5), torch.tensor([3, 2]))})
    with pytest.raises(ValueError, match="not a registered field"):
        dp.write_columns(meta, {"values": torch.zeros(2)})
    # a per-token field written 1-D, through a meta that carries no lengths: refused, not stored to break reads
    bare = type(meta)(meta.partition_id, list(meta.sample_ids), puts=meta.puts)
    with pytest.raises(ValueError, match="per-token fields are written jagged"):
        dp.write_columns(bare, {F.PREV_LOGPROBS: torch.zeros(2)})
    with pytest.raises(ValueError, match="row lengths differ from input_lengths"):  # lengths from the partition
        dp.write_columns(bare, {F.PREV_LOGPROBS: nested_from_values(torch.zeros(5), torch.tensor([3, 2]))})
    with pytest.raises(ValueError, match="trailing dims"):
        dp.write_columns(
            meta,
            {F.PREV_LOGPROBS: torch.nested.nested_tensor([torch.zeros(2, 2), torch.zeros(3, 2)], layout=torch.jagged)},
        )
    with pytest.raises(ValueError, match="never put"):
        dp.write_columns(type(meta)("step_000001", ["ghost_g0", "ghost_g1"]), {F.REWARDS: torch.zeros(2)})
    assert len(dp._commits(dp._part("step_000001"))) == before
    assert dp.read(meta, [F.INPUT_IDS, F.REWARDS])[F.REWARDS].tolist() == pytest.approx([0.0, 0.1])


def test_read_errors_name_partition_field_and_ids(dp):
    meta = dp.put("step_000001", _columns([2, 3]))
    with pytest.raises(ValueError, match="select_fields is required"):
        dp.read(meta, [])
    with pytest.raises(DataPlaneError, match="'prev_logprobs' was never written in partition 'step_000001'"):
        dp.read(meta, [F.PREV_LOGPROBS])
    with pytest.raises(DataPlaneError, match="not registered"):
        dp.read(meta, ["nope"])
    ghost = meta.concat(type(meta)("step_000001", ["ghost_g0"], puts=[]))
    with pytest.raises(DataPlaneError, match="ghost_g0"):
        dp.read(ghost, [F.REWARDS])
    dp.clear("step_000001")
    with pytest.raises(DataPlaneError, match="never registered or it was cleared"):
        dp.read(meta, [F.REWARDS])


@pytest.mark.parametrize(
    "bad", ["..", "../x", "/abs", "a/b", "a\x00b", "", ".hidden", "x" * 201, "step_000001\n", "run-1\r\n"]
)
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


def _commit_path(dp, part="step_000001"):
    return dp.fs.glob(f"{dp._part(part)}/_commits/*.json")


def test_a_malformed_or_stray_commit_record_is_skipped_by_name(dp):
    meta = dp.put("step_000001", _columns([2, 3]))
    dp.write_columns(meta, {F.PREV_LOGPROBS: nested_from_values(torch.zeros(5), torch.tensor([2, 3]))})
    (prev,) = [p for p in _commit_path(dp) if F.PREV_LOGPROBS in dp.fs.cat_file(p).decode()]
    dp.fs.pipe_file(prev, b'{"write_id": "abc", "file": "da')  # torn by hand
    dp.fs.pipe_file(f"{dp._part('step_000001')}/_commits/notes.json", b'{"hello": 1}')  # stray
    with pytest.warns(DataPlaneWarning) as caught:
        out = dp.read(meta, [F.INPUT_IDS, F.REWARDS])  # the rest of the partition reads as before
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2
    assert any(prev.rsplit("/", 1)[-1] in m and "not JSON" in m for m in messages)  # each record named, with why
    assert any("notes.json" in m and "missing or mistyped keys" in m for m in messages)
    assert out[F.REWARDS].tolist() == pytest.approx([0.0, 0.1])
    with (
        pytest.warns(DataPlaneWarning),
        pytest.raises(DataPlaneError, match=r"never written.*skipped malformed commit records"),
    ):
        dp.read(meta, [F.PREV_LOGPROBS])


def test_a_missing_or_changed_data_file_fails_by_name(dp):

    meta = dp.put("step_000001", _columns([40, 30, 50, 20]))
    (path,) = _data_files(dp)
    good = dp.fs.cat_file(path)
    rng = random.Random(0)
    for position in [rng.randrange(len(good)) for _ in range(9)]:  # flipped bytes anywhere: header, pages, footer
        bad = bytearray(good)
        bad[position] ^= 0x10
        dp.fs.pipe_file(path, bytes(bad))
        with pytest.raises(IntegrityError, match="fails its checksum"):
            dp.read(meta, [F.INPUT_IDS, F.REWARDS])
    other = DataPlane(dp.root_url, "run-2", storage_options=dp.fs.storage_options)  # a valid file of the same shape
    other.register_partition("step_000001", fields=SCHEMA)
    cols = _columns([40, 30, 50, 20])
    cols[F.REWARDS] = cols[F.REWARDS] + 1
    other.put("step_000001", cols)
    (swap,) = _data_files(other)
    dp.fs.pipe_file(path, other.fs.cat_file(swap))
    with pytest.raises(IntegrityError, match="fails its checksum"):
        dp.read(meta, [F.REWARDS])
    dp.fs.rm(path)
    with pytest.raises(IntegrityError, match=f"names data file .*{path.rsplit('/', 1)[-1]}, which is missing"):
        dp.read(meta, [F.REWARDS])


def test_sample_ids_belong_to_their_run(store):
    root, options = store
    a, b = DataPlane(root, "run-a", storage_options=options), DataPlane(root, "run-b", storage_options=options)
    for plane, offset in ((a, 0), (b, 100)):
        plane.register_partition("step_000001", fields=SCHEMA)
        cols = _columns([2, 3])
        cols[F.REWARDS] = cols[F.REWARDS] + offset
        meta = plane.put("step_000001", cols, id_key="rollout")  # the same deterministic key in both runs
        if plane is a:
            meta_a = meta
    assert a.read(meta_a, [F.REWARDS])[F.REWARDS].tolist() == pytest.approx([0.0, 0.1])
    with pytest.raises(DataPlaneError, match="is the meta of another run"):
        b.read(meta_a, [F.REWARDS])
    with pytest.raises(ValueError, match="never put.*another run or partition"):
        b.write_columns(meta_a, {F.PREV_LOGPROBS: nested_from_values(torch.zeros(5), torch.tensor([2, 3]))})


def test_a_field_keeps_its_shape_across_writes(dp):
    meta = dp.put("step_000001", _columns([2, 3]))
    dp.register_partition("step_000001", fields={**SCHEMA, "score": "float32"})
    dp.write_columns(meta, {"score": torch.zeros(2)})
    with pytest.raises(ValueError, match="Arrow type large_list.*stored it as float"):
        dp.write_columns(meta.slice(0, 1), {"score": nested_from_values(torch.zeros(2), torch.tensor([2]))})


def test_garbage_collection_removes_orphans_and_temps_of_killed_writers(dp):
    meta = dp.put("step_000001", _columns([2, 3]))
    part = dp._part("step_000001")
    dp.fs.pipe_file(f"{part}/data/{'0' * 32}-deadbeef.parquet", b"half a file")  # a writer killed before its commit
    dp.fs.pipe_file(f"{part}/_commits/{'0' * 32}.json.tmp-{'1' * 32}", b"{")  # killed before its rename
    ckpts = f"{part.rsplit('/', 1)[0]}/checkpoints"  # a checkpoint save killed mid-way, and one mid-swap
    for folder, payload in (
        (f".step_000002.tmp-{'2' * 32}", b"half"),
        (f".step_000001.old-{'3' * 32}", b"old"),
        ("step_000001", b"kept"),
    ):
        if dp._local:
            dp.fs.makedirs(f"{ckpts}/{folder}", exist_ok=True)
        dp.fs.pipe_file(f"{ckpts}/{folder}/model.safetensors", payload)
    assert dp.collect_garbage() == {"orphan_data_files": 0, "temp_files": 0}  # all younger than an hour: kept
    assert dp.collect_garbage(grace_s=0) == {"orphan_data_files": 1, "temp_files": 3}
    assert len(_data_files(dp)) == 1 and len(_commit_path(dp)) == 1
    assert [p.rsplit("/", 2)[-2] for p in dp.fs.find(ckpts)] == ["step_000001"]
    assert not dp.fs.glob(f"{part}/_commits/*tmp*")
    assert dp.read(meta, [F.REWARDS])[F.REWARDS].tolist() == pytest.approx([0.0, 0.1])
    assert dp.collect_garbage(grace_s=0) == {"orphan_data_files": 0, "temp_files": 0}


def test_transient_storage_errors_are_retried_and_permanent_ones_are_not(dp, monkeypatch):
    monkeypatch.setattr(dataplane.errors.time, "sleep", lambda s: None)
    meta = dp.put("step_000001", _columns([2, 3]))
    real = dp.fs.cat  # s3fs binds its sync methods per instance: patch the instance
    failures = {"n": 0}

    def flaky(*args, **kwargs):
        if failures["n"] < 3:
            failures["n"] += 1
            raise ConnectionRefusedError(111, "Connection refused")
        return real(*args, **kwargs)

    monkeypatch.setattr(dp.fs, "cat", flaky)
    assert dp.read(meta, [F.REWARDS])[F.REWARDS].tolist() == pytest.approx([0.0, 0.1])
    assert failures["n"] == 3

    def gone(*args, **kwargs):
        failures["n"] += 1
        raise PermissionError("access denied")

    monkeypatch.setattr(dp.fs, "cat", gone)
    with pytest.raises(PermissionError):
        dp.read(meta, [F.REWARDS])
    assert failures["n"] == 4  # once: a permanent error is not retried
