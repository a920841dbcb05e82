"""The records that describe a partition as a whole: its schema (``_schema.json``, written by ``register_partition``)
and its sealed batch (``_sealed.json``, written by ``seal``). Encoding and parsing only; ``dataplane.client`` does the
I/O and ``dataplane.paths`` names the objects.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from dataplane.errors import IntegrityError
from dataplane.meta import KVBatchMeta


def encode_schema(partition_id: str, fields: Mapping[str, str]) -> bytes:
    """The schema record of a partition: JSON ``{"fields": {name: dtype name}, "partition_id": ...}``, keys sorted."""
    doc = {"partition_id": partition_id, "fields": dict(fields)}
    return json.dumps(doc, sort_keys=True).encode()


def parse_schema(path: str, blob: bytes) -> dict[str, str]:
    """The registered fields (name -> dtype name) of the schema record ``blob`` read from ``path``.

    Raises:
        IntegrityError: the record is malformed (named by ``path``).
    """
    try:
        fields = json.loads(blob)["fields"]
        if not isinstance(fields, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in fields.items()
        ):
            raise TypeError("fields is not a mapping of names to dtype names")
    except (ValueError, KeyError, TypeError) as err:
        msg = f"partition schema {path} is malformed ({type(err).__name__}: {err}); register the partition again"
        raise IntegrityError(msg) from None
    return fields


def encode_sealed(meta: KVBatchMeta) -> bytes:
    """The sealed record of ``meta``'s partition: the meta as JSON, keys sorted."""
    return json.dumps(dataclasses.asdict(meta), sort_keys=True).encode()


def parse_sealed(path: str, blob: bytes, partition_id: str) -> KVBatchMeta:
    """The meta of the sealed record ``blob`` read from ``path``.

    Raises:
        IntegrityError: the record is not a meta (named by ``path``).
    """
    try:
        return KVBatchMeta(**json.loads(blob))
    except (ValueError, TypeError) as err:
        msg = f"{path}: not a sealed batch record ({err}); clear partition {partition_id!r} to produce it again"
        raise IntegrityError(msg) from None
