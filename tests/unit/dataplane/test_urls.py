"""`dataplane.urls`: roots fsspec would misread are refused, credentials are redacted before logging."""

from __future__ import annotations

import pytest

from dataplane.urls import check_root, has_userinfo, is_secret_key, redact


@pytest.mark.parametrize(
    "url",
    [
        "runs",
        "./runs",
        "/tmp/dp",
        "runs/a:b",  # a colon after the first path component is a file name, not a scheme
        "file:///tmp/dp",
        "s3://bucket",
        "s3://bucket/prefix",
        "memory://dp",
        "gs://bucket/x",
        "simplecache::s3://bucket/prefix",
        "s3/bucket",  # a relative folder named s3
    ],
)
def test_check_root_accepts_folders_and_known_urls(url):
    assert check_root(url) == url


@pytest.mark.parametrize(
    ("url", "match"),
    [
        # fsspec reads these as a local folder named `s3:` (the regression: a typo silently wrote locally)
        ("s3:/bucket", r"malformed scheme 's3:'.*write 's3://bucket'"),
        ("s3:bucket", r"malformed scheme 's3:'.*write 's3://bucket'"),
        ("s3:", r"malformed scheme 's3:'"),
        ("S3//bucket", r"missing the ':' after 'S3'.*write 's3://bucket'"),
        ("s3//bucket/p", r"missing the ':'.*write 's3://bucket/p'"),
        ("s4://x", r"protocol 's4' is not known to fsspec; use a known protocol \(s3://, .*memory://"),
        ("S3://bucket", r"protocols are lowercase\); write 's3://bucket'"),
        ("", "is empty"),
        ("   ", "is empty"),
        (" s3://bucket", "leading or trailing spaces"),
        ("s3://", "names no bucket or folder"),
        ("s3://bucket/p?versionId=3", "query or fragment"),
        ("s3://bucket/p#frag", "query or fragment"),
        ("nocache::s3://bucket", "protocol 'nocache' is not known"),
    ],
)
def test_check_root_refuses_misreadable_roots(url, match):
    with pytest.raises(ValueError, match=match):
        check_root(url)


def test_check_root_refuses_a_non_string():
    with pytest.raises(ValueError, match="expected a string"):
        check_root(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("http://alice:s3cret@host:5000", "http://***@host:5000"),
        ("https://alice:s3cret@host:5000/path?x=1", "https://***@host:5000/path?x=1"),
        ("s3://AKIA:secret@bucket/prefix", "s3://***@bucket/prefix"),
        ("postgresql://u:p@w@db:5432/mlflow", "postgresql://***@db:5432/mlflow"),  # an unescaped '@' in the password
        ("http://alice@host", "http://***@host"),
        ("simplecache::s3://k:s@bucket", "simplecache::s3://***@bucket"),
        ("https://host/x?X-Amz-Signature=abc&X-Amz-Date=1", "https://host/x?X-Amz-Signature=***&X-Amz-Date=1"),
        ("https://host/x?token=abc", "https://host/x?token=***"),
        ("https://host/x?sas=sv2024sig&sp=r", "https://host/x?sas=***&sp=r"),
        # a URL quoted in a message ends at the quote or a space: the rest of the message stays
        (
            "'s3://b/r?X-Amz-Signature=abc' has a query or fragment ('?' or '#'), drop it",
            "'s3://b/r?X-Amz-Signature=***' has a query or fragment ('?' or '#'), drop it",
        ),
        ("'http://host:5000' is down; mail admin@corp.com", "'http://host:5000' is down; mail admin@corp.com"),
        ("'http://u:p@host' and 'http://v@h2'", "'http://***@host' and 'http://***@h2'"),
        # nothing to hide
        ("sqlite:///runs/mlflow.db", "sqlite:///runs/mlflow.db"),
        ("http://host:5000/a@b", "http://host:5000/a@b"),  # an '@' in the path is no userinfo
        ("runs", "runs"),
        ("", ""),
    ],
)
def test_redact_hides_userinfo_and_secret_query_values(url, redacted):
    assert redact(url) == redacted
    assert has_userinfo(url) == ("***@" in redacted)


@pytest.mark.parametrize(
    "name",
    [
        "key",
        "secret",
        "token",
        "password",
        "passwd",
        "pwd",
        "auth",
        "headers",
        "credential",
        "credentials",
        "session",
        "session_token",
        "aws_access_key_id",
        "aws_secret_access_key",
        "AccessKeyId",
        "apiKey",
        "Authorization",
        "connection_string",
        "ConnectionString",
        "conn_str",
        "sas",
        "sas_token",
        "creds",
        "account_key",
    ],
)
def test_secret_names(name):
    assert is_secret_key(name)


@pytest.mark.parametrize(
    "name",
    [
        "endpoint_url",
        "anon",
        "client_kwargs",
        "region_name",
        "use_ssl",
        "requester_pays",
        "config_kwargs",
        "signature_version",
        "SSEKMSKeyId",
        "s3_additional_kwargs",
        "default_block_size",
        "use_listings_cache",
        "account_name",
        "container_name",
        "consistency",
        "sasquatch_mode",
    ],
)
def test_non_secret_names(name):
    assert not is_secret_key(name)


def test_check_root_errors_do_not_quote_credentials():
    with pytest.raises(ValueError, match=r"'s4://\*\*\*@bucket'") as err:
        check_root("s4://AKIA:hush@bucket")
    assert "hush" not in str(err.value)
    assert check_root("s3://AKIA:hush@bucket") == "s3://AKIA:hush@bucket"  # accepted; `redact` before logging it
