"""What a write's check after its commit costs, and what it finds: on a real S3 server on loopback (moto), the check
(``dataplane.gc.file_state``) is one LIST of the data file's stem, which shows both the claims of garbage collections
on the file and the file itself; on a local folder and on S3 it tells a claimed, a removed and an untouched file apart.

Requests are counted at s3fs's botocore client (every call of ``_make_api_call``, as ``bench/dataplane.py`` counts
them), by operation and key.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dataplane import gc
from dataplane.client import DataPlane

PART = "step_000001"


def _log_requests(monkeypatch, fs) -> list[tuple[str, str]]:
    """Record (operation, key or prefix) of every request ``fs`` (s3fs) sends from now on."""
    fs.connect()
    client = fs.s3
    real = client._make_api_call
    log: list[tuple[str, str]] = []

    async def call(operation, params):
        log.append((operation, params.get("Key", params.get("Prefix", ""))))
        return await real(operation, params)

    monkeypatch.setattr(client, "_make_api_call", call)
    return log


@pytest.fixture
def s3_plane(s3_server):
    import fsspec

    fsspec.filesystem("s3").clear_instance_cache()
    dp = DataPlane(
        f"s3://grpoflow/requests-{uuid.uuid4().hex[:8]}", "run-req", storage_options={"endpoint_url": s3_server}
    )
    dp.register_partition(PART, fields={"a": "float32", "b": "float32"})
    return dp


def _after_commit(log: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The requests after the (last) commit record's PUT."""
    last = max(i for i, (op, key) in enumerate(log) if op == "PutObject" and "/_commits/" in key)
    return log[last + 1 :]


def _stem_prefix(log: list[tuple[str, str]]) -> str:
    """``{partition}/data/{stem}.`` of the one data file the logged write uploaded."""
    (key,) = [key for op, key in log if op == "PutObject" and key.endswith(".parquet")]
    return key.removesuffix(".parquet") + "."


def test_a_put_and_a_delta_write_check_their_file_with_one_listing(s3_plane, monkeypatch):
    log = _log_requests(monkeypatch, s3_plane.fs)
    meta = s3_plane.put(PART, {"a": torch.tensor([1.0, 2.0, 3.0, 4.0])}, group_size=2)
    # list the partition, read the schema, upload the file, write the commit record, check: 5 requests
    assert [op for op, _ in log] == ["ListObjectsV2", "GetObject", "PutObject", "PutObject", "ListObjectsV2"], log
    assert _after_commit(log) == [("ListObjectsV2", _stem_prefix(log))]

    log.clear()
    meta = s3_plane.write_columns(meta, {"b": torch.tensor([0.5, -1.5, 2.5, -3.5])})
    # ... and the put's record read too: 6 requests
    ops = [op for op, _ in log]
    assert ops == ["ListObjectsV2", "GetObject", "GetObject", "PutObject", "PutObject", "ListObjectsV2"], log
    assert _after_commit(log) == [("ListObjectsV2", _stem_prefix(log))]
    assert s3_plane.read(meta, ["a", "b"])["b"].tolist() == [0.5, -1.5, 2.5, -3.5]


def _io(what: str, fn: Callable[[], Any]) -> Any:
    return fn()


def test_file_state_tells_claimed_removed_and_untouched_files_apart(store):
    root, options = store
    dp = DataPlane(root, "run-state", storage_options=options)
    folder = f"{dp._part(PART)}/data"
    stem = f"{'a' * 32}-0000000a"
    data = f"{folder}/{stem}.parquet"
    assert gc.file_state(dp.fs, data, _io) == gc.FileState([], [], False)  # no folder yet
    if dp._local:
        dp.fs.makedirs(folder, exist_ok=True)
    dp.fs.pipe_file(data, b"data")
    other = f"{folder}/{'a' * 32}-0000000b.parquet"  # another attempt of the same write, claimed
    dp.fs.pipe_file(other, b"another attempt")
    dp.fs.pipe_file(gc.claim_path(other, "f" * 32), b"")
    assert gc.file_state(dp.fs, data, _io) == gc.FileState([], [], True)

    claim = gc.claim_path(data, "c" * 32)
    assert claim == f"{folder}/{stem}.gc-{'c' * 32}"
    dp.fs.pipe_file(claim, b"")  # a collection in progress
    state = gc.file_state(dp.fs, data, _io)
    assert ([c.rsplit("/", 1)[-1] for c in state.claims], state.removed, state.present) == (
        [f"{stem}.gc-{'c' * 32}"],
        [],
        True,
    )
    dp.fs.rm(data)
    dp.fs.pipe_file(claim, gc.REMOVED)  # ... that removed the file
    state = gc.file_state(dp.fs, data, _io)
    assert (state.claims, [c.rsplit("/", 1)[-1] for c in state.removed], state.present) == (
        [],
        [f"{stem}.gc-{'c' * 32}"],
        False,
    )
    dp.fs.rm(claim)
    assert gc.file_state(dp.fs, data, _io) == gc.FileState([], [], False)
