"""The vLLM back-end's pure helpers (no engine): request seeds and KV-cache waves."""

from __future__ import annotations

import pytest

from rl.backends.vllm.generation import request_seed, waves


def test_waves_keep_order_and_fit_the_cache():
    # capacity 10: 4 + 4 = 8 fits, + 4 = 12 does not -> new wave; 4 + 6 = 10 fits; + 10 does not -> new wave
    assert waves([4, 4, 4, 6, 10], 10) == [[0, 1], [2, 3], [4]]
    assert waves([10, 10], 10) == [[0], [1]]
    assert waves([], 10) == []


def test_a_group_larger_than_the_cache_says_what_to_raise():
    with pytest.raises(
        ValueError,
        match="needs 11 KV-cache tokens but the vLLM engine holds 10; raise generation.vllm_cfg.cpu_kv_cache_gib",
    ):
        waves([3, 11], 10)


def test_request_seeds_are_distinct_and_fixed():
    seeds = [request_seed(s, b) for s in range(20) for b in range(64)]
    assert len(set(seeds)) == len(seeds) and all(0 <= x < 2**62 for x in seeds)
    assert request_seed(5, 3) == request_seed(5, 3)
