"""A config from a nested mapping, inline JSON, or a YAML/JSON file (local or at any fsspec URL), for `GRPOConfig` or a
class that adds sections to it (the task layer's ``RunConfig``): unknown keys and wrong values fail naming the dotted
key. The only I/O of `rl.config`: reading the file.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from dataplane.errors import is_transient
from dataplane.urls import redact
from rl.config.checks import describe, fail
from rl.config.parsing import build_config, build_config_from_json, parse_json, parse_yaml
from rl.config.sections import GRPOConfig

C = TypeVar("C", bound=GRPOConfig)

MAX_CONFIG_BYTES = 1 << 20
"""The largest config file read (1 MiB): a config is a few kilobytes, and a larger file is a mistake."""


def config_from_dict(data: dict[str, Any], root: type[C] = GRPOConfig) -> C:  # type: ignore[assignment]
    """Build a config from a (partial) nested dict; missing keys take their defaults (`rl.config.parsing.build_config`).

    Args:
        data: ``{section: {key: value}}``, e.g. ``{"grpo": {"max_num_steps": 8}}``.
        root: the config class: `GRPOConfig`, or one that adds sections to it (``tasks.run_config.RunConfig``).

    Raises:
        ValueError: as `rl.config.parsing.build_config`.
    """
    return build_config(data, root)


def load_config(source: str, *, root: type[C] = GRPOConfig, storage_options: dict[str, Any] | None = None) -> C:  # type: ignore[assignment]
    """Config from inline JSON or from a YAML or JSON file, local or at any fsspec URL.

    Args:
        source: inline JSON (it starts with ``{``: ``'{"grpo": {"max_num_steps": 2}}'``), or a ``.yaml``, ``.yml`` or
            ``.json`` file: a local path (``configs/quick.yaml``, ``~/x.yaml``) or a URL (``s3://bucket/x.yaml``,
            ``gs://...``, ``file:///abs/x.json``, ``https://host/x.yaml``). An empty YAML file is all defaults.
        root: the config class, as in `config_from_dict`.
        storage_options: fsspec options of the file's filesystem; None takes them from the environment
            (`env_storage_options`: flytekit's ``FLYTE_AWS_*`` for ``s3://``), and the filesystem adds its own
            (AWS_* variables, ~/.aws, an IAM role; fsspec's ``FSSPEC_<PROTOCOL>_<OPTION>`` variables).

    Raises:
        ValueError: the file does not exist, is a folder, is not a regular file after following links (a FIFO, a
            device such as ``/dev/zero``, a socket), is larger than `MAX_CONFIG_BYTES` (1 MiB), cannot be read (its
            filesystem's error, e.g. access denied), is not named .yaml/.yml/.json, is not valid YAML or JSON, gives a
            key twice in one mapping, holds a YAML alias inside its own anchor (``a: &a [*a]``) or aliases that expand
            past `rl.config.parsing.MAX_CONFIG_VALUES` values, nests too deeply, or holds no mapping of sections; or
            what `config_from_dict` raises for. Each message about the file names it (credentials in its URL
            redacted).
            Inline JSON fails the same way where it is invalid or gives a key twice.
    """
    return config_from_dict(read_config_source(source, storage_options=storage_options), root)


def read_config_source(source: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The nested mapping `load_config` builds its config from: ``source`` parsed, not yet checked against a config
    class. Args as `load_config`'s.

    Raises:
        ValueError: what `load_config` raises for, but for `config_from_dict`'s errors.
    """
    if source.lstrip().startswith("{"):
        try:
            data = parse_json(source, "(inline JSON)")
        except json.JSONDecodeError as err:
            fail(
                "(inline JSON)",
                f"is not valid JSON ({err})",
                "check its quotes and brackets, or give a .yaml/.json file",
            )
        return data
    return _read_config_file(source, storage_options)


def config_from_json(text: str, root: type[C] = GRPOConfig) -> C:  # type: ignore[assignment]
    """`GRPOConfig.from_json`: a (partial) JSON config as ``pyflyte run ... --cfg`` hands it over
    (`rl.config.parsing.build_config_from_json`).

    Raises:
        ValueError: invalid JSON, a key given twice in one object, or what `config_from_dict` raises for; also a
            ``click.BadParameter`` (`rl.config.checks.usage_error`).
    """
    return build_config_from_json(text, root)


# ---------------------------------------------------------------- config files


def env_storage_options(protocol: str) -> dict[str, Any]:
    """fsspec options of a ``protocol`` filesystem from the environment variables flytekit reads (a Flyte pod has
    them; ``flytectl demo start``'s sandbox sets them to its MinIO): for ``s3``, ``FLYTE_AWS_ENDPOINT`` ->
    ``endpoint_url``, ``FLYTE_AWS_ACCESS_KEY_ID`` and ``FLYTE_AWS_SECRET_ACCESS_KEY`` -> ``key`` and ``secret``.
    Empty for other protocols, and for unset variables: the filesystem's own defaults apply."""
    if protocol not in ("s3", "s3a"):
        return {}
    names = {
        "endpoint_url": "FLYTE_AWS_ENDPOINT",
        "key": "FLYTE_AWS_ACCESS_KEY_ID",
        "secret": "FLYTE_AWS_SECRET_ACCESS_KEY",
    }
    return {option: os.environ[name] for option, name in names.items() if os.environ.get(name)}


def _read_config_file(source: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """The mapping held by the YAML/JSON file at ``source`` (a path or an fsspec URL); see `load_config`."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    where = f"file {redact(source)!r}"
    suffix = Path(urlsplit(source).path if "://" in source else source).suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        fail(
            where,
            "is not a .yaml, .yml or .json file",
            "give a YAML or JSON config file, or inline JSON starting with '{'",
        )
    try:
        protocol = fsspec.utils.get_protocol(source)
        options = env_storage_options(protocol) if storage_options is None else storage_options
        fs, path = fsspec.core.url_to_fs(source, **options)
        mode = os.stat(path).st_mode if isinstance(fs, LocalFileSystem) else None  # follows symlinks
    except Exception as err:  # any filesystem's own error: botocore's NoCredentialsError is no OSError
        msg, cause = _unreadable(where, source, err)
        raise ValueError(msg) from cause
    if mode is not None and stat.S_ISDIR(mode):
        fail(where, "is a folder", "name the config file inside it")
    if mode is not None and not stat.S_ISREG(mode):  # a FIFO would block the read, /dev/zero never end it
        fail(
            where,
            f"is {_file_kind(mode)}{_link_target(path)}, not a regular file",
            "give the path of a YAML or JSON file (write the config to a file first), or inline JSON starting with '{'",
        )
    try:
        with fs.open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except IsADirectoryError:
        fail(where, "is a folder", "name the config file inside it")
    except Exception as err:  # any filesystem's own error: botocore's NoCredentialsError is no OSError
        msg, cause = _unreadable(where, source, err)
        raise ValueError(msg) from cause
    if len(raw) > MAX_CONFIG_BYTES:
        fail(
            where,
            f"is larger than {MAX_CONFIG_BYTES} bytes (1 MiB), the most a config file may hold",
            "give the config file itself (a config is a few kilobytes; put data in data.train)",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        fail(where, "is not a text file", "give a YAML or JSON config file")
    if suffix == ".json":
        try:
            data = parse_json(text, where)
        except json.JSONDecodeError as err:
            fail(where, f"is not valid JSON ({err})", "check its quotes, commas and brackets")
    else:
        data = parse_yaml(text, where)
    if data is None:
        return {}
    if not isinstance(data, dict):
        fail(
            where,
            f"holds {describe(data)}, not a mapping of sections",
            "write sections such as 'grpo: {max_num_steps: 2}'",
        )
    return data


def _file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in words (``a named pipe (FIFO)``), from its ``st_mode``."""
    kinds = (
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


def _link_target(path: str) -> str:
    """`` (a link to '/dev/zero')`` where ``path`` is a symbolic link (or lies under one), else ``""``."""
    target = os.path.realpath(path)
    return f" (a link to {target!r})" if target != os.path.abspath(path) else ""


def _unreadable(where: str, source: str, err: Exception) -> tuple[str, BaseException | None]:
    """The message of a config file that could not be read, and the error to chain it to: the one that says why,
    so that `dataplane.errors.is_transient` still tells a dropped connection (retry) from a missing file (fail)."""
    cause = err.__cause__
    if isinstance(err, FileNotFoundError) and not (cause is not None and is_transient(cause)):
        local = "" if "://" in source else f" (looked for {Path(source).expanduser().resolve()})"
        return (
            f"config {where}: does not exist{local}; check the path (a relative path starts at the current folder) or "
            "the URL",
            None,
        )
    if isinstance(err, FileNotFoundError) and cause is not None:  # fsspec's HTTP filesystem: a refused connection
        err = cause  # type: ignore[assignment]
    fix = "check the URL, its credentials (the environment's) and that the filesystem's package is installed"
    return f"config {where}: cannot be read ({type(err).__name__}: {redact(str(err))}); {fix}", err
