"""The cluster path: two GRPO steps of the *serialized* workflow with every task a fresh process running its own
container command (``pyflyte-execute``, as a pod does), sharing only the data plane and checkpoints (a real S3
server on loopback) and MLflow (a real ``mlflow server``). The default checkpoint period (2) means step 1 saves
no full checkpoint: the train task of step 2, a process of its own, must still find step 1's optimizer state.
The result equals a run of the same config through the local executor (one warm process), bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.flyte_pods import Pods
from tests.helpers import metric_steps, small_config


def _weights(url: str, storage_options: dict) -> dict[str, torch.Tensor]:
    from pathlib import Path

    from safetensors.torch import load_file

    from rl.checkpoint import local_copy

    folder = Path(local_copy(url, storage_options, require_complete=True))
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.integration
@pytest.mark.slow
def test_two_steps_with_every_task_in_a_fresh_process(tmp_path, tiny_model_dir, s3_server, mlflow_server, monkeypatch):
    import fsspec
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.admin.workflow import WorkflowSpec
    from flytekit.models.task import TaskSpec

    from rl.config import GRPOConfig
    from tasks.types import RunSummary
    from workflows.grpo import grpo
    from workflows.registration import fake_images, serialize, settings

    monkeypatch.setenv("GRPOFLOW_NUM_THREADS", "1")
    fsspec.filesystem("s3").clear_instance_cache()
    prefix = f"s3://grpoflow/cold-{random.randrange(1 << 30)}"
    so = {"endpoint_url": s3_server}
    cfg = small_config(
        tmp_path, tiny_model_dir,
        grpo={"max_num_steps": 2, "val_period": 2},
        checkpointing={"checkpoint_period": 2, "keep_last_k": 1},  # step 1: weights only, as on a cluster by default
        dataplane={"root": f"{prefix}/cold", "storage_options": so},
        tracking={"uri": mlflow_server, "experiment_name": "cold"},
    )
    with fake_images():
        entities = serialize(settings())
    tasks = {e.template.id.name: e.template for e in entities if isinstance(e, TaskSpec)}
    (spec,) = [e for e in entities if isinstance(e, WorkflowSpec) and e.template.id.name == "workflows.grpo.grpo"]
    ctx = FlyteContextManager.current_context()
    inputs = {"cfg": TypeEngine.to_literal(ctx, cfg, GRPOConfig, TypeEngine.to_literal_type(GRPOConfig))}

    pods = Pods(tmp_path / "cluster", execution=f"cold{random.randrange(1 << 30):x}", env={"GRPOFLOW_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    out = pods.run_workflow(spec, tasks, inputs)
    summary = TypeEngine.to_python_value(ctx, out["o0"], RunSummary)

    # every task was its own process; on-policy steps have no policy-logprob node
    ran = [p.node for p in pods.pods]
    assert len(ran) == len(set(ran)) == 12, ran
    for step in (1, 2):
        for task in ("rollout", "reference-logprobs", "advantages", "train"):
            assert any(n.endswith(f"step-{step}-{task}") for n in ran), (step, task, ran)
    assert not any("policy-logprobs" in n for n in ran)
    assert all(p.returncode == 0 for p in pods.pods)

    # the run: named after the execution, every step's metrics once, each task's startup timed
    assert summary.final_step == 2 and summary.run_id == f"run-{pods.execution}"
    uri, run_id = cfg.tracking.uri, summary.mlflow_run_id
    assert metric_steps(uri, run_id, "train/loss") == [1, 2]
    assert metric_steps(uri, run_id, "validation/accuracy") == [2]
    for task in ("rollout", "reference_logprobs", "advantages", "train"):
        assert metric_steps(uri, run_id, f"timing/{task}/startup") == [1, 2], task
    assert metric_steps(uri, run_id, "timing/validate/startup") == [2]
    assert metric_steps(uri, run_id, "timing/start_run/startup") == [0]
    from mlflow.tracking import MlflowClient

    assert MlflowClient(uri).get_run(run_id).info.run_name == pods.execution

    # step 1's train task left its optimizer state beside its weights: step 2's found it
    from dataplane import paths
    from rl import checkpoint

    assert checkpoint.has_trainer_state(summary.last_checkpoint, so)

    # the same config through the local executor (one warm process) gives the same weights, bit for bit
    warm_cfg = small_config(
        tmp_path, tiny_model_dir,
        grpo={"max_num_steps": 2, "val_period": 2},
        checkpointing={"checkpoint_period": 2, "keep_last_k": 1},
        dataplane={"root": f"{prefix}/warm", "storage_options": so},
        tracking={"uri": mlflow_server, "experiment_name": "warm"},
    )
    warm = grpo(cfg=warm_cfg)
    cold_w, warm_w = _weights(summary.last_checkpoint, so), _weights(warm.last_checkpoint, so)
    assert cold_w.keys() == warm_w.keys()
    assert all(torch.equal(cold_w[k], warm_w[k]) for k in cold_w), [k for k in cold_w if not torch.equal(cold_w[k], warm_w[k])]
    assert paths.checkpoint_dir(cfg.dataplane.root, summary.run_id, 2) == summary.last_checkpoint
