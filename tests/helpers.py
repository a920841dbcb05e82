"""Helpers shared by the tests: small run configs, walks over the config tree, workflow runs, batches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tasks.run_config import run_config_from_dict

ROOT = Path(__file__).resolve().parents[1]


def small_config(tmp_path: Path, model: str, **overrides: dict) -> object:
    """A run's config (a ``RunConfig``: ``resources`` may be overridden too) for a fast run: local data plane and
    sqlite MLflow store under ``tmp_path``."""
    base = {
        "model": {"name": model, "precision": "float32"},  # the same arithmetic on every CPU
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4, "max_num_steps": 2, "val_period": 2},
        "generation": {"max_new_tokens": 8},
        "data": {"num_val_problems": 4},
        "optim": {"lr": 1e-3, "train_micro_batch_size": 4, "logprob_batch_size": 8},
        "dataplane": {"root": str(tmp_path / "dp")},
        "checkpointing": {"checkpoint_period": 1, "keep_last_k": 1},
        "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment_name": "test"},
    }
    for section, values in overrides.items():
        base.setdefault(section, {}).update(values)
    return run_config_from_dict(base)


def config_leaves(cls: type, prefix: str = "") -> list[tuple[str, object]]:
    """``(dotted key, annotation)`` of every leaf field of the config tree under the dataclass ``cls``."""
    import dataclasses

    from rl.config.checks import field_hints

    out: list[tuple[str, object]] = []
    for name, hint in field_hints(cls).items():
        out += (
            config_leaves(hint, f"{prefix}{name}.") if dataclasses.is_dataclass(hint) else [(f"{prefix}{name}", hint)]
        )
    return out


def leaf_docs(cls: type, prefix: str = "") -> list[tuple[str, str | None]]:
    """``(dotted key, attribute docstring or None)`` of every leaf field of the config tree under ``cls``."""
    import dataclasses

    from rl.config.checks import field_hints
    from rl.config.descriptions import field_docs

    docs = field_docs(cls)
    out: list[tuple[str, str | None]] = []
    for name, hint in field_hints(cls).items():
        out += (
            leaf_docs(hint, f"{prefix}{name}.")
            if dataclasses.is_dataclass(hint)
            else [(f"{prefix}{name}", docs.get(name))]
        )
    return out


def schema_descriptions(cls: type) -> dict[str, tuple[str | None, str]]:
    """``{dotted key: (description in flytekit's JSON schema of cls, the field's docstring as one line)}`` of every leaf
    field: what the schema that flytekit attaches to a config input says of each key, against the source."""
    from flytekit.core.type_engine import TypeEngine

    from rl.config.descriptions import one_line

    schema = TypeEngine.to_literal_type(cls).metadata
    out = {}
    for key, doc in leaf_docs(cls):
        node = schema
        for part in key.split("."):
            node = node["properties"][part]
        out[key] = (node.get("description"), one_line(doc or ""))
    return out


def nested_dict(key: str, value: object) -> dict:
    """``{"a": {"b": value}}`` for the dotted ``key`` ``a.b``: a config that sets one key."""
    *path, name = key.split(".")
    data: dict = {}
    node = data
    for part in path:
        node = node.setdefault(part, {})
    node[name] = value
    return data


def put_config_on_s3(s3_server: str, monkeypatch: object, key: str, body: bytes) -> str:
    """Put a config file at ``s3://grpoflow/{key}`` on the loopback S3 server and set the FLYTE_AWS_* variables a Flyte
    pod reads it with; returns its URL."""
    import boto3
    import fsspec

    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").put_object(
        Bucket="grpoflow", Key=key, Body=body
    )
    fsspec.filesystem("s3").clear_instance_cache()
    monkeypatch.setenv("FLYTE_AWS_ENDPOINT", s3_server)
    monkeypatch.setenv("FLYTE_AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("FLYTE_AWS_SECRET_ACCESS_KEY", "testing")
    return f"s3://grpoflow/{key}"


def metric_steps(uri: str, run_id: str, key: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, key))


def _launch(cfg: dict) -> subprocess.Popen:
    """The ``grpo`` workflow on ``cfg`` in a new process, at the default thread count (a run must be exact without
    GRPOFLOW_NUM_THREADS / OMP_NUM_THREADS pinning it to 1)."""
    code = (
        "import sys; from tasks.run_config import RunConfig; from workflows.grpo import grpo; "
        "grpo(cfg=RunConfig.from_json(sys.argv[1]))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GRPOFLOW_NUM_THREADS", "OMP_NUM_THREADS")}
    env["FLYTE_LOCAL_CACHE_ENABLED"] = "false"
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(cfg)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def run_to_end(cfg: dict, timeout: float = 600) -> str:
    """Run the workflow on ``cfg`` in a new process to its end; its output. Fails the test if the run fails."""
    proc = _launch(cfg)
    out, _ = proc.communicate(timeout=timeout)
    text = out.decode()
    assert proc.returncode == 0, text[-3000:]
    return text


def kill_when(cfg: dict, ready: Callable[[], object], timeout: float = 600) -> Path:
    """Start the workflow on ``cfg`` in a new process and SIGKILL it as soon as ``ready()`` is true; the run's folder
    under ``dataplane.root``. Fails the test if the run ends first."""
    proc = _launch(cfg)
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, "the run ended before the moment to kill it"
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (run_dir,) = [p for p in Path(cfg["dataplane"]["root"]).iterdir() if p.is_dir()]
    return run_dir


def grouped_batch(n: int, width: int, prompt: int, seed: int = 0) -> dict:
    """A random right-padded training batch of ``n`` rows in groups of 4 that share their first ``prompt`` tokens (the
    prompt; the rest is the response), with advantages and logprobs: what the logprob and update paths read."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt + 2, width + 1, (n,), generator=g)  # [n]
    ids = torch.randint(3, 1000, (n, width), generator=g)  # [n, S]
    ids[:, :prompt] = ids[::4, :prompt].repeat_interleave(4, 0)[:n]  # groups of 4 share their prompt
    pos = torch.arange(width)[None]
    valid = pos < lengths[:, None]  # [n, S]
    return {
        "input_ids": torch.where(valid, ids, 2),
        "input_lengths": lengths,
        "token_mask": valid & (pos >= prompt),
        "sample_mask": torch.ones(n, dtype=torch.bool),
        "advantages": torch.randn(n, 1, generator=g).expand(n, width).contiguous(),
        "generation_logprobs": -torch.rand(n, width, generator=g),
        "reference_policy_logprobs": -torch.rand(n, width, generator=g) - 0.5,
    }


def killed_in_step_3_and_resumed(tmp_path: Path, model: str, **overrides: dict) -> tuple[object, object]:
    """Run ``small_config(tmp_path / "clean", ...)`` to its end; start the same config under ``tmp_path / "crash"``,
    SIGKILL it once step 3's partition exists (before step 4's checkpoint), and resume it to its end.

    Returns:
        ``(clean, crash)``: the two runs' configs (their ``dataplane.root`` and ``tracking.uri`` hold their outputs).
    """
    clean = small_config(tmp_path / "clean", model, **overrides)
    crash = small_config(tmp_path / "crash", model, **overrides)
    run_to_end(clean.to_dict())
    root = Path(crash.dataplane.root)
    run_dir = kill_when(crash.to_dict(), lambda: list(root.glob("*/step_000003/_schema.json")))
    assert not (run_dir / "checkpoints" / "step_000004").exists()
    resumed = crash.to_dict()
    resumed["checkpointing"]["resume_run_id"] = run_dir.name
    assert "resuming run" in run_to_end(resumed)
    return clean, crash
