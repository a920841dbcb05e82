"""The grouped-query decode attention (`rl.backends.hf.gqa_decode`): the same numbers as transformers' SDPA
attention (which repeats the key-value heads), on the calls it takes over and on those it hands back; the decode loops
give the same completions with it; the model's attention is switched back after. (That it saves the copies' time is a
GPU measurement: ``bench/profile_decode.py``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl.backends.hf.decode import generate
from rl.backends.hf.gqa_decode import NAME, applies, grouped_query_attention, grouped_query_decode


def _layer(groups: int) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.num_key_value_groups = groups
    layer.is_causal = True
    return layer


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_folding_the_query_heads_equals_repeating_the_keys(mask_kind):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    b, kvh, groups, length, d = 3, 2, 4, 11, 8
    q = torch.randn(b, kvh * groups, 1, d, generator=g)
    k, v = torch.randn(b, kvh, length, d, generator=g), torch.randn(b, kvh, length, d, generator=g)
    keep = torch.ones(b, 1, 1, length, dtype=torch.bool)
    keep[0, ..., :4] = False  # row 0 left-padded by 4, row 1 by 1
    keep[1, ..., :1] = False
    mask = {"bool": keep, "additive": torch.zeros(keep.shape).masked_fill(~keep, -1e9), "none": None}[mask_kind]
    layer = _layer(groups)
    got, _ = grouped_query_attention(layer, q, k, v, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3)
    assert got.shape == want.shape == (b, 1, kvh * groups, d)
    assert torch.allclose(got, want, atol=1e-6)


def test_calls_it_does_not_fold_go_to_transformers_sdpa():
    """A prefill (several query positions), plain multi-head attention and a mask per head are handed back."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(1)
    cases = [
        (_layer(2), torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g), None),
        (_layer(1), torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g), None),
        (_layer(2), torch.randn(2, 4, 1, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g), torch.ones(2, 4, 1, 5)),
    ]
    for layer, q, k, mask in cases:
        got, _ = grouped_query_attention(layer, q, k, k, mask)
        want, _ = sdpa_attention_forward(layer, q, k, k, mask)
        assert torch.equal(got, want)


def test_the_decode_loops_give_the_same_completions_with_it_and_switch_the_model_back(tiny_model_dir):
    from rl.backends.hf.model import load_model
    from rl.model import load_tokenizer

    model, tok = load_model(tiny_model_dir, "sdpa", device="cpu"), load_tokenizer(tiny_model_dir)
    assert applies(model)  # the tiny Llama: 2 query heads on 1 key-value head
    rows = [p for p in ([1, 5, 9, 13], [1, 7, 2]) for _ in range(2)]
    for loop in ("dynamic", "static"):
        plain = generate(model, tok, rows, max_new_tokens=6, greedy=True, precision="float32", loop=loop)
        folded = generate(
            model, tok, rows, max_new_tokens=6, greedy=True, precision="float32", loop=loop, gqa_decode=True
        )
        assert [x.tolist() for x in folded.input_ids] == [x.tolist() for x in plain.input_ids], loop
        for a, b in zip(folded.generation_logprobs, plain.generation_logprobs, strict=True):
            assert torch.allclose(a, b, atol=1e-5)
        assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"), grouped_query_decode(model):
        assert model.config._attn_implementation == NAME
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    eager = SimpleNamespace(config=SimpleNamespace(_attn_implementation="eager", num_attention_heads=2,
                                                   num_key_value_heads=1))  # fmt: skip
    assert not applies(eager)
