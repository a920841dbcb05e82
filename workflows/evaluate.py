"""`evaluate`: greedy held-out accuracy of a saved checkpoint, logged beside the run's training curves.

    pyflyte run workflows/evaluate.py evaluate --run_id run-20261125-101500-ab12cd
    pyflyte run workflows/evaluate.py evaluate --checkpoint runs/<run_id>/checkpoints/step_000004

``workflows/launch_plans.py`` schedules it on the newest checkpoint.
"""

from __future__ import annotations

from flytekit import workflow

from tasks.evaluate import evaluate as evaluate_checkpoint
from tasks.evaluate import find_checkpoint
from tasks.run_config import RunConfig


@workflow
def evaluate(cfg: RunConfig = RunConfig(), run_id: str = "", checkpoint: str = "") -> float:
    """Greedy accuracy (share of correct answers) of a checkpoint on the config's held-out questions.

    Args:
        cfg: the config of the run that wrote the checkpoint (``dataplane.root``, ``model``, ``data``, ``tracking``).
        run_id: evaluate this run's newest complete checkpoint.
        checkpoint: or this checkpoint (a ``checkpoints/step_N`` URL); with neither, the newest checkpoint of any run.
    """
    run = find_checkpoint(cfg=cfg, run_id=run_id, checkpoint=checkpoint)
    return evaluate_checkpoint(cfg=cfg, run=run)
