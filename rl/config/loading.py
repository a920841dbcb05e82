"""A config from a nested mapping, inline JSON, or a YAML/JSON file (local or at any fsspec URL), for `GRPOConfig` or a
class that adds sections to it (the task layer's ``RunConfig``): unknown keys and wrong values fail naming the dotted
key. The only I/O of `rl.config`: reading the file.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from dataplane.urls import redact
from rl.config.checks import describe, fail, usage_error
from rl.config.sections import GRPOConfig

C = TypeVar("C", bound=GRPOConfig)

RENAMED = {
    "loss.token_level_loss": "it became loss.loss_type: write loss_type: dapo for token_level_loss: true, loss_type: grpo for false",
}
"""Keys an older config may still hold, with what replaced them."""


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
            fail(
                where or "root", f"expected a mapping, got {type(values).__name__}", "give a nested mapping of sections"
            )
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known), key=str)
        for key in unknown:
            dotted = f"{where}.{key}" if where else str(key)
            if dotted in RENAMED:
                fail(dotted, "is no longer a key", RENAMED[dotted])
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
            denied), is not named .yaml/.yml/.json, is not valid YAML or JSON, gives a key twice in one mapping,
            holds a YAML alias inside its own anchor (``a: &a [*a]``) or aliases that expand past
            `MAX_CONFIG_VALUES` values, nests too deeply, or holds no mapping of sections; or what
            `config_from_dict` raises for. Each message about the file names it (credentials in its URL redacted).
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
            data = _parse_json(source, "(inline JSON)")
        except json.JSONDecodeError as err:
            fail(
                "(inline JSON)",
                f"is not valid JSON ({err})",
                "check its quotes and brackets, or give a .yaml/.json file",
            )
        return data
    return _read_config_file(source, storage_options)


def config_from_json(text: str, root: type[C] = GRPOConfig) -> C:  # type: ignore[assignment]
    """`GRPOConfig.from_json`: a (partial) JSON config as ``pyflyte run ... --cfg`` hands it over.

    Raises:
        ValueError: invalid JSON, a key given twice in one object, or what `config_from_dict` raises for; also a
            ``click.BadParameter`` (`rl.config.checks.usage_error`).
    """
    try:
        data = _parse_json(text, "")
    except json.JSONDecodeError as err:
        msg = f'config: not valid JSON ({err}); write a JSON object such as \'{{"grpo": {{"max_num_steps": 2}}}}\''
        raise usage_error(msg) from None
    except ValueError as err:
        raise usage_error(str(err)) from None
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
    names = {
        "endpoint_url": "FLYTE_AWS_ENDPOINT",
        "key": "FLYTE_AWS_ACCESS_KEY_ID",
        "secret": "FLYTE_AWS_SECRET_ACCESS_KEY",
    }
    return {option: os.environ[name] for option, name in names.items() if os.environ.get(name)}


def _read_config_file(source: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """The mapping held by the YAML/JSON file at ``source`` (a path or an fsspec URL); see `load_config`."""
    from urllib.parse import urlsplit

    import fsspec

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
        with fs.open(path, "rb") as f:
            raw = f.read()
    except IsADirectoryError:
        fail(where, "is a folder", "name the config file inside it")
    except Exception as err:  # any filesystem's own error: botocore's NoCredentialsError is no OSError
        msg, cause = _unreadable(where, source, err)
        raise ValueError(msg) from cause
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        fail(where, "is not a text file", "give a YAML or JSON config file")
    if suffix == ".json":
        try:
            data = _parse_json(text, where)
        except json.JSONDecodeError as err:
            fail(where, f"is not valid JSON ({err})", "check its quotes, commas and brackets")
    else:
        data = _parse_yaml(text, where)
    if data is None:
        return {}
    if not isinstance(data, dict):
        fail(
            where,
            f"holds {describe(data)}, not a mapping of sections",
            "write sections such as 'grpo: {max_num_steps: 2}'",
        )
    return data


def _unreadable(where: str, source: str, err: Exception) -> tuple[str, BaseException | None]:
    """The message of a config file that could not be read, and the error to chain it to: the one that says why,
    so that `dataplane.errors.is_transient` still tells a dropped connection (retry) from a missing file (fail)."""
    from dataplane.errors import is_transient

    cause = err.__cause__
    if isinstance(err, FileNotFoundError) and not (cause is not None and is_transient(cause)):
        local = "" if "://" in source else f" (looked for {Path(source).expanduser().resolve()})"
        return (
            f"config {where}: does not exist{local}; check the path (a relative path starts at the current folder) or the URL",
            None,
        )
    if isinstance(err, FileNotFoundError) and cause is not None:  # fsspec's HTTP filesystem: a refused connection
        err = cause  # type: ignore[assignment]
    fix = "check the URL, its credentials (the environment's) and that the filesystem's package is installed"
    return f"config {where}: cannot be read ({type(err).__name__}: {redact(str(err))}); {fix}", err


# ---------------------------------------------------------------- parsing: no duplicate keys, no alias bombs

MAX_CONFIG_VALUES = 100_000
"""Most values (mappings, lists, scalars, keys) a config may hold once its YAML aliases are expanded: a full config
has a few hundred; aliases of lists of aliases (a "billion laughs") would expand to billions."""

_NESTING_FIX = "write the sections as a few levels of mappings"
_TWICE_FIX = "keep one of them (a plain YAML or JSON reader would silently take the last)"


def _parse_json(text: str, where: str) -> Any:
    """The value of JSON ``text``, refusing a key given twice in one object (a plain ``json.loads`` keeps the last
    silently) with its dotted path; ``where`` names the source in errors ("": the bare ``config: ...``).

    Raises:
        json.JSONDecodeError: ``text`` is not JSON (the caller says how to fix its source).
        ValueError: a key given twice, or nesting too deep to parse.
    """
    repeated: list[tuple[dict[str, Any], str]] = []

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                repeated.append((out, key))
            out[key] = value
        return out

    try:
        data = json.loads(text, object_pairs_hook=unique)
    except RecursionError:
        _fail_at(where, "nests too deeply to read", _NESTING_FIX)
    if repeated:
        owner, key = repeated[0]
        _fail_at(where, f"gives the key {_dotted(_path_to(data, owner) or '', key)!r} twice", _TWICE_FIX)
    return data


def _path_to(tree: Any, target: dict[str, Any], path: str = "") -> str | None:
    """The dotted path of the mapping ``target`` inside the JSON value ``tree`` ("" for ``tree`` itself)."""
    if tree is target:
        return path
    children = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, child in children:
        found = _path_to(child, target, f"{path}[{key}]" if isinstance(tree, list) else _dotted(path, key))
        if found is not None:
            return found
    return None


def _dotted(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _fail_at(where: str, problem: str, fix: str) -> NoReturn:
    """`fail`, where ``where`` may be "" (``config: {problem}; {fix}``)."""
    if where:
        fail(where, problem, fix)
    msg = f"config: {problem}; {fix}"
    raise ValueError(msg)


def _parse_yaml(text: str, where: str) -> Any:
    """The value of the YAML document ``text`` (None where empty), read with PyYAML's safe loader after
    `_check_yaml_graph` has checked the composed node graph, so that no duplicate key is silently dropped and no
    alias makes a structure that contains itself or expands past `MAX_CONFIG_VALUES` values."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_graph(node, loader, where)
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        detail = " ".join(str(err).split())
        fail(where, f"is not valid YAML ({detail})", "check its indentation and quotes")
    except RecursionError:
        fail(where, "nests too deeply to read", _NESTING_FIX)
    finally:
        loader.dispose()


def _check_yaml_graph(root: Any, loader: Any, where: str) -> None:
    """Refuse, naming the dotted path: a key given twice in one mapping (merged ``<<`` keys may be overridden), a
    node inside itself (``a: &a [*a]``: PyYAML would build a list that contains itself), and aliases that expand
    past `MAX_CONFIG_VALUES` values. Each node is visited once, however many aliases point at it."""
    import yaml

    size: dict[int, int] = {}  # id(node) -> values under it, aliases expanded
    visiting: dict[int, str] = {}  # id(node) -> its path, for the nodes being walked

    def walk(node: yaml.Node, path: str) -> int:
        if id(node) in size:
            return size[id(node)]
        if id(node) in visiting:
            anchor = repr(visiting[id(node)]) if visiting[id(node)] else "the document"
            problem = f"{path} is an alias of {anchor} inside {anchor} itself (a structure that contains itself)"
            fail(where, problem, "write the value out instead of the alias")
        visiting[id(node)] = path
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(walk(child, f"{path}[{i}]") for i, child in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, value_node in node.value:
                merge = key_node.tag == "tag:yaml.org,2002:merge"  # `<<: *base`: its keys may be overridden
                scalar = isinstance(key_node, yaml.ScalarNode) and not merge
                key = loader.construct_object(key_node, deep=True) if scalar else None
                if scalar and _hashable(key):
                    if key in seen:
                        line = key_node.start_mark.line + 1
                        fail(
                            where,
                            f"gives the key {_dotted(path, key)!r} twice (lines {seen[key]} and {line})",
                            _TWICE_FIX,
                        )
                    seen[key] = key_node.start_mark.line + 1
                total += walk(key_node, path) + walk(value_node, path if merge else _dotted(path, key))
        del visiting[id(node)]
        if total > MAX_CONFIG_VALUES:
            fail(
                where,
                f"{path or 'the document'} expands to more than {MAX_CONFIG_VALUES} values (YAML aliases repeated inside one another)",
                "write the config without nested aliases",
            )
        size[id(node)] = total
        return total

    walk(root, "")


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
