"""The user's task: prompts from a JSONL file (on loopback S3, and on disk), two tasks routed by a column to their
environments, reward functions written for TRL's ``GRPOTrainer`` with weights, per-task metrics and the datasets'
lineage in MLflow, and an exact resume that sees the same prompts in the same order."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, killed_in_step_3_and_resumed, metric_steps, small_config


def _example(name: str):
    """A module of ``examples/`` (a folder of scripts, not a package), loaded from its file."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example_rows = _example("make_dataset").rows

TASKS = {
    "sum": {
        "reward_functions": [
            {"function": "tests.rewards:earnable", "weight": 1.0},
            {"function": "examples/rewards.py:number_match", "weight": 0.5},
        ]
    },
    "product": {
        "reward_functions": [
            {"function": "rl.environments.rewards:math_verify_accuracy", "weight": 1.0},
            {"function": "tests.rewards:earnable", "weight": 0.25},
        ]
    },
}
DATA = {"prompt_key": "question", "answer_key": "answer", "task_key": "task", "num_val_problems": 4}


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _expected_reward(task: str, response: str, answer: str) -> float:
    """The weighted total of the task's reward functions, called here directly as TRL would call them."""
    number_match = _example("rewards").number_match

    from rl.environments.rewards import math_verify_accuracy
    from tests.rewards import earnable

    even = earnable([response])[0]
    if task == "sum":
        return 1.0 * even + 0.5 * number_match([response], [answer])[0]
    accuracy = math_verify_accuracy([response], answer=[answer])[0]
    return (0.0 if accuracy is None else accuracy) + 0.25 * even


@pytest.mark.integration
def test_two_steps_on_a_jsonl_from_s3_with_two_tasks_and_weighted_rewards(tmp_path, tiny_model_dir, s3_server):
    import fsspec
    import pyarrow.parquet as pq
    from mlflow.tracking import MlflowClient

    from tasks.kept_rollouts import rollouts_url
    from workflows.grpo import grpo

    fsspec.filesystem("s3").clear_instance_cache()
    so = {"endpoint_url": s3_server}
    prefix = f"s3://grpoflow/own-data-{random.randrange(1 << 30)}"
    rows = example_rows(64, seed=0)
    fs = fsspec.filesystem("s3", **so)
    fs.pipe_file(f"{prefix}/prompts.jsonl", _jsonl(rows))
    cfg = small_config(
        tmp_path,
        tiny_model_dir,
        data={"train": f"{prefix}/prompts.jsonl", **DATA},
        env={"tasks": TASKS},
        dataplane={"root": f"{prefix}/dp", "storage_options": so, "keep_rollouts": True},
    )
    summary = grpo(cfg=cfg)
    assert summary.final_step == 2
    uri, run_id = cfg.tracking.uri, summary.mlflow_run_id

    # per task, per named reward, the weighted total, the epoch: every step
    for key in (
        "train/reward",
        "train/reward/sum",
        "train/reward/product",
        "train/reward/sum/earnable",
        "train/reward/sum/number_match",
        "train/reward/product/math_verify_accuracy",
        "train/reward/product/earnable",
        "train/epoch",
    ):
        assert metric_steps(uri, run_id, key) == [1, 2], key
    assert metric_steps(uri, run_id, "validation/accuracy") == [2]
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    val_tasks = [k.rsplit("/", 1)[-1] for k in run.data.metrics if k.startswith("validation/accuracy/")]
    assert val_tasks and set(val_tasks) <= {"sum", "product"}

    # each kept rollout: its row of the file, its task, and a reward equal to the weighted sum of the task's reward
    # functions called directly
    by_row = {f"train:{i}": r for i, r in enumerate(rows)}
    table = pq.read_table(rollouts_url(cfg.dataplane.root, summary.run_id, 1), filesystem=fs).to_pylist()
    assert len(table) == 16
    for sample in table:
        row = by_row[sample["row_id"]]
        assert sample["task_name"] == row["task"]
        assert sample["prompt"] == row["question"] and sample["answer"] == row["answer"]
        expected = _expected_reward(row["task"], sample["response"], row["answer"])
        assert sample["rewards"] == pytest.approx(expected, abs=1e-6), sample
    history = client.get_metric_history(run_id, "train/reward")
    assert sorted(history, key=lambda m: m.step)[0].value == pytest.approx(
        sum(s["rewards"] for s in table) / len(table), abs=1e-6
    )

    # lineage: the datasets as the run's inputs, the reward code by name and source hash
    inputs = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
    assert set(inputs) == {"training", "validation"}
    assert f"{prefix}/prompts.jsonl" in inputs["training"].source
    profile = json.loads(inputs["training"].profile)
    assert profile["num_rows"] + profile["held_out"] == 64
    assert "question" in inputs["training"].schema
    params = run.data.params
    assert {"env.sum.earnable", "env.sum.number_match", "env.product.math_verify_accuracy"} <= set(params)
    assert "examples/rewards.py:number_match" in params["env.sum.number_match"]


def _weights(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (ckpt,) = sorted(root.glob("*/checkpoints/step_000004"))
    return load_file(str(ckpt / "model.safetensors"))


def _row_ids(root: Path) -> list[list[str]]:
    import pyarrow.parquet as pq

    (run,) = [p for p in root.iterdir() if p.is_dir()]
    out = []
    for k in range(1, 5):  # each step's prompts in group order, one row id per group
        rows = pq.read_table(run / "rollouts" / f"step_{k:06d}.parquet").to_pylist()
        out.append([r["row_id"] for r in sorted(rows, key=lambda r: r["prompt_index"]) if r["generation_index"] == 0])
    return out


@pytest.mark.integration
@pytest.mark.slow
def test_sigkill_during_step_3_then_resume_sees_the_same_prompts_and_ends_bitwise_equal(tmp_path, tiny_model_dir):
    """12 rows, about 10 of them for training: four steps of 4 prompts cross an epoch boundary, where the order is
    reshuffled from the seed."""
    data = tmp_path / "prompts.jsonl"
    data.write_bytes(_jsonl(example_rows(12, seed=3)))
    overrides = dict(
        data={"train": str(data), **DATA},
        env={"tasks": TASKS},
        grpo={"max_num_steps": 4, "val_period": 0},
        checkpointing={"checkpoint_period": 2, "keep_last_k": 2},
        dataplane={"keep_rollouts": True},
    )
    clean, crash = killed_in_step_3_and_resumed(tmp_path, tiny_model_dir, **overrides)
    root = Path(crash.dataplane.root)
    seen, again = _row_ids(Path(clean.dataplane.root)), _row_ids(root)
    assert seen == again  # the same prompts, in the same order, step by step
    train = {r for step in seen for r in step}
    n = len(train)
    assert 4 < n < 12  # a held-out share went to validation; 16 draws over n rows cross an epoch boundary
    epoch_one = [r for step in seen for r in step][:n]
    assert sorted(epoch_one) == sorted(train)  # every training row once per epoch
    a, b = _weights(Path(clean.dataplane.root)), _weights(root)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
