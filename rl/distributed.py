"""Data-parallel collectives of the train and logprob back-ends: the process group of a torchrun-style launch, the
sums that make a sharded step equal to an unsharded one, and the gradient all-reduce. No Flyte. Without a process
group (one rank) every function is the identity, so the single-process path runs the same code."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

GRADIENT_BUCKET_BYTES = 64 * 2**20
"""Gradients are summed in flat buckets of this size: one collective per bucket instead of one per parameter
(~290 for SmolLM2), as DDP's ``bucket_cap_mb`` does."""


def _group() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if _group() else 0


def world_size() -> int:
    """Ranks in the process group (1 without one)."""
    return dist.get_world_size() if _group() else 1


@contextlib.contextmanager
def process_group(timeout_s: float = 1800.0) -> Iterator[int]:
    """Join the process group a torchrun-style launcher describes (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT`` in the environment; set by ``torch.distributed.elastic`` and flytekitplugins-kfpytorch), on NCCL
    where every local rank has a GPU, else gloo; leave it on exit. Yields the world size. Without ``WORLD_SIZE`` > 1, or
    inside a group already joined, it does nothing.

    Args:
        timeout_s: how long a collective waits for the other ranks before it raises (a rank that died leaves the
            others waiting; the launcher usually kills them sooner).
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1 or dist.is_initialized():
        yield world_size()
        return
    # NCCL needs a GPU per local rank; with fewer (a workstation trying two ranks on one GPU) the ranks run on gloo
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield size
    finally:
        dist.destroy_process_group()


def _device() -> torch.device:
    """Where the group's collectives run: the current GPU under NCCL, else the CPU (gloo)."""
    return (
        torch.device("cuda", torch.cuda.current_device()) if str(dist.get_backend()) == "nccl" else torch.device("cpu")
    )


def _spans(group: Any) -> bool:
    """Whether ``group`` (None: every rank) has more than one rank, so that a collective over it does something."""
    return _group() and (group is None or dist.get_world_size(group) > 1)


def all_reduce(values: torch.Tensor, op: str = "sum", *, group: Any = None) -> torch.Tensor:
    """``values`` reduced elementwise over the ranks of ``group`` (None: all; ``sum``, ``max`` or ``min``); a new
    tensor on ``values``'s device, in float64 for float inputs so that sums of counts and of metric sums stay exact."""
    out = values.detach().to(torch.float64 if values.is_floating_point() else values.dtype).clone()
    if not _spans(group):
        return out
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    moved = out.to(_device())
    dist.all_reduce(moved, op=ops[op], group=group)
    return moved.to(out.device)


def sum_scalars(values: dict[str, float]) -> dict[str, float]:
    """Each value summed over the ranks. Every rank must pass the same keys (checked)."""
    if not _group():
        return dict(values)
    keys = sorted(values)
    check = gather_objects(keys)
    if any(k != keys for k in check):
        msg = f"sum_scalars: ranks disagree on the keys: {check}"
        raise RuntimeError(msg)
    total = all_reduce(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
    return {k: float(v) for k, v in zip(keys, total.tolist(), strict=True)}


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` without a process group)."""
    if not _group():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``obj`` itself without a process group): one decision for all ranks."""
    if not _group():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait until every rank is here."""
    if _group():
        dist.barrier()


def all_reduce_gradients(params: Iterable[torch.nn.Parameter], *, group: Any = None) -> None:
    """Sum every parameter's gradient over the ranks of ``group`` (None: all), in place, in flat buckets of
    ``GRADIENT_BUCKET_BYTES``.

    A parameter without a gradient on this rank (no rows here) takes part with zeros, so that the ranks' buckets line
    up; one that no rank gave a gradient has none afterwards, as with one rank (AdamW skips it). The loss is normalized
    by the global token and sequence counts (see ``rl.loss.clipped_pg_loss``), so the sum, not the mean, of the ranks'
    gradients is the gradient of the whole batch: DDP's averaging would need the loss scaled by the world size
    (NeMo-RL's DTensor worker does so). Megatron-core's ``DistributedDataParallel`` with ``overlap_grad_reduce=False``
    does the same reduction: once
    per optimizer update, after the last micro-batch.
    """
    if not _spans(group):
        return
    live = [p for p in params if p.requires_grad]
    had = all_reduce(torch.tensor([p.grad is not None for p in live], dtype=torch.int32), op="max", group=group)  # [P]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.Tensor] = []
    size = 0
    for p in live:
        if bucket and p.grad.dtype != bucket[0].dtype:  # type: ignore[union-attr]  # one dtype per flat bucket
            _reduce_bucket(bucket, group)
            bucket, size = [], 0
        bucket.append(p.grad)  # type: ignore[arg-type]
        size += p.grad.numel() * p.grad.element_size()  # type: ignore[union-attr]
        if size >= GRADIENT_BUCKET_BYTES:
            _reduce_bucket(bucket, group)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(bucket, group)
    for p, used in zip(live, had.tolist(), strict=True):
        if not used:
            p.grad = None


def _reduce_bucket(grads: list[torch.Tensor], group: Any) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
