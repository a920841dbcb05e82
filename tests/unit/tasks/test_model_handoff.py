"""The base model from ``start_run`` to every pod: a remote execution publishes it to the run's storage once (a local
run keeps its folder), and a pod with an empty node cache loads the published model, its reference policy and
step-0 weights from that cache, equal to the original."""

from __future__ import annotations

import random
from pathlib import Path

import fsspec
import pytest
import torch

from rl import checkpoint, model_store
from rl.backends.interfaces import PolicyVersion
from tasks import runtime
from tasks.setup import run_model
from tasks.types import RunInfo
from tests.helpers import small_config


def _same(loaded: dict, original: dict) -> None:
    """Every tensor of the model file is loaded, bit for bit (a tied LM head is stored once, as the embedding)."""
    assert original and all(torch.equal(loaded[k], w) for k, w in original.items())


@pytest.fixture
def s3_root(s3_server):
    fsspec.filesystem("s3").clear_instance_cache()
    return f"s3://grpoflow/handoff-{random.randrange(1 << 30)}", {"endpoint_url": s3_server}


def test_a_local_run_loads_its_model_where_it_is(tmp_path, tiny_model_dir):
    cfg = small_config(tmp_path, tiny_model_dir)
    assert run_model(cfg, local=True) == tiny_model_dir
    assert not (tmp_path / "dp" / model_store.MODELS).exists()  # nothing hashed, copied or published


def test_a_remote_execution_publishes_the_model_once(tmp_path, tiny_model_dir, s3_root, monkeypatch):
    root, so = s3_root
    cfg = small_config(tmp_path, tiny_model_dir, dataplane={"root": root, "storage_options": so})
    url = run_model(cfg, local=False)
    assert url == f"{root}/models/{model_store.digest(model_store.manifest(tiny_model_dir))}"
    assert model_store.is_published(url, so)
    monkeypatch.setattr(model_store, "_upload", lambda *a, **k: pytest.fail("the second run uploaded the model again"))
    assert run_model(cfg, local=False) == url  # a second run (or a retried start_run) reuses it
    # a published model's URL as model.name is handed on as it is (start_run reads it through its node cache)
    monkeypatch.setenv(model_store.CACHE_ENV, str(tmp_path / "node-cache"))
    assert run_model(small_config(tmp_path, url, dataplane={"root": root, "storage_options": so}), local=False) == url
    assert (tmp_path / "node-cache" / url.rsplit("/", 1)[-1] / "config.json").is_file()


def test_a_pod_with_an_empty_cache_loads_the_published_model(tmp_path, tiny_model_dir, s3_root, monkeypatch):
    from safetensors.torch import load_file

    root, so = s3_root
    cfg = small_config(tmp_path, tiny_model_dir, dataplane={"root": root, "storage_options": so})
    url = run_model(cfg, local=False)
    cache = tmp_path / "node-cache"
    monkeypatch.setenv(model_store.CACHE_ENV, str(cache))
    monkeypatch.setattr(runtime, "_BASE_MODELS", {})  # a fresh process
    copies = []
    real = checkpoint.local_copy
    monkeypatch.setattr(checkpoint, "local_copy", lambda u, *a, **k: copies.append(u) or real(u, *a, **k))
    run = RunInfo(run_id="run-pod", mlflow_run_id="m", model_path=url, start_policy_path=url, cold_tasks=True)
    try:
        gen = runtime.generation(cfg, run, PolicyVersion(step=0, path=run.start_policy_path))  # a rollout pod
        folder = runtime.base_model(cfg, run)
        assert Path(folder) == cache / url.rsplit("/", 1)[-1]
        assert copies == [folder]  # step 0's weights came from the node cache, not from a second download
        original = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
        _same(gen._model.state_dict(), original)
        assert runtime.base_tokenizer(cfg, run).get_vocab() == runtime.tokenizer(tiny_model_dir).get_vocab()
        runtime.discard(run, "generation")
        policy = runtime.policy(
            cfg, run, PolicyVersion(step=0, path=run.start_policy_path), training=True
        )  # a train pod
        assert copies == [folder, folder]
        _same(dict(policy.named_weights()), original)
        policy.load_reference_policy()  # a reference pod: from the node cache too
        _same(policy._reference.state_dict(), original)
    finally:
        runtime.release(run)
