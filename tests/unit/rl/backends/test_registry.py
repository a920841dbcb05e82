"""Back-ends by name: unknown names list the valid ones, missing packages name their install command, and nothing
heavy is imported until a back-end is chosen."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rl.backends import registry
from rl.backends.interfaces import GenerationBackend, PolicyBackend


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"'sglang' is not a generation back-end; use one of \['transformers', 'vllm'\]"
    ):
        registry.load("generation", "sglang")


def test_a_missing_package_names_the_install_command(monkeypatch):
    spec = registry.BackendSpec(
        "nowhere:Nothing", ("grpoflow_no_such_package",), "pip install grpoflow-no-such-package"
    )
    monkeypatch.setitem(registry.GENERATION_BACKENDS, "fake", spec)
    assert registry.missing_packages("generation", "fake") == ["grpoflow_no_such_package"]
    with pytest.raises(
        ImportError,
        match=r"generation.backend 'fake' needs grpoflow_no_such_package.*: pip install grpoflow-no-such-package",
    ):
        registry.load("generation", "fake")


def test_the_registered_classes_implement_their_interface():
    assert issubclass(registry.load("generation", "transformers"), GenerationBackend)
    assert issubclass(registry.load("policy", "transformers"), PolicyBackend)


def test_config_and_rollout_import_no_back_end():
    code = (
        "import rl.config, rl.rollout, rl.backends.registry, tasks.types, sys; "
        "print(sorted(m for m in ('vllm', 'transformers', 'megatron') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_megatron_on_a_machine_without_cuda_says_it_needs_a_gpu():
    pytest.importorskip("megatron.core")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert registry.missing_packages("policy", "megatron") == []
    with pytest.raises(
        RuntimeError,
        match=(
            r"policy.backend 'megatron' needs a CUDA GPU and this machine has none .*Use policy.backend 'transformers' "
            r"on CPU"
        ),
    ):
        registry.load("policy", "megatron")


def test_a_missing_package_is_named_before_a_missing_gpu(monkeypatch):
    spec = registry.BackendSpec(
        "nowhere:Nothing", ("grpoflow_no_such.core",), "pip install -e '.[nothing]'", needs_cuda=True
    )
    monkeypatch.setitem(registry.POLICY_BACKENDS, "fake", spec)
    with pytest.raises(
        ImportError,
        match=(
            r"policy.backend 'fake' needs grpoflow_no_such.core, which is not installed here: pip install -e "
            r"'.\[nothing\]'"
        ),
    ):
        registry.check_installed("policy", "fake")
