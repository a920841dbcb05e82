"""Where a user dataset comes from: `describe_source` resolves a spec (a file, folder of shards or glob on any fsspec
filesystem, a ``datasets`` ``save_to_disk`` folder, or a Hugging Face Hub name) into its files and one schema, and
`iter_batches` streams its rows batch by batch (pyarrow's JSON, CSV and Parquet readers; ``datasets``' Arrow tables),
file by file in name order. Errors in a file (malformed JSON, non-UTF-8 bytes) are located by `locate` to the file's
line and byte offset."""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.json as pjson
import pyarrow.parquet as pq

from dataplane.urls import redact
from rl.datasets.errors import DatasetError

__all__ = ["SourceBatch", "SourceInfo", "describe_source", "iter_batches", "locate"]

_KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}
_KINDS[".csv"] = "csv"
_COMPRESSION = {".gz", ".bz2", ".xz", ".zst", ".lz4"}
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_BLOCK = 8 << 20  # bytes per pyarrow JSON/CSV block: one row may not be longer
_IDENTITY_KEYS = ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "last_modified", "updated")


@dataclass(frozen=True)
class SourceInfo:
    """A resolved dataset source.

    Attributes:
        url: the spec with credentials redacted.
        kind: ``"jsonl"``, ``"json"``, ``"parquet"``, ``"csv"`` (files; a folder or glob holds one kind),
            ``"hf_disk"`` (a ``save_to_disk`` folder) or ``"hf_hub"``.
        files: the files read, in read order (sorted by name); a ``datasets`` source's Arrow cache files.
        schema: the columns of every row (shards' schemas unified: a column null in one shard takes the other's type).
        fingerprint: identifies the source's content: sha256 over each file's path, size and ETag or mtime, or the
            ``datasets`` fingerprint; a change of any file changes it.
        split: the ``datasets`` split read (``hf_disk``/``hf_hub``), else None.
    """

    url: str
    kind: str
    files: list[str]
    schema: pa.Schema
    fingerprint: str = ""
    split: str | None = None
    dataset: Any = field(default=None, repr=False, compare=False)
    fs: Any = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class SourceBatch:
    """Consecutive rows of one file of a source.

    Attributes:
        file: the file (or ``datasets`` split) they come from.
        file_row: the first row's index in that file, from 0.
        source_row: the first row's index in the whole source (files in read order), from 0.
        batch: the rows, with the source's unified schema.
    """

    file: str
    file_row: int
    source_row: int
    batch: pa.RecordBatch


def _kind_of(path: str) -> str | None:
    suffixes = [s.lower() for s in PurePosixPath(path).suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION:
        suffixes.pop()
    return _KINDS.get(suffixes[-1]) if suffixes else None


def _has_scheme(spec: str) -> bool:
    return "://" in spec or "::" in spec


def _fingerprint(parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _identity(info: dict[str, Any]) -> dict[str, Any]:
    return {"size": info.get("size"), **{k: str(info[k]) for k in _IDENTITY_KEYS if info.get(k) is not None}}


def describe_source(
    spec: str, *, split: str | None = None, hf_config_name: str | None = None, storage_options: dict | None = None
) -> SourceInfo:
    """Resolve a dataset spec into its files and schema, reading no rows but each shard's first block for its schema.

    Args:
        spec: a local path or fsspec URL (``s3://``, ``gs://``, ``az://``, ``file://``, ...) of a ``.jsonl``/
            ``.json``/``.parquet``/``.csv`` file (optionally ``.gz``/``.bz2``/``.xz``/``.zst``), a folder of such
            shards (searched recursively) or a glob; a folder written by ``datasets``' ``save_to_disk``; or a
            Hugging Face Hub name (``openai/gsm8k``) loaded with ``datasets.load_dataset``.
        split: the ``datasets`` split to read (a ``DatasetDict`` folder or a Hub dataset); files ignore it.
        hf_config_name: the Hub dataset's configuration (``"main"`` for gsm8k).
        storage_options: fsspec options of the filesystem (``endpoint_url``, ``key``, ...).

    Returns:
        The `SourceInfo`.

    Raises:
        DatasetError: no such file or folder; a glob or folder with no data file; an unknown extension; files of
            different kinds; shards whose schemas disagree (naming both files and the column); a missing or
            unknown ``datasets`` split; a spec that is neither a path nor a Hub dataset that loads.
    """
    storage_options = dict(storage_options or {})
    if not isinstance(spec, str) or not spec.strip():
        msg = f"data source {spec!r} is empty; set it to a file, folder, glob or Hugging Face dataset name"
        raise DatasetError(msg)
    url = redact(spec)
    try:
        fs, path = fsspec.core.url_to_fs(spec, **storage_options)
    except (ImportError, ValueError) as err:  # an unknown protocol, or its package (s3fs, gcsfs, adlfs) missing
        msg = f"data source {url!r}: fsspec cannot open it ({err}); check the URL's protocol or install its package"
        raise DatasetError(redact(msg)) from None
    if any(c in path for c in "*?["):
        found = fs.glob(path, detail=True)
        files = {p: i for p, i in found.items() if i.get("type") != "directory" and _kind_of(p)}
        if not files:
            msg = (
                f"data source {url!r}: the glob matches no .jsonl/.json/.parquet/.csv file (it matches "
                f"{len(found)} paths); check the pattern and the extension of the files"
            )
            raise DatasetError(msg)
        return _files_source(url, fs, files)
    if fs.isdir(path):
        if any(fs.exists(f"{path.rstrip('/')}/{m}") for m in _HF_MARKERS):
            return _hf_disk(spec, url, split, storage_options)
        found = fs.find(path, detail=True)
        files = {p: i for p, i in found.items() if _kind_of(p)}
        if not files:
            names = sorted(PurePosixPath(p).name for p in found)[:10]
            msg = (
                f"data source {url!r}: the folder holds no .jsonl/.json/.parquet/.csv file (it holds {names}); "
                f"point data.train (or data.validation) at the data files or a datasets save_to_disk folder"
            )
            raise DatasetError(msg)
        return _files_source(url, fs, files)
    if fs.isfile(path):
        if _kind_of(path) is None:
            msg = (
                f"data source {url!r}: unknown extension {PurePosixPath(path).suffix!r}; use a .jsonl, .json, "
                f".parquet or .csv file (optionally compressed: .gz, .bz2, .xz, .zst)"
            )
            raise DatasetError(msg)
        return _files_source(url, fs, {path: fs.info(path)})
    if _has_scheme(spec) or _kind_of(spec) or not _HUB_NAME.fullmatch(spec):
        msg = f"data source {url!r}: no such file or folder; check the path (and the storage options for a URL)"
        raise DatasetError(msg)
    return _hf_hub(spec, url, split, hf_config_name)


def _shown(fs: Any, path: str) -> str:
    """A file as messages show it and ``fs.open`` takes it: the local path, or the URL (``s3://bucket/key``)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else fs.unstrip_protocol(path)


def _files_source(url: str, fs: Any, found: dict[str, dict[str, Any]]) -> SourceInfo:
    files = {_shown(fs, p): info for p, info in found.items()}
    names = sorted(files)
    kinds = {p: _kind_of(p) for p in names}
    if len(set(kinds.values())) > 1:
        a = names[0]
        b = next(p for p in names if kinds[p] != kinds[a])
        msg = (
            f"data source {url!r} mixes file kinds: {a!r} is {kinds[a]} and {b!r} is {kinds[b]}; keep one format "
            f"per source"
        )
        raise DatasetError(msg)
    kind = kinds[names[0]]
    schemas = [(p, _file_schema(fs, p, kind)) for p in names]
    schema = _unify([(p, sch) for p, sch in schemas if len(sch)] or schemas)  # an empty text shard has no columns
    fingerprint = _fingerprint([[p, _identity(files[p])] for p in names])
    return SourceInfo(url=url, kind=kind, files=names, schema=schema, fingerprint=fingerprint, fs=fs)


def _unify(schemas: list[tuple[str, pa.Schema]]) -> pa.Schema:
    """One schema for all shards: same column names; each column's type equal or null in some shards."""
    first_file, first = schemas[0]
    fields = {f.name: f for f in first}
    owner = {f.name: first_file for f in first}
    for path, schema in schemas[1:]:
        names = set(schema.names)
        for name in fields:
            if name not in names:
                msg = (
                    f"shards disagree: column {name!r} is in {owner[name]!r} but not in {path!r}; give every shard "
                    f"the same columns"
                )
                raise DatasetError(msg)
        for f in schema:
            if f.name not in fields:
                msg = (
                    f"shards disagree: column {f.name!r} is in {path!r} but not in {first_file!r}; give every shard "
                    f"the same columns"
                )
                raise DatasetError(msg)
            have = fields[f.name].type
            if have == f.type or pa.types.is_null(f.type):
                continue
            if pa.types.is_null(have):
                fields[f.name], owner[f.name] = f.with_nullable(True), path
                continue
            msg = (
                f"shards disagree: column {f.name!r} is {have} in {owner[f.name]!r} but {f.type} in {path!r}; give "
                f"the column the same type in every shard"
            )
            raise DatasetError(msg)
    return pa.schema([fields[f.name] for f in first])


def _open(fs: Any, path: str) -> Any:
    return fs.open(path, "rb", compression="infer")


def _has_null(t: pa.DataType) -> bool:
    """Whether ``t`` is or holds the null type (a JSON key or CSV column with no value yet)."""
    return pa.types.is_null(t) or any(_has_null(t.field(i).type) for i in range(t.num_fields))


def _file_schema(fs: Any, path: str, kind: str) -> pa.Schema:
    """A file's schema: Parquet's footer; CSV's first block (a column empty there is text); JSON's first block,
    and the following blocks while a key has only nulls so far (its type is that of its first value)."""
    if kind == "parquet":
        with _open(fs, path) as f:
            return pq.read_schema(f).remove_metadata()
    schema = None
    for batch in _read_file(fs, path, kind, _BLOCK, None):
        schema = batch.schema if schema is None else _merge(path, schema, batch.schema)
        if kind == "csv" or not any(_has_null(t) for t in schema.types):
            break
    if schema is None:
        return pa.schema([])
    if kind == "csv":
        schema = pa.schema([f.with_type(pa.string()) if pa.types.is_null(f.type) else f for f in schema])
    return schema.remove_metadata()


def _merge(path: str, schema: pa.Schema, more: pa.Schema) -> pa.Schema:
    try:
        return pa.unify_schemas([schema, more])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        msg = f"file {path!r}: a column changes type between rows ({err}); give each column one type in every row"
        raise DatasetError(msg) from None


def _is_json_array(f: Any) -> bool:
    head = f.read(4096)
    f.seek(0)
    text = head.lstrip(codecs.BOM_UTF8).lstrip()
    return text[:1] == b"["


def _line_blocks(f: Any, block: int) -> Iterator[bytes]:
    """The file's bytes in pieces of about ``block`` bytes, each ending at a line end (the last one at EOF)."""
    rest = b""
    while True:
        data = f.read(block)
        if not data:
            break
        data = rest + data
        cut = data.rfind(b"\n") + 1
        if cut == 0:  # one line longer than a block: read on
            rest = data
            continue
        rest = data[cut:]
        yield data[:cut]
    if rest.strip():
        yield rest


def _read_file(fs: Any, path: str, kind: str, block: int, schema: pa.Schema | None) -> Iterator[pa.RecordBatch]:
    """Batches of one file as its reader gives them, typed as ``schema`` when given (CSV, JSON Lines); errors are
    raised as `DatasetError` located in the file."""
    try:
        with _open(fs, path) as f:
            if kind == "parquet":
                yield from pq.ParquetFile(f).iter_batches(batch_size=max(1, block // 256))
            elif kind == "csv":
                convert = pcsv.ConvertOptions(column_types=schema) if schema is not None else None
                reader = pcsv.open_csv(f, read_options=pcsv.ReadOptions(block_size=block), convert_options=convert)
                for batch in reader:
                    _check_csv_text(fs, path, batch)
                    yield batch
            elif kind == "json" and _is_json_array(f):
                yield from _json_array(path, f.read())
            else:
                parse = pjson.ParseOptions(explicit_schema=schema) if schema is not None else None
                for data in _line_blocks(f, block):
                    options = pjson.ReadOptions(block_size=len(data) + 1, use_threads=False)
                    table = pjson.read_json(pa.BufferReader(data), read_options=options, parse_options=parse)
                    for batch in table.to_batches():
                        _validate(fs, path, kind, batch)
                        yield batch
    except pa.ArrowInvalid as err:
        raise _diagnose(fs, path, kind, err) from None


def _json_array(path: str, data: bytes) -> Iterator[pa.RecordBatch]:
    try:
        rows = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        msg = f"file {path!r}, line {line} (byte offset {err.start}): not UTF-8 text ({err.reason}); save it as UTF-8"
        raise DatasetError(msg) from None
    except json.JSONDecodeError as err:
        msg = f"file {path!r}, line {err.lineno}, column {err.colno}: malformed JSON ({err.msg}); fix the file"
        raise DatasetError(msg) from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        i = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), 0) if isinstance(rows, list) else 0
        msg = (
            f"file {path!r}, element {i} of the array: not a JSON object; write one array of objects or JSON Lines "
            f"(one object per line)"
        )
        raise DatasetError(msg)
    if rows:
        yield pa.RecordBatch.from_pylist(rows)


def _validate(fs: Any, path: str, kind: str, batch: pa.RecordBatch) -> None:
    try:
        batch.validate(full=True)
    except pa.ArrowInvalid as err:  # pyarrow's JSON reader passes invalid UTF-8 through to the strings
        raise _diagnose(fs, path, kind, err) from None


def _check_csv_text(fs: Any, path: str, batch: pa.RecordBatch) -> None:
    """pyarrow's CSV reader reads a column with non-UTF-8 bytes as binary: find the line."""
    if any(pa.types.is_binary(t) or pa.types.is_large_binary(t) for t in batch.schema.types):
        raise _diagnose(fs, path, "csv", pa.ArrowInvalid("non-UTF-8 bytes in a text column"))


def _lines(fs: Any, path: str) -> Iterator[tuple[int, int, bytes]]:
    """``(line number from 1, byte offset, bytes)`` of each line of a (decompressed) file."""
    offset = 0
    with _open(fs, path) as f:
        for number, line in enumerate(f, start=1):
            yield number, offset, line
            offset += len(line)


def _diagnose(fs: Any, path: str, kind: str, err: Exception) -> DatasetError:
    """Find the first bad line of a text file that pyarrow refused: non-UTF-8, malformed JSON, not an object, or a
    key whose JSON type changes."""
    types: dict[str, tuple[str, int]] = {}
    for number, offset, raw in _lines(fs, path):
        try:
            text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as bad:
            msg = (
                f"file {path!r}, line {number} (byte offset {offset + bad.start}): not UTF-8 text ({bad.reason}); "
                f"save the file as UTF-8"
            )
            return DatasetError(msg)
        if kind == "csv" or not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as bad:
            msg = (
                f"file {path!r}, line {number}, column {bad.colno}: malformed JSON ({bad.msg}); write one JSON object "
                f"per line"
            )
            return DatasetError(msg)
        if not isinstance(row, dict):
            msg = f"file {path!r}, line {number}: a JSON {type(row).__name__}, not an object; write one object per line"
            return DatasetError(msg)
        for key, value in row.items():
            if value is None:
                continue
            t = {bool: "boolean", int: "number", float: "number", str: "string", list: "list", dict: "object"}.get(
                type(value), type(value).__name__
            )
            seen = types.setdefault(key, (t, number))
            if seen[0] != t:
                msg = (
                    f"file {path!r}, line {number}, column {key!r}: a {t} where line {seen[1]} has a {seen[0]}; give "
                    f"the column one type in every row"
                )
                return DatasetError(msg)
    return DatasetError(f"file {path!r}: cannot be read as {kind} ({err}); fix the file")


def locate(info: SourceInfo, file: str, file_row: int) -> str:
    """Where row ``file_row`` (from 0) of ``file`` is, for a message: ``"file 'x.jsonl', line 4 (row 3)"``.

    JSON Lines: the line of the row, found by reading the file up to it (blank lines are not rows); CSV: the data row
    (line ``file_row + 2`` without values spanning lines); other kinds: the row.
    """
    if info.kind == "jsonl" or (info.kind == "json" and not _array_file(info, file)):
        seen = -1
        for number, _, raw in _lines(info.fs, file):
            seen += bool(raw.strip())
            if seen == file_row:
                return f"file {file!r}, line {number} (row {file_row})"
    if info.kind == "csv":
        return f"file {file!r}, row {file_row} (line {file_row + 2} counting the header)"
    if info.kind in ("hf_disk", "hf_hub"):
        return f"{file}, row {file_row}"
    return f"file {file!r}, row {file_row}"


def _array_file(info: SourceInfo, file: str) -> bool:
    with _open(info.fs, file) as f:
        return _is_json_array(f)


def iter_batches(info: SourceInfo, *, batch_size: int = 65536) -> Iterator[SourceBatch]:
    """Stream a source's rows: files in ``info.files`` order, each in batches of at most ``batch_size`` rows, cast to
    ``info.schema``; never the whole source in memory (a JSON array file excepted: it is parsed whole).

    Raises:
        DatasetError: a file that cannot be read (located to its line: malformed JSON, non-UTF-8 bytes, a column
            whose type changes).
    """
    source_row = 0
    if info.dataset is not None:
        where = f"dataset {info.url!r} split {info.split!r}"
        file_row = 0
        for table in info.dataset.with_format("arrow").iter(batch_size=batch_size):
            for batch in table.replace_schema_metadata(None).to_batches():
                yield SourceBatch(where, file_row, source_row, batch)
                file_row += batch.num_rows
                source_row += batch.num_rows
        return
    for path in info.files:
        file_row = 0
        for raw in _read_file(info.fs, path, info.kind, _BLOCK, info.schema):
            extra = [name for name in raw.schema.names if name not in info.schema.names]
            if extra:
                raise _late_key(info, path, extra[0], file_row)
            table = pa.Table.from_batches([raw])
            try:
                table = table.select(info.schema.names).cast(info.schema)
            except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError) as err:
                msg = (
                    f"file {path!r}, rows {file_row}..{file_row + raw.num_rows - 1}: columns {raw.schema.names} do "
                    f"not match the source's {info.schema.names} ({err}); give every row the same columns and types"
                )
                raise DatasetError(msg) from None
            for batch in table.to_batches(max_chunksize=batch_size):
                yield SourceBatch(path, file_row, source_row, batch)
                file_row += batch.num_rows
                source_row += batch.num_rows


def _late_key(info: SourceInfo, path: str, key: str, file_row: int) -> DatasetError:
    """A JSON key first seen after the rows the schema was read from: find its first line."""
    line = next((n for n, _, raw in _lines(info.fs, path) if f'"{key}"'.encode() in raw), None)
    where = f"line {line}" if line is not None else f"after row {file_row}"
    msg = (
        f"file {path!r}, {where}, column {key!r}: a key that the rows the schema was read from (the file's first "
        f"{_BLOCK >> 20} MiB) do not have; give every row every key (null where it has no value)"
    )
    return DatasetError(msg)


# ---------------------------------------------------------------- datasets (save_to_disk folders, the Hub)


def _pick_split(obj: Any, split: str | None, where: str) -> tuple[Any, str | None]:
    import datasets

    if isinstance(obj, datasets.Dataset):
        return obj, split
    names = list(obj)
    if split is None and len(names) == 1:
        return obj[names[0]], names[0]
    if split not in names:
        what = "no split is set" if split is None else f"there is no split {split!r}"
        msg = f"{where}: {what}; the splits are {names}; set data.train_split (or data.validation_split) to one of them"
        raise DatasetError(msg)
    return obj[split], split


def _from_dataset(url: str, kind: str, ds: Any, split: str | None) -> SourceInfo:
    files = [c["filename"] for c in ds.cache_files]
    schema = ds.data.schema.remove_metadata()
    fingerprint = _fingerprint([kind, url, split, ds._fingerprint])
    return SourceInfo(url=url, kind=kind, files=files, schema=schema, fingerprint=fingerprint, split=split, dataset=ds)


def _hf_disk(spec: str, url: str, split: str | None, storage_options: dict) -> SourceInfo:
    import datasets

    where = f"datasets folder {url!r}"
    try:
        obj = datasets.load_from_disk(spec, storage_options=storage_options or None)
    except (FileNotFoundError, ValueError, OSError) as err:
        msg = f"{where}: cannot be loaded with datasets.load_from_disk ({err}); write it with save_to_disk"
        raise DatasetError(redact(msg)) from None
    ds, split = _pick_split(obj, split, where)
    return _from_dataset(url, "hf_disk", ds, split)


def _hf_hub(spec: str, url: str, split: str | None, config: str | None) -> SourceInfo:
    import datasets

    where = f"Hugging Face dataset {url!r} (config {config!r})"
    try:
        obj = datasets.load_dataset(spec, config, split=split)
    except Exception as err:  # noqa: BLE001  any failure of the Hub loader means: not a Hub dataset we can read
        msg = (
            f"data source {url!r} is neither an existing file or folder (no such path) nor a Hugging Face dataset "
            f"that loads (datasets.load_dataset({spec!r}, {config!r}, split={split!r}) raised "
            f"{type(err).__name__}: {err}); check the path, or the dataset name, data.hf_config_name and "
            f"data.train_split (data.validation_split)"
        )
        raise DatasetError(redact(msg)) from None
    ds, split = _pick_split(obj, split, where)
    return _from_dataset(url, "hf_hub", ds, split)
