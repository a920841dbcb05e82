"""`rl.lengths`: a prompt plus ``generation.max_new_tokens`` must fit the model's positions and vLLM's
``max_model_len``, or the run is refused (vLLM would stop the completion at ``max_model_len`` without an error)."""

from __future__ import annotations

import json

import pytest

from rl.config import config_from_dict
from rl.lengths import MODEL_LIMIT, check_fits, context_limit, model_max_len


def test_context_limit_is_the_lower_of_the_model_and_the_engine():
    vllm = config_from_dict({"generation": {"backend": "vllm", "vllm_cfg": {"max_model_len": 1024}}})
    assert context_limit(vllm, 8192) == (1024, "generation.vllm_cfg.max_model_len")
    assert context_limit(vllm, 512) == (512, MODEL_LIMIT)  # vLLM caps max_model_len at the model's own limit
    hf = config_from_dict({"generation": {"vllm_cfg": {"max_model_len": 1024}}})  # transformers ignores vllm_cfg
    assert context_limit(hf, 8192) == (8192, MODEL_LIMIT)


def test_a_prompt_and_its_completion_fit_up_to_the_last_token():
    check_fits([50, 60], 4, 64, MODEL_LIMIT)  # 60 + 4 = 64: fits exactly
    with pytest.raises(
        ValueError,
        match=r"^config generation.max_new_tokens: 5 plus the longest prompt's 60 tokens is more than the 64 "
        r"tokens of generation.vllm_cfg.max_model_len, so completions would be cut short; lower it to at "
        r"most 4, or raise generation.vllm_cfg.max_model_len",
    ):
        check_fits([50, 60], 5, 64, "generation.vllm_cfg.max_model_len")


def test_max_new_tokens_past_the_model_is_refused_before_any_prompt():
    with pytest.raises(
        ValueError,
        match=r"^config generation.max_new_tokens: 1000000000 is more than the 8192 tokens of the model's "
        r"max_position_embeddings, so completions would be cut short; lower it to at most 8192$",
    ):
        check_fits([], 10**9, 8192, MODEL_LIMIT)


def test_a_prompt_longer_than_the_context_asks_for_shorter_prompts():
    with pytest.raises(ValueError, match=r"lower it|shorten the prompts") as err:
        check_fits([70], 1, 64, MODEL_LIMIT)
    assert "shorten the prompts" in str(err.value)


def test_model_max_len_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert model_max_len(str(tmp_path)) == 2048
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert model_max_len(str(tmp_path)) == 1 << 30
