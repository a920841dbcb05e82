"""Data plane: `KVBatchMeta` handles, the jagged<->Arrow codec, and the object-store client."""

from dataplane.meta import KVBatchMeta

__all__ = ["KVBatchMeta"]
