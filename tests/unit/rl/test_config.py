from __future__ import annotations

import json

import pytest

from rl.config import GRPOConfig, config_from_dict, load_config


def test_defaults_are_valid_and_json_safe():
    cfg = GRPOConfig()
    assert cfg.samples_per_step == 64
    json.dumps(cfg.to_dict())
    assert "dataplane.storage_options" not in cfg.flat_params()
    assert cfg.flat_params()["loss.reference_policy_kl_penalty"] == "0.01"


@pytest.mark.parametrize(
    ("section", "values", "match"),
    [
        ("grpo", {"num_generations_per_prompt": 1}, "at least 2"),
        ("loss", {"reference_policy_kl_type": "k9"}, "use 'k1', 'k2' or 'k3'"),
        ("loss", {"ratio_clip_max": 1.5}, "ratio_clip_max"),
        ("loss", {"ratio_clip_c": 0.5}, "ratio_clip_c"),
        ("optim", {"lr": 0}, "positive learning rate"),
        ("optim", {"train_global_batch_size": 12, "train_micro_batch_size": 8}, "multiple"),
        ("generation", {"temperature": 0}, "temperature"),
        ("generation", {"backend": "sglang"}, r"'sglang' is not a generation back-end; use one of \['transformers', 'vllm'\]"),
        ("policy", {"backend": "megatron"}, r"'megatron' is not a policy back-end; use one of \['transformers'\]"),
        ("generation", {"vllm_cfg": {"gpu_memory_utilization": 1.5}}, r"vllm_cfg.gpu_memory_utilization: is 1.5"),
        ("generation", {"backend": "vllm", "max_new_tokens": 64, "vllm_cfg": {"max_model_len": 64}}, "raise vllm_cfg.max_model_len"),
        ("grpo", {"dynamic_sampling_max_gen_batches": 0}, "at least 1"),
        ("loss", {"seq_logprob_error_threshold": 0.5}, ">= 1"),
        ("model", {"precision": "fp8"}, "'auto', 'bfloat16' or 'float32'"),
        ("grpo", {"advantage_clip": 0}, "positive bound"),
        ("loss", {"truncated_importance_sampling_ratio": 2.0}, "use_importance_sampling_correction is false"),
        ("loss", {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": -1}, "positive bound"),
        ("dataplane", {"storage_options": {"secret": "x"}}, "environment"),
    ],
)
def test_bad_values_fail_with_a_fix(section, values, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict({section: values})


def test_global_batch_must_divide_step():
    with pytest.raises(ValueError, match="does not divide"):
        config_from_dict({"optim": {"train_global_batch_size": 48, "train_micro_batch_size": 8}})


def test_unknown_keys_are_named():
    with pytest.raises(ValueError, match=r"unknown keys \['lr_typo'\]"):
        config_from_dict({"optim": {"lr_typo": 1}})
    with pytest.raises(ValueError, match="unknown keys"):
        config_from_dict({"optimizer": {}})
    # nested sections are parsed as strictly, and their keys are named with their path
    with pytest.raises(ValueError, match=r"generation.vllm_cfg: unknown keys \['gpu_mem'\]"):
        config_from_dict({"generation": {"vllm_cfg": {"gpu_mem": 0.5}}})
    nested = config_from_dict({"generation": {"backend": "vllm", "vllm_cfg": {"cpu_kv_cache_gib": 3.0}}})
    assert nested.generation.vllm_cfg.cpu_kv_cache_gib == 3.0 and nested.generation.vllm_cfg.max_model_len == 2048


def test_load_yaml_json_inline(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("grpo:\n  max_num_steps: 7\n")
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"optim": {"lr": 0.001}}))
    assert load_config(str(y)).grpo.max_num_steps == 7
    assert load_config(str(j)).optim.lr == 0.001
    assert load_config('{"generation": {"max_new_tokens": 5}}').generation.max_new_tokens == 5
    with pytest.raises(ValueError, match="neither an existing"):
        load_config("missing.yaml")
