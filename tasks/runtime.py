"""Process-local state of a run's tasks: the data-plane client, the base model's local folder, the tokenizer, and
the back-ends cached per (run, role), so a local run loads each model once and refits generation from the live
trainer in place. On a cluster every task starts cold and loads what it needs from storage: the base model through
the node's model cache (:func:`base_model`), checkpoints from the run's storage. Tasks take the client, tokenizer and
back-ends from here and pass them down to the code they call, which never reaches into this module.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from rl.backends import registry
from rl.backends.interfaces import GenerationBackend, PolicyBackend
from rl.model import load_tokenizer
from tasks.run_config import RunConfig
from tasks.types import PolicyVersion, RunInfo

if TYPE_CHECKING:
    from tasks.trajectories import TrajectoryCollector

_BACKENDS: dict[tuple[str, str], Any] = {}
"""(run_id, role) -> back-end object; roles ``generation`` and ``policy``."""

_BASE_MODELS: dict[str, str] = {}
"""``RunInfo.model_path`` -> the local folder (or hub id) this process loads it from (:func:`base_model`)."""

_COLLECTORS: dict[str, TrajectoryCollector] = {}
"""run_id -> the run's background trajectory collector in this process (async GRPO in a local run)."""

COLLECTOR_ENV = "GRPOFLOW_COLLECTOR"
"""``auto`` (default): a local run with ``grpo.max_trajectory_age_steps`` > 0 generates in the background; ``off``:
the rollout task generates, as on a cluster; ``on``: the collector also at a = 0 (tests: it must equal the sync run)."""

_TASKS_STARTED = 0
"""Tasks begun in this process (:func:`begin_task`)."""


def begin_task() -> float:
    """Mark the start of a task; returns the moment its startup counts from (unix seconds): the process's start
    for the first task of a process (a pod: interpreter, imports, flytekit's input download included), else now
    (a warm process: only what the task itself loads)."""
    global _TASKS_STARTED
    _TASKS_STARTED += 1
    if _TASKS_STARTED == 1:
        import psutil

        return psutil.Process().create_time()
    return time.time()


def startup_metric(task: str, since: float) -> dict[str, float]:
    """``{"timing/<task>/startup": seconds}`` from ``since`` (:func:`begin_task`) to now, the task's first useful
    work: call it once imports, model and state loads are done."""
    return {f"timing/{task}/startup": time.time() - since}


def set_threads() -> None:
    """torch's intra-op threads: ``GRPOFLOW_NUM_THREADS`` shared out among the ranks a data-parallel task runs on this
    node (torch elastic's ``LOCAL_WORLD_SIZE``), so that they do not oversubscribe it. Unset: torch's default, which
    for ranks is 1 thread each (the launcher sets ``OMP_NUM_THREADS=1`` when it is unset, as torchrun does)."""
    import torch

    threads = int(os.environ.get("GRPOFLOW_NUM_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(max(1, threads // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def dataplane(cfg: RunConfig, run: RunInfo):
    from dataplane.client import DataPlane

    return DataPlane(cfg.dataplane.root, run.run_id, storage_options=cfg.dataplane.storage_options)


def base_model(cfg: RunConfig, run: RunInfo) -> str:
    """The run's base model (``run.model_path``, also the reference policy) as a local folder this process loads.

    A model published on the run's storage (``{root}/models/{digest}``, :func:`rl.model_store.publish`: what a
    remote execution's ``start_run`` hands on) is downloaded once per node into the node's model cache
    (``$GRPOFLOW_MODEL_CACHE``, :func:`rl.model_store.cache_root`) and checked against its manifest; a local folder
    or hub id (a local run, or a handle from before models were published) is used as it is. Resolved once per
    process.

    Raises:
        ValueError, dataplane.errors.IntegrityError, storage errors: as :func:`rl.model_store.materialize` (a
            remote ``model_path`` that is not a complete published model, or a download that fails its manifest).
    """
    found = _BASE_MODELS.get(run.model_path)
    if found is None:
        from rl.model_store import materialize

        found = _BASE_MODELS[run.model_path] = materialize(run.model_path, cfg.dataplane.storage_options)
    return found


def base_tokenizer(cfg: RunConfig, run: RunInfo) -> Any:
    """The tokenizer of the run's base model (:func:`base_model`, :func:`tokenizer`)."""
    return tokenizer(base_model(cfg, run))


def _local_base(cfg: RunConfig, run: RunInfo, version: PolicyVersion) -> PolicyVersion:
    """``version`` with the base model's node-cache folder as its path when it names the base model (step 0 of a
    new run), so that back-ends load it from the node cache instead of copying it from storage again."""
    if version.path == run.model_path:
        return replace(version, path=base_model(cfg, run))
    return version


@lru_cache(maxsize=4)
def tokenizer(path: str) -> Any:
    """The tokenizer of the local model folder (or hub id) ``path``, loaded once per process."""

    return load_tokenizer(path)


def generation(cfg: RunConfig, run: RunInfo, policy: PolicyVersion) -> GenerationBackend:
    """The run's generation back-end holding the weights of ``policy``.

    It refits only when it holds another version: in place from the live policy back-end when that one is at
    ``policy.step`` (a warm process: no disk round trip), else from ``policy.path`` (a cold one).
    """
    gen = _generation_backend(cfg, run)
    if gen.weight_version != policy.step:
        live = _BACKENDS.get((run.run_id, "policy"))
        warm = live is not None and live.weight_version == policy.step
        gen.refit(_local_base(cfg, run, policy), weights=live.named_weights() if warm else None)
    return gen


def _generation_backend(cfg: RunConfig, run: RunInfo) -> GenerationBackend:
    gen = _BACKENDS.get((run.run_id, "generation"))
    if gen is None:
        cls = registry.load("generation", cfg.generation.backend)
        base = base_model(cfg, run)
        # vLLM sleeps between rollouts where a trainer in this process computes on the same GPU (settings.py)
        extra = {"shares_gpu": shares_trainer_gpu(cfg, run)} if cfg.generation.backend == "vllm" else {}
        gen = _BACKENDS[(run.run_id, "generation")] = cls(cfg, tokenizer=tokenizer(base), model_path=base, **extra)
    return gen


def shares_trainer_gpu(cfg: RunConfig, run: RunInfo) -> bool:
    """Whether this process's generation engine shares its device with a trainer in the same process: a local run
    (one process for every task), or steps run together in one task (``resources.steps_per_task`` > 1); not a
    cluster's rollout pod, which holds its GPU alone."""
    return not run.cold_tasks or cfg.resources.steps_per_task > 1


def collector(cfg: RunConfig, run: RunInfo) -> TrajectoryCollector | None:
    """The run's background trajectory collector in this process, started on first use (async GRPO in a local run).

    None where the rollout task generates its batch itself: tasks run cold (a cluster, where the DAG overlaps the
    steps, or data-parallel ranks in processes of their own), ``grpo.max_trajectory_age_steps`` is 0, or
    ``GRPOFLOW_COLLECTOR=off`` (see :data:`COLLECTOR_ENV`). A collector left by an earlier attempt of the run that
    started elsewhere (an in-process resume) is stopped and replaced.

    Raises:
        ValueError: ``GRPOFLOW_COLLECTOR`` is not ``auto``, ``on`` or ``off``.
    """
    mode = os.environ.get(COLLECTOR_ENV, "auto") or "auto"
    if mode not in ("auto", "on", "off"):
        msg = f"{COLLECTOR_ENV}={mode!r}: use auto (the default), on or off"
        raise ValueError(msg)
    if run.cold_tasks or mode == "off" or (mode == "auto" and cfg.grpo.max_trajectory_age_steps == 0):
        return None
    found = _COLLECTORS.get(run.run_id)
    if found is not None and found.start_step != run.start_step:  # left by an earlier attempt of the run (a resume)
        _COLLECTORS.pop(run.run_id).stop()
        found = None
    if found is None:
        from rl.step import rollout_to_batch
        from tasks.trajectories import TrajectoryCollector, buffered_batch, copy_dtype

        gen, tok, dp = _generation_backend(cfg, run), base_tokenizer(cfg, run), dataplane(cfg, run)
        found = TrajectoryCollector(
            cfg,
            run,
            gen,
            produce=lambda generator, step: rollout_to_batch(generator, tok, cfg, dataplane=dp, step=step),
            reuse=lambda step: buffered_batch(cfg, dp, step),
            release=_engine_release(cfg, run, gen),
            cuda_dtype=copy_dtype(cfg),
        )
        _COLLECTORS[run.run_id] = found.start_collection()
    return found


def _engine_release(cfg: RunConfig, run: RunInfo, gen: GenerationBackend) -> Any:
    """The generation back-end's ``release_memory`` where it is a vLLM engine beside a trainer in this process (it
    then sleeps while the trainer computes), else None."""
    if cfg.generation.backend == "vllm" and shares_trainer_gpu(cfg, run):
        return gen.release_memory  # type: ignore[attr-defined]
    return None


def make_room_for_trainer(cfg: RunConfig, run: RunInfo) -> None:
    """Before the trainer of ``run`` loads or computes in this process: a vLLM engine that shares its GPU starts
    first if it has not (its start needs its share of the GPU free: ``VLLMGeneration.start``), then sleeps, its
    weights discarded, so that the trainer has the memory (``VLLMGeneration.release_memory``). With a trajectory
    collector, whose thread drives the engine, only the start: the collector puts it to sleep when it waits. A no-op
    for the transformers back-end, on the CPU, and for a rollout pod's engine, which has its GPU alone."""
    release = None if cfg.generation.backend != "vllm" else _engine_release(cfg, run, _generation_backend(cfg, run))
    if release is None:
        return
    gen = _generation_backend(cfg, run)
    gen.start()  # type: ignore[attr-defined]
    if run.run_id not in _COLLECTORS:
        release()


def publish(run: RunInfo, version: PolicyVersion) -> None:
    """Hand the policy of ``version`` to the run's collector in this process, if there is one, with a copy of the live
    trainer's weights when it holds that version (else the collector loads ``version.path`` when it needs it)."""
    found = _COLLECTORS.get(run.run_id)
    if found is None:
        return
    live = _BACKENDS.get((run.run_id, "policy"))
    weights = live.named_weights() if live is not None and live.weight_version == version.step else None
    found.set_weight_version(version, weights)


@contextmanager
def generation_exclusive(run: RunInfo) -> Iterator[None]:
    """Hold the run's generation back-end away from its collector (which waits for its batch in flight, starts none,
    and refits back to its own version afterwards); a no-op without a collector."""
    found = _COLLECTORS.get(run.run_id)
    if found is None:
        yield
        return
    found.prepare_for_refit()
    try:
        yield
    finally:
        found.resume_after_refit()


def policy(
    cfg: RunConfig, run: RunInfo, version: PolicyVersion | None = None, *, training: bool = False
) -> PolicyBackend:
    """The run's policy back-end; with ``version``, holding those weights (and, with ``training``, their optimizer
    state). Without ``version`` it may hold none: enough for reference-policy logprobs.

    Raises:
        RuntimeError: ``training`` but no optimizer state for ``version`` exists in this process or on storage.
    """

    make_room_for_trainer(cfg, run)
    pol = _BACKENDS.get((run.run_id, "policy"))
    if pol is None:
        cls = registry.load("policy", cfg.policy.backend)
        base = base_model(cfg, run)  # the reference policy too: from the node cache
        pol = _BACKENDS[(run.run_id, "policy")] = cls(cfg, tokenizer=tokenizer(base), reference_path=base)
    if version is not None and (
        pol.weight_version != version.step or (training and not pol.has_optimizer_state(version))
    ):
        pol.load_checkpoint(_local_base(cfg, run, version), with_optimizer=training)
    return pol


def holds_trainer(run: RunInfo, version: PolicyVersion) -> bool:
    """Whether this process's policy back-end of ``run`` holds ``version`` with its optimizer state."""
    pol = _BACKENDS.get((run.run_id, "policy"))
    return pol is not None and pol.weight_version == version.step and pol.has_optimizer_state(version)


def discard(run: RunInfo, role: str) -> None:
    """Shut down and forget this process's ``role`` back-end of ``run`` (after a failed update it may be half-way)."""
    backend = _BACKENDS.pop((run.run_id, role), None)
    if backend is not None:
        backend.shutdown()


def release_all() -> None:
    """Stop every collector and shut down every back-end of this process (a local run failed: ``tasks.failure``; a
    resume loads what it needs again)."""
    for run_id in list(_COLLECTORS):
        _COLLECTORS.pop(run_id).stop()
    for key in list(_BACKENDS):
        _BACKENDS.pop(key).shutdown()


def release(run: RunInfo) -> None:
    """Stop the run's collector and shut down every back-end of ``run`` in this process (the run is over)."""
    found = _COLLECTORS.pop(run.run_id, None)
    if found is not None:
        found.stop()
    for role in ("generation", "policy"):
        discard(run, role)
