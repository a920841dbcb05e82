"""Reading user datasets: every format to the same Problems, shards, ``datasets`` folders, the Hub branch, chat
messages, and one test per bad input, each asserting that the message names the file, the line or row and the
column (real files written in ``tmp_path``)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

import rl.datasets.sources as sources
from rl.data import Problem
from rl.datasets import ColumnKeys, DatasetError, describe_source, first_rows, prepare_split

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": 2 * i, "level": "easy" if i % 2 else "hard"} for i in range(7)]
KEYS = ColumnKeys(prompt_key="prompt", answer_key="answer")


def write_jsonl(path: Path, rows: list[dict], *, blank_after: int | None = None) -> Path:
    lines = [json.dumps(r) for r in rows]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def read_all(spec: str, keys: ColumnKeys = KEYS, **kwargs) -> list[Problem]:
    out = Path(spec).parent / f"out-{Path(spec).name.replace('*', 'x')}"
    split = prepare_split(spec, out_url=str(out), split="train", keys=keys, storage_options={}, keep="all", **kwargs)
    return first_rows(split, 10**6, keys=keys, storage_options={})


def expected(rows: list[dict] = ROWS) -> list[Problem]:
    return [
        Problem(
            question=r["prompt"],
            answer=str(r["answer"]),
            entry={"answer": r["answer"], "level": r["level"]},
            task="default",
            row_id=f"train:{i}",
        )
        for i, r in enumerate(rows)
    ]


# ---------------------------------------------------------------- formats, shards, datasets folders


def test_every_format_reads_to_the_same_problems(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS, blank_after=3)  # a blank line is not a row
    (tmp_path / "b.json").write_text(json.dumps(ROWS, indent=2))  # one JSON array
    write_jsonl(tmp_path / "c.json", ROWS)  # JSON Lines named .json
    write_parquet(tmp_path / "d.parquet", ROWS)
    pcsv.write_csv(pa.Table.from_pylist(ROWS), tmp_path / "e.csv")
    (tmp_path / "f.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in ROWS).encode()))
    kinds = {}
    for name in ("a.jsonl", "b.json", "c.json", "d.parquet", "e.csv", "f.jsonl.gz"):
        assert read_all(str(tmp_path / name)) == expected(), name
        kinds[name] = describe_source(str(tmp_path / name), storage_options={}).kind
    assert kinds == {
        "a.jsonl": "jsonl",
        "b.json": "json",
        "c.json": "json",
        "d.parquet": "parquet",
        "e.csv": "csv",
        "f.jsonl.gz": "jsonl",
    }


def test_a_file_url_reads_like_its_path(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    assert read_all(f"file://{tmp_path}/a.jsonl") == expected()


def test_a_folder_or_glob_of_shards_reads_files_in_name_order(tmp_path):
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "a.jsonl", ROWS[:4])
    (tmp_path / "b.jsonl").write_text("")  # an empty shard: no rows, no columns
    write_jsonl(tmp_path / "c.jsonl", ROWS[4:])
    assert read_all(str(tmp_path / "*.jsonl")) == expected()
    write_parquet(shards / "part-1.parquet", ROWS[3:5])
    write_parquet(shards / "part-0.parquet", ROWS[:3])
    write_parquet(shards / "sub" / "part-2.parquet", ROWS[5:])  # folders are searched recursively
    (shards / "README.md").write_text("not data")
    info = describe_source(str(shards), storage_options={})
    assert [Path(f).name for f in info.files] == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    assert info.schema.names == ["prompt", "answer", "level"]
    assert read_all(str(shards)) == expected()
    assert read_all(str(shards / "part-*.parquet")) == expected()[:5]


def test_a_column_null_in_one_shard_takes_the_other_shards_type(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p0", "note": None}])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p1", "note": "n1"}])
    info = describe_source(str(tmp_path / "*.jsonl"), storage_options={})
    assert info.schema.field("note").type == pa.string()
    problems = read_all(str(tmp_path / "*.jsonl"), ColumnKeys())
    assert [(p.question, p.entry) for p in problems] == [("p0", {"note": None}), ("p1", {"note": "n1"})]


def test_save_to_disk_folders_dataset_and_dataset_dict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "one"))
    assert read_all(str(tmp_path / "one")) == expected()
    one = describe_source(str(tmp_path / "one"), storage_options={})
    assert one.kind == "hf_disk" and describe_source(str(tmp_path / "one"), storage_options={}).fingerprint == (
        one.fingerprint
    )  # the same folder loaded again: the same source (a retried prepare reads nothing)
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "dict"))
    assert read_all(str(tmp_path / "dict"), hf_split="test") == expected()[:2]
    with pytest.raises(
        DatasetError, match=r"no split is set; the splits are \['train', 'test'\]; set data.train_split"
    ):
        describe_source(str(tmp_path / "dict"), storage_options={})
    with pytest.raises(DatasetError, match=r"there is no split 'validation'; the splits are"):
        describe_source(str(tmp_path / "dict"), split="validation", storage_options={})


def test_a_hub_name_goes_to_load_dataset(tmp_path, monkeypatch):
    import datasets

    calls = []

    def load_dataset(name, config, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.chdir(tmp_path)  # no such local path
    info = describe_source("openai/gsm8k", split="train", hf_config_name="main", storage_options={})
    assert (info.kind, info.split, calls) == ("hf_hub", "train", [("openai/gsm8k", "main", "train")])
    split = prepare_split(
        "openai/gsm8k",
        out_url="out",
        split="train",
        keys=KEYS,
        storage_options={},
        hf_split="train",
        hf_config_name="main",
    )
    assert first_rows(split, 100, keys=KEYS, storage_options={}) == expected()


def test_a_name_that_is_neither_a_path_nor_a_hub_dataset(tmp_path, monkeypatch):
    import datasets

    def load_dataset(name, config, split=None):
        raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError) as err:
        describe_source("data/prompts", split="train", storage_options={})
    assert "'data/prompts' is neither an existing file or folder (no such path) nor a Hugging Face dataset" in str(
        err.value
    )
    assert "FileNotFoundError: Dataset 'data/prompts' doesn't exist on the Hub" in str(err.value)


def test_a_messages_column(tmp_path):
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": f"Add 1 and {i}."},
            ],
            "answer": str(i + 1),
        }
        for i in range(3)
    ]
    write_jsonl(tmp_path / "chat.jsonl", rows)
    keys = ColumnKeys(prompt_key="messages", answer_key="answer", task_key=None, default_task="math")
    problems = read_all(str(tmp_path / "chat.jsonl"), keys)
    assert [p.question for p in problems] == ["Add 1 and 0.", "Add 1 and 1.", "Add 1 and 2."]
    assert problems[2].messages == tuple(rows[2]["messages"])
    assert (problems[2].answer, problems[2].entry, problems[2].task) == ("3", {"answer": "3"}, "math")


def test_a_task_column_routes_rows(tmp_path):
    rows = [{"prompt": "p0", "env": "math"}, {"prompt": "p1", "env": "code"}]
    write_jsonl(tmp_path / "a.jsonl", rows)
    keys = ColumnKeys(task_key="env")
    problems = read_all(str(tmp_path / "a.jsonl"), keys, tasks={"math", "code"})
    assert [(p.task, p.answer, p.entry) for p in problems] == [
        ("math", "", {"env": "math"}),
        ("code", "", {"env": "code"}),
    ]


# ---------------------------------------------------------------- bad inputs: what, where (file, line/row, column), fix


def prepare_error(tmp_path: Path, spec: str, keys: ColumnKeys = KEYS, **kwargs) -> str:
    with pytest.raises(DatasetError) as err:
        prepare_split(spec, out_url=str(tmp_path / "out"), split="train", keys=keys, storage_options={}, **kwargs)
    return str(err.value)


def test_no_such_file(tmp_path):
    msg = prepare_error(tmp_path, str(tmp_path / "missing.jsonl"))
    assert f"data source '{tmp_path}/missing.jsonl': no such file or folder" in msg


def test_no_such_object_on_a_url(tmp_path):
    msg = prepare_error(tmp_path, f"file://{tmp_path}/missing.parquet")
    assert "missing.parquet': no such file or folder" in msg


def test_a_glob_that_matches_nothing(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    msg = prepare_error(tmp_path, str(tmp_path / "*.jsonl"))
    assert f"'{tmp_path}/*.jsonl': the glob matches no .jsonl/.json/.parquet/.csv file" in msg


def test_an_unknown_extension(tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    msg = prepare_error(tmp_path, str(tmp_path / "data.txt"))
    assert "data.txt': unknown extension '.txt'; use a .jsonl, .json, .parquet or .csv file" in msg


def test_a_folder_without_data_files(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("x")
    msg = prepare_error(tmp_path, str(tmp_path / "d"))
    assert "the folder holds no .jsonl/.json/.parquet/.csv file (it holds ['notes.txt'])" in msg


def test_shards_whose_schemas_disagree(tmp_path):
    write_parquet(tmp_path / "a.parquet", [{"prompt": "p", "answer": 1}])
    write_parquet(tmp_path / "b.parquet", [{"prompt": "p", "answer": "one"}])
    msg = prepare_error(tmp_path, str(tmp_path / "*.parquet"))
    assert f"column 'answer' is int64 in '{tmp_path}/a.parquet' but string in '{tmp_path}/b.parquet'" in msg
    write_parquet(tmp_path / "b.parquet", [{"prompt": "p"}])
    msg = prepare_error(tmp_path, str(tmp_path / "*.parquet"))
    assert f"column 'answer' is in '{tmp_path}/a.parquet' but not in '{tmp_path}/b.parquet'" in msg


def test_a_missing_column_lists_the_columns(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    msg = prepare_error(tmp_path, str(tmp_path / "a.jsonl"), ColumnKeys(prompt_key="question"))
    assert "there is no column 'question' (data.prompt_key); the columns are ['prompt', 'answer', 'level']" in msg
    msg = prepare_error(tmp_path, str(tmp_path / "a.jsonl"), ColumnKeys(answer_key="solution"))
    assert "no column 'solution' (data.answer_key)" in msg


def test_an_empty_prompt_names_file_line_and_column(tmp_path):
    rows = [dict(r) for r in ROWS]
    rows[4]["prompt"] = "  "
    write_jsonl(tmp_path / "a.jsonl", rows, blank_after=2)  # the blank line moves row 4 to line 6
    msg = prepare_error(tmp_path, str(tmp_path / "a.jsonl"))
    assert f"file '{tmp_path}/a.jsonl', line 6 (row 4), column 'prompt': the prompt is empty ('  ')" in msg
    rows[4]["prompt"] = None
    write_parquet(tmp_path / "b.parquet", rows)
    msg = prepare_error(tmp_path, str(tmp_path / "b.parquet"))
    assert f"file '{tmp_path}/b.parquet', row 4, column 'prompt': the prompt is missing (null)" in msg


def test_a_non_string_prompt(tmp_path):
    write_parquet(tmp_path / "a.parquet", [{"prompt": None}, {"prompt": 7}])
    msg = prepare_error(tmp_path, str(tmp_path / "a.parquet"), ColumnKeys())
    assert f"file '{tmp_path}/a.parquet', row 1, column 'prompt': the prompt is 7 of type int64" in msg


def test_a_bad_messages_prompt(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}]}
    bad = {"messages": [{"role": "system", "content": "sys"}]}
    write_jsonl(tmp_path / "a.jsonl", [good, good, bad])
    msg = prepare_error(tmp_path, str(tmp_path / "a.jsonl"), ColumnKeys(prompt_key="messages"))
    assert f"'{tmp_path}/a.jsonl', line 3 (row 2), column 'messages': the chat-messages prompt has no message " in msg
    write_jsonl(tmp_path / "b.jsonl", [good, {"messages": []}])
    msg = prepare_error(tmp_path, str(tmp_path / "b.jsonl"), ColumnKeys(prompt_key="messages"))
    assert "line 2 (row 1), column 'messages': the chat-messages prompt is not a non-empty list" in msg


def test_a_malformed_json_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c",,}\n')
    msg = prepare_error(tmp_path, str(path), ColumnKeys())
    # '{"prompt": "c",' is 15 characters: the second comma, where a key should be, is column 16
    assert f"file '{path}', line 3, column 16: malformed JSON (Expecting property name" in msg


def test_a_malformed_json_array(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[\n {"prompt": "a"},\n {"prompt": "b"\n]\n')
    msg = prepare_error(tmp_path, str(path), ColumnKeys())
    assert f"file '{path}', line 4, column 1: malformed JSON (Expecting ',' delimiter)" in msg


def test_non_utf8_bytes(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    msg = prepare_error(tmp_path, str(path), ColumnKeys())
    # line 1 is 16 bytes with its newline; '{"prompt": "caf' is 15 more: 0xE9 is byte 31
    assert f"file '{path}', line 2 (byte offset 31): not UTF-8 text (invalid continuation byte)" in msg
    csv = tmp_path / "a.csv"
    csv.write_bytes(b"prompt,answer\nok,1\ncaf\xe9,2\n")
    msg = prepare_error(tmp_path, str(csv), ColumnKeys())
    assert f"file '{csv}', line 3 (byte offset 22): not UTF-8 text" in msg


def test_a_column_whose_json_type_changes(tmp_path):
    path = tmp_path / "a.jsonl"
    write_jsonl(path, [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": None}, {"prompt": "c", "answer": "x"}])
    msg = prepare_error(tmp_path, str(path), ColumnKeys())
    assert f"file '{path}', line 3, column 'answer': a string where line 1 has a number" in msg


def test_an_unknown_task(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p0", "env": "math"}, {"prompt": "p1", "env": "chess"}])
    msg = prepare_error(tmp_path, str(tmp_path / "a.jsonl"), ColumnKeys(task_key="env"), tasks=["math", "code"])
    assert f"'{tmp_path}/a.jsonl', line 2 (row 1), column 'env': task 'chess' is not a known task" in msg
    assert "(the known tasks are ['code', 'math'])" in msg


def test_a_prompt_that_does_not_fit_names_both_fixes(tmp_path):
    pcsv.write_csv(pa.Table.from_pylist(ROWS), tmp_path / "a.csv")
    msg = prepare_error(tmp_path, str(tmp_path / "a.csv"), fits=lambda ps: [p.answer != "6" for p in ps])
    assert f"file '{tmp_path}/a.csv', row 3 (line 5 counting the header), column 'prompt': the prompt does not" in msg
    assert "lower generation.max_new_tokens" in msg and "set data.on_overlong_prompt: skip" in msg


def test_no_row_kept(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    msg = prepare_error(
        tmp_path, str(tmp_path / "a.jsonl"), fits=lambda ps: [False] * len(ps), on_overlong_prompt="skip"
    )
    assert "no row kept for split 'train' (7 read, 0 in the other split, 7 overlong prompts skipped)" in msg


def test_credentials_in_a_url_are_redacted(tmp_path):
    with pytest.raises(DatasetError) as err:
        describe_source("memory://alice:s3cret@bucket/none.jsonl", storage_options={})
    assert "s3cret" not in str(err.value) and "memory://***@bucket/none.jsonl" in str(err.value)


# ---------------------------------------------------------------- schemas of text files read block by block


@pytest.fixture
def small_blocks(monkeypatch):
    """JSON and CSV files read in 256-byte blocks, so that a few rows span several blocks."""
    monkeypatch.setattr(sources, "_BLOCK", 256)


def test_a_json_key_null_in_the_first_blocks_takes_its_later_type(tmp_path, small_blocks):
    items = [
        {"prompt": f"p{i}", "note": None if i < 30 else f"n{i}", "meta": {"k": None if i < 30 else i}}
        for i in range(40)
    ]
    write_jsonl(tmp_path / "a.jsonl", items)
    info = describe_source(str(tmp_path / "a.jsonl"), storage_options={})
    assert str(info.schema) == str(
        pa.schema([("prompt", pa.string()), ("note", pa.string()), ("meta", pa.struct([("k", pa.int64())]))])
    )
    problems = read_all(str(tmp_path / "a.jsonl"), ColumnKeys())
    assert [p.entry for p in problems] == [{"note": r["note"], "meta": r["meta"]} for r in items]


def test_an_empty_csv_column_is_text(tmp_path, small_blocks):
    lines = ["prompt,hint"] + [f"p{i}," for i in range(30)] + [f"p{i},h{i}" for i in range(30, 40)]
    (tmp_path / "a.csv").write_text("\n".join(lines) + "\n")
    problems = read_all(str(tmp_path / "a.csv"), ColumnKeys())
    assert [p.entry["hint"] for p in problems] == [""] * 30 + [f"h{i}" for i in range(30, 40)]  # CSV: empty text


def test_a_json_key_that_appears_late(tmp_path, small_blocks):
    items = [{"prompt": f"p{i}"} for i in range(30)] + [{"prompt": "late", "extra": 1}]
    write_jsonl(tmp_path / "a.jsonl", items)
    msg = prepare_error(tmp_path, str(tmp_path / "a.jsonl"), ColumnKeys())
    assert f"file '{tmp_path}/a.jsonl', line 31, column 'extra': a key that the rows the schema was read from" in msg
