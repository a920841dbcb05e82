"""The cluster path: two GRPO steps of the *serialized* workflow with every task a fresh process running its own
container command (``pyflyte-execute``, as a pod does), sharing only the data plane and checkpoints (a real S3
server on loopback) and MLflow (a real ``mlflow server``). The default checkpoint period (2) means step 1 saves
no full checkpoint: the train task of step 2, a process of its own, must still find step 1's optimizer state.
The run uses the default model, which exists only where ``start_run`` converted it, in its own pod's home cache;
each pod has its own HOME and caches, deleted when it exits, so the other pods get the model only from storage.
The result equals a run of the same config through the local executor (one warm process), bit for bit. The run is
scored by reward functions of the user's project folder, which every rollout pod imports.
"""

from __future__ import annotations

import hashlib
import random
import shutil
from pathlib import Path

import pytest
import torch

from rl.config import DEFAULT_MODEL
from rl.model_store import MODELS, manifest
from tests.flyte_pods import Pods
from tests.helpers import metric_steps, small_config


def _weights(url: str, storage_options: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from rl.checkpoint import local_copy

    folder = Path(local_copy(url, storage_options, require_complete=True))
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


USER_REWARDS = {
    "reward_functions": [
        {"function": "tests.rewards:earnable"},  # a module of the project folder
        {"function": "examples/rewards.py:brevity", "weight": 0.5},  # a file of it, by path
    ]
}
"""Reward code from the user's folder, which pyflyte's fast registration ships to the pods (here: their working
directory is the project folder, as a fast-registered pod's is)."""


def _converted(tiny_model_dir: str, cache: Path) -> None:
    """Put the tiny model where :func:`rl.model.resolve_model` keeps the converted default model under ``cache``
    (a ``GRPOFLOW_CACHE``), as if the GGUF had been converted there (the real conversion and model would make this
    test minutes slower)."""
    shutil.copytree(tiny_model_dir, cache / "models" / DEFAULT_MODEL)


@pytest.mark.integration
@pytest.mark.slow
def test_two_steps_with_every_task_in_a_fresh_process(tmp_path, tiny_model_dir, s3_server, mlflow_server, monkeypatch):
    import fsspec
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.admin.workflow import WorkflowSpec
    from flytekit.models.task import TaskSpec

    from tasks.run_config import RunConfig
    from tasks.types import RunSummary
    from workflows.grpo import grpo
    from workflows.registration import fake_images, serialize, settings

    monkeypatch.setenv("GRPOFLOW_NUM_THREADS", "1")
    fsspec.filesystem("s3").clear_instance_cache()
    prefix = f"s3://grpoflow/cold-{random.randrange(1 << 30)}"
    so = {"endpoint_url": s3_server}
    cfg = small_config(
        tmp_path,
        DEFAULT_MODEL,
        grpo={"max_num_steps": 2, "val_period": 2},
        checkpointing={"checkpoint_period": 2, "keep_last_k": 1},  # step 1: weights only, as on a cluster by default
        dataplane={"root": f"{prefix}/cold", "storage_options": so},
        tracking={"uri": mlflow_server, "experiment_name": "cold"},
        env=USER_REWARDS,
    )
    with fake_images():
        entities = serialize(settings())
    tasks = {e.template.id.name: e.template for e in entities if isinstance(e, TaskSpec)}
    (spec,) = [e for e in entities if isinstance(e, WorkflowSpec) and e.template.id.name == "workflows.grpo.grpo"]
    ctx = FlyteContextManager.current_context()
    inputs = {"cfg": TypeEngine.to_literal(ctx, cfg, RunConfig, TypeEngine.to_literal_type(RunConfig))}

    def prepare_home(task: str, home: Path) -> None:  # only start_run's pod has the model on its disk
        if task.endswith(".start_run"):
            _converted(tiny_model_dir, home / ".cache" / "grpoflow")

    pods = Pods(
        tmp_path / "cluster",
        execution=f"cold{random.randrange(1 << 30):x}",
        env={"GRPOFLOW_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
        prepare_home=prepare_home,
    )
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
    # the reward file of the user's project folder and a module of it resolved in every rollout pod
    for name in ("earnable", "brevity"):
        assert metric_steps(uri, run_id, f"train/reward/chain_sum/{name}") == [1, 2], name
    for task in ("rollout", "reference_logprobs", "advantages", "train"):
        assert metric_steps(uri, run_id, f"timing/{task}/startup") == [1, 2], task
    assert metric_steps(uri, run_id, "timing/validate/startup") == [2]
    assert metric_steps(uri, run_id, "timing/start_run/startup") == [0]
    from mlflow.tracking import MlflowClient

    assert MlflowClient(uri).get_run(run_id).info.run_name == pods.execution

    # start_run published the model once, content-addressed, byte for byte; the pods that load it (rollout,
    # reference, the first train step, validation) each downloaded it into their empty node cache; no pod's disk
    # outlived it
    fs = fsspec.filesystem("s3", endpoint_url=s3_server, use_listings_cache=False)
    published = fs.ls(f"{prefix}/cold/{MODELS}".removeprefix("s3://"), detail=False)
    expected = manifest(tiny_model_dir)
    assert [p.rsplit("/", 1)[-1] for p in published] == [hashlib.sha256(expected).hexdigest()]
    assert fs.cat_file(f"{published[0]}/_COMPLETE") == expected
    for rel in ("model.safetensors", "config.json", "tokenizer.json"):
        assert fs.cat_file(f"{published[0]}/{rel}") == (Path(tiny_model_dir) / rel).read_bytes(), rel
    loaded = sorted(p.node for p in pods.pods if "into the node cache" in p.log)
    for step in (1, 2):
        assert any(n.endswith(f"step-{step}-rollout") for n in loaded) and any(
            n.endswith(f"step-{step}-reference-logprobs") for n in loaded
        ), loaded
    assert any(n.endswith("step-1-train") for n in loaded) and any("validate" in n for n in loaded), loaded
    assert not any(p.exists() for p in (tmp_path / "cluster" / "pods").glob("*/home"))

    # step 1's train task left its optimizer state beside its weights: step 2's found it
    from dataplane import paths
    from rl import checkpoint

    assert checkpoint.has_trainer_state(summary.last_checkpoint, so)

    # the same config through the local executor (one warm process) gives the same weights, bit for bit
    _converted(tiny_model_dir, tmp_path / "warm-cache")
    monkeypatch.setenv("GRPOFLOW_CACHE", str(tmp_path / "warm-cache"))
    warm_cfg = small_config(
        tmp_path,
        DEFAULT_MODEL,
        grpo={"max_num_steps": 2, "val_period": 2},
        checkpointing={"checkpoint_period": 2, "keep_last_k": 1},
        dataplane={"root": f"{prefix}/warm", "storage_options": so},
        tracking={"uri": mlflow_server, "experiment_name": "warm"},
        env=USER_REWARDS,
    )
    warm = grpo(cfg=warm_cfg)
    assert not fs.exists(f"{prefix}/warm/{MODELS}".removeprefix("s3://"))  # a local run loads the model where it is
    cold_w, warm_w = _weights(summary.last_checkpoint, so), _weights(warm.last_checkpoint, so)
    assert cold_w.keys() == warm_w.keys()
    assert all(torch.equal(cold_w[k], warm_w[k]) for k in cold_w), [
        k for k in cold_w if not torch.equal(cold_w[k], warm_w[k])
    ]
    assert paths.checkpoint_dir(cfg.dataplane.root, summary.run_id, 2) == summary.last_checkpoint


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("policy", [{}, {"lora": {"rank": 4, "alpha": 8.0}}], ids=["full", "lora"])
def test_two_steps_per_task_across_fresh_processes_equal_the_warm_run(
    tmp_path, tiny_model_dir, s3_server, mlflow_server, monkeypatch, policy
):
    """``resources.steps_per_task: 2`` over 3 steps: a node for steps 1-2 and one for step 3, each a fresh process.
    Step 2 (the first node's last) hands its optimizer state to the second node through storage; step 1 saves only
    its weights (a checkpoint period of 3). The weights equal the warm run's, bit for bit. With a LoRA adapter the
    second node loads the base model from its node cache, then the adapter and its optimizer state from storage."""
    import fsspec
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.admin.workflow import WorkflowSpec
    from flytekit.models.task import TaskSpec

    from rl import checkpoint
    from tasks.run_config import RunConfig
    from tasks.types import RunSummary
    from workflows.grpo import grpo
    from workflows.registration import fake_images, serialize, settings

    monkeypatch.setenv("GRPOFLOW_NUM_THREADS", "1")
    fsspec.filesystem("s3").clear_instance_cache()
    # random is seeded alike for every test (conftest): the parameter keeps the two runs' storage and run ids apart
    prefix = f"s3://grpoflow/cold-k-{'lora' if policy else 'full'}-{random.randrange(1 << 30)}"
    so = {"endpoint_url": s3_server}

    def config(root: str, k: int):
        return small_config(
            tmp_path,
            tiny_model_dir,
            grpo={"max_num_steps": 3, "val_period": 0},
            checkpointing={"checkpoint_period": 3, "keep_last_k": 1},
            dataplane={"root": root, "storage_options": so},
            tracking={"uri": mlflow_server, "experiment_name": f"k{k}"},
            resources={"steps_per_task": k},
            policy=policy,
        )

    cfg = config(f"{prefix}/cold", 2)
    with fake_images():
        entities = serialize(settings())
    tasks = {e.template.id.name: e.template for e in entities if isinstance(e, TaskSpec)}
    (spec,) = [e for e in entities if isinstance(e, WorkflowSpec) and e.template.id.name == "workflows.grpo.grpo"]
    ctx = FlyteContextManager.current_context()
    inputs = {"cfg": TypeEngine.to_literal(ctx, cfg, RunConfig, TypeEngine.to_literal_type(RunConfig))}
    pods = Pods(
        tmp_path / "cluster",
        execution=f"coldk{'l' if policy else 'f'}{random.randrange(1 << 30):x}",
        env={"GRPOFLOW_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
    )
    summary = TypeEngine.to_python_value(ctx, pods.run_workflow(spec, tasks, inputs)["o0"], RunSummary)

    ran = [p.node for p in pods.pods]
    assert [n.split("-", 1)[1] for n in ran if "grpo-steps" in n] == ["steps-1-2-grpo-steps", "steps-3-3-grpo-steps"], (
        ran
    )
    assert not any(n.endswith(("-rollout", "-train")) for n in ran), ran  # no per-task nodes
    assert all(p.returncode == 0 for p in pods.pods)
    assert summary.final_step == 3
    assert metric_steps(cfg.tracking.uri, summary.mlflow_run_id, "train/loss") == [1, 2, 3]

    warm = grpo(cfg=config(f"{prefix}/warm", 1))
    cold_w, warm_w = _weights(summary.last_checkpoint, so), _weights(warm.last_checkpoint, so)
    assert cold_w.keys() == warm_w.keys()
    assert all((".lora_" in k) == bool(policy) for k in cold_w)  # a LoRA checkpoint: the adapter alone
    assert all(torch.equal(cold_w[k], warm_w[k]) for k in cold_w), [
        k for k in cold_w if not torch.equal(cold_w[k], warm_w[k])
    ]
    assert checkpoint.has_trainer_state(summary.last_checkpoint, so)
