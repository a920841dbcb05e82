"""URL hygiene for the data plane root and other configured URLs: `check_root` refuses roots that fsspec
would silently read as something else (``s3:/bucket`` is a local folder ``s3:``), `redact` hides credentials
before a URL is logged (`redact_json` in a whole JSON value, by key name too), `credential_parts` says what in a
value is a credential, and `is_secret_key` tells option names that hold credentials. Pure functions, no I/O.
"""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["check_root", "credential_parts", "has_userinfo", "is_secret_key", "redact", "redact_json"]

_SCHEME = r"[A-Za-z][A-Za-z0-9+.\-]*"
# `scheme://userinfo@`: the userinfo runs to the last '@' of the authority (it ends at the first '/', '?' or '#').
# A URL inside a message ends at whitespace or a quote: neither appears unencoded in a URL (RFC 3986).
_USERINFO = re.compile(rf"(?P<scheme>{_SCHEME}://)(?P<userinfo>[^/?#\s'\"]*@)")
# `user:password@host/...` without a scheme (an image reference such as `alice:pw@ghcr.io/acme/img:v1`): at the start
# of the string or of a word, a colon in the userinfo, and a host that a '/' ends (`img:tag@sha256:...` is no userinfo).
_BARE_USERINFO = re.compile(r"(?<![^\s'\"(=,\[])(?P<userinfo>[^/@\s:'\"(=,\[]+:[^/@\s'\"]*@)(?=[^/@\s'\"]+/)")
# a secret-named parameter of a query or a connection string: `?password=...`, `&X-Amz-Signature=...`,
# `;AccountKey=...`
_QUERY_PARAM = re.compile(r"(?P<lead>[?&;])(?P<name>[^=&;#\s'\"?]+)=(?P<value>[^&;#\s'\"]*)")
_LOCAL = frozenset({"file", "local"})
_COMMON = ("s3", "gs", "gcs", "az", "abfs", "file", "memory", "http", "https", "sftp")

# Option names that hold credentials: matched as a substring of the lowercased name ...
_SECRET_PARTS = ("secret", "passw", "pwd", "token", "credential", "creds", "auth", "apikey", "accesskey", "privatekey")
# ... or as one word of it (split at '_', '-', '.', spaces and camelCase): `key` (s3fs's access key id),
# `aws_access_key_id`, `session`, `headers` (an ``Authorization`` header), `cookie(s)`, `signature`
# (``X-Amz-Signature``), `sas` (an Azure shared access signature, adlfs's ``sas_token``), `cred`.
_SECRET_WORDS = frozenset(
    {"key", "session", "headers", "header", "cookie", "cookies", "signature", "sig", "sas", "cred"}
)
# ... or as a run of words: adlfs's ``connection_string`` holds an account key (``AccountKey=...``).
_SECRET_PHRASES = (("connection", "string"), ("conn", "str"), ("conn", "string"))
# ... unless it is a known non-secret: a KMS key *id* names a key without being one; botocore's `signature_version`.
_NOT_SECRET_PARTS = ("kms", "signature_version")


def _words(name: str) -> list[str]:
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", " ", name)
    return [w.lower() for w in re.split(r"[\s_.\-]+", spaced) if w]


def is_secret_key(name: str) -> bool:
    """Whether an option name (of fsspec ``storage_options``, a header, a query parameter) holds a credential.

    Args:
        name: the option's name, e.g. ``aws_secret_access_key``, ``endpoint_url``, ``SSEKMSKeyId``.

    Returns:
        True for names like ``key``, ``secret``, ``token``, ``password``/``passwd``/``pwd``, ``auth``,
        ``headers``, ``credential(s)``, ``creds``, ``session``, ``aws_access_key_id``, ``sas``/``sas_token``,
        ``connection_string`` (adlfs's, with an account key); False for ``endpoint_url``, ``anon``,
        ``region_name``, ``use_ssl``, ``requester_pays``, ``client_kwargs`` and KMS key ids.
    """
    low = name.lower()
    if any(part in low for part in _NOT_SECRET_PARTS):
        return False
    words = _words(name)
    pairs = set(zip(words, words[1:], strict=False))
    return (
        any(part in low for part in _SECRET_PARTS)
        or any(word in _SECRET_WORDS for word in words)
        or any(phrase in pairs for phrase in _SECRET_PHRASES)
        or "connectionstring" in low
    )


def has_userinfo(url: str) -> bool:
    """Whether ``url`` carries credentials in its authority: ``scheme://user:password@host``, or
    ``user:password@host/...`` without a scheme (an image reference).

    Args:
        url: any string; only ``scheme://...@`` parts and ``user:password@host/`` at the start of a word count.
    """
    return _USERINFO.search(url) is not None or _BARE_USERINFO.search(url) is not None


def _secret_params(text: str) -> list[str]:
    """Names of the secret-named parameters with a value in ``text`` (``?token=abc``, ``;AccountKey=abc``)."""
    return [m["name"] for m in _QUERY_PARAM.finditer(text) if m["value"] and is_secret_key(m["name"])]


def credential_parts(text: str) -> list[str]:
    """What in ``text`` (a URL, a connection string, an image reference) holds credentials, in words: ``a
    user:password@ part``, ``the parameter 'X-Amz-Signature'``; empty when nothing does.

    Args:
        text: any string.

    Returns:
        One phrase per credential found, userinfo first, then each secret-named parameter (`is_secret_key`) of a
        query (``?``, ``&``) or connection string (``;``) that has a value, in order.
    """
    found = ["a user:password@ part"] if has_userinfo(text) else []
    return found + [f"the parameter {name!r}" for name in _secret_params(text)]


def redact(url: str) -> str:
    """``url`` safe to log: the userinfo of every ``scheme://userinfo@host`` (and of ``user:password@host/...``
    without a scheme, as image references write it) replaced by ``***``, and the values of secret-named parameters of
    a query or connection string (``?password=...``, ``&X-Amz-Signature=...``, ``;AccountKey=...``) by ``***``.

    ``http://alice:s3cret@host:5000/x`` -> ``http://***@host:5000/x``; ``alice:pw@ghcr.io/acme/img:v1`` ->
    ``***@ghcr.io/acme/img:v1``; URLs without credentials, local paths and ``sqlite:///...`` come back unchanged.

    Args:
        url: a URL, a path, or a message quoting them.

    Returns:
        The redacted string.
    """
    out = _USERINFO.sub(lambda m: f"{m['scheme']}***@", url)
    out = _BARE_USERINFO.sub("***@", out)
    return _QUERY_PARAM.sub(lambda m: f"{m['lead']}{m['name']}=***" if is_secret_key(m["name"]) else m[0], out)


def redact_json(value: Any, *, secret: bool = False) -> Any:
    """A JSON value (mappings, lists, scalars) safe to log: every string under a secret-named key (`is_secret_key`,
    at any depth: ``{"dataset_kwargs": {"token": "hf_x"}}``, ``{"headers": {"Authorization": "Bearer x"}}``)
    replaced by ``"***"``, every other string passed through `redact`. Numbers, booleans and null stay (``max_tokens:
    64`` is no credential).

    Args:
        value: the value; not modified.
        secret: ``value`` sits under a secret-named key already.

    Returns:
        A redacted copy (lists and tuples become lists).
    """
    if isinstance(value, dict):
        return {k: redact_json(v, secret=secret or is_secret_key(str(k))) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_json(v, secret=secret) for v in value]
    if isinstance(value, str):
        return "***" if secret else redact(value)
    return value


def _known() -> set[str]:
    import fsspec  # here: importing it takes ~0.2 s, and `redact` callers need none of it

    return set(fsspec.available_protocols())


def _known_hint(known: set[str]) -> str:
    common = [p for p in _COMMON if p in known]
    return f"use a known protocol ({', '.join(p + '://' for p in common)}, ... {len(known)} in all) or a local folder"


def _check_protocol(proto: str, url: str, known: set[str]) -> None:
    if not re.fullmatch(_SCHEME, proto):
        msg = f"{url!r} has a malformed protocol {proto!r}; write e.g. 's3://bucket/prefix' or a local folder"
        raise ValueError(msg)
    if proto in known:
        return
    if proto.lower() in known:
        msg = (
            f"{url!r}: protocol {proto!r} is not known to fsspec (protocols are lowercase); write "
            f"{proto.lower() + url[len(proto) :]!r}"
        )
        raise ValueError(msg)
    msg = f"{url!r}: protocol {proto!r} is not known to fsspec; {_known_hint(known)}"
    raise ValueError(msg)


def check_root(url: str) -> str:
    """Check that ``url`` is a data plane root fsspec reads as meant, and return it unchanged.

    Accepted: a local folder (``runs``, ``./runs``, ``/tmp/dp``), ``file:///tmp/dp``, ``proto://...`` with a
    protocol fsspec knows (``s3://bucket/prefix``, ``memory://dp``, ``gs://...``), and fsspec chains
    (``simplecache::s3://bucket``). Whether the protocol's package (s3fs, gcsfs, ...) is installed is not checked.

    Args:
        url: the root, e.g. ``DataPlaneConfig.root``.

    Returns:
        ``url``.

    Raises:
        ValueError: ``url`` is not a string, is empty or padded with spaces; looks like a URL with a broken scheme
            (``s3:/bucket``, ``s3:bucket``, ``s3//bucket``: fsspec would make a local folder of it); names a
            protocol fsspec does not know (``s4://x``) or names nothing after ``proto://``; or has a query or
            fragment (``?...``, ``#...``), which object stores would take as part of the key.
    """
    if not isinstance(url, str):
        msg = f"expected a string, got {type(url).__name__}; write a folder or a URL such as 's3://bucket/prefix'"
        raise ValueError(msg)
    try:
        return _check_root(url)
    except ValueError as err:  # the message quotes the URL: never with its credentials
        raise ValueError(redact(str(err))) from None


def _check_root(url: str) -> str:
    if not url.strip():
        msg = "is empty; use a folder (e.g. 'runs') or a URL such as 's3://bucket/prefix'"
        raise ValueError(msg)
    if url != url.strip():
        msg = f"{url!r} has leading or trailing spaces; write {url.strip()!r}"
        raise ValueError(msg)
    parts = url.split("::")
    if "://" not in url and len(parts) == 1:
        return _check_local(url)
    known = _known()
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if "://" not in part:
            if last:  # `simplecache::runs`: a chain ending in a local path
                _check_local(part)
            else:  # `simplecache::...`: a bare protocol name in front of the target
                _check_protocol(part, url, known)
            continue
        proto, rest = part.split("://", 1)
        _check_protocol(proto, url, known)
        if last and not rest.strip("/"):
            msg = (
                f"{url!r} names no bucket or folder after {proto + '://'!r}; write e.g. {proto + '://bucket/prefix'!r}"
            )
            raise ValueError(msg)
        if "?" in rest or "#" in rest:
            msg = f"{url!r} has a query or fragment ('?' or '#'), which fsspec would take as part of the path; drop it"
            raise ValueError(msg)
    return url


def _check_local(path: str) -> str:
    first = re.split(r"[/\\]", path, maxsplit=1)[0]
    if os.name == "nt" and re.fullmatch(r"[A-Za-z]:", first):  # a Windows drive, `C:\runs`
        return path
    scheme = re.match(rf"({_SCHEME}):", first)
    if scheme:  # `s3:/bucket`, `s3:bucket`, `s3:`: fsspec reads these as a local folder named `s3:`
        name, known = scheme[1], _known()
        rest = path[len(name) + 1 :].lstrip("/\\")
        fix = f"write {name.lower() + '://' + (rest or 'bucket')!r}" if name.lower() in known else _known_hint(known)
        msg = (
            f"{path!r} looks like a URL with a malformed scheme {name + ':'!r} (a URL needs '://'), and fsspec would "
            f"read it as a local folder {first!r}; {fix}"
        )
        raise ValueError(msg)
    slashes = re.match(rf"({_SCHEME})//", path)
    if slashes and slashes[1].lower() in _known() - _LOCAL:  # `s3//bucket`, `S3//bucket`
        name = slashes[1]
        msg = (
            f"{path!r} looks like a URL missing the ':' after {name!r}, and fsspec would read it as a local folder; "
            f"write {name.lower() + ':' + path[len(name) :]!r}"
        )
        raise ValueError(msg)
    return path
