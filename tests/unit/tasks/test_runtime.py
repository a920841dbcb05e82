"""`tasks.runtime`: back-ends cached per (run, role), refitted only when the version differs, warm from the live
policy in place; a rollout builds no optimizer. Transformers back-ends on a tiny random model."""

from __future__ import annotations

import time

import pytest
import torch

from rl.backends.interfaces import PolicyVersion
from tasks import runtime
from tasks.types import RunInfo
from tests.helpers import small_config


@pytest.fixture
def run(tiny_model_dir):
    info = RunInfo(run_id="run-test", mlflow_run_id="m", model_path=tiny_model_dir)
    yield info
    runtime.release(info)


def test_generation_is_cached_and_refits_only_on_a_new_version(tmp_path, run, tiny_model_dir, monkeypatch):
    cfg = small_config(tmp_path, tiny_model_dir)
    v0 = PolicyVersion(step=0, path=tiny_model_dir)
    gen = runtime.generation(cfg, run, v0)
    assert (run.run_id, "policy") not in runtime._BACKENDS  # a rollout builds no trainer, no optimizer
    refits = []
    monkeypatch.setattr(type(gen), "refit", lambda self, version, weights=None: refits.append(version.step))
    assert runtime.generation(cfg, run, v0) is gen and refits == []
    runtime.generation(cfg, run, PolicyVersion(step=3, path=tiny_model_dir))
    assert refits == [3]


def test_a_warm_refit_copies_the_live_policy_without_touching_storage(tmp_path, run, tiny_model_dir):
    cfg = small_config(tmp_path, tiny_model_dir)
    v0 = PolicyVersion(step=0, path=tiny_model_dir)
    gen = runtime.generation(cfg, run, v0)
    policy = runtime.policy(cfg, run, v0, training=True)
    assert policy.has_optimizer_state(v0)
    with torch.no_grad():
        for _, w in policy.named_weights():
            w.add_(0.01)
    policy._version = 1  # as after a train step
    runtime.generation(cfg, run, PolicyVersion(step=1, path=str(tmp_path / "never-written")))
    assert gen.weight_version == 1
    theirs = dict(policy.named_weights())
    assert all(torch.equal(w, theirs[k]) for k, w in gen._model.state_dict().items())
    assert runtime.policy(cfg, run) is policy


def test_release_shuts_the_runs_back_ends_down(tmp_path, run, tiny_model_dir):
    cfg = small_config(tmp_path, tiny_model_dir)
    gen = runtime.generation(cfg, run, PolicyVersion(step=0, path=tiny_model_dir))
    runtime.release(run)
    assert gen.weight_version is None and not [k for k in runtime._BACKENDS if k[0] == run.run_id]


def test_startup_counts_from_the_process_start_for_the_first_task_only(monkeypatch):
    """The first task of a process (a pod) counts its startup from the process's start: interpreter and imports
    included; a later task of the same process (a local run) from its own start."""

    import psutil

    monkeypatch.setattr(runtime, "_TASKS_STARTED", 0)
    first = runtime.begin_task()
    assert first == psutil.Process().create_time()
    before = time.time()
    second = runtime.begin_task()
    assert before <= second <= time.time()
    ((key, seconds),) = runtime.startup_metric("rollout", first).items()
    assert key == "timing/rollout/startup" and seconds >= time.time() - first - 1
