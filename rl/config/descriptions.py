"""Each config field's description: the attribute docstring written right under the field, read from the source.

`document_tree` copies it into the field's ``metadata["description"]``, which mashumaro writes into the JSON schema
that flytekit attaches to a config input (``pyflyte run ... --help`` prints it); ``scripts/config_reference.py``
renders the same docstrings as docs/config.md. No I/O beyond reading the classes' source.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types

from rl.config.checks import field_hints, section_type, sections


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
    field without one, optional sections included) the docstring of its dataclass, as one line.

    mashumaro's ``build_json_schema`` writes that metadata as the property's ``description``, and flytekit's dataclass
    transformer puts that schema into the metadata of the input's literal type, which is registered with the
    workflow (tools that render the schema show it). Fields shared with a base class (an inherited
    ``dataclasses.Field``) get the same description.
    """
    docs = field_docs(cls)
    hints = field_hints(cls)
    for f in dataclasses.fields(cls):
        doc = docs.get(f.name)
        section = section_type(hints.get(f.name))
        if doc is None and section is not None:
            doc = class_doc(section)
        if doc and f.metadata.get("description") != one_line(doc):
            f.metadata = types.MappingProxyType({**f.metadata, "description": one_line(doc)})


def document_tree(root: type) -> None:
    """`document_fields` of the config dataclass ``root`` and of every section under it."""
    for cls in [root, *(cls for _, cls in sections(root))]:
        document_fields(cls)
