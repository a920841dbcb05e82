"""Token-balanced data-parallel split of a meta, from metadata only (no I/O).

Mirrors NeMo-RL `nemo_rl.data_plane.preshard.shard_meta_for_dp`.
"""

from __future__ import annotations

import heapq

from dataplane.meta import KVBatchMeta


def shard_meta_for_dp(meta: KVBatchMeta, *, dp_world: int) -> tuple[list[KVBatchMeta], list[int]]:
    """Split ``meta`` into ``dp_world`` metas with near-equal token counts.

    Greedy longest-first assignment to the least-loaded rank (LPT), with equal row counts per rank when
    the size divides evenly. Every shard inherits ``global_forward_pad_seqlen`` from the parent.

    Args:
        meta: the full batch; needs ``sequence_lengths``.
        dp_world: number of data-parallel ranks (>= 1).

    Returns:
        ``(shards, unsorted_indices)``: ``unsorted_indices[i]`` is the position, in the concatenation of
        the shards' rows, of the parent's row ``i`` (apply it to restore the parent order).

    Raises:
        ValueError: ``dp_world < 1``, or no ``sequence_lengths`` on the meta.
    """
    if dp_world < 1:
        msg = f"dp_world must be >= 1, got {dp_world}"
        raise ValueError(msg)
    if meta.sequence_lengths is None:
        msg = "shard_meta_for_dp needs meta.sequence_lengths (set by the first put from input_lengths)"
        raise ValueError(msg)
    parent = meta.stamp_pad_seqlen()
    n = parent.size()
    cap = -(-n // dp_world)
    order = sorted(range(n), key=lambda i: -parent.sequence_lengths[i])  # type: ignore[index]
    heap = [(0, r) for r in range(dp_world)]
    rows: list[list[int]] = [[] for _ in range(dp_world)]
    for i in order:
        full = []
        load, r = heapq.heappop(heap)
        while len(rows[r]) >= cap:
            full.append((load, r))
            load, r = heapq.heappop(heap)
        rows[r].append(i)
        heapq.heappush(heap, (load + parent.sequence_lengths[i], r))  # type: ignore[index]
        for item in full:
            heapq.heappush(heap, item)
    for r in rows:
        r.sort()
    shards = [parent.subset(r) for r in rows]
    flat = [i for r in rows for i in r]
    unsorted = [0] * n
    for pos, i in enumerate(flat):
        unsorted[i] = pos
    return shards, unsorted
