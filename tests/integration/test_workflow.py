"""Two GRPO steps of the real workflow through Flyte's local executor, on a tiny random model."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import metric_steps, small_config
from tests.rewards import EARNABLE

# the reference's metric list (NeMo-RL grpo.py, see the digest), logged at every step
STEP_METRICS = [
    *(
        f"train/{k}"
        for k in (
            "loss",
            "grad_norm",
            "reward",
            "filtered_reward",
            "mean_prompt_length",
            "total_num_tokens",
            "advantages/mean",
            "advantages/max",
            "advantages/min",
            "baseline_reward/pct_0",
            "baseline_reward/pct_1",
            "baseline_reward/pct_mixed",
            "dynamic_sampling_num_gen_batches",
            "dynamic_sampling_num_discarded_valid_samples",
            "probs_ratio",
            "probs_ratio_clamped",
            "kl_penalty",
            "token_mult_prob_error",
            "approx_entropy",
            "lr",
            "global_valid_toks",
            "generated_tokens_per_s",
            "sampling_importance_ratio",
            "clip_fraction/low",
            "clip_fraction/high",
            "max_seq_mult_prob_error",
            "mean_seq_mult_prob_error",
            "min_seq_mult_prob_error",
        )
    ),
    *(
        f"timing/train/{k}"
        for k in (
            "total_step_time",
            "generation",
            "policy_and_reference_logprobs",
            "advantage_calculation",
            "policy_training",
            "checkpointing",
        )
    ),
]


# Per-step values (steps 1, 2) of the two-step run below, pinned as torchtune's recipe tests pin their losses:
# float32 on the CPU gives the same values on every run (it was run twice), so a change of the maths, of an RNG draw
# or of their order moves them. The run is rewarded by `tests.rewards.earnable` (the tiny model never earns the
# dataset's reward: its loss and gradient would be ~0 and pin nothing). To regenerate after an intended change: set
# each list to [], run `python -m pytest tests/integration/test_workflow.py -k two_steps_through_local_executor` and
# copy the values each failure prints.
GOLDEN = {
    "transformers": {
        "train/loss": [4.842877388000488e-08, -0.0457125548273325],
        "train/reward": [0.5, 0.5625],
        "train/grad_norm": [1.2278715372085571, 0.9231077432632446],
    },
    "vllm": {
        "train/loss": [-0.09150592982769012, 0.04577961191534996],
        "train/reward": [0.625, 0.4375],
        "train/grad_norm": [1.1583263874053955, 1.0430395603179932],
    },
}
GOLDEN_TOLERANCE = {"train/loss": {"abs": 1e-5}, "train/reward": {"abs": 1e-5}, "train/grad_norm": {"rel": 1e-4}}


def metric_values(uri: str, run_id: str, key: str) -> list[float]:
    """The values of ``key`` logged in the MLflow run, in step order."""
    from mlflow.tracking import MlflowClient

    return [m.value for m in sorted(MlflowClient(uri).get_metric_history(run_id, key), key=lambda m: m.step)]


@pytest.mark.integration
@pytest.mark.parametrize(
    "backend",
    [
        "transformers",
        pytest.param(
            "vllm", marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
        ),
    ],
)
def test_two_steps_through_local_executor(tmp_path, tiny_model_dir, backend, monkeypatch):
    from safetensors.torch import load_file

    from workflows.grpo import grpo

    # rewarded by tests.rewards.earnable: advantages that move the policy, values worth pinning
    cfg = small_config(tmp_path, tiny_model_dir, generation={"backend": backend}, env=EARNABLE)
    summary = grpo(cfg=cfg)

    assert summary.final_step == 2
    uri = cfg.tracking.uri
    for key in STEP_METRICS:
        assert metric_steps(uri, summary.mlflow_run_id, key) == [1, 2], key
    assert metric_steps(uri, summary.mlflow_run_id, "validation/accuracy") == [2]
    assert metric_steps(uri, summary.mlflow_run_id, "validation/avg_length") == [2]
    assert math.isfinite(summary.metrics["train/loss"])
    # the generation back-end sampled the policy being trained, step 2 included (its weights were refitted)
    assert summary.metrics["train/token_mult_prob_error"] == pytest.approx(1.0, abs=1e-3)
    assert summary.metrics["train/grad_norm"] > 0
    logged = {key: metric_values(uri, summary.mlflow_run_id, key) for key in GOLDEN[backend]}
    for key, want in GOLDEN[backend].items():
        assert logged[key] == pytest.approx(want, **GOLDEN_TOLERANCE[key]), f"{key}: got {logged}"

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


@pytest.mark.integration
def test_two_steps_per_task_equal_a_node_per_task(tmp_path, tiny_model_dir):
    """``resources.steps_per_task: 2`` runs steps 1-2 and 3 as two tasks with warm back-ends: the same weights, bit
    for bit, and the same metrics as a node per task."""
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    from workflows.grpo import grpo

    runs = {}
    for k in (1, 2):
        cfg = small_config(
            tmp_path / f"k{k}",
            tiny_model_dir,
            grpo={"max_num_steps": 3, "val_period": 2},
            resources={"steps_per_task": k},
        )
        summary = grpo(cfg=cfg)
        assert summary.final_step == 3
        history = {
            key: [
                (m.step, m.value)
                for m in sorted(
                    MlflowClient(cfg.tracking.uri).get_metric_history(summary.mlflow_run_id, key), key=lambda m: m.step
                )
            ]
            for key in ("train/loss", "train/reward", "train/grad_norm", "validation/accuracy")
        }
        runs[k] = (
            load_file(str(Path(summary.last_checkpoint) / "model.safetensors")),
            history,
            summary.validation_accuracy,
        )
    (w1, h1, a1), (w2, h2, a2) = runs[1], runs[2]
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    assert (
        h1 == h2
        and [s for s, _ in h1["train/loss"]] == [1, 2, 3]
        and [s for s, _ in h1["validation/accuracy"]] == [2, 3]
    )
    assert a1 == a2


@pytest.mark.integration
def test_a_retried_multi_step_task_trains_again_what_its_first_attempt_did_not_finish(
    tmp_path, tiny_model_dir, monkeypatch
):
    """Tasks of steps 1-2 and 3-4, as on a cluster (``cold_tasks``: each hands the next its trainer state through
    storage). The second dies after saving step 4 and before logging its last metrics (the MLflow call fails): its retry
    finds no step of its range finished, starts again from its input policy (step 2's, kept although step 4's save
    pruned the weights folder), and ends with the weights and metrics of an undisturbed run, each step logged once.
    A retry of the finished task trains nothing."""

    from flytekit.exceptions.user import FlyteRecoverableException
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    from tasks import tracking
    from tasks.setup import start_run
    from tasks.train import DONE_METRIC
    from tasks.types import PolicyVersion
    from workflows.grpo import grpo, grpo_steps

    def config(name: str):
        return small_config(
            tmp_path / name,
            tiny_model_dir,
            grpo={"max_num_steps": 4, "val_period": 2},
            checkpointing={"checkpoint_period": 4, "keep_last_k": 1},
            resources={"steps_per_task": 2},
        )

    clean_cfg = config("clean")
    clean = grpo(cfg=clean_cfg)
    cfg = config("retried")
    run = dataclasses.replace(start_run.task_function(cfg=cfg), cold_tasks=True)
    start = PolicyVersion(step=run.start_step, path=run.start_policy_path)
    p2, _ = grpo_steps.task_function(cfg=cfg, run=run, policy=start, first=1, last=2, accuracy=-1.0)
    real, died = tracking.log_metrics, []

    def dies_once(uri, run_id, metrics, step):
        if step == 4 and DONE_METRIC in metrics and not died:  # the batch logged after the save
            died.append(step)
            raise ConnectionError("the tracking server went away")
        return real(uri, run_id, metrics, step)

    monkeypatch.setattr(tracking, "log_metrics", dies_once)
    with pytest.raises(
        FlyteRecoverableException,
        match=r"^USER:Recoverable: error=train: transient ConnectionError: the tracking server went away "
        r"\(Flyte retries the task\)",
    ):
        grpo_steps.task_function(cfg=cfg, run=run, policy=p2, first=3, last=4, accuracy=-1.0)
    assert died == [4] and Path(p2.path.removeprefix("file://"), "_COMPLETE").exists()  # the input survived
    policy, accuracy = grpo_steps.task_function(cfg=cfg, run=run, policy=p2, first=3, last=4, accuracy=-1.0)
    again = grpo_steps.task_function(cfg=cfg, run=run, policy=p2, first=3, last=4, accuracy=-1.0)
    assert again == (policy, accuracy) and accuracy == clean.validation_accuracy

    w, w_clean = (
        load_file(str(Path(p.removeprefix("file://")) / "model.safetensors"))
        for p in (policy.path, clean.last_checkpoint)
    )
    assert w.keys() == w_clean.keys() and all(torch.equal(w[k], w_clean[k]) for k in w)

    def losses(uri: str, run_id: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, "train/loss"))

    assert losses(cfg.tracking.uri, run.mlflow_run_id) == losses(clean_cfg.tracking.uri, clean.mlflow_run_id)
    assert [s for s, _ in losses(cfg.tracking.uri, run.mlflow_run_id)] == [1, 2, 3, 4]


@pytest.mark.integration
def test_a_variant_run_trains_with_the_advantages_its_config_asks_for(tmp_path, tiny_model_dir):
    """GSPO with two updates per step (the second off-policy), REINFORCE++ advantages and DAPO's overlong shaping
    through the real workflow: the kept rollouts' advantages are the estimator's on the shaped rewards of their
    response lengths, and the penalty, the clip fractions and the importance ratio are logged at every step."""
    import pyarrow.parquet as pq
    from mlflow.tracking import MlflowClient

    from rl.advantages import advantages_for_step, overlong_penalty
    from workflows.grpo import grpo

    cfg = small_config(
        tmp_path,
        tiny_model_dir,
        grpo={"adv_estimator": "reinforce_plus_plus", "reward_shaping": {"enabled": True, "overlong_buffer_length": 6}},
        loss={"loss_type": "grpo", "importance_sampling_level": "sequence"},
        optim={"lr": 1e-3, "train_micro_batch_size": 4, "logprob_batch_size": 8, "train_global_batch_size": 8},
        dataplane={"root": str(tmp_path / "dp"), "keep_rollouts": True},
    )
    summary = grpo(cfg=cfg)
    assert summary.final_step == 2
    client = MlflowClient(cfg.tracking.uri)
    for step in (1, 2):
        table = pq.read_table(tmp_path / "dp" / summary.run_id / "rollouts" / f"step_{step:06d}.parquet").to_pydict()
        lengths = torch.tensor(table["response_lengths"])
        rewards = torch.tensor(table["rewards"], dtype=torch.float32)
        want = advantages_for_step(rewards, torch.tensor(table["sample_mask"]), lengths, cfg).advantages
        assert torch.equal(torch.tensor(table["advantages"], dtype=torch.float32), want), step
        penalty = overlong_penalty(
            lengths, max_response_length=8, overlong_buffer_length=6, overlong_buffer_penalty=1.0
        )
        logged = {
            m.step: m.value
            for m in client.get_metric_history(summary.mlflow_run_id, "train/reward_shaping/overlong_penalty")
        }
        assert logged[step] == pytest.approx(float(penalty.mean()), abs=1e-6) and float(penalty.min()) < 0
    for key in (
        "train/sampling_importance_ratio",
        "train/clip_fraction/low",
        "train/clip_fraction/high",
        "train/approx_entropy",
    ):
        assert metric_steps(cfg.tracking.uri, summary.mlflow_run_id, key) == [1, 2], key
    ratios = [m.value for m in client.get_metric_history(summary.mlflow_run_id, "train/probs_ratio")]
    assert (
        max(abs(r - 1) for r in ratios) > 1e-4
    )  # the second update of a step trained on prev_logprobs of older weights
