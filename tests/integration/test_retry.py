"""A task that fails after writing part of its output and is retried, as Flyte retries it (same inputs, up to
the task's ``retries``, only for recoverable errors; the local executor here retries as Flyte does, ``tasks.retry``),
leaves the same data plane state, MLflow metrics and weights as a clean run.

Faults are injected at real boundaries by wrapping the real function so that it does its work (writes its
output) and then raises a transient error, once:
- step 1 rollout: after its rows are committed to the data plane;
- step 1 train: after the new weights and checkpoint are saved (and older ones pruned), before the metrics are
  logged; then, in its second attempt, after the metrics are logged, before the step partition is cleared (a
  dropped MLflow connection);
- step 2 reference_logprobs: after its delta write is committed;
- step 2 train: after the optimizer has updated the in-memory policy, before anything is saved; then, in its
  second attempt, after the step partition is cleared (a pod lost before the task returned);
- validation: after its metrics are logged, before its sample table.

A retried write leaves the losing attempt's data file behind as an orphan (no write deletes a file another attempt
may have committed): the snapshots are taken after `DataPlane.collect_garbage`, which ``finish_run`` calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from flytekit import task
from flytekit.exceptions.base import FlyteRecoverableException

from tasks.retry import transient_errors_retried
from tests.helpers import small_config


def _run(cfg, *, snapshots: list, attempts: list | None = None):
    """Two GRPO steps and a validation, task by task in the order of ``grpo_step``: each call retries its task's
    recoverable failures."""
    from tasks.advantages import advantages
    from tasks.logprobs import policy_logprobs, reference_logprobs
    from tasks.rollout import rollout
    from tasks.setup import start_run
    from tasks.train import train
    from tasks.types import PolicyVersion
    from tasks.validate import validate

    # one run id for both runs (in their own roots): sample ids hash it, and the two runs' states are compared
    run = dataclasses.replace(start_run(cfg=cfg), run_id="run-retry-test")
    policy = PolicyVersion(step=0, path=run.start_policy_path)
    for step in (1, 2):
        batch = rollout(cfg=cfg, run=run, policy=policy, step=step)
        prev = policy_logprobs(cfg=cfg, run=run, policy=policy, meta=batch)
        ref = reference_logprobs(cfg=cfg, run=run, meta=batch)
        adv = advantages(cfg=cfg, run=run, meta=batch)
        snapshots.append(_state(cfg, run))  # the step partition, complete, before train clears it
        policy = train(
            cfg=cfg,
            run=run,
            policy=policy,
            with_advantages=adv,
            with_prev_logprobs=prev,
            with_reference_logprobs=ref,
        )
        snapshots.append(_state(cfg, run))
    validate(cfg=cfg, run=run, policy=policy)
    snapshots.append(_state(cfg, run))
    return run, policy


def _state(cfg, run) -> dict[str, str]:
    """Everything under the run's data plane folder once its garbage is collected: relative path -> content
    digest, with what legitimately differs between two runs normalized (run ids, write-attempt nonces, commit
    timestamps, the MLflow run id, generation timings in a sealed batch's meta)."""
    from dataplane.client import DataPlane

    DataPlane(cfg.dataplane.root, run.run_id).collect_garbage()
    root = Path(cfg.dataplane.root) / run.run_id
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = re.sub(r"-[0-9a-f]{8}\.parquet$", ".parquet", str(path.relative_to(root)))
        data = path.read_bytes()
        if path.suffix == ".json" and "/_commits/" in f"/{rel}":
            doc = json.loads(data)
            doc.pop("created_unix_ns")
            doc["file"] = re.sub(r"-[0-9a-f]{8}\.parquet$", ".parquet", doc["file"])
            data = json.dumps(doc, sort_keys=True).encode()
        if path.name == "_sealed.json":  # the batch's meta: its rollout metrics include generation timings
            doc = json.loads(data)
            doc["extra_info"] = {
                k: v
                for k, v in doc["extra_info"].items()
                if k not in ("rollout/generation_time_s", "rollout/generated_tokens_per_s")
            }
            data = json.dumps(doc, sort_keys=True).encode()
        if path.name == "_COMPLETE":  # the manifest: its digest of state.json covers the MLflow run id
            doc = json.loads(data)
            doc["files"] = {k: v["size"] for k, v in doc["files"].items()}
            data = json.dumps(doc, sort_keys=True).encode()
        data = data.replace(run.run_id.encode(), b"RUN").replace(run.mlflow_run_id.encode(), b"MLFLOW_RUN")
        out[rel] = hashlib.sha256(data).hexdigest()
    return out


def _metrics(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(uri)
    keys = c.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value) for m in c.get_metric_history(run_id, k)) for k in keys}


def _fail_once_after(monkeypatch, owner, name, label, fired, when):
    """Wrap ``owner.name`` so that the first call with ``when(*args)`` true does its work, then raises."""
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        if label not in fired and when(*args, **kwargs):
            fired.append(label)
            raise ConnectionResetError(f"injected fault: {label}")
        return out

    monkeypatch.setattr(owner, name, wrapper)


@pytest.mark.integration
def test_retried_partial_failures_leave_the_clean_state(tmp_path, tiny_model_dir, monkeypatch):
    from safetensors.torch import load_file

    import rl.backends.hf.train
    import tasks.saving
    import tasks.tracking
    from dataplane.client import DataPlane

    clean_cfg = small_config(tmp_path / "clean", tiny_model_dir)
    clean_snaps: list = []
    clean_run, clean_policy = _run(clean_cfg, snapshots=clean_snaps)

    fired: list[str] = []

    def second_update(model, optimizer, scheduler, *args, **kwargs):
        return scheduler.last_epoch == 2  # (checked after the call) the update of step 2, in any attempt

    _fail_once_after(
        monkeypatch, DataPlane, "put", "rollout step 1", fired, lambda self, part, *a, **k: part == "step_000001"
    )
    _fail_once_after(
        monkeypatch,
        tasks.saving,
        "save_policy",
        "train step 1 after saving",
        fired,
        lambda cfg, run, backend, *a, **k: backend.weight_version == 1,
    )
    _fail_once_after(
        monkeypatch,
        DataPlane,
        "write_columns",
        "ref_lp step 2",
        fired,
        lambda self, meta, *a, task_name=None, **k: task_name == "ref_lp" and meta.partition_id == "step_000002",
    )
    _fail_once_after(
        monkeypatch,
        tasks.tracking,
        "log_metrics",
        "train step 1 after logging",
        fired,
        lambda uri, run, metrics, step: step == 1 and "train/loss" in metrics,
    )
    _fail_once_after(
        monkeypatch, rl.backends.hf.train, "train_on_batch", "train step 2 after the update", fired, second_update
    )
    _fail_once_after(
        monkeypatch, DataPlane, "clear", "train step 2 after the clear", fired, lambda self, part: part == "step_000002"
    )
    _fail_once_after(
        monkeypatch,
        tasks.tracking,
        "log_metrics",
        "validation after logging",
        fired,
        lambda uri, run, metrics, step: "validation/accuracy" in metrics,
    )

    faulty_cfg = small_config(tmp_path / "faulty", tiny_model_dir)
    faulty_snaps: list = []
    faulty_run, faulty_policy = _run(faulty_cfg, snapshots=faulty_snaps)

    assert len(fired) == 7, fired  # every fault fired once and every task then succeeded on retry
    assert len(clean_snaps) == len(faulty_snaps) == 5
    for i, (a, b) in enumerate(zip(clean_snaps, faulty_snaps)):
        assert a == b, f"data plane state differs at snapshot {i}: {sorted(set(a.items()) ^ set(b.items()))}"
    assert any(k.startswith("step_000001/data/") for k in clean_snaps[0])  # the snapshots saw the partition

    clean_metrics = _metrics(clean_cfg.tracking.uri, clean_run.mlflow_run_id)
    faulty_metrics = _metrics(faulty_cfg.tracking.uri, faulty_run.mlflow_run_id)
    assert sorted(clean_metrics) == sorted(faulty_metrics)
    for key, history in faulty_metrics.items():
        assert [s for s, _ in history] == [s for s, _ in clean_metrics[key]], key  # each step exactly once
        if not key.startswith("timing/") and not key.endswith(("_per_s", "generation_time_s")):
            assert history == clean_metrics[key], key

    a = load_file(str(Path(clean_policy.path) / "model.safetensors"))
    b = load_file(str(Path(faulty_policy.path) / "model.safetensors"))
    assert all(a[k].equal(b[k]) for k in a)


ATTEMPTS_ENV = "GRPOFLOW_TEST_ATTEMPTS"
"""A file to which each attempt of :func:`connection_drops` adds a line."""


@task(retries=2)
@transient_errors_retried
def connection_drops(x: int) -> int:
    """Counts its attempt, then fails with a transient error (recoverable) in every attempt when ``x`` > 0."""
    with open(os.environ[ATTEMPTS_ENV], "a") as f:
        f.write("attempt\n")
    if x > 0:
        msg = f"injected fault ({x})"
        raise ConnectionResetError(msg)
    return x


@pytest.mark.integration
def test_a_pods_attempt_raises_a_recoverable_error_once_and_a_local_run_retries_it(tmp_path, monkeypatch):
    """Remote executions are unchanged: the task's own command (``pyflyte-execute``, as a pod runs it, in a fresh
    process) makes one attempt and records the error as recoverable, for Flyte to retry; a local call of the same
    task makes 1 + ``retries`` attempts (``tasks.retry``)."""

    from flyteidl.core import errors_pb2
    from flytekit.configuration import ImageConfig, SerializationSettings
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import LiteralMap

    from tests.flyte_pods import ROOT, Pods

    local, pod = tmp_path / "local.txt", tmp_path / "pod.txt"
    monkeypatch.setenv(ATTEMPTS_ENV, str(local))
    with pytest.raises(FlyteRecoverableException, match=r"injected fault \(1\)"):
        connection_drops(x=1)
    assert local.read_text().count("attempt") == 3

    pod_dir = tmp_path / "pod"
    (pod_dir / "out").mkdir(parents=True)
    literal = TypeEngine.to_literal(FlyteContextManager.current_context(), 1, int, TypeEngine.to_literal_type(int))
    (pod_dir / "inputs.pb").write_bytes(LiteralMap(literals={"x": literal}).to_flyte_idl().SerializeToString())
    command = connection_drops.get_default_command(SerializationSettings(image_config=ImageConfig.auto_default_image()))
    args = [Pods._substitute(a, pod_dir) for a in command]
    args[0] = str(Path(sys.executable).parent / args[0])  # pyflyte-execute of this virtualenv
    env = {
        **os.environ,
        ATTEMPTS_ENV: str(pod),
        "PYTHONPATH": str(ROOT),
        "FLYTE_INTERNAL_EXECUTION_ID": "pod0",
        "FLYTE_ATTEMPT_NUMBER": "0",
    }
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    doc = errors_pb2.ErrorDocument()
    doc.ParseFromString((pod_dir / "out" / "error.pb").read_bytes())
    assert doc.error.kind == errors_pb2.ContainerError.RECOVERABLE, doc
    assert "injected fault (1)" in doc.error.message
    assert pod.read_text().count("attempt") == 1, (
        done.stdout[-2000:] + done.stderr[-2000:]
    )  # one attempt: Flyte retries
    assert "[grpoflow]" not in done.stderr
