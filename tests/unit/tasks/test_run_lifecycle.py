"""A local run's lifecycle past the happy path, on the real task functions (flytekit's local executor) or in a fresh
process: a retried ``train`` task after its update at a step whose input has no checkpoint (`tasks.train`), and a run
stopped by Ctrl-C or SIGTERM (`tasks.failure.watch_interrupts`, `rl.checkpoint`'s temporary copies)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tasks.run_config import run_config_from_dict
from tests.helpers import small_config

ROOT = Path(__file__).resolve().parents[3]


def _steps(cfg, n: int, *, until_train=None):
    """``n`` GRPO steps of a new run, task by task in ``grpo_step``'s order; returns ``(run, policy)``. With
    ``until_train``, the train task of step ``n`` is called by ``until_train(train, kwargs)`` instead."""
    from tasks.advantages import advantages
    from tasks.logprobs import policy_logprobs, reference_logprobs
    from tasks.rollout import rollout
    from tasks.setup import start_run
    from tasks.train import train
    from tasks.types import PolicyVersion

    run = start_run(cfg=cfg)
    policy = PolicyVersion(step=0, path=run.start_policy_path)
    for step in range(1, n + 1):
        batch = rollout(cfg=cfg, run=run, policy=policy, step=step)
        kwargs = {
            "cfg": cfg,
            "run": run,
            "policy": policy,
            "with_prev_logprobs": policy_logprobs(cfg=cfg, run=run, policy=policy, meta=batch),
            "with_reference_logprobs": reference_logprobs(cfg=cfg, run=run, meta=batch),
            "with_advantages": advantages(cfg=cfg, run=run, meta=batch),
        }
        policy = until_train(train, kwargs) if until_train and step == n else train(**kwargs)
    return run, policy


def _config(tmp_path, model):
    # step 1 is saved with weights only (not due at period 2); step 2, the last, is a checkpoint
    return small_config(
        tmp_path,
        model,
        checkpointing={"checkpoint_period": 2, "keep_last_k": 1},
        grpo={"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
        generation={"max_new_tokens": 4},
        optim={"train_micro_batch_size": 4},
    )


def _fail_once(monkeypatch, owner, name, when, *, after: bool):
    """Make the first call of ``owner.name`` with ``when(*args)`` raise a transient error, before or after its work."""
    real, fired = getattr(owner, name), []

    def wrapper(*args, **kwargs):
        hit = not fired and when(*args, **kwargs)
        if hit and not after:
            fired.append(True)
            raise ConnectionResetError(f"injected fault in {name}")
        out = real(*args, **kwargs)
        if hit:
            fired.append(True)
            raise ConnectionResetError(f"injected fault in {name}")
        return out

    monkeypatch.setattr(owner, name, wrapper)
    return fired


def test_a_local_retry_of_train_after_its_update_keeps_the_update(tmp_path, tiny_model_dir, monkeypatch, capfd):
    """Step 2's input (step 1) has weights only; its train task fails after the update (a dropped connection while
    saving): the retry saves the update this process holds instead of training from step 1 again."""
    from safetensors.torch import load_file

    import rl.step
    import tasks.saving
    from rl import checkpoint
    from tasks import tracking

    updates, updated = [], {}
    real_update = rl.step.update

    def update(cfg, policy, *args, step, **kwargs):
        out = real_update(cfg, policy, *args, step=step, **kwargs)
        updates.append(step)
        updated[step] = {k: v.detach().clone() for k, v in policy.policy.model.state_dict().items()}
        return out

    monkeypatch.setattr(rl.step, "update", update)
    fired = _fail_once(
        monkeypatch,
        tasks.saving,
        "save_policy",
        lambda cfg, run, backend, **k: backend.weight_version == 2,
        after=False,
    )
    cfg = _config(tmp_path / "run", tiny_model_dir)
    run, policy = _steps(cfg, 2)

    assert fired == [True]
    assert updates == [1, 2]  # the retry did not train step 2 again
    assert "train: attempt 1 of 3 failed (recoverable: train: transient ConnectionResetError" in capfd.readouterr().err
    assert policy.step == 2 and checkpoint.has_trainer_state(policy.path)
    saved = load_file(f"{policy.path}/model.safetensors")  # the first attempt's update, as it left it
    assert saved and all(saved[k].equal(updated[2][k]) for k in saved)
    history = tracking.client(cfg.tracking.uri).get_metric_history
    for key in ("train/loss", "timing/train/checkpointing"):  # each logged once
        assert [m.step for m in history(run.mlflow_run_id, key)] == [1, 2], key


def test_a_local_retry_that_lost_the_optimizer_state_says_how_to_resume_this_run(tmp_path, tiny_model_dir, monkeypatch):
    """The update itself fails half-way (the weights may be half-updated: dropped), and step 1 was saved without its
    optimizer state: the retry cannot train step 2, and the error names this run's resume command."""
    import rl.backends.hf.train

    _fail_once(
        monkeypatch,
        rl.backends.hf.train,
        "train_on_batch",
        lambda model, optimizer, scheduler, *a, **k: scheduler.last_epoch == 1,  # step 2's update (before it)
        after=False,
    )
    cfg = _config(tmp_path, tiny_model_dir)
    started = []

    def train(task, kwargs):
        started.append(kwargs["run"])
        return task(**kwargs)

    with pytest.raises(RuntimeError) as caught:
        _steps(cfg, 2, until_train=train)
    text = str(caught.value)
    run_id = started[0].run_id
    assert f"the policy of step 1 at {cfg.dataplane.root}/{run_id}/weights/step_000001 has no optimizer state" in text
    assert "checkpointing.checkpoint_period: 1 saves the optimizer state at every step" in text
    # no checkpoint to resume from yet: the command that starts this run again, with its config
    assert "no checkpoint yet (checkpointing.checkpoint_period: 2): start it again: " in text
    command = re.search(r"pyflyte run workflows/grpo\.py grpo --cfg '([^']+)'", text)
    assert command, text
    assert run_config_from_dict(json.loads(command[1])) == cfg


_STOPPED_RUN = """
import json, sys, threading
from pathlib import Path

import fsspec

from dataplane import paths
from rl.checkpoint import local_copy
from tasks.setup import start_run
from tests.helpers import small_config

tmp, model = Path(sys.argv[1]), sys.argv[2]
cfg = small_config(tmp, model)
run = start_run(cfg=cfg)  # opens the MLflow run
fsspec.filesystem("memory").pipe("/grpoflow-test/step_000001/config.json", b"{}")
copy = local_copy("memory://grpoflow-test/step_000001")  # a remote checkpoint's temporary copy under $TMPDIR
saved = Path(paths.checkpoint_dir(cfg.dataplane.root, run.run_id, 1))  # a complete checkpoint to resume from
saved.mkdir(parents=True)
(saved / "_COMPLETE").write_text("{}")
(tmp / "ready.json").write_text(json.dumps({"run_id": run.run_id, "mlflow_run_id": run.mlflow_run_id, "copy": copy}))
threading.Event().wait()  # the run goes on until stopped
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_local_run_stopped_by_a_signal_is_killed_and_says_how_to_resume(tmp_path, tiny_model_dir, sig):
    """A fresh process opens a local run's MLflow run and a temporary checkpoint copy, then is stopped by ``sig``: the
    MLflow run is KILLED, one line gives the run id and its resume command, no traceback, no temporary folder left."""
    from tasks import tracking

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(_STOPPED_RUN))
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": str(ROOT), "GRPOFLOW_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), tiny_model_dir],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready = tmp_path / "ready.json"
    deadline = time.monotonic() + 120
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # waiting for the marker file, not for an interleaving
    if not ready.exists():
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the run did not start (exit {proc.returncode}):\n{out}\n{err}")
    started = json.loads(ready.read_text())
    assert Path(started["copy"]).is_dir() and Path(started["copy"]).parent == tmpdir
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)

    assert proc.returncode == (143 if sig == signal.SIGTERM else -signal.SIGINT), (proc.returncode, err)
    assert "Traceback" not in err, err
    stopped = [line for line in (out + err).splitlines() if "marked KILLED" in line]
    run_id, mlflow_run_id = started["run_id"], started["mlflow_run_id"]
    assert len(stopped) == 1, out + err
    assert stopped[0].startswith(
        f"[grpoflow] run {run_id} stopped by {sig.name} | MLflow run {mlflow_run_id} marked KILLED "
        "| resume: pyflyte run workflows/grpo.py grpo --cfg '{"
    ), stopped[0]
    resumed = run_config_from_dict(json.loads(stopped[0].split(" --cfg '")[1].removesuffix("'")))
    cfg = small_config(tmp_path, tiny_model_dir)
    assert resumed == dataclasses.replace(
        cfg, checkpointing=dataclasses.replace(cfg.checkpointing, resume_run_id=run_id)
    )
    assert tracking.client(cfg.tracking.uri).get_run(mlflow_run_id).info.status == "KILLED"
    assert sorted(p.name for p in tmpdir.iterdir() if p.name.startswith("grpoflow-")) == []
