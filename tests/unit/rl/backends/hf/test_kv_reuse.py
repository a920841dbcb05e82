"""Which part of a prompt a kept KV covers (`rl.backends.hf.kv_reuse.reusable`), and the cache seeded from kept rows:
right-aligned, masked where a row has fewer cached tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl.backends.hf.kv_reuse import KVRow, reusable, seeded_cache


def _row(tokens: list[int], heads: int = 2, dim: int = 3) -> KVRow:
    k = torch.arange(len(tokens), dtype=torch.float32)[None, :, None].expand(heads, len(tokens), dim)
    return KVRow(tokens=tokens, layers=[(k + 100, -k)])


def test_the_covered_part_is_the_common_prefix_short_of_the_last_token():
    kv = _row([1, 2, 3, 4])
    assert reusable(kv, [1, 2, 3, 4, 9, 9]) == 4  # the conversation continues: all of it
    assert reusable(kv, [1, 2, 3, 4]) == 3  # the last token is left for the decode's first step
    assert reusable(kv, [1, 2, 7, 7, 7]) == 2  # a completion cut at a stop string: the shared part
    assert reusable(kv, [5, 2, 3]) == 0 and reusable(None, [1, 2]) == 0


def test_the_seeded_cache_right_aligns_each_rows_kv_and_masks_the_rest():
    from transformers import LlamaConfig

    model = SimpleNamespace(config=LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    cache, mask = seeded_cache(model, [_row([1, 2, 3]), None, _row([4, 5])], [3, 0, 1])
    assert mask.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 1]]
    keys = cache.layers[0].keys  # [3 rows, 2 heads, 3, 3]
    assert keys[0, 0, :, 0].tolist() == [100.0, 101.0, 102.0]
    assert keys[2, 0, :, 0].tolist() == [0.0, 0.0, 100.0]  # row 2 keeps only its first token, at the right
    with pytest.raises(ValueError, match="no row has cached tokens"):
        seeded_cache(model, [None], [0])
