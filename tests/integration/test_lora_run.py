"""Whole GRPO runs that train a LoRA adapter (``policy.lora``) through Flyte's local executor on a tiny random model:
what a step trains and saves, several steps per task, async GRPO's collector, and a SIGKILLed run's resume, each equal
bit for bit to its reference run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tests.helpers import killed_in_step_3_and_resumed, metric_steps, small_config
from tests.rewards import EARNABLE

LORA = {"lora": {"rank": 4, "alpha": 8.0}}
"""``policy`` of every run here: a rank-4 adapter on every linear layer."""


def _adapter(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(checkpoint) / ADAPTER_WEIGHTS))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _history(cfg, summary, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    found = MlflowClient(cfg.tracking.uri).get_metric_history(summary.mlflow_run_id, key)
    return sorted((m.step, m.value) for m in found)


@pytest.mark.integration
def test_a_lora_run_trains_and_saves_the_adapter_only_and_two_steps_per_task_equal_one(tmp_path, tiny_model_dir):
    from mlflow.tracking import MlflowClient

    from tasks.finish import PEFT_ADAPTOR
    from workflows.grpo import grpo

    runs = {}
    for k in (1, 2):
        cfg = small_config(
            tmp_path / f"k{k}",
            tiny_model_dir,
            grpo={"max_num_steps": 3, "val_period": 2},
            policy=LORA,
            env=EARNABLE,
            resources={"steps_per_task": k},
        )
        summary = grpo(cfg=cfg)
        assert summary.final_step == 3
        runs[k] = cfg, summary
    (cfg, one), (cfg2, two) = runs[1], runs[2]

    ckpt = Path(one.last_checkpoint)
    files = {p.name for p in ckpt.iterdir()}
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "trainer_state", "_COMPLETE"} <= files
    assert not [f for f in files if f.startswith("model")]  # no base weights in a LoRA checkpoint
    base = (Path(tiny_model_dir) / "model.safetensors").stat().st_size
    saved = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file() and p.suffix == ".safetensors")
    assert saved < base / 3  # adapter + its AdamW moments, against the base weights alone

    adapter = _adapter(ckpt)
    assert len(adapter) == 2 * 7 * 2  # A and B of 7 projections in 2 layers: nothing else trained
    assert all(adapter[k].abs().max() > 0 for k in adapter if ".lora_B." in k)  # every B left zero
    # the generation back-end sampled the merged policy at every step (a refit of merged weights)
    assert [v for _, v in _history(cfg, one, "train/token_mult_prob_error")] == pytest.approx([1.0] * 3, abs=1e-3)
    kl = [v for _, v in _history(cfg, one, "train/kl_penalty")]
    assert kl[0] == 0 and kl[-1] > 0  # the reference (adapter disabled) stays the base as the policy moves

    # several steps in one task (warm back-ends, the adapter handed over in memory) make the same run, bit for bit
    assert _same(adapter, _adapter(two.last_checkpoint))
    for key in ("train/loss", "train/reward", "train/grad_norm", "validation/accuracy"):
        assert _history(cfg, one, key) == _history(cfg2, two, key), key

    import mlflow

    mlflow.set_tracking_uri(cfg.tracking.uri)
    found = mlflow.search_logged_models(
        experiment_ids=[MlflowClient(cfg.tracking.uri).get_run(one.mlflow_run_id).info.experiment_id],
        output_format="list",
    )
    assert len(found) == 1
    info = mlflow.models.get_model_info(f"models:/{found[0].model_id}")
    assert PEFT_ADAPTOR in info.flavors["transformers"]  # logged as a peft adapter on its base


@pytest.mark.integration
def test_the_collector_trains_the_adapter_the_rollout_task_path_does(tmp_path, tiny_model_dir, monkeypatch):
    from workflows.grpo import grpo

    overrides = {
        "grpo": {"max_num_steps": 3, "val_period": 0, "max_trajectory_age_steps": 1},
        "loss": {"use_importance_sampling_correction": True},
        "policy": LORA,
        "env": EARNABLE,
    }
    out = {}
    for collector in ("off", "auto"):
        monkeypatch.setenv("GRPOFLOW_COLLECTOR", collector)
        cfg = small_config(tmp_path / collector, tiny_model_dir, **overrides)
        out[collector] = cfg, grpo(cfg=cfg)
    (cfg_task, task), (cfg_coll, coll) = out["off"], out["auto"]
    assert metric_steps(cfg_coll.tracking.uri, coll.mlflow_run_id, "timing/rollout/wait") == [1, 2, 3]
    assert _same(_adapter(task.last_checkpoint), _adapter(coll.last_checkpoint))
    for key in ("train/loss", "train/reward", "train/sampling_importance_ratio"):
        assert _history(cfg_task, task, key) == _history(cfg_coll, coll, key), key
    assert [v for _, v in _history(cfg_coll, coll, "train/avg_trajectory_age")] == [0.0, 1.0, 1.0]


@pytest.mark.integration
@pytest.mark.slow
def test_a_lora_run_sigkilled_in_step_3_resumes_bit_for_bit(tmp_path, tiny_model_dir):
    overrides = dict(
        grpo={"max_num_steps": 4, "val_period": 0},
        checkpointing={"checkpoint_period": 2, "keep_last_k": 2},
        policy=LORA,
        env=EARNABLE,
    )
    clean, crash = killed_in_step_3_and_resumed(tmp_path, tiny_model_dir, **overrides)
    (a,) = sorted(Path(clean.dataplane.root).glob("*/checkpoints/step_000004"))
    (b,) = sorted(Path(crash.dataplane.root).glob("*/checkpoints/step_000004"))
    assert _same(_adapter(a), _adapter(b))
    assert not _same(_adapter(a), _adapter(sorted(Path(clean.dataplane.root).glob("*/checkpoints/step_000002"))[0]))
