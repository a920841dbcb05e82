"""The workflow against a real `mlflow server` on loopback: metrics, the validation table, the plot and the
final model (an HF folder that `from_pretrained` loads) all land in the run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import metric_steps, small_config


@pytest.mark.integration
def test_run_logged_to_a_real_tracking_server(tmp_path, tiny_model_dir, mlflow_server):
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    from workflows.grpo import grpo

    cfg = small_config(
        tmp_path, tiny_model_dir, grpo={"max_num_steps": 1, "val_period": 1}, tracking={"uri": mlflow_server}
    )
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
    assert {"plots", "validation"} <= names
    table = client.list_artifacts(summary.mlflow_run_id, "validation")
    assert [a.path for a in table] == ["validation/step_000001.json"]
    import mlflow
    import mlflow.artifacts

    mlflow.set_tracking_uri(mlflow_server)  # runs:/ finds the run's logged model through the global URI only
    try:
        local = Path(
            mlflow.artifacts.download_artifacts(f"runs:/{summary.mlflow_run_id}/model", dst_path=str(tmp_path / "dl"))
        )
    finally:
        mlflow.set_tracking_uri(None)
    assert (local / "MLmodel").exists() and not (local / "model" / "trainer_state").exists()
    assert AutoModelForCausalLM.from_pretrained(local / "model").num_parameters() > 0
