"""Which weights copy a policy save adds for the next step's generation pod (``tasks.saving.serving_dtype``)."""

from __future__ import annotations

import pytest

from tasks.run_config import run_config_from_dict
from tasks.runtime import shares_trainer_gpu
from tasks.saving import serving_dtype
from tasks.types import RunInfo


def _run(cold: bool) -> RunInfo:
    return RunInfo(run_id="r", mlflow_run_id="0" * 32, model_path="/m", cold_tasks=cold)


@pytest.mark.parametrize(
    ("cold", "rollout_gpu", "precision", "expected"),
    [
        (True, 1, "auto", "bfloat16"),  # a cluster with GPU rollouts: the pods load half the bytes
        (True, 1, "bfloat16", "bfloat16"),
        (True, 1, "float32", None),  # they compute in float32: they load the float32 master
        (True, 0, "auto", None),  # CPU rollouts resolve auto per CPU: no copy they might not use
        (False, 1, "auto", None),  # one process: the generator refits from the live trainer, nothing is loaded
    ],
)
def test_a_bf16_copy_only_where_cold_gpu_rollouts_compute_in_bf16(cold, rollout_gpu, precision, expected):
    cfg = run_config_from_dict({"model": {"precision": precision}, "resources": {"rollout": {"gpu": rollout_gpu}}})
    assert serving_dtype(cfg, _run(cold)) == expected


@pytest.mark.parametrize(("cold", "k", "expected"), [(False, 1, True), (True, 1, False), (True, 4, True)])
def test_the_generation_engine_shares_its_gpu_with_a_trainer_in_its_process(cold, k, expected):
    cfg = run_config_from_dict({"resources": {"steps_per_task": k}})
    assert shares_trainer_gpu(cfg, _run(cold)) is expected
