"""Grouped-query attention of a one-token decode step without copying the keys and values per query head.

A Llama with fewer key-value heads than query heads (grouped-query attention: SmolLM2-135M 9 / 3, the 1B shape
32 / 8) shares each key-value head among ``groups`` query heads. Under a padding mask, transformers' SDPA attention
repeats every key and value ``groups`` times (``repeat_kv``) before calling SDPA, because torch's kernels take grouped
heads only without a mask: on an H200 at 1B, 512 rows, those copies were 45% of a decode step's GPU time
(``bench/profile_decode.py``). A decode step has one query per head, so the ``groups`` query heads of a key-value head
can instead be stacked as ``groups`` query positions of that head: ``q [b, kvh * groups, 1, d] -> [b, kvh, groups,
d]``, attending to the un-repeated ``k, v [b, kvh, L, d]`` under the same ``[b, 1, 1, L]`` mask. Each (row, head)
computes the same softmax over the same keys, so the result is the same (up to the kernel's rounding), with the keys
and values read once instead of ``groups`` times and nothing copied. (The same folding is what FlashDecoding-style
GQA kernels do; vLLM's attention backends pack a KV head's query heads likewise.)

:func:`grouped_query_attention` is registered with transformers' attention interface under :data:`NAME`
(its masks are SDPA's); :func:`grouped_query_decode` runs a block with a model's SDPA attention switched to it.
Every other call (a prompt's prefill, a training forward, a mask per head) goes to transformers' own SDPA attention.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

NAME = "grpoflow_gqa_sdpa"
"""The attention implementation name :func:`grouped_query_attention` is registered under."""

_REGISTERED = threading.Lock()
_DONE: list[bool] = []


def grouped_query_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (the signature of ``sdpa_attention_forward``).

    Args:
        module: the attention layer (its ``num_key_value_groups`` is ``groups``).
        query: [b, heads, q, d]; key, value: [b, kv_heads, L, d].
        attention_mask: None, or a [b, 1, 1, L] mask (bool: True attends; or additive) shared by every head.
        dropout, scaling, is_causal: as SDPA's ``dropout_p``, ``scale``, ``is_causal``.

    Returns:
        ``(out [b, q, heads, d], None)``, as transformers' SDPA attention returns it.

    With one query position, grouped heads, no dropout and a mask shared by the heads, the query heads are folded
    onto the key-value heads (the module's docstring); otherwise transformers' ``sdpa_attention_forward`` runs.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q, d = query.shape
    shared_mask = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1))
    if q != 1 or groups <= 1 or dropout or not shared_mask or kwargs.get("output_attentions"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    folded = query.reshape(b, heads // groups, groups, d)  # head h = kv head h // groups, as repeat_kv orders them
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, heads, 1, d).transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :func:`grouped_query_attention` and SDPA's mask function under :data:`NAME` (once per process)."""
    with _REGISTERED:
        if _DONE:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, grouped_query_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _DONE.append(True)


def applies(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs transformers' SDPA attention with grouped query heads."""
    c = model.config
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return c._attn_implementation == "sdpa" and kv < c.num_attention_heads


@contextlib.contextmanager
def grouped_query_decode(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Run the block with ``model``'s attention switched from ``sdpa`` to :data:`NAME` where :func:`applies` (and
    ``enabled``); restored on exit, also when the block raises. The switch is the model's config: a model decoded
    by one thread at a time (the generation copy) is what it is for."""
    if not (enabled and applies(model)):
        yield
        return
    register()
    model.config._attn_implementation = NAME
    try:
        yield
    finally:
        model.config._attn_implementation = "sdpa"
