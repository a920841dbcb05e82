"""Helpers shared by the workflow tests."""

from __future__ import annotations

from pathlib import Path

from rl.config import config_from_dict


def small_config(tmp_path: Path, model: str, **overrides: dict) -> object:
    """A config for a fast run: local data plane and sqlite MLflow store under ``tmp_path``."""
    base = {
        "model": {"name": model, "precision": "float32"},  # the same arithmetic on every CPU
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4, "max_num_steps": 2, "val_period": 2},
        "generation": {"max_new_tokens": 8},
        "data": {"num_val_problems": 4},
        "optim": {"lr": 1e-3, "train_micro_batch_size": 4, "logprob_batch_size": 8},
        "dataplane": {"root": str(tmp_path / "dp")},
        "checkpointing": {"checkpoint_period": 1, "keep_last_k": 1},
        "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment_name": "test"},
    }
    for section, values in overrides.items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


def metric_steps(uri: str, run_id: str, key: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, key))
