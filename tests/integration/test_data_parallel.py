"""The train and logprob tasks with two data-parallel ranks (``policy.nproc_per_node: 2``): gloo processes that
flytekitplugins-kfpytorch's ``Elastic`` launcher (torch elastic, as torchrun) spawns on this CPU, each reading only
its shard of the step. Tasks are called as Flyte's local executor calls them, step by step as ``grpo_step`` orders
them, with a tiny random model.

The tiny model never solves a problem, so every reward, hence every advantage, is 0 and the first update would
be driven by float noise alone (Adam normalizes any gradient to a step of ~lr): after ``advantages`` the test
replaces the column with fixed random advantages, in the same write the task made, so that the update has a
direction and the 1-rank and 2-rank updates can be compared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from flytekit.exceptions.base import FlyteRecoverableException

from dataplane import fields as F
from tasks.types import PolicyVersion
from tests.helpers import small_config
from tests.integration.test_retry import _metrics, _state

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEP_SHAPE = {
    "grpo": {"num_prompts_per_step": 3, "num_generations_per_prompt": 3},  # 9 samples: shards of 5 and 4
    "generation": {"max_new_tokens": 16},
    "optim": {"train_global_batch_size": 3, "train_micro_batch_size": 3},  # 3 updates: the policy_logprobs task runs
}


def _cfg(root: Path, model: str, ranks: int, loss: dict | None = None):
    return small_config(root, model, **STEP_SHAPE, policy={"nproc_per_node": ranks}, **({"loss": loss} if loss else {}))


def _set_advantages(cfg, run, meta) -> None:
    """Fixed random per-sequence advantages, written over the task's column (the same write id: it replaces it)."""
    from dataplane import fields as F
    from dataplane.client import DataPlane
    from dataplane.codec import to_nested_by_length

    dp = DataPlane(cfg.dataplane.root, run.run_id)
    batch = dp.read(meta, [F.TOKEN_MASK, F.INPUT_LENGTHS])
    g = torch.Generator().manual_seed(int(meta.partition_id[-1]))
    adv = torch.randn(meta.size(), 1, generator=g) * batch[F.TOKEN_MASK]  # [N, S]
    dp.write_columns(meta, {F.ADVANTAGES: to_nested_by_length(adv, batch[F.INPUT_LENGTHS])}, task_name="advantages")


@contextlib.contextmanager
def _rank_dies_once(drill: str, failures: list[str], check: Callable[..., None] | None = None) -> Iterator[None]:
    """Fault drill ``drill`` (``<task>:<rank>``) in a task's first attempt only, as a lost pod: once an attempt has
    failed the drill is taken out of the environment, so the retry's ranks (spawned afresh) run clean. The failed
    attempt's error goes to ``failures``, then ``check(**inputs)`` runs."""
    from tasks.data_parallel import FAULT_DRILL_ENV, DataParallelTask

    real = DataParallelTask._execute

    def first_attempt_dies(self, **inputs):
        try:
            return real(self, **inputs)
        except Exception as err:
            if os.environ.pop(FAULT_DRILL_ENV, None) is not None:
                failures.append(str(err))
                if check is not None:
                    check(**inputs)
            raise

    os.environ[FAULT_DRILL_ENV] = drill
    DataParallelTask._execute = first_attempt_dies
    try:
        yield
    finally:
        DataParallelTask._execute = real
        os.environ.pop(FAULT_DRILL_ENV, None)


def _attempts(task, drill: str | None, failures: list[str], **inputs):
    """Call ``task``; with a fault drill, that rank dies in its first attempt (recoverable) and the local executor
    retries the task with the same inputs, as Flyte does (``tasks.retry``). A failed train attempt must not have
    saved the step."""
    from tasks import saving

    def not_saved(cfg, run, policy, **_):  # rank 0 waited for the dead rank at the barrier: nothing was committed
        assert saving.saved_version(cfg, run, policy.step + 1) is None

    if drill is None:
        return task(**inputs)
    before = len(failures)
    with _rank_dies_once(drill, failures, check=not_saved if drill.startswith("train:") else None):
        out = task(**inputs)
    assert len(failures) == before + 1  # the drill fired, and the retry succeeded
    return out


def _run(cfg, *, drills: dict | None = None, failures: list | None = None, steps: tuple[int, ...] = (1, 2)):
    """GRPO ``steps``, task by task. Returns the run, its final policy, and per step the logprob columns by sample id
    and the weights the step saved."""
    from dataplane import fields as F
    from dataplane.client import DataPlane
    from tasks import runtime
    from tasks.advantages import advantages
    from tasks.logprobs import policy_logprobs, reference_logprobs
    from tasks.rollout import rollout
    from tasks.setup import start_run
    from tasks.train import train
    from tasks.types import PolicyVersion

    # every run here has one run id: a back-end left warm in this process by an earlier run (its weights, its config)
    # must not serve this one
    runtime.release_all()
    drills, failures = drills or {}, failures if failures is not None else []
    run = dataclasses.replace(start_run(cfg=cfg), run_id="run-dp-test")  # one id: sample ids hash it
    policy = PolicyVersion(step=0, path=run.start_policy_path)
    columns, weights = {}, {}
    for step in steps:
        batch = rollout(cfg=cfg, run=run, policy=policy, step=step)
        prev = _attempts(
            policy_logprobs,
            drills.get(("policy_logprobs", step)),
            failures,
            cfg=cfg,
            run=run,
            policy=policy,
            meta=batch,
        )
        ref = _attempts(
            reference_logprobs, drills.get(("reference_logprobs", step)), failures, cfg=cfg, run=run, meta=batch
        )
        adv = advantages(cfg=cfg, run=run, meta=batch)
        _set_advantages(cfg, run, adv)
        dp = DataPlane(cfg.dataplane.root, run.run_id)
        read = dp.read(batch.join(prev, ref), [F.PREV_LOGPROBS, F.REFERENCE_POLICY_LOGPROBS], layout="jagged")
        columns[step] = {k: dict(zip(batch.sample_ids, v.unbind(), strict=True)) for k, v in read.items()}
        # the visible reference-logprob writes: one per rank, also after a retried attempt
        columns[step]["ref_lp writes"] = sorted(
            c["write_id"] for c in dp._commits(dp._part(batch.partition_id)) if c["task_name"] == "ref_lp"
        )
        policy = _attempts(
            train,
            drills.get(("train", step)),
            failures,
            cfg=cfg,
            run=run,
            policy=policy,
            with_advantages=adv,
            with_prev_logprobs=prev,
            with_reference_logprobs=ref,
        )
        weights[step] = _weights(policy)
    return run, policy, columns, weights


def _weights(policy) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(policy.path) / "model.safetensors"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_model_dir):
    cfg = _cfg(tmp_path_factory.mktemp("two"), tiny_model_dir, 2)
    return cfg, *_run(cfg)


def test_two_ranks_train_as_one_rank_and_log_the_same_metrics(tmp_path, tiny_model_dir, two_ranks):
    """Step 1 is compared: both runs sample it from the same weights. Step 2's rollouts come from weights that differ
    in the 7th digit (float32 sums in another order), which may flip a sampled token: it is only checked to be there."""
    cfg2, run2, _, columns2, weights2 = two_ranks
    cfg1 = _cfg(tmp_path, tiny_model_dir, 1)
    run1, _, columns1, weights1 = _run(cfg1)

    assert len(columns1[1]["ref_lp writes"]) == 1 and len(columns2[1]["ref_lp writes"]) == 2
    # every rank's logprobs landed under their own sample ids: the same values as one rank's
    for field in (F.PREV_LOGPROBS, F.REFERENCE_POLICY_LOGPROBS):
        by_id = columns1[1][field]
        assert by_id.keys() == columns2[1][field].keys()
        for sid, values in by_id.items():
            torch.testing.assert_close(columns2[1][field][sid], values, atol=2e-6, rtol=0)

    w0 = _weights(PolicyVersion(0, run1.start_policy_path))
    moved = max(float((weights1[1][k] - w0[k]).abs().max()) for k in w0)
    differs = max(float((weights1[1][k] - weights2[1][k]).abs().max()) for k in w0)
    assert moved > 5e-4 and differs < 1e-5, (moved, differs)

    m1, m2 = _metrics(cfg1.tracking.uri, run1.mlflow_run_id), _metrics(cfg2.tracking.uri, run2.mlflow_run_id)
    assert sorted(m1) == sorted(m2)
    for key, history in m1.items():
        assert [s for s, _ in m2[key]] == [s for s, _ in history], key  # logged once per step, by rank 0 only
        (_, a), (_, b) = history[0], m2[key][0]
        if key in ("train/global_valid_toks", "train/total_num_tokens"):  # counts summed over the ranks: exact
            assert a == b, key
        elif key.startswith("train/") and not key.endswith(("_per_s", "generation_time_s")):
            assert b == pytest.approx(a, rel=1e-4, abs=1e-6), key


def test_two_ranks_train_gspo_as_one_rank(tmp_path, tiny_model_dir):
    """GSPO, whose ratio and loss are per sequence and whose importance-ratio metric is a mean over sequences, with the
    off-policy correction: each rank holds whole sequences, and the counts and sums over ranks give one rank's
    update."""
    gspo = {"loss_type": "grpo", "importance_sampling_level": "sequence", "use_importance_sampling_correction": True}
    cfg1, cfg2 = (_cfg(tmp_path / str(ranks), tiny_model_dir, ranks, loss=gspo) for ranks in (1, 2))
    (run1, _, _, weights1), (run2, _, _, weights2) = _run(cfg1, steps=(1,)), _run(cfg2, steps=(1,))
    w0 = _weights(PolicyVersion(0, run1.start_policy_path))
    moved = max(float((weights1[1][k] - w0[k]).abs().max()) for k in w0)
    differs = max(float((weights1[1][k] - weights2[1][k]).abs().max()) for k in w0)
    assert moved > 5e-4 and differs < 1e-5, (moved, differs)
    m1, m2 = _metrics(cfg1.tracking.uri, run1.mlflow_run_id), _metrics(cfg2.tracking.uri, run2.mlflow_run_id)
    for key in (
        "train/loss",
        "train/grad_norm",
        "train/sampling_importance_ratio",
        "train/clip_fraction/low",
        "train/clip_fraction/high",
    ):
        assert m2[key][0][1] == pytest.approx(m1[key][0][1], rel=1e-4, abs=1e-6), key


def test_two_ranks_train_multi_turn_episodes_as_one_rank(tmp_path, tiny_model_dir):
    """Episodes of 3 turns, whose rows hold environment tokens (token_mask 0) between the assistant's, split over two
    ranks: the same logprobs per sample and the same update as one rank."""
    shape = {**STEP_SHAPE, "grpo": {**STEP_SHAPE["grpo"], "max_rollout_turns": 3}}
    env = {"tasks": {"chain_sum": {"environment": {"class": "tests.unit.rl.test_multi_turn:Parity"}}}}
    cfg1, cfg2 = (
        small_config(tmp_path / str(ranks), tiny_model_dir, **shape, env=env, policy={"nproc_per_node": ranks})
        for ranks in (1, 2)
    )
    (run1, _, columns1, weights1), (_, _, columns2, weights2) = _run(cfg1, steps=(1,)), _run(cfg2, steps=(1,))
    for field in (F.PREV_LOGPROBS, F.REFERENCE_POLICY_LOGPROBS):
        assert columns1[1][field].keys() == columns2[1][field].keys()
        for sid, values in columns1[1][field].items():
            torch.testing.assert_close(columns2[1][field][sid], values, atol=2e-6, rtol=0)
    w0 = _weights(PolicyVersion(0, run1.start_policy_path))
    moved = max(float((weights1[1][k] - w0[k]).abs().max()) for k in w0)
    differs = max(float((weights1[1][k] - weights2[1][k]).abs().max()) for k in w0)
    assert moved > 5e-4 and differs < 1e-5, (moved, differs)


def test_a_rank_that_dies_fails_the_task_clearly_and_the_retry_ends_as_a_clean_run(tmp_path, tiny_model_dir, two_ranks):
    clean_cfg, clean_run, clean_policy, clean_columns, _ = two_ranks
    cfg = _cfg(tmp_path, tiny_model_dir, 2)
    failures: list[str] = []
    # rank 1 dies after its update of step 1 (rank 0 waits for it before saving), and after its reference-logprob
    # write of step 2 (rank 0's write is then committed too: the retry replaces both)
    drills = {("train", 1): "train:1", ("reference_logprobs", 2): "reference_logprobs:1"}
    run, policy, columns, _ = _run(cfg, drills=drills, failures=failures)
    assert (
        len(columns[2]["ref_lp writes"]) == 2 and columns[2]["ref_lp writes"] == clean_columns[2]["ref_lp writes"]
    )  # replaced

    assert len(failures) == 2
    for task, message in zip(("train", "reference_logprobs"), failures, strict=True):
        # the rank that died is named, not the survivor whose collective then failed (tasks.data_parallel._ranked)
        assert f"error={task}: rank 1 of 2 (pid " in message, message
        assert "exited with code 86 without raising an error" in message and "Flyte retries the task" in message

    assert _state(cfg, run) == _state(clean_cfg, clean_run)  # checkpoints, data plane: the same bytes
    a, b = _weights(policy), _weights(clean_policy)
    assert all(a[k].equal(b[k]) for k in a)
    clean, faulty = (
        _metrics(clean_cfg.tracking.uri, clean_run.mlflow_run_id),
        _metrics(cfg.tracking.uri, run.mlflow_run_id),
    )
    assert sorted(clean) == sorted(faulty)
    for key, history in faulty.items():
        assert [s for s, _ in history] == [s for s, _ in clean[key]], key  # each step once
        if not key.startswith("timing/") and not key.endswith(("_per_s", "generation_time_s")):
            assert history == clean[key], key


def test_a_local_run_whose_rank_dies_in_step_1_completes(tmp_path, tiny_model_dir, capfd):
    """A local run (the workflow called in Python, as ``pyflyte run`` without ``--remote`` runs it) whose train task
    loses rank 1 in step 1 retries that task, as Flyte does, and completes."""
    from tests.helpers import metric_steps
    from workflows.grpo import grpo

    cfg = small_config(
        tmp_path,
        tiny_model_dir,
        policy={"nproc_per_node": 2},
        grpo={"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_num_steps": 1, "val_period": 0},
        optim={"train_global_batch_size": 4, "train_micro_batch_size": 2},  # on-policy: no policy_logprobs task
    )
    assert cfg.on_policy
    failures: list[str] = []
    with _rank_dies_once("train:1", failures):
        summary = grpo(cfg=cfg)

    assert summary.final_step == 1
    assert len(failures) == 1 and "train: rank 1 of 2 (pid " in failures[0], failures
    assert "[grpoflow] train: attempt 1 of 3 failed (recoverable: train: rank 1 of 2 (pid " in capfd.readouterr().err
    assert metric_steps(cfg.tracking.uri, summary.mlflow_run_id, "train/loss") == [1]  # logged once


def test_a_rank_that_raises_fails_the_task_with_its_error(tmp_path, tiny_model_dir):
    from dataplane.meta import KVBatchMeta
    from tasks.logprobs import reference_logprobs
    from tasks.setup import start_run

    cfg = _cfg(tmp_path, tiny_model_dir, 2)
    run = start_run(cfg=cfg)
    meta = KVBatchMeta(partition_id="step_000009", sample_ids=["a", "b", "c"], sequence_lengths=[3, 4, 5])
    with pytest.raises(
        Exception, match=r"reference_logprobs: rank [01] of 2 \(pid \d+\) failed: .*step_000009"
    ) as failed:
        reference_logprobs(cfg=cfg, run=run, meta=meta)
    assert not isinstance(failed.value, FlyteRecoverableException)  # an error that a retry would repeat


def test_pyflyte_run_with_two_ranks(tmp_path, tiny_model_dir):
    """docs/cluster.md's local data-parallel command, in a fresh process outside the repository: ``pyflyte run``
    puts the code root on sys.path only while it loads the workflow file, yet the spawned ranks must import the
    tasks' modules."""

    root = Path(__file__).resolve().parents[2]
    cfg = _cfg(tmp_path, tiny_model_dir, 2)
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, max_num_steps=1, val_period=0))
    env = {**os.environ, "FLYTE_LOCAL_CACHE_ENABLED": "false"}
    env.pop("PYTHONPATH", None)
    pyflyte = Path(sys.executable).with_name("pyflyte")
    done = subprocess.run(
        [str(pyflyte), "run", str(root / "workflows/grpo.py"), "grpo", "--cfg", json.dumps(cfg.to_dict())],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "[grpoflow] done: 1 steps" in done.stdout
