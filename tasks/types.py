"""Small dataclasses that tasks pass besides `KVBatchMeta` (no tensors, no token lists)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl.backends.interfaces import PolicyVersion

__all__ = ["PolicyVersion", "RunInfo", "RunSummary"]


@dataclass
class RunInfo:
    """One training run: its data-plane namespace, MLflow run and resolved base model."""

    run_id: str
    mlflow_run_id: str
    model_path: str
    """Resolved base model (also the reference policy)."""
    start_step: int = 0
    """Last completed step (0 for a new run; the checkpoint's step when resuming)."""
    start_policy_path: str = ""
    """Weights of ``start_step`` (the base model for a new run)."""


@dataclass
class RunSummary:
    run_id: str
    mlflow_run_id: str
    tracking_uri: str
    final_step: int
    last_checkpoint: str
    validation_accuracy: float
    metrics: dict[str, float] = field(default_factory=dict)
