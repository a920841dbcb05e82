"""The README's "Train on your own data" example, as a user runs it: the project writes the JSONL, the example config
and reward file train the real SmolLM2-135M-Instruct on it (one step here; the README runs four)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.helpers import ROOT, metric_steps, small_config


@pytest.mark.e2e
def test_the_readme_example_trains_on_its_generated_jsonl(tmp_path, real_model_dir, monkeypatch):
    from workflows.grpo import grpo

    monkeypatch.chdir(ROOT)  # its reward file is named relative to the project folder, as pyflyte runs it
    data = tmp_path / "arithmetic.jsonl"
    out = subprocess.run(
        [sys.executable, "examples/make_dataset.py", "--out", str(data)], cwd=ROOT, check=True, capture_output=True
    )
    assert b"wrote 512 rows" in out.stdout
    example = yaml.safe_load((ROOT / "examples" / "own_data.yaml").read_text())
    example["data"]["train"] = str(data)
    cfg = small_config(
        tmp_path,
        "SmolLM2-135M-Instruct",
        data={**example["data"], "num_val_problems": 8},
        env=example["env"],
        grpo={"max_num_steps": 1, "val_period": 1},
        generation={"max_new_tokens": 16},
    )
    summary = grpo(cfg=cfg)

    assert summary.final_step == 1
    uri, run_id = cfg.tracking.uri, summary.mlflow_run_id
    for key in ("train/reward/sum", "train/reward/product", "train/reward/sum/number_match", "train/epoch"):
        assert metric_steps(uri, run_id, key) == [1], key
    # the instruct model answers some one-digit sums and products: the rewards are not all zero
    assert summary.metrics["train/reward"] > 0
    assert metric_steps(uri, run_id, "validation/accuracy") == [1]
