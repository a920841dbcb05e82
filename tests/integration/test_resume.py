"""Exact resume: a run SIGKILLed during step 3 and resumed ends with the same weights, bit for bit, as an
uninterrupted run, and its MLflow run holds each step's metrics exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import small_config

ROOT = Path(__file__).resolve().parents[2]


def _launch(cfg_json: str) -> subprocess.Popen:
    code = (
        "import sys; from rl.config import GRPOConfig; from workflows.grpo import grpo; "
        "grpo(cfg=GRPOConfig.from_json(sys.argv[1]))"
    )
    # the default thread count: the run must be exact without GRPOFLOW_NUM_THREADS / OMP_NUM_THREADS pinning it to 1
    env = {k: v for k, v in os.environ.items() if k not in ("GRPOFLOW_NUM_THREADS", "OMP_NUM_THREADS")}
    env["FLYTE_LOCAL_CACHE_ENABLED"] = "false"
    return subprocess.Popen([sys.executable, "-c", code, cfg_json], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


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

    proc = _launch(json.dumps(clean.to_dict()))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out.decode()[-3000:]

    proc = _launch(json.dumps(crash.to_dict()))
    root = Path(crash.dataplane.root)
    deadline = time.time() + 600
    while not list(root.glob("*/step_000003/_schema.json")):
        assert proc.poll() is None, "the run ended before step 3"
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    assert not (run_dir / "checkpoints" / "step_000004").exists()

    resumed = crash.to_dict()
    resumed["checkpointing"]["resume_run_id"] = run_dir.name
    proc = _launch(json.dumps(resumed))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out.decode()[-3000:]
    assert b"resuming run" in out

    a, b = _final_weights(Path(clean.dataplane.root)), _final_weights(root)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)

    client = MlflowClient(crash.tracking.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    assert run.info.status == "FINISHED"
    for key in ("train/loss", "train/reward", "train/grad_norm", "timing/train/total_step_time"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(steps) == [1, 2, 3, 4], (key, steps)
