"""The KV cache of a conversation carried from one decode call to the next, so that turn k of a multi-turn episode
(`rl.multi_turn`) prefills only what came after turn k - 1 (the environment's reply), not the whole conversation
again: what vLLM's prefix caching does on its side.

A decode call that is asked to keep its rows' KV returns, per row, :class:`KVRow`: the keys and values of every token
it fed the model (the prompt and the completion except its last token, which was sampled, never fed). A later call
whose prompt starts with those tokens starts from them (:func:`seeded_cache`): the cached rows are left-padded to a
common width in a fresh ``DynamicCache``, and only the rest of each prompt is prefilled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVRow:
    """The KV of one row's fed tokens.

    Attributes:
        tokens: the token ids whose keys and values these are, in order.
        layers: per decoder layer ``(keys, values)``, each [kv_heads, len(tokens), head_dim].
    """

    tokens: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]


def reusable(kv: KVRow | None, prompt: list[int]) -> int:
    """How many leading tokens of ``prompt`` ``kv`` covers: the longest common prefix of ``kv.tokens`` and the prompt,
    leaving at least the prompt's last token (the one the decode's first step feeds); 0 without ``kv``. A completion
    cut at a stop string shares all but its cut tail with the tokens its KV was kept for."""
    if kv is None:
        return 0
    limit = min(len(kv.tokens), len(prompt) - 1)
    if kv.tokens[:limit] == prompt[:limit]:  # the usual case: the whole kept conversation continues
        return max(limit, 0)
    c = 0
    while c < limit and kv.tokens[c] == prompt[c]:
        c += 1
    return c


def seeded_cache(model: torch.nn.Module, rows: list[KVRow | None], lengths: list[int]) -> tuple[object, torch.Tensor]:
    """A ``DynamicCache`` holding, for row i, the first ``lengths[i]`` tokens' KV of ``rows[i]`` right-aligned in a
    common width C = max(lengths), and its [n, C] int64 padding mask (1 on cached tokens).

    Raises:
        ValueError: ``rows`` has no cached token at all (C = 0).
    """
    from transformers import DynamicCache

    width = max(lengths, default=0)
    if width == 0:
        msg = "no row has cached tokens: prefill the prompts instead"
        raise ValueError(msg)
    first = next(r for r, c in zip(rows, lengths, strict=True) if c)
    n, device = len(rows), first.layers[0][0].device
    mask = torch.zeros(n, width, dtype=torch.int64)
    for i, c in enumerate(lengths):
        mask[i, width - c :] = 1
    cache = DynamicCache(config=model.config)
    for layer, (k0, v0) in enumerate(first.layers):
        keys = k0.new_zeros(n, k0.shape[0], width, k0.shape[-1])  # [n, kv_heads, C, d]
        values = v0.new_zeros(n, v0.shape[0], width, v0.shape[-1])
        for i, (row, c) in enumerate(zip(rows, lengths, strict=True)):
            if c:
                keys[i, :, width - c :] = row.layers[layer][0][:, :c]
                values[i, :, width - c :] = row.layers[layer][1][:, :c]
        cache.update(keys, values, layer)
    return cache, mask.to(device)


def row_layers(cache: object, j: int, keep: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row ``j`` of ``cache`` at the positions ``keep`` ([L] bool over the first L positions), per layer
    ``(keys, values)`` [kv_heads, kept, head_dim], copied (the cache may drop the row next)."""
    width = keep.shape[0]
    return [
        (layer.keys[j, :, :width][:, keep].clone(), layer.values[j, :, :width][:, keep].clone())
        for layer in cache.layers  # type: ignore[attr-defined]
    ]
