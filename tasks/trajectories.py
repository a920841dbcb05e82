"""A step's rollout batch found again in the data plane (sealed), and the in-process trajectory collector that
generates later steps in the background while a local run trains (async GRPO). Generating a batch is
:func:`rl.step.rollout_to_batch`.

On a cluster the Flyte DAG gives the overlap (``workflows/grpo.py``: the rollout of step k waits only for the policy
of step k - a); in one process the tasks run one after another, so :class:`TrajectoryCollector` generates on a thread
of its own and the rollout task takes its batch from the replay buffer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from dataplane import paths
from dataplane.meta import KVBatchMeta
from rl.async_grpo import ReplayBuffer, Trajectories, generation_version, target_steps, trajectory_age
from rl.backends.interfaces import GenerationBackend, PolicyVersion
from tasks.run_config import RunConfig
from tasks.types import RunInfo

if TYPE_CHECKING:
    from dataplane.client import DataPlane


def copy_weights(
    weights: Iterable[tuple[str, torch.Tensor]], *, cuda_dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """A copy of ``weights`` (HF name -> tensor) the trainer may overwrite the originals of as soon as this returns.

    Each tensor is copied on its own device: a CUDA tensor (any accelerator's) stays on its GPU (a device-to-device
    copy, no host round trip) and, with ``cuda_dtype``, floating-point ones are cast to it on the way (the generation
    engine's dtype: bfloat16 halves a float32 master's bytes, and both back-ends cast to it when they load anyway, so
    the values are the ones a refit from the originals would give); host tensors are copied as they are. The copies on
    a GPU are enqueued on its current stream, which is synchronized before returning, so neither the trainer's later
    in-place updates nor another thread's stream can see them half-written. They take device memory (one model in
    ``cuda_dtype`` per version the collector still needs) where the old host copies took host memory.

    Args:
        weights: (name, tensor) pairs, e.g. ``PolicyBackend.named_weights()``.
        cuda_dtype: dtype of the copies of floating-point CUDA tensors (None: their own).

    Returns:
        name -> copy, in the order given.
    """
    out: dict[str, torch.Tensor] = {}
    devices: set[torch.device] = set()
    for name, tensor in weights:
        t = tensor.detach()
        if t.device.type != "cpu":  # an accelerator (CUDA; tests' fake device): stay there
            devices.add(t.device)
            dtype = cuda_dtype if cuda_dtype is not None and t.is_floating_point() else t.dtype
            out[name] = t.to(dtype=dtype, copy=True)
        else:
            out[name] = t.to("cpu", copy=True)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    return out


def copy_dtype(cfg: RunConfig) -> torch.dtype | None:
    """The dtype of the collector's CUDA weight copies (:func:`copy_weights`): bfloat16 where ``model.precision``
    resolves to it on CUDA (both generation back-ends then serve bfloat16 weights), else None (as the trainer holds
    them)."""
    from rl.precision import resolve

    return torch.bfloat16 if resolve(cfg.model.precision, "cuda") == "bfloat16" else None


def buffered_batch(cfg: RunConfig, dataplane: DataPlane, step: int) -> KVBatchMeta | None:
    """``step``'s sealed batch if the data plane holds one young enough for the age bound (a resumed run finds the
    batches generated before it stopped); a batch too old for the bound is evicted (cleared). None: none usable."""
    partition = paths.step_partition(step)
    meta = dataplane.sealed(partition)
    if meta is None:
        return None
    version = int(meta.extra_info["rollout/weight_version"])
    age = trajectory_age(step, version)
    if 0 <= age <= cfg.grpo.max_trajectory_age_steps:
        print(
            f"[grpoflow] step {step}: taking the batch buffered in the data plane "
            f"(weight version {version}, age {age})",
            flush=True,
        )
        return meta
    dataplane.clear(partition)
    print(
        f"[grpoflow] step {step}: evicted a buffered batch {age} steps old (bound {cfg.grpo.max_trajectory_age_steps})",
        flush=True,
    )
    return None


class TrajectoryCollector:
    """Generates the rollouts of steps ``start_step + 1 ..`` on a background thread, each with the weight version
    :func:`rl.async_grpo.generation_version` gives it, as soon as that version is published, into the data plane and
    a :class:`ReplayBuffer` (NeMo-RL's ``AsyncTrajectoryCollector``, ``reference/seeds/trajectory_collector.txt``).

    Versions arrive by :meth:`set_weight_version`: the train task of this process publishes each new policy with a copy
    of its weights (a collector runs only where the trainer is in the same process: one rank, warm tasks). Only
    published versions are used, never a folder found on storage (a killed run may have left newer ones behind).
    :meth:`prepare_for_refit` / :meth:`resume_after_refit` bracket another user of the generation back-end (a
    validation): no new batch starts, the one in flight finishes first.

    Args:
        cfg: the run's config (``grpo.max_trajectory_age_steps`` = a).
        run: the run; ``run.start_step`` and ``run.start_policy_path`` are the first version.
        generator: the generation back-end this collector drives (shared with validation, see above).
        produce: ``(generator, step) -> meta``: generate and write one step's batch (:func:`rl.step.rollout_to_batch`).
        reuse: ``step -> meta or None``: a batch already in the data plane (:func:`buffered_batch`).
        release: called on the collector's thread before it waits for a version not yet published: the generation
            back-end hands its device memory to the trainer meanwhile (vLLM beside a trainer:
            ``VLLMGeneration.release_memory``). None: nothing to release.
        cuda_dtype: dtype of the weight copies :meth:`set_weight_version` makes of CUDA tensors (:func:`copy_dtype`).
    """

    def __init__(
        self,
        cfg: RunConfig,
        run: RunInfo,
        generator: GenerationBackend,
        *,
        produce: Callable[[GenerationBackend, int], KVBatchMeta],
        reuse: Callable[[int], KVBatchMeta | None],
        release: Callable[[], object] | None = None,
        cuda_dtype: torch.dtype | None = None,
    ) -> None:
        self.max_age = cfg.grpo.max_trajectory_age_steps
        self.start_step = run.start_step
        self.max_num_steps = cfg.grpo.max_num_steps
        self.buffer = ReplayBuffer(self.max_age)
        self._generator = generator
        self._produce = produce
        self._reuse = reuse
        self._release = release
        self._cuda_dtype = cuda_dtype
        self._cond = threading.Condition()
        self._versions: dict[int, tuple[PolicyVersion, dict[str, torch.Tensor] | None]] = {
            run.start_step: (PolicyVersion(step=run.start_step, path=run.start_policy_path), None)
        }
        self._paused = False
        self._busy = False
        self._stop = False
        self._thread = threading.Thread(target=self._collection_loop, name="trajectory-collector", daemon=True)

    # ---------------------------------------------------------------- control
    def start_collection(self) -> TrajectoryCollector:
        self._thread.start()
        return self

    def set_weight_version(
        self, version: PolicyVersion, weights: Iterable[tuple[str, torch.Tensor]] | None = None
    ) -> None:
        """Publish the policy of ``version.step``; ``weights`` (HF names) are copied now (:func:`copy_weights`: on
        their own device, CUDA tensors in the generation engine's dtype), so the trainer may move on."""
        if self.max_age and not target_steps(version.step, self.max_age, self.start_step, self.max_num_steps):
            weights = None  # no step left to generate with it
        copy = None if weights is None else copy_weights(weights, cuda_dtype=self._cuda_dtype)
        with self._cond:
            self._versions[version.step] = (version, copy)
            self._cond.notify_all()

    def pause(self) -> None:
        """No new batch starts until :meth:`resume`; one in flight goes on."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def prepare_for_refit(self) -> None:
        """Pause, then wait until the batch in flight (if any) is written: the generation back-end is free."""
        with self._cond:
            self._paused = True
            while self._busy:
                self._cond.wait()

    def resume_after_refit(self) -> None:
        """Resume after :meth:`prepare_for_refit`; the next batch refits the back-end to its own version first."""
        self.resume()

    def stop(self) -> None:
        """End the thread after the batch in flight (it is written; later ones are not generated)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def take(self, step: int, *, timeout: float | None = None) -> Trajectories:
        """Step ``step``'s batch, waiting until it is generated; batches no later step may use are evicted first.

        Raises:
            RuntimeError: the collector failed generating a step (naming it; its error is the cause) or was stopped.
            TimeoutError: nothing within ``timeout`` seconds.
        """
        self.buffer.evict(step)

        def alive() -> None:
            if not self._thread.is_alive():
                msg = f"the trajectory collector stopped before it generated step {step}"
                raise RuntimeError(msg)

        return self.buffer.take(step, timeout=timeout, poll=alive)

    # ---------------------------------------------------------------- the thread
    def _collection_loop(self) -> None:
        step = self.start_step
        try:
            for step in range(self.start_step + 1, self.max_num_steps + 1):
                version = generation_version(step, self.max_age, self.start_step)
                if self._release is not None and self._begin_release(version):
                    try:
                        self._release()  # idle until the trainer publishes it: the trainer gets the memory meanwhile
                    finally:
                        self._end_release()
                if not self._wait_for(version):
                    return
                t0 = time.time()
                meta = self._reuse(step)
                if meta is None:
                    self._refit(version)
                    meta = self._produce(self._generator, step)
                    version_used = version
                else:
                    version_used = int(meta.extra_info["rollout/weight_version"])
                self._forget_before(version)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                self.buffer.add(
                    Trajectories(step=step, weight_version=version_used, meta=meta, generation_s=time.time() - t0)
                )
        except BaseException as err:  # noqa: BLE001 - handed to the trainer, which raises it
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            failure = RuntimeError(
                f"the trajectory collector failed generating step {step}: {type(err).__name__}: {err}"
            )
            failure.__cause__ = err
            self.buffer.fail(failure)

    def _begin_release(self, version: int) -> bool:
        """Whether to release the generation back-end's memory before waiting for ``version``: it is not published,
        and nobody else uses the back-end (not paused, not stopped). If so, the release counts as a batch in flight,
        so that :meth:`prepare_for_refit` waits for it before another user refits and generates."""
        with self._cond:
            if version in self._versions or self._paused or self._stop:
                return False
            self._busy = True
            return True

    def _end_release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def _wait_for(self, version: int) -> bool:
        """Block until ``version`` is published and the collector is not paused, then mark a batch in flight. False:
        stopped."""
        with self._cond:
            while self._stop or version not in self._versions or self._paused:
                if self._stop:
                    return False
                self._cond.wait()
            self._busy = True
            return True

    def _refit(self, version: int) -> None:
        if self._generator.weight_version == version:
            return
        policy, weights = self._versions[version]
        self._generator.refit(policy, weights=None if weights is None else weights.items())

    def _forget_before(self, version: int) -> None:
        """Drop the weight copies of versions older than ``version``: no later step generates with them."""
        with self._cond:
            for v in [v for v in self._versions if v < version]:
                del self._versions[v]
