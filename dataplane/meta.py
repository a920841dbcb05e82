"""`KVBatchMeta`: the small handle tasks pass instead of tensors, and its I/O-free transforms.

Owns row bookkeeping only; it never touches storage (that is `dataplane.client`).
Mirrors NeMo-RL's `nemo_rl.data_plane.interfaces.KVBatchMeta` (its 7 fields, plus ``puts``; no I/O in any method).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

GLOBAL_FORWARD_PAD_SEQLEN = "global_forward_pad_seqlen"
PAD_TO_MULTIPLE = "pad_to_multiple"


@dataclass
class KVBatchMeta:
    """Names the rows of one partition of the data plane.

    Attributes:
        partition_id: the partition, e.g. ``"step_000003"`` or ``"val_000004"``.
        sample_ids: per-row keys, minted once at the first put as ``f"{uid}_g{i}"``
            (one uid per prompt, ``i`` the index in its group) and reused by every later read/write.
        task_name: consumer tag (``"prev_lp"``, ``"ref_lp"``, ``"train"``) or None.
        fields: the fields known to be written under these ids (the union of the writes that led here).
        sequence_lengths: unpadded per-row lengths (``input_lengths``) for token-balanced sharding.
        extra_info: batch-level bag of numbers: rollout metrics, timings (s),
            ``pad_to_multiple``, ``global_forward_pad_seqlen``.
        tags: per-row numeric sidecar aligned with ``sample_ids`` (e.g. ``baseline``, ``std``).
        puts: the puts that wrote these rows, each ``"{write_id}:{crc32}"`` (the put's write id and the CRC-32 of
            its data file, see ``DataPlane.put``), or None (a meta built by hand: ``DataPlane`` reads and delta
            writes refuse it, since its rows cannot be checked; ``DataPlane.meta_for`` makes a meta for rows by their
            ids). Reads and delta writes under the meta fail with ``StaleMetaError`` when a row was since put again
            with other content
            (``clear`` and a re-put with the same ``id_key``, a retried put that sampled other rows). A retry that
            wrote the same bytes is the same put: the meta stays valid.
    """

    partition_id: str
    sample_ids: list[str]
    task_name: str | None = None
    fields: list[str] | None = None
    sequence_lengths: list[int] | None = None
    extra_info: dict[str, float] = field(default_factory=dict)
    tags: list[dict[str, float]] | None = None
    puts: list[str] | None = None

    def __post_init__(self) -> None:
        n = len(self.sample_ids)
        if self.puts is not None and not (isinstance(self.puts, list) and all(isinstance(p, str) for p in self.puts)):
            msg = f"puts must be a list of strings (the put records' '{{write_id}}:{{crc32}}'), got {self.puts!r}"
            raise ValueError(msg)
        if self.sequence_lengths is not None and len(self.sequence_lengths) != n:
            msg = (
                f"sequence_lengths has {len(self.sequence_lengths)} entries for {n} sample_ids; give one length per "
                "sample"
            )
            raise ValueError(msg)
        if self.tags is not None and len(self.tags) != n:
            msg = f"tags has {len(self.tags)} entries for {n} sample_ids; give one tag dict per sample"
            raise ValueError(msg)
        if len(set(self.sample_ids)) != n:
            msg = f"sample_ids of partition {self.partition_id!r} contain duplicates; every row needs its own id"
            raise ValueError(msg)

    def size(self) -> int:
        """Number of rows."""
        return len(self.sample_ids)

    def subset(self, indices: Sequence[int]) -> KVBatchMeta:
        """Rows at ``indices`` (in that order); per-row lists follow, batch-level info is copied."""
        idx = [int(i) for i in indices]
        n = self.size()
        bad = [i for i in idx if not -n <= i < n]
        if bad:
            msg = f"indices {bad[:5]} out of range for a meta of {n} rows"
            raise IndexError(msg)
        return replace(
            self,
            sample_ids=[self.sample_ids[i] for i in idx],
            sequence_lengths=None if self.sequence_lengths is None else [self.sequence_lengths[i] for i in idx],
            tags=None if self.tags is None else [dict(self.tags[i]) for i in idx],
            extra_info=dict(self.extra_info),
            puts=None if self.puts is None else list(self.puts),
        )

    def slice(self, start: int, stop: int) -> KVBatchMeta:
        """Rows ``start:stop``."""
        return self.subset(range(*slice(start, stop).indices(self.size())))

    def concat(self, *others: KVBatchMeta) -> KVBatchMeta:
        """Rows of ``self`` then of each of ``others``; all must name the same partition. ``puts`` is the union of
        theirs (None if one of them has none: its rows could not be checked).

        Raises:
            ValueError: a meta of another partition, or an id present twice.
        """
        metas = (self, *others)
        parts = {m.partition_id for m in metas}
        if len(parts) != 1:
            msg = f"concat needs metas of one partition, got {sorted(parts)}"
            raise ValueError(msg)
        has_lengths = all(m.sequence_lengths is not None for m in metas)
        has_tags = all(m.tags is not None for m in metas)
        has_puts = all(m.puts is not None for m in metas)
        field_sets = [set(m.fields) for m in metas if m.fields is not None]
        extra: dict[str, Any] = {}
        for m in metas:
            extra.update(m.extra_info)
        return KVBatchMeta(
            partition_id=self.partition_id,
            sample_ids=[s for m in metas for s in m.sample_ids],
            task_name=self.task_name,
            fields=sorted(set.intersection(*field_sets)) if field_sets else None,
            sequence_lengths=[x for m in metas for x in m.sequence_lengths] if has_lengths else None,  # type: ignore[union-attr]
            extra_info=extra,
            tags=[dict(t) for m in metas for t in m.tags] if has_tags else None,  # type: ignore[union-attr]
            puts=sorted({p for m in metas for p in m.puts}) if has_puts else None,  # type: ignore[union-attr]
        )

    def join(self, *others: KVBatchMeta) -> KVBatchMeta:
        """The same rows, with the ``fields`` and ``extra_info`` of ``others`` added.

        ``others`` are metas returned by delta writes to the same rows (e.g. the logprob tasks), so the
        result names every column written so far; later ``extra_info`` values win.

        Raises:
            ValueError: a meta of another partition or with other sample ids.
        """
        merged_fields = list(self.fields or [])
        extra = dict(self.extra_info)
        for other in others:
            if other.partition_id != self.partition_id or other.sample_ids != self.sample_ids:
                msg = (
                    f"join needs metas of the same rows; {other.partition_id!r} differs from {self.partition_id!r} or "
                    "in its sample_ids"
                )
                raise ValueError(msg)
            merged_fields += [f for f in other.fields or [] if f not in merged_fields]
            extra.update(other.extra_info)
        return replace(self, fields=merged_fields, extra_info=extra)

    def with_extra_info(self, **info: Any) -> KVBatchMeta:
        """The same rows with ``info`` merged into ``extra_info``."""
        return replace(self, extra_info={**self.extra_info, **info})

    def stamp_tags(self, values: Mapping[str, Sequence[Any]]) -> KVBatchMeta:
        """Add per-row tags; each sequence must have one primitive per row.

        Raises:
            ValueError: a sequence whose length is not ``size()``.
        """
        n = self.size()
        tags = [dict(t) for t in self.tags] if self.tags is not None else [{} for _ in range(n)]
        for key, seq in values.items():
            seq = list(seq)
            if len(seq) != n:
                msg = f"tag {key!r} has {len(seq)} values for {n} rows"
                raise ValueError(msg)
            for t, v in zip(tags, seq):
                t[key] = v.item() if hasattr(v, "item") else v
        return replace(self, tags=tags, extra_info=dict(self.extra_info))

    def global_forward_pad_seqlen(self) -> int:
        """``round_up(max(sequence_lengths), pad_to_multiple)``: the one length every reader pads to.

        Set once on the driver (stored in ``extra_info``) and inherited by every per-rank meta, so all
        data-parallel ranks see the same sequence dimension (NeMo-RL `GLOBAL_FORWARD_PAD_SEQLEN`).
        """
        if GLOBAL_FORWARD_PAD_SEQLEN in self.extra_info:
            return int(self.extra_info[GLOBAL_FORWARD_PAD_SEQLEN])
        if not self.sequence_lengths:
            return 0
        multiple = int(self.extra_info.get(PAD_TO_MULTIPLE, 1))
        return int(math.ceil(max(self.sequence_lengths) / multiple) * multiple)

    def stamp_pad_seqlen(self) -> KVBatchMeta:
        """Fix ``global_forward_pad_seqlen`` into ``extra_info`` (idempotent)."""
        return self.with_extra_info(**{GLOBAL_FORWARD_PAD_SEQLEN: self.global_forward_pad_seqlen()})
