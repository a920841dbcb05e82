"""Config text to a config, without I/O: the strict JSON and YAML readers (no key given twice, no alias that contains
itself or expands past `MAX_CONFIG_VALUES` values) and the builder of a config class from a nested mapping.

`rl.config.loading` reads files and URLs with them and gives the public functions their default class, `GRPOConfig`;
`GRPOConfig.from_json` (`rl.config.sections`) builds with `build_config_from_json`.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from rl.config.checks import fail, field_hints, section_type, usage_error

if TYPE_CHECKING:
    from rl.config.sections import GRPOConfig

C = TypeVar("C", bound="GRPOConfig")

RENAMED = {
    "loss.token_level_loss": (
        "it became loss.loss_type: write loss_type: dapo for token_level_loss: true, loss_type: grpo for false"
    ),
}
"""Keys an older config may still hold, with what replaced them."""


def build_config(data: dict[str, Any], root: type[C]) -> C:
    """Build a config of class ``root`` from a (partial) nested dict; missing keys take their defaults.

    Args:
        data: ``{section: {key: value}}``, e.g. ``{"grpo": {"max_num_steps": 8}}``.
        root: the config class: `GRPOConfig`, or one that adds sections to it (``tasks.run_config.RunConfig``).

    Raises:
        ValueError: naming the dotted key (``config grpo.val_at_start: ...``): an unknown key (the known ones are
            listed), a value of the wrong type (no coercion: ``"no"`` is no bool, ``3.5`` no int; a float field
            takes a number or a numeric string such as YAML 1.1's ``'1e-5'``; NaN and infinity are refused), or a
            value out of range. An optional section (``policy.lora``) is built from a mapping (``{}``: its
            defaults) and left None where the value is null or the key missing.
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
        hints = field_hints(cls)
        for name, value in values.items():
            hint = hints.get(name)
            section = section_type(hint)
            unset = value is None and type(None) in typing.get_args(hint)  # null: an optional section left unset
            nested = section is not None and not unset
            kwargs[name] = build(section, value, f"{where}.{name}" if where else name) if nested else value
        return cls(**kwargs)

    return build(root, data, "")


def build_config_from_json(text: str, root: type[C]) -> C:
    """A config of class ``root`` from a (partial) JSON config as ``pyflyte run ... --cfg`` hands it over
    (`GRPOConfig.from_json`).

    Raises:
        ValueError: invalid JSON, a key given twice in one object, or what `build_config` raises for; also a
            ``click.BadParameter`` (`rl.config.checks.usage_error`).
    """
    try:
        data = parse_json(text, "")
    except json.JSONDecodeError as err:
        msg = f'config: not valid JSON ({err}); write a JSON object such as \'{{"grpo": {{"max_num_steps": 2}}}}\''
        raise usage_error(msg) from None
    except ValueError as err:
        raise usage_error(str(err)) from None
    try:
        return build_config(data, root)
    except ValueError as err:
        raise usage_error(str(err)) from None


# ---------------------------------------------------------------- parsing: no duplicate keys, no alias bombs

MAX_CONFIG_VALUES = 100_000
"""Most values (mappings, lists, scalars, keys) a config may hold once its YAML aliases are expanded: a full config
has a few hundred; aliases of lists of aliases (a "billion laughs") would expand to billions."""

_NESTING_FIX = "write the sections as a few levels of mappings"
_TWICE_FIX = "keep one of them (a plain YAML or JSON reader would silently take the last)"


def parse_json(text: str, where: str) -> Any:
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


def parse_yaml(text: str, where: str) -> Any:
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
                f"{path or 'the document'} expands to more than {MAX_CONFIG_VALUES} values (YAML aliases repeated "
                "inside one another)",
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
