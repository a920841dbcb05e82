"""``python -m bench.learning``'s table, written from a real MLflow store (sqlite) holding what a run logs: the greedy
validation tables, ``validation/accuracy`` and, with ``grpo.num_val_generations_per_prompt``, the sampled accuracy."""

from __future__ import annotations

import argparse

import pytest

from bench.learning import report, wilson
from tests.helpers import small_config


@pytest.mark.parametrize("k", [0, 4])
def test_the_table_has_a_row_per_validation_and_the_sampled_column_only_when_sampled(tmp_path, k):
    from mlflow.tracking import MlflowClient

    cfg = small_config(tmp_path, "unused", grpo={"num_val_generations_per_prompt": k})
    client = MlflowClient(cfg.tracking.uri)
    run_id = client.create_run(client.create_experiment("t", artifact_location=str(tmp_path / "artifacts"))).info.run_id
    questions = ["What is 12 + 3?", "What is 45 + 6?", "What is 78 + 9?", "What is 1234 + 1?"]
    for step, correct in ((0, [True, False, False, False]), (2, [True, True, False, True])):
        client.log_table(
            run_id,
            data={"prompt": questions, "correct": correct},
            artifact_file=f"validation/step_{step:06d}.json",
        )
        client.log_metric(run_id, "validation/accuracy", sum(correct) / 4, step=step)
        if k:
            client.log_metric(run_id, "validation/sampled_accuracy", 0.25 * (step + 1), step=step)
    for step, reward in ((1, 0.5), (2, 0.75)):
        client.log_metric(run_id, "train/reward", reward, step=step)
        client.log_metric(run_id, "timing/train/total_step_time", 10.0 * step, step=step)
    args = argparse.Namespace(cfg="c.yaml", pass_at_k=0, from_run=run_id)
    lines = report(cfg, client, run_id, args, wall=None, ceiling={}).splitlines()

    header = next(line for line in lines if line.startswith("| step"))
    assert header.split("|")[3:-1] == [" all ", " 2-digit ", " 4-digit "] + (
        [f" sampled (T={cfg.generation.temperature}) "] if k else []
    )
    rows = {line.split("|")[1].strip(): line.split("|")[3:-1] for line in lines if line[:4] in ("| 0 ", "| 2 ")}
    lo, hi = wilson(0.25, 4)
    assert rows["0"][0].strip() == f"0.250 [{lo:.2f}, {hi:.2f}]"  # 1 of the 4 questions
    assert rows["2"][1].strip().startswith("0.667 ") and rows["2"][2].strip().startswith("1.000 ")  # 2 of 3, 1 of 1
    if k:  # the sampled share, its interval over the N x K completions
        lo, hi = wilson(0.75, 4 * k)
        assert rows["2"][3].strip() == f"0.750 [{lo:.2f}, {hi:.2f}]"
        assert any("4 completions per held-out question" in line for line in lines)
    else:
        assert len(rows["2"]) == 3
    assert lines[-1] == "Training reward per step: 0.500, 0.750"
