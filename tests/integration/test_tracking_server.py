"""The workflow against a real `mlflow server` on loopback: metrics, the validation table, the plot and the
final model (an HF folder that `from_pretrained` loads) all land in the run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import metric_steps, small_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{tmp_path}/server.db", "--artifacts-destination", str(tmp_path / "artifacts"),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None, "mlflow server exited"
            assert time.time() < deadline, "mlflow server did not start in 120 s"
            time.sleep(0.5)
    yield url
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)


@pytest.mark.integration
def test_run_logged_to_a_real_tracking_server(tmp_path, tiny_model_dir, mlflow_server):
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    from workflows.grpo import grpo

    cfg = small_config(tmp_path, tiny_model_dir, grpo={"max_num_steps": 1, "val_period": 1}, tracking={"uri": mlflow_server})
    summary = grpo(cfg=cfg)

    assert metric_steps(mlflow_server, summary.mlflow_run_id, "train/loss") == [1]
    assert metric_steps(mlflow_server, summary.mlflow_run_id, "validation/accuracy") == [1]
    client = MlflowClient(mlflow_server)
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["grpo.num_generations_per_prompt"] == "4"
    assert run.data.tags["grpoflow.run_id"] == summary.run_id
    assert "flyte.execution_id" in run.data.tags
    names = {a.path for a in client.list_artifacts(summary.mlflow_run_id)}
    assert {"model", "plots", "validation"} <= names
    table = client.list_artifacts(summary.mlflow_run_id, "validation")
    assert [a.path for a in table] == ["validation/step_000001.json"]
    local = client.download_artifacts(summary.mlflow_run_id, "model", str(tmp_path / "dl"))
    assert not (Path(local) / "trainer_state").exists()
    assert AutoModelForCausalLM.from_pretrained(local).num_parameters() > 0
