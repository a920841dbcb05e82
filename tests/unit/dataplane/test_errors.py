"""Storage failures are classified by what they mean (`dataplane.errors.is_transient`), and tasks raise only the
transient ones as recoverable (`tasks.retry.transient_errors_retried`)."""

from __future__ import annotations

import errno
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flytekit.exceptions.user import FlyteRecoverableException

import dataplane.errors
from dataplane.errors import DataPlaneError, IntegrityError, is_transient, retry_transient
from tasks.retry import transient_errors_retried


def _client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
    )


def _translated(err: BaseException) -> BaseException:
    """``err`` as s3fs raises it: translated to a builtin error, the original as its cause."""
    from s3fs.errors import translate_boto_error

    return translate_boto_error(err)


def _mlflow_error(message: str) -> BaseException:
    """What MLflow's REST client raises when it gives up (it does not chain the requests error)."""
    from mlflow.exceptions import MlflowException

    return MlflowException(message)


def _corrupt_parquet_error() -> BaseException:
    """What pyarrow raises for a Parquet file with flipped bytes: an ``OSError`` for most positions."""

    buf = io.BytesIO()
    pq.write_table(pa.table({"a": list(range(100))}), buf, compression="lz4")
    good = buf.getvalue()
    for position in range(len(good)):
        bad = bytearray(good)
        bad[position] ^= 0xFF
        try:
            pq.read_table(pa.BufferReader(bytes(bad)))
        except OSError as err:
            return err
    raise AssertionError("no flipped byte gave an OSError")


def test_transient_errors(tmp_path):
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

    refused = EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
    assert not isinstance(refused, OSError)  # why classifying by base class missed it
    for err in [
        refused,
        ConnectTimeoutError(endpoint_url="http://127.0.0.1:9"),
        ReadTimeoutError(endpoint_url="http://127.0.0.1:9"),
        ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
        OSError(errno.ECONNRESET, "Connection reset by peer"),
        TimeoutError("timed out"),
        _client_error("SlowDown", 503),
        _translated(_client_error("InternalError", 500)),
        _translated(_client_error("ServiceUnavailable", 503)),
        _mlflow_error(
            "API request to http://127.0.0.1:5000/api/2.0/mlflow/runs/log-batch failed with exception "
            "HTTPConnectionPool(host='127.0.0.1', port=5000): Max retries exceeded with url: ... (Caused by "
            "NewConnectionError('Failed to establish a new connection: [Errno 111] Connection refused'))"
        ),
    ]:
        assert is_transient(err), repr(err)


def test_permanent_errors(tmp_path):
    corrupt = _corrupt_parquet_error()
    assert isinstance(corrupt, OSError)  # why classifying by base class retried it
    for err in [
        corrupt,
        FileNotFoundError(errno.ENOENT, "No such file", "s3://b/run/step_000001/data/x.parquet"),
        PermissionError("Access Denied"),
        _translated(_client_error("AccessDenied", 403)),
        _translated(_client_error("NoSuchKey", 404)),
        IntegrityError("data file x fails its checksum"),
        DataPlaneError("partition 'step_000001' does not exist"),
        ValueError("bad config"),
        OSError("an OSError that says nothing about the network"),
        _mlflow_error("Run 'abc' not found"),
    ]:
        assert not is_transient(err), repr(err)


def test_the_outermost_known_meaning_decides():
    try:
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError as inner:
            raise IntegrityError("gave up: the file is corrupt") from inner
    except IntegrityError as err:
        assert not is_transient(err)
    try:
        try:
            raise _client_error("SlowDown", 503)
        except Exception as inner:
            raise OSError("s3fs: request failed") from inner
    except OSError as err:
        assert is_transient(err)


def test_retry_transient_retries_until_the_deadline_and_not_permanent_errors(monkeypatch):
    slept = []
    monkeypatch.setattr(dataplane.errors.time, "sleep", slept.append)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")
        return "ok"

    assert retry_transient(flaky, what="test") == "ok"
    assert slept == [0.5, 1.0, 2.0]  # exponential backoff
    calls.clear()
    with pytest.raises(PermissionError):
        retry_transient(lambda: calls.append(1) or (_ for _ in ()).throw(PermissionError("denied")), what="test")
    assert len(calls) == 1
    with pytest.raises(ConnectionRefusedError):  # a deadline of 0: no retry
        retry_transient(lambda: (_ for _ in ()).throw(ConnectionRefusedError("refused")), what="test", deadline_s=0)


def test_tasks_raise_only_transient_errors_as_recoverable():
    from botocore.exceptions import EndpointConnectionError

    @transient_errors_retried
    def task(err):
        raise err

    with pytest.raises(FlyteRecoverableException, match="EndpointConnectionError"):
        task(EndpointConnectionError(endpoint_url="http://127.0.0.1:9"))
    for permanent in (IntegrityError("corrupt"), FileNotFoundError("gone"), ValueError("bad")):
        with pytest.raises(type(permanent)):
            task(permanent)
