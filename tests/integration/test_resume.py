"""Exact resume: a run SIGKILLed during step 3 and resumed ends with the same weights, bit for bit, as an
uninterrupted run, and its MLflow run holds each step's metrics exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import kill_when, run_to_end, small_config


def _final_weights(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (ckpt,) = sorted(root.glob("*/checkpoints/step_000004"))
    return load_file(str(ckpt / "model.safetensors"))


@pytest.mark.integration
@pytest.mark.slow
def test_sigkill_during_step_3_then_resume_is_exact(tmp_path, tiny_model_dir):
    from mlflow.tracking import MlflowClient

    overrides = dict(grpo={"max_num_steps": 4, "val_period": 0}, checkpointing={"checkpoint_period": 2, "keep_last_k": 2})
    clean = small_config(tmp_path / "clean", tiny_model_dir, **overrides)
    crash = small_config(tmp_path / "crash", tiny_model_dir, **overrides)

    run_to_end(clean.to_dict())
    root = Path(crash.dataplane.root)
    run_dir = kill_when(crash.to_dict(), lambda: list(root.glob("*/step_000003/_schema.json")))
    assert not (run_dir / "checkpoints" / "step_000004").exists()

    resumed = crash.to_dict()
    resumed["checkpointing"]["resume_run_id"] = run_dir.name
    assert "resuming run" in run_to_end(resumed)

    a, b = _final_weights(Path(clean.dataplane.root)), _final_weights(root)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)

    client = MlflowClient(crash.tracking.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    assert run.info.status == "FINISHED"
    for key in ("train/loss", "train/reward", "train/grad_norm", "timing/train/total_step_time"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(steps) == [1, 2, 3, 4], (key, steps)
