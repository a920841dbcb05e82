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


def shard_updates_for_dp(
    meta: KVBatchMeta, *, dp_world: int, rank: int, rows_per_update: int
) -> tuple[KVBatchMeta, list[int]]:
    """Rank ``rank``'s rows of a step that makes several optimizer updates, each on ``rows_per_update`` consecutive
    rows of ``meta``: every update's rows are split across the ranks by :func:`shard_meta_for_dp`, so update ``g``
    of every rank together is exactly update ``g`` of one rank (the same samples, the same global token counts).

    Args:
        meta: the step's batch; needs ``sequence_lengths``. Its ``global_forward_pad_seqlen`` (stamped here if
            missing) is every shard's, so all ranks' tensors share one sequence dimension.
        dp_world: data-parallel ranks (>= 1).
        rank: this rank, ``0 <= rank < dp_world``.
        rows_per_update: the global batch of one optimizer update (``train_global_batch_size``); the last update
            takes the remainder.

    Returns:
        ``(shard, update_sizes)``: this rank's rows, update by update, and how many of them each update has (a
        rank may have 0 rows in an update that has fewer rows than ranks).

    Raises:
        ValueError: ``rank`` out of range, ``rows_per_update < 1``, or what :func:`shard_meta_for_dp` raises for.
    """
    if not 0 <= rank < dp_world:
        msg = f"rank {rank} is not in [0, {dp_world})"
        raise ValueError(msg)
    if rows_per_update < 1:
        msg = f"rows_per_update must be >= 1, got {rows_per_update}"
        raise ValueError(msg)
    parent = meta.stamp_pad_seqlen()
    pieces = [
        shard_meta_for_dp(parent.slice(g0, min(g0 + rows_per_update, parent.size())), dp_world=dp_world)[0][rank]
        for g0 in range(0, parent.size(), rows_per_update)
    ]
    if not pieces:  # an empty step: one empty update
        return parent.subset([]), [0]
    return pieces[0].concat(*pieces[1:]), [p.size() for p in pieces]
