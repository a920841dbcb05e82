"""Preparing a user dataset: streamed in batches into 1024-row groups, the copy equal to the source rows in order,
idempotent (a second prepare reads nothing), committed by its index, held-out split by content hash, overlong prompts
skipped and counted, and S3 (moto on loopback) as source and target."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest

import rl.datasets.prepare as prepare_module
import rl.datasets.sources as sources
from rl.data import split_of
from rl.datasets import ColumnKeys, DatasetError, PromptStream, first_rows, open_split, prepare_split
from rl.datasets.rows import ROW_COLUMN

KEYS = ColumnKeys(prompt_key="prompt", answer_key="answer")


def rows(n: int) -> list[dict]:
    return [{"prompt": f"Compute {i} * 3.", "answer": 3 * i} for i in range(n)]


def write_jsonl(path: Path, items: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return str(path)


def copy_rows(url: str) -> list[dict]:
    """Every row of a prepared copy, files in index order, read with pyarrow directly."""
    index = json.loads((Path(url) / "index.json").read_text())
    out = []
    for f in index["files"]:
        pf = pq.ParquetFile(Path(url) / f["name"])
        assert pf.metadata.num_row_groups == f["row_groups"]
        sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
        assert all(s == 1024 for s in sizes[:-1]) and sizes[-1] <= 1024
        out += pf.read().to_pylist()
    return out


def test_prepare_streams_batches_into_row_groups_and_keeps_source_order(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_BLOCK", 4096)  # the ~150 kB file is parsed in ~40 blocks
    source = write_jsonl(tmp_path / "big.jsonl", rows(5000))
    seen: list[int] = []
    split = prepare_split(
        source,
        out_url=str(tmp_path / "out"),
        split="train",
        keys=KEYS,
        storage_options={},
        keep="all",
        batch_size=300,
        progress=seen.append,
    )
    assert seen[-1] == 5000 and len(seen) >= 5000 // 300 and seen == sorted(seen)
    assert (split.num_rows, split.counts) == (5000, {"rows_read": 5000, "held_out": 0, "skipped_overlong": 0})
    assert split.schema == {"prompt": "string", "answer": "int64"}
    got = copy_rows(split.url)
    assert got == [{**r, ROW_COLUMN: i} for i, r in enumerate(rows(5000))]
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert [(f["num_rows"], f["row_groups"]) for f in index["files"]] == [(5000, 5)]  # 4 x 1024 + 904


def test_big_copies_span_several_files(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "GROUPS_PER_FILE", 2)
    source = write_jsonl(tmp_path / "big.jsonl", rows(5000))
    split = prepare_split(
        source, out_url=str(tmp_path / "out"), split="train", keys=KEYS, storage_options={}, keep="all", batch_size=700
    )
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert [(f["name"], f["num_rows"], f["row_groups"]) for f in index["files"]] == [
        ("part-00000.parquet", 2048, 2),
        ("part-00001.parquet", 2048, 2),
        ("part-00002.parquet", 904, 1),
    ]
    assert [r["answer"] for r in copy_rows(split.url)] == [3 * i for i in range(5000)]
    problems = PromptStream(split, seed=0, keys=KEYS, storage_options={}, shuffle=False).problems(2040, 20)
    assert [p.row_id for p in problems] == [f"train:{i}" for i in range(2040, 2060)]


def test_prepare_again_reads_nothing_and_a_changed_source_is_prepared_again(tmp_path, monkeypatch):
    source = write_jsonl(tmp_path / "a.jsonl", rows(50))
    kwargs = dict(out_url=str(tmp_path / "out"), split="train", keys=KEYS, storage_options={}, val_fraction=0.3)
    first = prepare_split(source, **kwargs)
    real = prepare_module.iter_batches
    monkeypatch.setattr(prepare_module, "iter_batches", lambda *a, **k: pytest.fail("the source was read again"))
    assert prepare_split(source, **kwargs) == first
    assert open_split(str(tmp_path / "out"), storage_options={}) == first
    # the same rows prepared elsewhere, in other batches: the same digest
    monkeypatch.setattr(prepare_module, "iter_batches", real)
    elsewhere = prepare_split(source, **{**kwargs, "out_url": str(tmp_path / "other")}, batch_size=7)
    assert (elsewhere.digest, elsewhere.num_rows) == (first.digest, first.num_rows)
    # another keep, or a changed source file: read again
    val = prepare_split(source, **{**kwargs, "keep": "val"})
    assert val.num_rows == 50 - first.num_rows and val.digest != first.digest
    write_jsonl(tmp_path / "a.jsonl", rows(60))
    again = prepare_split(source, **kwargs)
    assert again.counts["rows_read"] == 60 and again.digest != first.digest


def test_held_out_split_is_by_content_hash(tmp_path):
    items = rows(400)
    source = write_jsonl(tmp_path / "a.jsonl", items)
    common = dict(split="train", keys=KEYS, storage_options={}, val_fraction=0.25)
    train = prepare_split(source, out_url=str(tmp_path / "train"), keep="train", **common)
    val = prepare_split(source, out_url=str(tmp_path / "val"), keep="val", **common)
    train_rows = {r[ROW_COLUMN] for r in copy_rows(train.url)}
    val_rows = {r[ROW_COLUMN] for r in copy_rows(val.url)}
    assert train_rows.isdisjoint(val_rows) and train_rows | val_rows == set(range(400))
    assert val_rows == {i for i, r in enumerate(items) if split_of(r["prompt"], 0.25) == "val"}
    assert 60 < len(val_rows) < 140  # about a quarter
    assert (train.counts["held_out"], val.counts["held_out"]) == (len(val_rows), len(train_rows))
    problems = first_rows(val, 3, keys=KEYS, storage_options={})
    assert [p.row_id for p in problems] == [f"train:{i}" for i in sorted(val_rows)[:3]]


def test_overlong_prompts_are_skipped_and_counted(tmp_path):
    source = write_jsonl(tmp_path / "a.jsonl", rows(3000))
    batches: list[int] = []

    def fits(problems):
        batches.append(len(problems))
        return [not p.answer.endswith("0") for p in problems]  # the rows i with 3i ending in 0: i % 10 == 0

    split = prepare_split(
        source,
        out_url=str(tmp_path / "out"),
        split="train",
        keys=KEYS,
        storage_options={},
        keep="all",
        fits=fits,
        on_overlong_prompt="skip",
        batch_size=1000,
    )
    assert sum(batches) == 3000 and max(batches) <= 1000 and len(batches) >= 3
    assert split.counts == {"rows_read": 3000, "held_out": 0, "skipped_overlong": 300}
    assert [r[ROW_COLUMN] for r in copy_rows(split.url)] == [i for i in range(3000) if i % 10]


def test_a_copy_without_its_index_is_not_a_copy(tmp_path):
    source = write_jsonl(tmp_path / "a.jsonl", rows(3000))

    def fits(problems):
        if problems[0].row_id != "train:0":
            raise RuntimeError("the pod died")
        return [True] * len(problems)

    with pytest.raises(RuntimeError, match="the pod died"):
        prepare_split(
            source,
            out_url=str(tmp_path / "out"),
            split="train",
            keys=KEYS,
            storage_options={},
            keep="all",
            fits=fits,
            batch_size=1000,
        )
    assert not (tmp_path / "out" / "index.json").exists()
    with pytest.raises(
        DatasetError, match=r"out': no index.json there \(never prepared, or preparing did not finish\)"
    ):
        open_split(str(tmp_path / "out"), storage_options={})
    done = prepare_split(
        source, out_url=str(tmp_path / "out"), split="train", keys=KEYS, storage_options={}, keep="all"
    )
    assert done.num_rows == 3000 and len(copy_rows(done.url)) == 3000


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"keep='test'; use one of \['train', 'val', 'all'\]"):
        prepare_split("x.jsonl", out_url="o", split="train", keys=KEYS, storage_options={}, keep="test")
    with pytest.raises(ValueError, match=r"data.on_overlong_prompt='truncate'; use one of \['refuse', 'skip'\]"):
        prepare_split("x.jsonl", out_url="o", split="t", keys=KEYS, storage_options={}, on_overlong_prompt="truncate")
    with pytest.raises(ValueError, match=r"keep='val' needs a val_fraction"):
        prepare_split("x.jsonl", out_url="o", split="val", keys=KEYS, storage_options={}, keep="val")


def test_s3_source_and_copy(s3_server):
    options = {"endpoint_url": s3_server}
    fs = fsspec.filesystem("s3", **options)
    fs.pipe_file("grpoflow/datasets/shard-0.jsonl", "".join(json.dumps(r) + "\n" for r in rows(1500)).encode())
    fs.pipe_file("grpoflow/datasets/shard-1.jsonl", "".join(json.dumps(r) + "\n" for r in rows(2000)[1500:]).encode())
    split = prepare_split(
        "s3://grpoflow/datasets/",
        out_url="s3://grpoflow/prepared/train",
        split="train",
        keys=KEYS,
        storage_options=options,
        keep="all",
        batch_size=256,
    )
    assert split.num_rows == 2000 and split.source == "s3://grpoflow/datasets/"
    assert sorted(fs.ls("grpoflow/prepared/train", detail=False)) == [
        "grpoflow/prepared/train/index.json",
        "grpoflow/prepared/train/part-00000.parquet",
    ]
    assert open_split("s3://grpoflow/prepared/train", storage_options=options) == split
    stream = PromptStream(split, seed=3, keys=KEYS, storage_options=options)
    problems = stream.problems(1990, 20)  # across the epoch boundary
    perm0 = stream.rows(0, 2000)
    assert [p.row_id for p in problems[:10]] == [f"train:{i}" for i in perm0[1990:]]
    assert all(p.answer == str(3 * int(p.row_id.split(":")[1])) for p in problems)
    fs.pipe_file("grpoflow/bad/a.jsonl", b'{"prompt": "a", "answer": 1}\n{"prompt": "", "answer": 2}\n')
    with pytest.raises(
        DatasetError, match=r"^file 's3://grpoflow/bad/a.jsonl', line 2 \(row 1\), column 'prompt': the"
    ):
        prepare_split(
            "s3://grpoflow/bad/a.jsonl",
            out_url="s3://grpoflow/prepared/bad",
            split="train",
            keys=KEYS,
            storage_options=options,
        )
    again = prepare_split(
        "s3://grpoflow/datasets/",
        out_url="s3://grpoflow/prepared/train",
        split="train",
        keys=KEYS,
        storage_options=options,
        keep="all",
        batch_size=256,
    )
    assert again == split
