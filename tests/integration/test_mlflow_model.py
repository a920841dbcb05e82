"""`finish_run` logs the final checkpoint as an MLflow transformers model (HF files only) that loads back with the
same weights, registers it when `tracking.registered_model_name` is set, ends the run once, and opens no socket."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from tests.helpers import small_config


@pytest.fixture
def no_network(monkeypatch):
    """Every name lookup and outgoing connection attempt (host names and addresses in the returned list) fails at
    once."""
    tried: list[object] = []
    real_connect = socket.socket.connect

    def getaddrinfo(host, *args, **kwargs):
        tried.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "network disabled in this test")

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            tried.append(address)
            raise OSError("network disabled in this test")
        return real_connect(self, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", lambda self, address: tried.append(address) or 111)
    return tried


def _checkpoint(url: str, model_dir: str) -> dict[str, torch.Tensor]:
    """A complete checkpoint at ``url`` (HF files, ``trainer_state/``, ``_COMPLETE``) of perturbed tiny weights."""
    from transformers import AutoModelForCausalLM

    from rl import checkpoint
    from rl.model import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not the base model's weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(p.sum() for p in model.parameters()).backward()
    optimizer.step()
    state = checkpoint.TrainerState(step=3, mlflow_run_id="unused", extra={})
    checkpoint.save(url, model=model, tokenizer=load_tokenizer(model_dir), optimizer=optimizer, state=state)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.integration
def test_final_model_is_logged_registered_and_loads_back(tmp_path, tiny_model_dir, no_network, capsys):
    import mlflow
    import mlflow.transformers
    from mlflow.tracking import MlflowClient

    from dataplane import paths
    from tasks import tracking
    from tasks.finish import finish_run
    from tasks.types import PolicyVersion, RunInfo

    cfg = small_config(tmp_path, tiny_model_dir, tracking={"registered_model_name": "grpoflow-tiny"})
    uri = cfg.tracking.uri
    run_id = tracking.start_run(uri=uri, experiment_name="test", run_name=None, params={}, tags={})
    tracking.log_metrics(uri, run_id, {"train/reward": 0.5, "train/loss": 0.1, "train/kl_penalty": 0.0}, 3)
    url = paths.checkpoint_dir(cfg.dataplane.root, "run-1", 3)
    weights = _checkpoint(url, tiny_model_dir)
    run = RunInfo(run_id="run-1", mlflow_run_id=run_id, model_path=tiny_model_dir, start_policy_path=tiny_model_dir)

    summary = finish_run(cfg=cfg, run=run, policy=PolicyVersion(step=3, path=url), validation_accuracy=0.25)

    assert summary.last_checkpoint == url and summary.final_step == 3
    assert no_network == []  # nothing tried the hub or PyPI
    client = MlflowClient(uri)
    ended = client.get_run(run_id)
    assert ended.info.status == "FINISHED" and ended.info.end_time is not None
    assert ended.data.tags["grpoflow.last_checkpoint"] == url
    version = client.get_model_version("grpoflow-tiny", "1")
    assert version.run_id == run_id
    assert [str(v.version) for v in client.search_model_versions("name='grpoflow-tiny'")] == ["1"]
    out = capsys.readouterr().out
    assert "final model: models:/grpoflow-tiny/1" in out
    assert f"#/experiments/{ended.info.experiment_id}/runs?workflowType=machine_learning" in out

    mlflow.set_tracking_uri(uri)
    try:
        local = Path(mlflow.artifacts.download_artifacts(f"runs:/{run_id}/model", dst_path=str(tmp_path / "dl")))
        loaded = mlflow.transformers.load_model("models:/grpoflow-tiny/1", return_type="components")
    finally:
        mlflow.set_tracking_uri(None)
    hf_files = sorted(p.name for p in (local / "model").iterdir())
    assert "model.safetensors" in hf_files and "config.json" in hf_files and "tokenizer.json" in hf_files
    assert not any(name.startswith("_") or name == "trainer_state" for name in hf_files)  # no marker, no trainer state
    requirements = (local / "requirements.txt").read_text().split()
    assert any(r.startswith("transformers==") for r in requirements) and any(
        r.startswith("torch==") for r in requirements
    )
    assert loaded["task"] == "text-generation"
    state = loaded["model"].state_dict()
    assert state.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name
    assert len(loaded["tokenizer"]) == loaded["model"].config.vocab_size
