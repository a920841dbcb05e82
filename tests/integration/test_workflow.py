"""Two GRPO steps of the real workflow through Flyte's local executor, on a tiny random model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers import metric_steps, small_config

STEP_METRICS = [
    "train/loss",
    "train/reward",
    "train/kl_penalty",
    "train/grad_norm",
    "train/probs_ratio",
    "train/token_mult_prob_error",
    "train/advantages/mean",
    "train/generated_tokens_per_s",
    "train/total_num_tokens",
    "timing/train/total_step_time",
    "timing/train/generation",
    "timing/train/policy_training",
]


@pytest.mark.integration
def test_two_steps_through_local_executor(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    from workflows.grpo import grpo

    cfg = small_config(tmp_path, tiny_model_dir)
    summary = grpo(cfg=cfg)

    assert summary.final_step == 2
    uri = cfg.tracking.uri
    for key in STEP_METRICS:
        assert metric_steps(uri, summary.mlflow_run_id, key) == [1, 2], key
    assert metric_steps(uri, summary.mlflow_run_id, "validation/accuracy") == [2]
    assert math.isfinite(summary.metrics["train/loss"])
    assert summary.metrics["train/grad_norm"] > 0

    ckpt = Path(summary.last_checkpoint)
    assert ckpt == tmp_path / "dp" / summary.run_id / "checkpoints" / "step_000002"
    assert (ckpt / "_COMPLETE").exists() and (ckpt / "trainer_state" / "optimizer.safetensors").exists()
    assert not (ckpt.parent / "step_000001").exists()  # keep_last_k = 1
    # every step's partition was cleared when its step ended
    assert not list((tmp_path / "dp" / summary.run_id).glob("step_*"))
    # the weights moved
    before = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    after = load_file(str(ckpt / "model.safetensors"))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)
