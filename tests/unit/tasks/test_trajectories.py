"""The trajectory collector (``tasks/trajectories.py``) driven with a recording generation back-end: which version
generates which step, refits, the pause around another user's refit, errors, stop and batches found again."""

from __future__ import annotations

import threading
import time

import pytest

from dataplane.meta import KVBatchMeta
from rl.backends.interfaces import PolicyVersion
from rl.config import config_from_dict
from tasks.trajectories import TrajectoryCollector
from tasks.types import RunInfo


class Recorder:
    """A generation back-end that records refits; ``produce`` records which version generated which step."""

    def __init__(self) -> None:
        self.weight_version: int | None = None
        self.refits: list[tuple[int, bool]] = []  # (version, from a weight copy)
        self.made: list[tuple[int, int]] = []  # (step, version)

    def refit(self, version: PolicyVersion, *, weights=None) -> None:
        self.refits.append((version.step, weights is not None))
        self.weight_version = version.step

    def produce(self, gen: Recorder, step: int) -> KVBatchMeta:
        assert gen is self
        self.made.append((step, gen.weight_version))
        return KVBatchMeta(
            partition_id=f"step_{step:06d}",
            sample_ids=[f"s{step}"],
            extra_info={"rollout/weight_version": float(gen.weight_version)},
        )


def _collector(age: int, steps: int, gen: Recorder, *, start: int = 0, produce=None, reuse=None) -> TrajectoryCollector:
    cfg = config_from_dict(
        {
            "grpo": {"max_num_steps": steps, "max_trajectory_age_steps": age},
            "loss": {"use_importance_sampling_correction": age > 0},
        }
    )
    run = RunInfo(
        run_id="run-1",
        mlflow_run_id="0" * 32,
        model_path="/models/base",
        start_step=start,
        start_policy_path=f"/ckpt/{start}",
    )
    return TrajectoryCollector(
        cfg, run, gen, produce=produce or gen.produce, reuse=reuse or (lambda step: None)
    ).start_collection()


def _publish(c: TrajectoryCollector, step: int) -> None:
    c.set_weight_version(PolicyVersion(step=step, path=f"/weights/{step}"), [("w", __import__("torch").zeros(1))])


def test_each_step_is_generated_by_its_version_once_that_version_is_published():
    gen = Recorder()
    c = _collector(1, 4, gen)
    try:
        assert c.take(1, timeout=10).weight_version == 0
        assert c.take(2, timeout=10).weight_version == 0  # a = 1: step 2 from the start policy too
        with pytest.raises(TimeoutError, match="no batch for step 3"):
            c.take(3, timeout=0.3)  # version 1 is not published: the collector waits, and so does training
        _publish(c, 1)
        assert c.take(3, timeout=10).weight_version == 1
        _publish(c, 2)
        assert c.take(4, timeout=10).weight_version == 2
    finally:
        c.stop()
    assert gen.made == [(1, 0), (2, 0), (3, 1), (4, 2)]
    # the start policy loads from its path once; later ones from the copies the trainer handed over
    assert gen.refits == [(0, False), (1, True), (2, True)]


def test_prepare_for_refit_waits_for_the_batch_in_flight_and_holds_new_ones_until_resumed():
    gen = Recorder()
    release = threading.Event()
    started = threading.Event()

    def slow(g: Recorder, step: int) -> KVBatchMeta:
        if step == 2:
            started.set()
            assert release.wait(10)
        return gen.produce(g, step)

    c = _collector(1, 3, gen, produce=slow)
    try:
        c.take(1, timeout=10)
        assert started.wait(10)  # step 2 is in flight
        done = threading.Event()
        threading.Thread(target=lambda: (c.prepare_for_refit(), done.set()), daemon=True).start()
        assert not done.wait(0.3)  # waits for step 2
        release.set()
        assert done.wait(10)
        _publish(c, 1)
        gen.refit(PolicyVersion(step=7, path="/validation"))  # another user of the back-end (a validation)
        time.sleep(0.3)
        assert [s for s, _ in gen.made] == [1, 2]  # paused: step 3 has not started
        c.resume_after_refit()
        assert c.take(3, timeout=10).weight_version == 1  # refitted back from the validation's weights
    finally:
        c.stop()
    assert gen.made == [(1, 0), (2, 0), (3, 1)]


def test_an_error_on_the_thread_reaches_the_trainer_naming_the_step():
    gen = Recorder()

    def broken(g: Recorder, step: int) -> KVBatchMeta:
        if step == 2:
            raise OSError("disk full")
        return gen.produce(g, step)

    c = _collector(1, 3, gen, produce=broken)
    assert c.take(1, timeout=10).weight_version == 0
    with pytest.raises(
        RuntimeError, match="the trajectory collector failed generating step 2: OSError: disk full"
    ) as err:
        c.take(2, timeout=10)
    assert isinstance(err.value.__cause__, OSError)
    c.stop()


def test_stop_ends_the_thread_and_a_later_take_says_so():
    gen = Recorder()
    c = _collector(1, 5, gen)
    c.take(1, timeout=10)
    c.take(2, timeout=10)
    c.stop()  # it was waiting for version 1
    assert not c._thread.is_alive()
    with pytest.raises(RuntimeError, match="stopped before it generated step 3"):
        c.take(3, timeout=10)


def test_batches_found_in_the_data_plane_are_taken_not_generated_again():
    """A resume from step 2 with a = 2: steps 3 and 4 were buffered before the stop (versions 0 and 1)."""
    gen = Recorder()
    found = {3: 0, 4: 1}

    def reuse(step: int) -> KVBatchMeta | None:
        if step not in found:
            return None
        return KVBatchMeta(
            partition_id=f"step_{step:06d}",
            sample_ids=[f"s{step}"],
            extra_info={"rollout/weight_version": float(found[step])},
        )

    c = _collector(2, 5, gen, start=2, reuse=reuse)
    try:
        assert [c.take(k, timeout=10).weight_version for k in (3, 4, 5)] == [0, 1, 2]
    finally:
        c.stop()
    assert gen.made == [(5, 2)]  # only step 5 was generated, by the checkpoint's policy
    assert gen.refits == [(2, False)]
