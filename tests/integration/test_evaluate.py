"""The `evaluate` workflow on the checkpoints of a real two-step run (tiny model, Flyte's local executor): greedy
held-out accuracy logged as ``evaluation/accuracy`` at the checkpoint's step in the run's MLflow run."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.helpers import small_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    """A finished two-step run checkpointed after each step, both checkpoints kept: (cfg, summary)."""
    from workflows.grpo import grpo

    tmp = tmp_path_factory.mktemp("evaluate")
    cfg = small_config(tmp, tiny_model_dir, checkpointing={"checkpoint_period": 1, "keep_last_k": 2})
    summary = grpo(cfg=cfg)
    assert summary.final_step == 2
    return cfg, summary


def _history(cfg, summary, key: str = "evaluation/accuracy") -> list[tuple[int, float]]:
    """``key``'s (step, value) entries in the run's MLflow run, by step."""
    from mlflow.tracking import MlflowClient

    history = MlflowClient(cfg.tracking.uri).get_metric_history(summary.mlflow_run_id, key)
    return sorted((m.step, m.value) for m in history)


def _at(cfg, summary, step: int, key: str = "evaluation/accuracy") -> list[float]:
    return [v for s, v in _history(cfg, summary, key) if s == step]


def _checkpoint(cfg, summary, step: int) -> Path:
    return Path(cfg.dataplane.root) / summary.run_id / "checkpoints" / f"step_{step:06d}"


def _table_rows(cfg, summary, step: int, tmp_path: Path) -> list[list]:
    """The rows of the completions table ``evaluation/step_N.json`` of the run's MLflow run."""
    from mlflow.tracking import MlflowClient

    local = MlflowClient(cfg.tracking.uri).download_artifacts(
        summary.mlflow_run_id, f"evaluation/step_{step:06d}.json", str(tmp_path)
    )
    return json.loads(Path(local).read_text())["data"]


def test_both_checkpoints_were_kept(trained):
    cfg, summary = trained
    for step in (1, 2):
        assert (_checkpoint(cfg, summary, step) / "_COMPLETE").exists()
    assert Path(summary.last_checkpoint) == _checkpoint(cfg, summary, 2)


def test_run_id_evaluates_its_newest_checkpoint_at_its_step(trained, capsys):
    from workflows.evaluate import evaluate

    cfg, summary = trained
    accuracy = evaluate(cfg=cfg, run_id=summary.run_id)
    assert isinstance(accuracy, float)
    assert 0.0 <= accuracy <= 1.0
    assert f"evaluating {_checkpoint(cfg, summary, 2)} (run {summary.run_id}, step 2)" in capsys.readouterr().out
    # logged once, at the checkpoint's step, in the run's MLflow run
    assert _at(cfg, summary, 2) == [accuracy]
    assert [s for s, _ in _history(cfg, summary)] in ([2], [1, 2])  # step 1: when another test evaluated it first
    # the same greedy completions of the same held-out questions as the run's own validation at step 2
    assert accuracy == summary.validation_accuracy
    assert _history(cfg, summary, "validation/accuracy") == [(2, accuracy)]
    (length,) = _at(cfg, summary, 2, "evaluation/avg_length")
    assert [(2, length)] == _history(cfg, summary, "validation/avg_length")
    assert 0 < length <= cfg.generation.max_new_tokens
    assert _at(cfg, summary, 2, "evaluation/reward") == [pytest.approx(accuracy)]  # reward 1 = correct, else 0

    # greedy: evaluating the same checkpoint again gives the same accuracy, and logs nothing twice
    assert evaluate(cfg=cfg, run_id=summary.run_id) == accuracy
    assert _at(cfg, summary, 2) == [accuracy]
    assert _at(cfg, summary, 2, "evaluation/avg_length") == [length]


def test_reevaluating_a_checkpoint_does_not_duplicate_its_completions_table(trained, tmp_path):
    """The metrics of a step are logged once (a retried or repeated evaluation logs nothing); the completions table
    must match them: one row per held-out question, not one more set per evaluation."""
    from workflows.evaluate import evaluate

    cfg, summary = trained
    for _ in range(2):
        evaluate(cfg=cfg, run_id=summary.run_id)
    rows = _table_rows(cfg, summary, 2, tmp_path)
    assert len(rows) == cfg.data.num_val_problems, f"{len(rows)} rows for {cfg.data.num_val_problems} questions"


def test_checkpoint_url_is_evaluated_at_its_own_step(trained, capsys):
    from workflows.evaluate import evaluate

    cfg, summary = trained
    url = str(_checkpoint(cfg, summary, 1))
    accuracy = evaluate(cfg=cfg, checkpoint=url)
    assert 0.0 <= accuracy <= 1.0
    assert f"evaluating {url} (run {summary.run_id}, step 1)" in capsys.readouterr().out
    assert _at(cfg, summary, 1) == [accuracy]
    assert evaluate(cfg=cfg, checkpoint=url) == accuracy
    assert _at(cfg, summary, 1) == [accuracy]


def test_neither_picks_the_newest_checkpoint_of_any_run(trained, tmp_path, capsys):
    from workflows.evaluate import evaluate

    cfg, summary = trained
    # one run under the root: its newest checkpoint, step 2
    accuracy = evaluate(cfg=cfg)
    assert f"evaluating {_checkpoint(cfg, summary, 2)} (run {summary.run_id}, step 2)" in capsys.readouterr().out
    assert _at(cfg, summary, 2) == [accuracy]

    # two runs: the checkpoint whose marker was written last wins, whatever its step and run
    root = tmp_path / "dp"
    old = root / summary.run_id / "checkpoints" / "step_000002"
    new = root / "run-later" / "checkpoints" / "step_000001"
    shutil.copytree(_checkpoint(cfg, summary, 2), old)
    shutil.copytree(_checkpoint(cfg, summary, 1), new)
    now = time.time()
    os.utime(old / "_COMPLETE", (now - 3600, now - 3600))
    os.utime(new / "_COMPLETE", (now, now))
    other = dataclasses.replace(cfg, dataplane=dataclasses.replace(cfg.dataplane, root=str(root)))
    step_1 = evaluate(cfg=other)
    assert f"evaluating {new} (run run-later, step 1)" in capsys.readouterr().out
    assert step_1 == evaluate(cfg=cfg, checkpoint=str(_checkpoint(cfg, summary, 1)))
    # logged in the MLflow run its trainer state names, at its step
    assert _at(cfg, summary, 1) == [step_1]
    # the evaluation's partition was cleared: only the copied checkpoint is left in the other run's folder
    assert sorted(p.name for p in (root / "run-later").iterdir()) == ["checkpoints"]


def _raises(match: str, **inputs) -> None:
    from workflows.evaluate import evaluate

    with pytest.raises(Exception, match=match) as err:  # noqa: PT011 (the local executor may wrap the task's error)
        evaluate(**inputs)
    chain = [err.value]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    assert any(isinstance(e, ValueError) for e in chain), [type(e) for e in chain]


def test_both_run_id_and_checkpoint_is_refused(trained):
    cfg, summary = trained
    url = str(_checkpoint(cfg, summary, 1))
    before = _history(cfg, summary)
    _raises(
        rf"find_checkpoint: give run_id \('{summary.run_id}'\) or checkpoint \('{url}'\), not both",
        cfg=cfg,
        run_id=summary.run_id,
        checkpoint=url,
    )
    assert _history(cfg, summary) == before


def test_run_without_checkpoint_is_named(trained):
    cfg, summary = trained
    where = Path(cfg.dataplane.root) / "run-none" / "checkpoints"
    _raises(rf"find_checkpoint: run 'run-none' has no complete checkpoint under {where}", cfg=cfg, run_id="run-none")


def test_folder_that_is_no_checkpoint_is_named(trained):
    cfg, summary = trained
    url = str(Path(cfg.dataplane.root) / summary.run_id / "checkpoints")
    _raises(rf"find_checkpoint: {url} is not a complete checkpoint with trainer state", cfg=cfg, checkpoint=url)


def test_empty_root_is_named(trained, tmp_path):
    cfg, _ = trained
    empty = dataclasses.replace(cfg, dataplane=dataclasses.replace(cfg.dataplane, root=str(tmp_path / "empty")))
    _raises(r"find_checkpoint: no complete checkpoint of any run under .*empty; check dataplane.root", cfg=empty)


def _printed_sampled(out: str) -> list[tuple[float, float]]:
    """``(accuracy, sampled accuracy)`` of each printed evaluation line with a sampled accuracy."""
    found = re.findall(r"evaluation at step \d+ \| accuracy ([\d.]+) .*\| sampled accuracy ([\d.]+) \(", out)
    return [(float(a), float(b)) for a, b in found]


def test_sampled_completions_at_a_near_zero_temperature_score_as_the_greedy_ones(trained, capsys):
    """``grpo.num_val_generations_per_prompt`` = K samples K completions per question besides the greedy one: at a
    temperature where sampling is argmax each of them is the greedy completion, so the sampled accuracy equals the
    greedy accuracy; at the run's temperature it is a share of the N x K completions, the same on a re-evaluation
    (seeded by the step), and the greedy accuracy does not move."""
    from workflows.evaluate import evaluate

    cfg, summary = trained
    url = str(_checkpoint(cfg, summary, 1))
    greedy = evaluate(cfg=cfg, checkpoint=url)
    k, n = 3, cfg.data.num_val_problems
    sampled = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, num_val_generations_per_prompt=k))
    cold = dataclasses.replace(sampled, generation=dataclasses.replace(cfg.generation, temperature=1e-9))
    capsys.readouterr()
    assert evaluate(cfg=cold, checkpoint=url) == greedy
    assert _printed_sampled(capsys.readouterr().out) == [(round(greedy, 3), round(greedy, 3))]

    assert evaluate(cfg=sampled, checkpoint=url) == greedy
    assert evaluate(cfg=sampled, checkpoint=url) == greedy
    (first, second) = _printed_sampled(capsys.readouterr().out)
    assert first == second and first[0] == round(greedy, 3)
    share = first[1] * n * k  # printed to 3 decimals: within 0.0005 x N x K of a whole number of completions
    assert abs(share - round(share)) <= 0.0005 * n * k and 0 <= round(share) <= n * k
