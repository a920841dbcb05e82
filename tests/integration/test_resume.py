"""Exact resume: a run SIGKILLed during step 3 and resumed ends with the same weights, bit for bit, as an
uninterrupted run, and its MLflow run holds each step's metrics exactly once; a run stopped on either side of a
checkpoint's save loses no metric once resumed, and its failure marks the MLflow run FAILED."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import killed_in_step_3_and_resumed, small_config


def _final_weights(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (ckpt,) = sorted(root.glob("*/checkpoints/step_000004"))
    return load_file(str(ckpt / "model.safetensors"))


@pytest.mark.integration
@pytest.mark.slow
def test_sigkill_during_step_3_then_resume_is_exact(tmp_path, tiny_model_dir):
    from mlflow.tracking import MlflowClient

    overrides = dict(
        grpo={"max_num_steps": 4, "val_period": 0}, checkpointing={"checkpoint_period": 2, "keep_last_k": 2}
    )
    clean, crash = killed_in_step_3_and_resumed(tmp_path, tiny_model_dir, **overrides)
    root = Path(crash.dataplane.root)

    a, b = _final_weights(Path(clean.dataplane.root)), _final_weights(root)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)

    client = MlflowClient(crash.tracking.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    assert run.info.status == "FINISHED"
    for key in ("train/loss", "train/reward", "train/grad_norm", "timing/train/total_step_time"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(steps) == [1, 2, 3, 4], (key, steps)


class _Stopped(RuntimeError):
    """Raised by the test where a kill would land."""


_VARIES = ("timing/", "_per_s", "_time_s")
"""Metrics measured with the wall clock: their values differ between two runs; all others are bit-identical."""


def _history(client, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric of the run from step 1 on: key -> sorted (step, value)."""
    keys = client.get_run(run_id).data.metrics
    out = {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k) if m.step >= 1) for k in keys}
    return {k: v for k, v in out.items() if v}


_STOP_RUN = {
    "grpo": {"max_num_steps": 2, "val_period": 0},
    "checkpointing": {"checkpoint_period": 1, "keep_last_k": 2},
    "dataplane": {"keep_rollouts": True},
}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory, tiny_model_dir) -> dict[str, list[tuple[int, float]]]:
    """The metrics of an undisturbed run of :data:`_STOP_RUN`."""
    from mlflow.tracking import MlflowClient

    from workflows.grpo import grpo

    cfg = small_config(tmp_path_factory.mktemp("undisturbed"), tiny_model_dir, **_STOP_RUN)
    summary = grpo(cfg=cfg)
    return _history(MlflowClient(cfg.tracking.uri), summary.mlflow_run_id)


@pytest.mark.integration
@pytest.mark.parametrize("stop", ["after_the_save", "before_the_save"])
def test_a_run_stopped_beside_a_checkpoint_save_loses_no_metric_and_is_marked_failed(
    tmp_path, tiny_model_dir, monkeypatch, stop, undisturbed
):
    """A run stopped at step 2 of 2 right after its checkpoint's save (``after_the_save``: a resume starts after that
    step, so the task must have logged the step's metrics before the save), or right before it (``before_the_save``:
    a resume trains the step again). The stop is an exception where the kill would land
    (``tasks.saving.save_policy``); nothing of the task runs after it but its error handling. Then:

    - the failed run's MLflow run is FAILED (the workflow's ``on_failure`` handler, ``tasks.failure``), and a resume
      marks it RUNNING, its end FINISHED;
    - after the resume every metric of the undisturbed run is logged exactly once per step, with the undisturbed
      run's values (all but the wall-clock ones, bit-identical), and the step's kept rollouts are there. The one
      exception, by construction (``tasks/train.py``'s docstring): stopped after the save, step 2 lacks the two
      timings measured after it (``timing/train/checkpointing``, ``timing/train/total_step_time``).
    """
    from mlflow.tracking import MlflowClient

    from tasks import saving
    from tasks.run_config import run_config_from_dict
    from tasks.train import DONE_METRIC
    from workflows.grpo import grpo

    cfg = small_config(tmp_path, tiny_model_dir, **_STOP_RUN)
    real = saving.save_policy

    def stops(cfg, run, backend, *, started_from):
        if backend.weight_version == 2 and stop == "before_the_save":
            raise _Stopped("stopped before the save of step 2")
        saved = real(cfg, run, backend, started_from=started_from)
        if saved.step == 2 and stop == "after_the_save":
            raise _Stopped("stopped after the save of step 2")
        return saved

    monkeypatch.setattr(saving, "save_policy", stops)
    with pytest.raises(Exception, match=f"stopped {stop.replace('_', ' ')} of step 2"):
        grpo(cfg=cfg)
    monkeypatch.setattr(saving, "save_policy", real)

    client = MlflowClient(cfg.tracking.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    assert run.info.status == "FAILED"
    (run_dir,) = [p for p in Path(cfg.dataplane.root).iterdir() if p.is_dir()]
    assert (run_dir / "checkpoints" / "step_000002" / "_COMPLETE").exists() == (stop == "after_the_save")

    resumed = cfg.to_dict()
    resumed["checkpointing"]["resume_run_id"] = run_dir.name
    summary = grpo(cfg=run_config_from_dict(resumed))
    assert summary.final_step == 2 and summary.mlflow_run_id == run.info.run_id
    assert client.get_run(run.info.run_id).info.status == "FINISHED"

    want = dict(undisturbed)
    got = _history(client, run.info.run_id)
    assert DONE_METRIC in want and "train/loss" in want
    if stop == "after_the_save":  # measured after the save by the stopped attempt, which died with them
        for key in (DONE_METRIC, "timing/train/total_step_time"):
            want[key] = [(s, v) for s, v in want[key] if s != 2]
    assert got.keys() == want.keys()
    for key, history in want.items():
        assert [s for s, _ in got[key]] == [s for s, _ in history], key  # each step once
        if not any(part in key for part in _VARIES):
            assert got[key] == history, key
    assert (run_dir / "rollouts" / "step_000002.parquet").exists()
