"""The model-parallel maths of the Megatron-core back-end: splitting sequences over context-parallel ranks, and token
logprobs and top-k over a vocabulary split across tensor-parallel ranks.

Pure tensor functions plus collectives over megatron-core's process groups (``parallel_state``); no I/O. The
sequence split is Megatron-LM's load-balanced one (``get_batch_on_this_cp_rank`` in Megatron-LM's ``utils.py``):
with causal attention the last chunks cost the most, so rank r takes chunks r and 2c-1-r of 2c.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def context_parallel_split(x: torch.Tensor, *, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``x`` along ``dim`` (the sequence): chunks ``rank`` and ``2*size-1-rank`` of ``2*size``.

    Args:
        x: [..., S, ...] with S (its length along ``dim``) a multiple of ``2*size``.

    Returns:
        [..., S/size, ...], the two chunks concatenated; ``x`` itself when ``size`` is 1.

    Raises:
        ValueError: S is not a multiple of ``2*size``.
    """
    if size == 1:
        return x
    s = x.shape[dim]
    if s % (2 * size):
        msg = (
            f"context parallelism over {size} ranks splits sequences into {2 * size} chunks, but the length {s} is not "
            f"a multiple of {2 * size}"
        )
        raise ValueError(msg)
    chunks = x.chunk(2 * size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=dim)


def context_parallel_merge(parts: Sequence[torch.Tensor], *, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's :func:`context_parallel_split` part, in rank order (its inverse).

    Args:
        parts: ``size`` tensors [..., S/size, ...].

    Returns:
        [..., S, ...].
    """
    size = len(parts)
    if size == 1:
        return parts[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * size)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * size - 1 - rank] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def padded_length(
    length: int, *, context_parallel_size: int, tensor_parallel_size: int, sequence_parallel: bool
) -> int:
    """``length`` rounded up to what the split needs: a multiple of ``2 * context_parallel_size`` (when above 1), times
    ``tensor_parallel_size`` under sequence parallelism."""
    multiple = (2 * context_parallel_size if context_parallel_size > 1 else 1) * (
        tensor_parallel_size if sequence_parallel else 1
    )
    return -(-length // multiple) * multiple


def _vocab_slice(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> tuple[torch.Tensor, int]:
    """This rank's logits in float32 with the padded vocabulary rows (global id >= ``vocab_size``) at -inf, and the
    global id of its first column."""
    width = logits.shape[-1]
    start = tp_rank * width
    logits = logits.float()
    pad = torch.arange(start, start + width, device=logits.device) >= vocab_size  # [V/t]
    if bool(pad.any()):
        logits = logits.masked_fill(pad, float("-inf"))
    return logits, start


def vocab_parallel_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature)[target] over a vocabulary split across the tensor-parallel ranks, without
    gathering it: megatron-core's ``vocab_parallel_cross_entropy`` (two all-reduces of [..] maxima and sums), whose
    backward is the softmax minus the one-hot on each rank's slice.

    Args:
        logits: [..., V_pad / t] this tensor-parallel rank's slice of the logits (rank r holds ids
            ``r * V_pad/t`` to ``(r+1) * V_pad/t - 1``); any float dtype.
        targets: [...] int64 global token ids (< ``vocab_size``).
        vocab_size: the real vocabulary; the padded rows above it are masked out of the softmax.
        temperature: the logits are divided by it (the sampling distribution of generation).

    Returns:
        [...] float32 logprobs in nats; gradients flow to ``logits``.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    sliced, _ = _vocab_slice(logits, vocab_size, parallel_state.get_tensor_model_parallel_rank())
    return -vocab_parallel_cross_entropy(sliced / temperature, targets)


def vocab_parallel_topk(logits: torch.Tensor, k: int, *, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits and their global ids over a vocabulary split across the tensor-parallel ranks: each
    rank's top-k, all-gathered over the tensor-parallel group, then the top-k of those.

    Args:
        logits: [T, V_pad / t] this rank's slice (see :func:`vocab_parallel_token_logprobs`).

    Returns:
        ``(values, indices)``: [T, k] float32 descending and [T, k] int64 global ids, the same on every rank.

    Raises:
        ValueError: ``k`` is not between 1 and ``vocab_size``.
    """
    from megatron.core import parallel_state

    if not 1 <= k <= vocab_size:
        msg = f"get_topk_logits: k={k} must be between 1 and the vocabulary size {vocab_size}"
        raise ValueError(msg)
    sliced, start = _vocab_slice(logits, vocab_size, parallel_state.get_tensor_model_parallel_rank())
    top = sliced.topk(min(k, sliced.shape[-1]), dim=-1)  # [T, k'] each
    values, indices = top.values, top.indices + start
    size = parallel_state.get_tensor_model_parallel_world_size()
    if size > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        all_values = [torch.empty_like(values) for _ in range(size)]
        all_indices = [torch.empty_like(indices) for _ in range(size)]
        torch.distributed.all_gather(all_values, values.contiguous(), group=group)
        torch.distributed.all_gather(all_indices, indices.contiguous(), group=group)
        values, indices = torch.cat(all_values, -1), torch.cat(all_indices, -1)  # [T, t*k']
    best = values.topk(k, dim=-1)  # [T, k]
    return best.values, indices.gather(-1, best.indices)
