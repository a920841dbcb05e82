"""Small dataclasses that tasks pass besides `KVBatchMeta` (no tensors, no token lists)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dataplane.urls import redact
from rl.backends.interfaces import PolicyVersion

__all__ = ["PolicyVersion", "RunInfo", "RunSummary"]


@dataclass
class RunInfo:
    """One training run: its data-plane namespace, MLflow run and resolved base model."""

    run_id: str
    mlflow_run_id: str
    model_path: str
    """The base model (also the reference policy), as every task of the run can reach it: for a remote execution
    the URL of the model published on the run's storage (``{dataplane.root}/models/{sha256 digest}``,
    :func:`rl.model_store.publish`), which each pod loads through its node's model cache
    (:func:`tasks.runtime.base_model`); for a local run the local folder (or hub id) ``model.name`` resolved to.
    Tasks never load it directly: they ask :func:`tasks.runtime.base_model` for a local folder."""
    start_step: int = 0
    """Last completed step (0 for a new run; the checkpoint's step when resuming)."""
    start_policy_path: str = ""
    """Weights of ``start_step``: ``model_path`` for a new run, the checkpoint's URL when resuming."""
    cold_tasks: bool = False
    """Every task runs in a fresh process (a remote execution: one pod per task), so nothing but storage carries
    the trainer from one step's train task to the next: each step's weights are saved with their optimizer state."""
    task_input_policy: str = ""
    """Inside a task that runs several steps (``workflows.grpo.grpo_steps``): the path of the policy the task started
    from, never pruned while the task runs, so that a retry of the task finds it. Empty elsewhere."""
    weights_superseded: bool = False
    """Inside such a task, a step before its last: no other process reads this step's weights (the next step's
    tasks run in this process on the live trainer), so they are saved only with a checkpoint that is due."""


@dataclass
class RunSummary:
    run_id: str
    mlflow_run_id: str
    tracking_uri: str
    final_step: int
    last_checkpoint: str
    validation_accuracy: float
    metrics: dict[str, float] = field(default_factory=dict)

    def __repr__(self) -> str:
        """``RunSummary(run_id=..., final_step=4, validation_accuracy=0.562, mlflow_run_id=..., last_checkpoint=...)``:
        the line ``pyflyte run`` prints at the end. The metrics are left out (they are in MLflow and ``.metrics``);
        ``validation_accuracy=none``: the run never validated (the field holds -1.0)."""
        accuracy = "none" if self.validation_accuracy < 0 else f"{self.validation_accuracy:.3f}"
        return (
            f"RunSummary(run_id={self.run_id!r}, final_step={self.final_step}, validation_accuracy={accuracy}, "
            f"mlflow_run_id={self.mlflow_run_id!r}, last_checkpoint={redact(self.last_checkpoint)!r})"
        )

    __str__ = __repr__
