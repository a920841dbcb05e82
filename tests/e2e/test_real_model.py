"""One GRPO step of the workflow on the real SmolLM2-135M-Instruct and real chain_sum problems."""

from __future__ import annotations

import math

import pytest

from tests.helpers import metric_steps, small_config


@pytest.mark.e2e
def test_one_step_on_the_real_model(tmp_path, real_model_dir):
    from transformers import AutoModelForCausalLM

    from workflows.grpo import grpo

    cfg = small_config(
        tmp_path,
        "SmolLM2-135M-Instruct",
        grpo={"max_num_steps": 1, "val_period": 1},
        generation={"max_new_tokens": 16},
        optim={"lr": 1e-5},
    )
    summary = grpo(cfg=cfg)

    m = summary.metrics
    assert summary.final_step == 1
    assert 0.0 <= m["train/reward"] <= 1.0 and math.isfinite(m["train/loss"])
    assert m["train/grad_norm"] > 0
    # training forward agrees with the generation logprobs for the same weights (float32 on CPU)
    assert m["train/token_mult_prob_error"] == pytest.approx(1.0, abs=1e-3)
    assert metric_steps(cfg.tracking.uri, summary.mlflow_run_id, "validation/accuracy") == [1]
    model = AutoModelForCausalLM.from_pretrained(summary.last_checkpoint)
    assert model.num_parameters() > 100_000_000
