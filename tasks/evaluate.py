"""`find_checkpoint` and `evaluate`: greedy held-out accuracy of a saved checkpoint, outside a training run
(launched by hand, or by the scheduled launch plan of ``workflows/evaluate.py``)."""

from __future__ import annotations

from flytekit import current_context, task

from dataplane import paths
from dataplane.errors import retry_transient
from dataplane.urls import redact
from tasks import runtime
from tasks.placement import declared
from tasks.retry import transient_errors_retried
from tasks.run_config import RunConfig
from tasks.types import PolicyVersion, RunInfo


@task(retries=2, **declared("cpu"))
@transient_errors_retried
def find_checkpoint(cfg: RunConfig, run_id: str = "", checkpoint: str = "") -> RunInfo:
    """The checkpoint to evaluate, as a run handle whose ``start_step``/``start_policy_path`` name it.

    Args:
        cfg: the config (``dataplane.root``, ``model.name``, ``tracking.uri``); a remote execution publishes the
            model to ``dataplane.root`` (:func:`tasks.setup.run_model`) for the evaluate task's pod.
        run_id: evaluate this run's newest complete checkpoint ...
        checkpoint: ... or this checkpoint URL (a ``checkpoints/step_N`` folder); with neither, the newest complete
            checkpoint of any run under ``dataplane.root`` (by the time its ``_COMPLETE`` marker was written).

    Raises:
        ValueError: both given, or no complete checkpoint with trainer state found where asked.
        OSError and storage errors: publishing the model failed.
    """
    from rl import checkpoint as ckpt
    from tasks.setup import run_model

    root, so = cfg.dataplane.root, cfg.dataplane.storage_options
    if run_id and checkpoint:
        msg = f"find_checkpoint: give run_id ({run_id!r}) or checkpoint ({redact(checkpoint)!r}), not both"
        raise ValueError(msg)
    if not checkpoint:
        checkpoint = _newest(root, so, run_id)
    if not ckpt.has_trainer_state(checkpoint, so):
        msg = (
            f"find_checkpoint: {redact(checkpoint)} is not a complete checkpoint with trainer state "
            "(a checkpoints/step_N folder)"
        )
        raise ValueError(msg)
    state = ckpt.trainer_state_doc(checkpoint, so)
    parent = checkpoint.rstrip("/").rsplit("/", 3)  # {root}/{run_id}/checkpoints/step_N
    owner = run_id or parent[-3]
    paths.check_name("run id", owner)
    model_path = run_model(
        cfg, local=current_context().execution_id.name == "local"
    )  # evaluate runs in a pod of its own
    print(f"[grpoflow] evaluating {redact(checkpoint)} (run {owner}, step {state['step']})", flush=True)
    return RunInfo(
        run_id=owner,
        mlflow_run_id=state["mlflow_run_id"],
        model_path=model_path,
        start_step=int(state["step"]),
        start_policy_path=checkpoint,
    )


def _newest(root: str, so: dict, run_id: str) -> str:
    """The newest complete checkpoint of ``run_id`` (by step), or of any run (by marker time) when it is empty."""
    import fsspec

    from rl import checkpoint as ckpt

    if run_id:
        found = ckpt.list_complete(paths.checkpoints_dir(root, run_id), so)
        if not found:
            msg = (
                f"find_checkpoint: run {run_id!r} has no complete checkpoint under "
                f"{redact(paths.checkpoints_dir(root, run_id))}"
            )
            raise ValueError(msg)
        return found[-1][1]
    fs, base = fsspec.core.url_to_fs(root, **so)
    markers = retry_transient(
        lambda: fs.glob(f"{base.rstrip('/')}/*/checkpoints/step_*/{ckpt.COMPLETE}", detail=True),
        what=f"{root}: list checkpoints",
    )
    if not markers:
        msg = f"find_checkpoint: no complete checkpoint of any run under {redact(root)}; check dataplane.root"
        raise ValueError(msg)

    def written(info: dict) -> float:
        t = info.get("mtime", info.get("LastModified", info.get("created", 0)))
        return t.timestamp() if hasattr(t, "timestamp") else float(t)

    path = max(markers, key=lambda p: (written(markers[p]), p)).rsplit("/", 1)[0]
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    return path if protocol in ("file", "local") else f"{protocol}://{path}"


@task(retries=2, **declared("rollout"))
@transient_errors_retried
def evaluate(cfg: RunConfig, run: RunInfo) -> float:
    """Greedy accuracy of the checkpoint ``run.start_policy_path`` on ``data.num_val_problems`` held-out questions;
    logs ``evaluation/accuracy`` (and ``evaluation/avg_length``, ``evaluation/reward``) at the checkpoint's step in
    the run's MLflow run, beside its training curves."""
    from tasks.validate import greedy_accuracy

    since = runtime.begin_task()
    policy = PolicyVersion(step=run.start_step, path=run.start_policy_path)
    try:
        return greedy_accuracy(cfg, run, policy, since=since, kind="evaluation", task="evaluate")
    finally:
        runtime.release(run)
