"""The trajectory collector's weight copies (``tasks.trajectories.copy_weights``): on the device the trainer's weights
live on, in the generation engine's dtype, never through the host, and independent of the trainer's later updates; and
the collector hands the engine's memory to the trainer while it waits for a version. The accelerator is
``tests/fake_device.py``'s (CPU numbers, device/host traffic recorded); the stream synchronisation is CUDA-only."""

from __future__ import annotations

import threading

import torch

from dataplane.meta import KVBatchMeta
from rl.backends.interfaces import PolicyVersion
from rl.config import config_from_dict
from tasks.run_config import RunConfig
from tasks.trajectories import TrajectoryCollector, copy_dtype, copy_weights
from tasks.types import RunInfo
from tests.fake_device import DEVICE, OnDevice, fake_device


def test_device_weights_are_copied_on_the_device_in_the_engines_dtype():
    master = {"w": torch.randn(4, 3), "b": torch.randn(3), "steps": torch.tensor([7])}
    with fake_device() as dev:
        on_device = {k: v.to(DEVICE) for k, v in master.items()}
        uploads = len(dev.uploads)
        copies = copy_weights(on_device.items(), cuda_dtype=torch.bfloat16)
        assert all(isinstance(t, OnDevice) for t in copies.values())  # stayed on the device
        assert (dev.syncs, len(dev.uploads)) == ([], uploads)  # no device -> host or host -> device copy
        on_device["w"].add_(1.0)  # the trainer moves on
        got = {k: v.elem.clone() for k, v in copies.items()}
    assert list(got) == ["w", "b", "steps"]
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], master["w"].to(torch.bfloat16))
    assert torch.equal(got["b"], master["b"].to(torch.bfloat16))
    assert got["steps"].dtype == torch.int64 and torch.equal(got["steps"], master["steps"])  # integers as they are


def test_host_weights_are_copied_as_they_are():
    master = {"w": torch.randn(4, 3)}
    before = master["w"].clone()
    copies = copy_weights(master.items(), cuda_dtype=torch.bfloat16)
    master["w"].add_(1.0)
    assert copies["w"].dtype == torch.float32 and torch.equal(copies["w"], before)
    assert copies["w"].data_ptr() != master["w"].data_ptr()


def test_the_copy_dtype_is_bfloat16_where_the_gpu_serves_it():
    assert copy_dtype(config_from_dict({"model": {"precision": "bfloat16"}}, RunConfig)) == torch.bfloat16
    assert copy_dtype(config_from_dict({"model": {"precision": "float32"}}, RunConfig)) is None


class _Recorder:
    def __init__(self) -> None:
        self.weight_version: int | None = None
        self.received: list[dict[str, torch.Tensor]] = []

    def refit(self, version: PolicyVersion, *, weights=None) -> None:
        if weights is not None:
            self.received.append({k: v.clone() for k, v in weights})
        self.weight_version = version.step

    def produce(self, gen, step: int) -> KVBatchMeta:
        return KVBatchMeta(
            partition_id=f"step_{step:06d}",
            sample_ids=[f"s{step}"],
            extra_info={"rollout/weight_version": float(gen.weight_version)},
        )


def test_the_collector_refits_from_its_copy_and_releases_the_engine_while_it_waits():
    cfg = config_from_dict(
        {
            "grpo": {"max_num_steps": 3, "max_trajectory_age_steps": 1},
            "loss": {"use_importance_sampling_correction": True},
        },
        RunConfig,
    )
    run = RunInfo(run_id="r", mlflow_run_id="0" * 32, model_path="/m", start_step=0, start_policy_path="/m")
    gen, waiting, releases = _Recorder(), threading.Event(), []

    def release() -> None:
        releases.append(gen.weight_version)
        waiting.set()

    c = TrajectoryCollector(
        cfg, run, gen, produce=gen.produce, reuse=lambda step: None, release=release, cuda_dtype=torch.bfloat16
    ).start_collection()
    try:
        assert c.take(1, timeout=10).weight_version == 0 and c.take(2, timeout=10).weight_version == 0
        assert waiting.wait(10)  # step 3 needs version 1, not published: the engine's memory goes to the trainer
        assert releases == [0]  # once, only before waiting (steps 1 and 2 had their version ready)
        trained = {"w": torch.ones(2)}
        c.set_weight_version(PolicyVersion(step=1, path="/w/1"), trained.items())
        trained["w"].add_(5.0)  # the trainer moves on right away
        assert c.take(3, timeout=10).weight_version == 1
    finally:
        c.stop()
    assert len(gen.received) == 1 and torch.equal(gen.received[0]["w"], torch.ones(2))  # host: float32 as given


def test_no_release_while_another_user_holds_the_engine_and_a_release_holds_off_that_user():
    cfg = config_from_dict(
        {
            "grpo": {"max_num_steps": 3, "max_trajectory_age_steps": 1},
            "loss": {"use_importance_sampling_correction": True},
        },
        RunConfig,
    )
    run = RunInfo(run_id="r", mlflow_run_id="0" * 32, model_path="/m", start_step=0, start_policy_path="/m")
    gen = _Recorder()
    c = TrajectoryCollector(cfg, run, gen, produce=gen.produce, reuse=lambda step: None, release=lambda: None)
    assert not c._begin_release(0)  # the start version is published: it generates at once, nothing to release
    c.pause()
    assert not c._begin_release(1)  # a validation holds the engine: its refit and generate must not lose it
    c.resume()
    assert c._begin_release(1)  # waiting for version 1: the release counts as a batch in flight ...
    prepared = threading.Event()
    other = threading.Thread(target=lambda: (c.prepare_for_refit(), prepared.set()))
    other.start()
    assert not prepared.wait(0.2)  # ... so another user waits for it
    c._end_release()
    other.join(10)
    assert prepared.is_set()
