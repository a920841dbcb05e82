"""A config from a nested mapping, inline JSON, or a YAML/JSON file (local or at any fsspec URL), for `GRPOConfig` or a
class that adds sections to it (the task layer's ``RunConfig``): unknown keys and wrong values fail naming the dotted
key. The only I/O of `rl.config`: reading the file.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, TypeVar

from dataplane.urls import redact
from rl.config.checks import describe, fail, usage_error
from rl.config.sections import GRPOConfig

C = TypeVar("C", bound=GRPOConfig)


def config_from_dict(data: dict[str, Any], root: type[C] = GRPOConfig) -> C:  # type: ignore[assignment]
    """Build a config from a (partial) nested dict; missing keys take their defaults.

    Args:
        data: ``{section: {key: value}}``, e.g. ``{"grpo": {"max_num_steps": 8}}``.
        root: the config class: `GRPOConfig`, or one that adds sections to it (``tasks.run_config.RunConfig``).

    Raises:
        ValueError: naming the dotted key (``config grpo.val_at_start: ...``): an unknown key (the known ones are
            listed), a value of the wrong type (no coercion: ``"no"`` is no bool, ``3.5`` no int; a float field
            takes a number or a numeric string such as YAML 1.1's ``'1e-5'``; NaN and infinity are refused), or a
            value out of range.
    """

    def build(cls: type, values: dict[str, Any], where: str) -> Any:
        if not isinstance(values, dict):
            fail(where or "root", f"expected a mapping, got {type(values).__name__}", "give a nested mapping of sections")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known), key=str)
        if unknown:
            fail(where or "root", f"unknown keys {unknown}", f"use only {sorted(known)}")
        kwargs = {}
        for name, value in values.items():
            sub = known[name].default_factory
            nested = dataclasses.is_dataclass(sub) and isinstance(sub, type)
            kwargs[name] = build(sub, value, f"{where}.{name}" if where else name) if nested else value  # type: ignore[arg-type]
        return cls(**kwargs)

    return build(root, data, "")


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
        ValueError: the file does not exist, is a folder, cannot be read (its filesystem's error, e.g. access
            denied), is not named .yaml/.yml/.json, is not valid YAML or JSON, or holds no mapping of sections; or
            what `config_from_dict` raises for. Each message names the file (credentials in its URL redacted).
    """
    if source.lstrip().startswith("{"):
        try:
            data = json.loads(source)
        except json.JSONDecodeError as err:
            fail("(inline JSON)", f"is not valid JSON ({err})", "check its quotes and brackets, or give a .yaml/.json file")
        return config_from_dict(data, root)
    return config_from_dict(_read_config_file(source, storage_options), root)


def config_from_json(text: str, root: type[C] = GRPOConfig) -> C:  # type: ignore[assignment]
    """`GRPOConfig.from_json`: a (partial) JSON config as ``pyflyte run ... --cfg`` hands it over.

    Raises:
        ValueError: invalid JSON, or what `config_from_dict` raises for; also a ``click.BadParameter``
            (`rl.config.checks.usage_error`).
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        msg = f"config: not valid JSON ({err}); write a JSON object such as '{{\"grpo\": {{\"max_num_steps\": 2}}}}'"
        raise usage_error(msg) from None
    try:
        return config_from_dict(data, root)
    except ValueError as err:
        raise usage_error(str(err)) from None


# ---------------------------------------------------------------- config files


def env_storage_options(protocol: str) -> dict[str, Any]:
    """fsspec options of a ``protocol`` filesystem from the environment variables flytekit reads (a Flyte pod has
    them; ``flytectl demo start``'s sandbox sets them to its MinIO): for ``s3``, ``FLYTE_AWS_ENDPOINT`` ->
    ``endpoint_url``, ``FLYTE_AWS_ACCESS_KEY_ID`` and ``FLYTE_AWS_SECRET_ACCESS_KEY`` -> ``key`` and ``secret``.
    Empty for other protocols, and for unset variables: the filesystem's own defaults apply."""
    import os

    if protocol not in ("s3", "s3a"):
        return {}
    names = {"endpoint_url": "FLYTE_AWS_ENDPOINT", "key": "FLYTE_AWS_ACCESS_KEY_ID", "secret": "FLYTE_AWS_SECRET_ACCESS_KEY"}
    return {option: os.environ[name] for option, name in names.items() if os.environ.get(name)}


def _read_config_file(source: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """The mapping held by the YAML/JSON file at ``source`` (a path or an fsspec URL); see `load_config`."""
    from urllib.parse import urlsplit

    import fsspec
    import yaml

    where = f"file {redact(source)!r}"
    suffix = Path(urlsplit(source).path if "://" in source else source).suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        fail(where, "is not a .yaml, .yml or .json file", "give a YAML or JSON config file, or inline JSON starting with '{'")
    try:
        protocol = fsspec.utils.get_protocol(source)
        options = env_storage_options(protocol) if storage_options is None else storage_options
        fs, path = fsspec.core.url_to_fs(source, **options)
        with fs.open(path, "rb") as f:
            raw = f.read()
    except IsADirectoryError:
        fail(where, "is a folder", "name the config file inside it")
    except Exception as err:  # any filesystem's own error: botocore's NoCredentialsError is no OSError
        msg, cause = _unreadable(where, source, err)
        raise ValueError(msg) from cause
    try:
        text = raw.decode("utf-8")
        data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except UnicodeDecodeError:
        fail(where, "is not a text file", "give a YAML or JSON config file")
    except json.JSONDecodeError as err:
        fail(where, f"is not valid JSON ({err})", "check its quotes, commas and brackets")
    except yaml.YAMLError as err:
        detail = " ".join(str(err).split())
        fail(where, f"is not valid YAML ({detail})", "check its indentation and quotes")
    if data is None:
        return {}
    if not isinstance(data, dict):
        fail(where, f"holds {describe(data)}, not a mapping of sections", "write sections such as 'grpo: {max_num_steps: 2}'")
    return data


def _unreadable(where: str, source: str, err: Exception) -> tuple[str, BaseException | None]:
    """The message of a config file that could not be read, and the error to chain it to: the one that says why,
    so that `dataplane.errors.is_transient` still tells a dropped connection (retry) from a missing file (fail)."""
    from dataplane.errors import is_transient

    cause = err.__cause__
    if isinstance(err, FileNotFoundError) and not (cause is not None and is_transient(cause)):
        local = "" if "://" in source else f" (looked for {Path(source).expanduser().resolve()})"
        return f"config {where}: does not exist{local}; check the path (a relative path starts at the current folder) or the URL", None
    if isinstance(err, FileNotFoundError) and cause is not None:  # fsspec's HTTP filesystem: a refused connection
        err = cause  # type: ignore[assignment]
    fix = "check the URL, its credentials (the environment's) and that the filesystem's package is installed"
    return f"config {where}: cannot be read ({type(err).__name__}: {redact(str(err))}); {fix}", err
