"""The micro-batch planner of the policy back-ends: consecutive rows of a batch under a row cap and a padded-token
budget (`micro_batch_slices`), and those limits from the config or, where it leaves them null, from the device
(`micro_batch_limits`: a row count on the CPU; on CUDA a token budget from the free device memory over an activation
estimate per token, `default_max_tokens`, less what an engine sleeping in this process takes back when it wakes:
`set_engine_reserve`).

Used by the shared update (`rl.backends.engine`) and by the back-ends' logprob passes.
"""

from __future__ import annotations

from typing import Any

import torch

from rl.config import GRPOConfig

CPU_MICRO_BATCH_ROWS = 32
"""Rows per micro-batch on the CPU when ``optim.train_micro_batch_size`` / ``logprob_batch_size`` are null: 32
rollouts of SmolLM2 per pass trained ~1.5x faster than 8 (``bench/micro_batch.py``)."""


def micro_batch_slices(lengths: torch.Tensor, *, max_rows: int | None, max_tokens: int | None) -> list[slice]:
    """Consecutive rows as micro-batches: each as many rows as fit under ``max_rows`` and under ``max_tokens`` padded
    tokens (rows x the longest row among them), at least one row each (a row longer than the budget goes alone).

    Rows stay in order, so a rollout's groups stay together and share their prompt's forward; the loss is normalized
    by the whole update's token and sequence counts, so the split changes the update only by the order of float sums.

    Example:
        >>> lengths = torch.tensor([4, 4, 4, 10, 2])
        >>> [(s.start, s.stop) for s in micro_batch_slices(lengths, max_rows=None, max_tokens=12)]  # 3 x 4 fits 12
        [(0, 3), (3, 4), (4, 5)]
        >>> [(s.start, s.stop) for s in micro_batch_slices(lengths, max_rows=2, max_tokens=None)]
        [(0, 2), (2, 4), (4, 5)]

    Args:
        lengths: [n] int64 unpadded row lengths, on the host.
        max_rows: most rows per micro-batch (None: no cap).
        max_tokens: most padded tokens per micro-batch (None: no budget).

    Returns:
        slices covering ``0..n`` in order (empty for n = 0).
    """
    n = int(lengths.shape[0])
    if max_tokens is None:
        step = max(max_rows or n, 1)
        return [slice(a, min(a + step, n)) for a in range(0, n, step)]
    out, start, longest = [], 0, 0
    for i, length in enumerate(lengths.tolist()):
        wider = max(longest, int(length))
        rows = i - start + 1
        if i > start and (wider * rows > max_tokens or (max_rows is not None and rows > max_rows)):
            out.append(slice(start, i))
            start, wider = i, int(length)
        longest = wider
    if n:
        out.append(slice(start, n))
    return out


def activation_bytes_per_token(model_config: Any, *, train: bool) -> int:
    """Device memory one token of a micro-batch takes, bytes, from a Hugging Face config (an estimate, on the safe
    side: 2.7 MB at the 1B shape, where ``bench/megatron.py``'s peak-memory column measured 2.0 MB on an H200 for the
    transformers back-end): under bf16 autocast the backward keeps ~(16 H + 4 I)
    bf16 values per layer and token (inputs of the norms, projections, attention and the MLP), the LM head a float32
    [V] row of logits and its log-softmax per wanted token (and its gradient when training); a forward without
    gradients keeps one layer's worth."""
    h, i = int(model_config.hidden_size), int(getattr(model_config, "intermediate_size", 4 * model_config.hidden_size))
    layers, vocab = int(model_config.num_hidden_layers), int(model_config.vocab_size)
    per_layer = 2 * (16 * h + 4 * i)
    return (layers if train else 2) * per_layer + (12 if train else 8) * vocab


_ENGINE_RESERVES: dict[tuple[str, str], int] = {}
"""(device, owner) -> bytes a generation engine in this process holds off the device while it sleeps and takes back
when it wakes (:func:`set_engine_reserve`)."""


def device_key(device: torch.device | str) -> str:
    """``"cuda:<index>"`` (the current device where ``device`` names none), or the device's type: the key of a device
    in :func:`set_engine_reserve`."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"


def set_engine_reserve(device: torch.device | str, owner: str, nbytes: int) -> None:
    """Record that ``owner`` (an in-process generation engine, e.g. vLLM in sleep mode beside the trainer) will take
    ``nbytes`` of ``device``'s memory back when it wakes; 0 forgets it (the engine is awake: the memory it holds is
    no longer free, or it is gone). :func:`default_max_tokens` leaves these bytes out of the memory it sizes the
    trainer's micro-batches from, so that a budget sized while the engine sleeps still fits beside it awake."""
    key = (device_key(device), owner)
    if nbytes > 0:
        _ENGINE_RESERVES[key] = int(nbytes)
    else:
        _ENGINE_RESERVES.pop(key, None)


def engine_reserve(device: torch.device | str) -> int:
    """Bytes of ``device`` that sleeping in-process engines take back when they wake (:func:`set_engine_reserve`)."""
    key = device_key(device)
    return sum(n for (dev, _), n in _ENGINE_RESERVES.items() if dev == key)


_BUDGETS: dict[tuple, int] = {}
"""Token budgets resolved in this process, per (device, train, model shape): a run's micro-batches do not change with
the memory free at each step."""


def default_max_tokens(
    model_config: Any,
    device: torch.device | str,
    *,
    train: bool,
    fraction: float = 0.5,
    reserved_bytes: int | None = None,
) -> int | None:
    """The padded-token budget of a micro-batch when the config leaves it null: None on the CPU (row counts decide,
    ``CPU_MICRO_BATCH_ROWS``); on CUDA ``fraction`` of the device memory free at the first call in this process (the
    driver's free memory plus the allocator's cached spare), less ``reserved_bytes`` (default: what sleeping
    in-process engines take back at their wake, :func:`engine_reserve`), less the gradients and AdamW moments a
    training model will hold (12 bytes per parameter, in case they are not allocated yet), over
    :func:`activation_bytes_per_token`; rounded down to a multiple of 1,024 and kept within 2,048..65,536.
    Resolved once per process, device and model shape."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    shape = tuple(
        int(getattr(model_config, k, 0) or 0)
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    )
    key = (str(device), train, shape)
    if key not in _BUDGETS:
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # the allocator's own spare
        free -= engine_reserve(device) if reserved_bytes is None else reserved_bytes
        if train:
            free -= 12 * parameter_count(model_config)
        tokens = int(fraction * max(free, 0) / activation_bytes_per_token(model_config, train=train)) // 1024 * 1024
        _BUDGETS[key] = max(2048, min(tokens, 65536))
    return _BUDGETS[key]


def parameter_count(model_config: Any) -> int:
    """Parameters of a Llama-shaped decoder from its Hugging Face config (embeddings counted once when tied)."""
    h, i = int(model_config.hidden_size), int(getattr(model_config, "intermediate_size", 4 * model_config.hidden_size))
    heads = int(getattr(model_config, "num_attention_heads", 1))
    head_dim = int(getattr(model_config, "head_dim", None) or h // heads)
    kv = int(getattr(model_config, "num_key_value_heads", None) or heads)
    layer = h * head_dim * (2 * heads + 2 * kv) + 3 * h * i + 2 * h
    vocab = int(model_config.vocab_size) * h * (1 if getattr(model_config, "tie_word_embeddings", False) else 2)
    return int(model_config.num_hidden_layers) * layer + vocab + h


def micro_batch_limits(
    cfg: GRPOConfig, model_config: Any, device: torch.device | str, *, train: bool
) -> tuple[int | None, int | None]:
    """``(max_rows, max_tokens)`` of a micro-batch for training (``train``) or a logprob pass: the config's
    ``optim.train_micro_batch_size`` / ``train_max_tokens_per_micro_batch`` (``logprob_batch_size`` /
    ``logprob_max_tokens_per_micro_batch``), a null resolved from the device: on the CPU 32 rows and no token
    budget; on CUDA no row cap and :func:`default_max_tokens`."""
    o = cfg.optim
    rows, tokens = (
        (o.train_micro_batch_size, o.train_max_tokens_per_micro_batch)
        if train
        else (o.logprob_batch_size, o.logprob_max_tokens_per_micro_batch)
    )
    if torch.device(device).type == "cpu":
        return (CPU_MICRO_BATCH_ROWS if rows is None and tokens is None else rows), tokens
    return rows, tokens if tokens is not None else default_max_tokens(model_config, device, train=train)
