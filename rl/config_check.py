"""Config values checked against their fields' annotations: the right type or a clear error naming the key, never a
silent coercion. Pure functions, no I/O; `rl.config` uses them in every section's ``__post_init__``.

flytekit's dataclass transformer decodes a task input with mashumaro, whose decoders coerce silently
(``bool("no")`` is True, ``int(3.5)`` is 3, ``dict[str, str]`` values become ``str(value)``), and only then calls
the constructor. `Section.Config` turns that coercion off, so a wrong value that reaches a task (a literal built
from a dict, the console's launch form) is refused there too. A mapping field is annotated as bare ``dict``:
mashumaro passes its JSON values through untouched, while ``dict[str, Any]`` would make flytekit log a spurious
"PickleFile" warning whenever a workflow is loaded.

`document_fields` copies each field's attribute docstring (the string right under it) into the field's
``metadata["description"]``, which mashumaro writes into the JSON schema that flytekit attaches to a config input.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import re
import textwrap
import types
import typing
from typing import Any, NoReturn

from mashumaro.helper import pass_through


def fail(where: str, problem: str, fix: str) -> NoReturn:
    """Raise ``ValueError("config {where}: {problem}; {fix}")``."""
    msg = f"config {where}: {problem}; {fix}"
    raise ValueError(msg)


@functools.cache
def _usage_error_type() -> type[ValueError]:
    import click

    class ConfigUsageError(click.BadParameter, ValueError):
        """A config error that click reports as a bad option value, without a traceback."""

    return ConfigUsageError


def usage_error(message: str) -> ValueError:
    """A ValueError with ``message`` that is also a ``click.BadParameter``: pyflyte prints any other exception
    raised while it parses ``--cfg`` with a full traceback, a click error as one paragraph (``Error: Invalid value
    for '--cfg': {message}``). A plain ValueError where click is not installed."""
    try:
        return _usage_error_type()(message)
    except ImportError:
        return ValueError(message)


class _StrictDecoding:
    """mashumaro options of the config dataclasses: hand scalars to the constructor as they arrive."""

    serialization_strategy = {bool: pass_through, int: pass_through, float: pass_through, str: pass_through}


class Section:
    """Base of the config dataclasses (no fields): the mashumaro ``Config`` that flytekit's decoders read."""

    Config = _StrictDecoding


def describe(value: Any) -> str:
    """A value as an error message shows it: ``the string 'no'``, ``the number 3.5``, ``null``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    if dataclasses.is_dataclass(value):
        return f"a {type(value).__name__}"
    return f"a {type(value).__name__} ({str(value)[:40]!r})"


def _conform_json(value: Any, where: str) -> Any:
    """A JSON value (null, bool, number, string, list, string-keyed mapping), checked all the way down."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            fail(where, f"expected a finite number, got {describe(value)}", "JSON has no NaN or infinity: use a finite value")
        return value
    if isinstance(value, dict):
        return _conform_mapping(value, Any, where)
    if isinstance(value, (list, tuple)):
        return [_conform_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    fail(where, f"expected a JSON value (null, true/false, a number, a string, a list or a mapping), got {describe(value)}", "write it as JSON")


def _conform_mapping(value: Any, value_type: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        fail(where, f"expected a mapping, got {describe(value)}", "write it as {key: value, ...}")
    out: dict[str, Any] = {}
    for k, v in value.items():
        if not isinstance(k, str):
            fail(where, f"key {k!r} is {describe(k)}, not a string", "quote the key")
        out[k] = conform(v, value_type, f"{where}.{k}")
    return out


def _expected(hint: Any) -> str:
    if hint is bool:
        return "true or false"
    if hint is int:
        return "a whole number"
    if hint is float:
        return "a finite number"
    if hint is str:
        return "a string"
    return getattr(hint, "__name__", str(hint))


def conform(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against the annotation ``hint`` and normalized (``3.0`` -> ``3`` for an int, ``1`` and
    ``'1e-5'`` -> floats for a float); a value of another type raises ValueError naming ``where``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        options = [a for a in args if a is not type(None)]
        if value is None and len(options) < len(args):
            return None
        if len(options) != 1:
            msg = f"config {where}: unsupported annotation {hint}"
            raise TypeError(msg)
        inner = options[0]
        if inner not in (bool, int, float, str):
            return conform(value, inner, where)
        try:
            return conform(value, inner, where)
        except ValueError:
            fail(where, f"expected {_expected(inner)} or null, got {describe(value)}", f"write {_expected(inner)}, or null to leave it unset")
    if hint is Any:
        return _conform_json(value, where)
    if hint is bool:
        if not isinstance(value, bool):
            fail(where, f"expected true or false, got {describe(value)}", "write true or false, unquoted")
        return value
    if hint is int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            fail(where, f"expected a whole number, got {describe(value)}", "write an integer such as 3, unquoted")
        return value
    if hint is float:
        number = value
        if isinstance(value, str):  # YAML 1.1 (PyYAML) reads `1e-5` as a string: a number without a '.'
            try:
                number = float(value.strip())
            except ValueError:
                fail(where, f"expected a finite number, got {describe(value)}", "write a number such as 0.5 or 1e-5")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(where, f"expected a finite number, got {describe(value)}", "write a number such as 0.5 or 1e-5")
        if not math.isfinite(number):
            fail(where, f"expected a finite number, got {describe(value)}", "NaN and infinity are not valid settings: use a finite value")
        return float(number)
    if hint is str:
        if not isinstance(value, str):
            fail(where, f"expected a string, got {describe(value)}", "quote it")
        return value
    if hint is dict or origin is dict:
        return _conform_mapping(value, args[1] if args else Any, where)
    if hint is list or origin is list:
        if not isinstance(value, (list, tuple)):
            fail(where, f"expected a list, got {describe(value)}", "write it as [a, b, ...]")
        return [conform(v, args[0] if args else Any, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            fail(where, f"expected a {hint.__name__} section, got {describe(value)}", "build nested sections from a mapping with config_from_dict")
        return value
    msg = f"config {where}: unsupported annotation {hint}"
    raise TypeError(msg)


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    """Resolved annotations (the module has postponed annotations) of ``cls``'s init fields."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def check_fields(obj: Any, section: str) -> None:
    """Check every field of the config dataclass ``obj`` (the section named ``section``, "" for the root) against its
    annotation and store the normalized value.

    Raises:
        ValueError: a field holds a value of the wrong type; the message names its dotted key.
    """
    for name, hint in field_hints(type(obj)).items():
        value = getattr(obj, name)
        conformed = conform(value, hint, f"{section}.{name}" if section else name)
        if conformed is not value:
            object.__setattr__(obj, name, conformed)


@functools.cache
def _class_body_docs(cls: type) -> tuple[str | None, dict[str, str]]:
    """``(class docstring, {field name: attribute docstring})`` of the fields annotated in ``cls``'s own body (not
    inherited ones), read from its source; ``(None, {})`` where the source is not available (a .pyc-only install)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return None, {}
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.ClassDef):
        return None, {}
    docs: dict[str, str] = {}
    for stmt, after in zip(node.body, node.body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return ast.get_docstring(node), docs


def class_doc(cls: type) -> str | None:
    """The docstring written in ``cls``'s body (None where it has none: not the signature ``@dataclass`` makes up)."""
    return _class_body_docs(cls)[0]


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of the dataclass ``cls``'s fields, ``{name: docstring}`` in field order.

    A field's docstring is the string literal right after its annotation in the body of the class that declares it
    last (a subclass that redeclares ``memory`` documents its own ``memory``). Fields without one are left out.
    """
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        owner = next((c for c in cls.__mro__ if f.name in c.__dict__.get("__annotations__", {})), None)
        doc = _class_body_docs(owner)[1].get(f.name) if owner is not None else None
        if doc:
            out[f.name] = doc
    return out


def one_line(text: str) -> str:
    """A docstring as one line of plain text: line breaks and runs of spaces made single spaces, reST's ````x````
    made ```x```."""
    return re.sub(r"\s+", " ", text).replace("``", "`").strip()


def document_fields(cls: type) -> None:
    """Put each field's description into its ``metadata["description"]``: its attribute docstring, else (a section
    field such as ``GRPOConfig.resources``) the docstring of its dataclass, as one line.

    mashumaro's ``build_json_schema`` writes that metadata as the property's ``description``, and flytekit's dataclass
    transformer puts that schema into the metadata of the input's literal type, which is registered with the
    workflow (tools that render the schema show it). Fields shared with a base class (an inherited
    ``dataclasses.Field``) get the same description.
    """
    docs = field_docs(cls)
    hints = field_hints(cls)
    for f in dataclasses.fields(cls):
        doc = docs.get(f.name)
        if doc is None and dataclasses.is_dataclass(hints.get(f.name)):
            doc = class_doc(hints[f.name])
        if doc and f.metadata.get("description") != one_line(doc):
            f.metadata = types.MappingProxyType({**f.metadata, "description": one_line(doc)})
