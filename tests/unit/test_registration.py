"""The offline registration check (``python -m workflows.registration``): every entity serializes with the images
faked, the step loop compiles for every shipped config, and any failure exits non-zero, named."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tasks.run_config import RunConfig, load_run_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))

TASKS = {
    "tasks.setup.start_run",
    "tasks.config_file.load_config_file",
    "tasks.rollout.rollout",
    "tasks.logprobs.policy_logprobs",
    "tasks.logprobs.reference_logprobs",
    "tasks.advantages.advantages",
    "tasks.train.train",
    "tasks.validate.validate",
    "tasks.finish.finish_run",
    "tasks.failure.run_failed",
    "tasks.failure.run_failed_from_file",
    "tasks.evaluate.find_checkpoint",
    "tasks.evaluate.evaluate",
    "workflows.grpo.training_loop",
    "workflows.grpo.grpo_steps",
}
WORKFLOWS = {"workflows.grpo.grpo", "workflows.grpo.grpo_from_file", "workflows.evaluate.evaluate"}
LAUNCH_PLANS = WORKFLOWS | {f"grpo_{p.stem.replace('-', '_')}" for p in CONFIGS} | {"evaluate_newest"}
"""Each workflow's default launch plan, one per config, and the scheduled evaluation."""


def _expected_nodes(cfg: RunConfig) -> int:
    """Nodes of the step loop of a run from step 0: rollout, reference logprobs, advantages and train per step,
    policy logprobs when off-policy, a validation where due (and at start if asked), and finish_run."""
    n, period = cfg.grpo.max_num_steps, cfg.grpo.val_period
    per_step = 4 + (0 if cfg.on_policy else 1)
    validations = sum(1 for s in range(1, n + 1) if period > 0 and (s % period == 0 or s == n))
    return n * per_step + validations + int(cfg.grpo.val_at_start) + 1


def _listed(stdout: str, kind: str) -> set[str]:
    (match,) = re.findall(rf"^(\d+) {kind}s: (.*)$", stdout, flags=re.M)
    names = set(match[1].split(", "))
    assert int(match[0]) == len(names), f"{kind}s listed twice: {match}"
    return names


def test_expected_node_counts_match_the_known_configs():
    assert _expected_nodes(RunConfig()) == 18  # 4 steps x 4, validation at step 4, finish
    assert _expected_nodes(load_run_config(str(ROOT / "configs" / "cluster.yaml"))) == 411  # 100 x 4 + 10 + 1


@pytest.fixture
def project_entities(monkeypatch):
    """Flytekit's registry of entities, limited to the project's own (and restored after): other test modules'
    entities, and the sub-workflow an earlier compile of the step loop left there, are not the check's business,
    and an entity a test adds does not outlive it."""
    from flytekit.core.context_manager import FlyteEntities

    import workflows.launch_plans  # noqa: F401 (registers every project entity)
    from workflows.registration import _declared_here as ours

    monkeypatch.setattr(FlyteEntities, "entities", [e for e in FlyteEntities.entities if ours(e)])


def test_main_in_process_with_one_config(project_entities, monkeypatch, tmp_path, capsys):
    from workflows import registration

    quick = load_run_config(str(ROOT / "configs" / "quick.yaml"))
    monkeypatch.setattr(registration, "shipped_configs", lambda: {"quick": quick})
    assert registration.main(["--out", str(tmp_path / "pb")]) == 0
    out = capsys.readouterr().out
    assert _listed(out, "task") == TASKS
    assert _listed(out, "workflow") == WORKFLOWS
    assert _listed(out, "launch plan") == LAUNCH_PLANS
    assert "step loop of config 'quick' (first steps): 10 nodes" in out
    assert len(list((tmp_path / "pb").glob("*.pb"))) == len(TASKS) + len(WORKFLOWS) + len(LAUNCH_PLANS)


def test_a_compile_error_of_a_config_fails_the_check(project_entities, monkeypatch, capsys):
    """A task the step loop places without a resource class (a new task not added to ROLE) fails the check."""
    from tasks import placement
    from workflows import registration

    monkeypatch.setattr(
        registration, "shipped_configs", lambda: {"quick": load_run_config(str(ROOT / "configs" / "quick.yaml"))}
    )
    monkeypatch.delitem(placement.ROLE, "advantages")
    assert registration.main([]) == 1
    captured = capsys.readouterr()
    assert (
        "registration check FAILED: KeyError: "
        "\"task 'tasks.advantages.advantages' has no resource class: add it to tasks.placement.ROLE\"" in captured.err
    )
    assert "tasks:" not in captured.out  # nothing listed as if it had passed


def test_an_entity_that_does_not_serialize_fails_the_check(project_entities, monkeypatch, tmp_path, capsys):
    from workflows import registration

    module = "grpoflow_test_bad_entities"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent("""
        from flytekit import task, workflow

        @task(container_image="{{.image.missing.fqn}}:{{.image.missing.version}}")
        def orphan(x: int) -> int:
            return x

        @workflow
        def uses_orphan(x: int = 1) -> int:
            return orphan(x=x)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registration, "MODULES", (*registration.MODULES, module))
    monkeypatch.setattr(
        registration, "shipped_configs", lambda: pytest.fail("configs compiled after a failed serialization")
    )
    try:
        assert registration.main(["--out", str(tmp_path / "pb")]) == 1
    finally:
        sys.modules.pop(module, None)
    err = capsys.readouterr().err
    assert (
        "registration check FAILED: AssertionError: Image Config with name missing not found in the configuration"
        in err
    )
    assert not (tmp_path / "pb").exists()  # nothing written


@pytest.mark.slow
def test_registration_module_serializes_every_entity_and_compiles_every_config(tmp_path):
    """The CI check itself, as a fresh process; it compiles each shipped config's step loop up to its first
    validation (every step compiles to the same nodes)."""
    from images.cpu import cpu_image
    from images.rollout_gpu import rollout_gpu_image
    from images.train_gpu import train_gpu_image
    from workflows.registration import checked_steps

    out = tmp_path / "pb"
    env = {"GRPOFLOW_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "workflows.registration", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    stdout = proc.stdout
    assert _listed(stdout, "task") == TASKS
    assert _listed(stdout, "workflow") == WORKFLOWS
    assert _listed(stdout, "launch plan") == LAUNCH_PLANS
    configs = {"default": RunConfig(), **{p.stem: load_run_config(str(p)) for p in CONFIGS}}
    for name, cfg in configs.items():
        expected = _expected_nodes(checked_steps(cfg))
        assert re.search(
            rf"^step loop of config '{re.escape(name)}' \(first steps\): {expected} nodes, \d+ tasks$",
            stdout,
            flags=re.M,
        ), name
    (faked,) = re.findall(r"^images \(faked\): (.*)$", stdout, flags=re.M)
    assert set(faked.split(", ")) == {
        cpu_image.image_name(),
        rollout_gpu_image.image_name(),
        train_gpu_image.image_name(),
    }
    total = len(TASKS) + len(WORKFLOWS) + len(LAUNCH_PLANS)
    assert f"wrote {total} entities to {out}" in stdout

    # the files: NN_<name>_<resource type>.pb (1 task, 2 workflow, 3 launch plan), each a parseable spec
    from flyteidl.admin.launch_plan_pb2 import LaunchPlan
    from flyteidl.admin.task_pb2 import TaskSpec
    from flyteidl.admin.workflow_pb2 import WorkflowSpec

    files = sorted(out.glob("*.pb"))
    assert len(files) == total
    by_kind: dict[str, set[str]] = {"1": set(), "2": set(), "3": set()}
    for f in files:
        m = re.fullmatch(r"\d+_(.+)_([123])\.pb", f.name)
        assert m, f.name
        by_kind[m.group(2)].add(m.group(1))
    assert by_kind == {"1": TASKS, "2": WORKFLOWS, "3": LAUNCH_PLANS}
    (train_file,) = [f for f in files if f.name.endswith("_tasks.train.train_1.pb")]
    train = TaskSpec.FromString(train_file.read_bytes())
    assert train.template.container.image == train_gpu_image.image_name()
    assert {r.value for r in train.template.container.resources.requests} == {"2", "16Gi"}
    (wf_file,) = [f for f in files if f.name.endswith("_workflows.evaluate.evaluate_2.pb")]
    assert WorkflowSpec.FromString(wf_file.read_bytes()).template.id.name == "workflows.evaluate.evaluate"
    (lp_file,) = [f for f in files if f.name.endswith("_evaluate_newest_3.pb")]
    lp = LaunchPlan.FromString(lp_file.read_bytes())
    assert lp.id.name == "evaluate_newest"
    assert lp.spec.entity_metadata.schedule.cron_schedule.schedule == "0 */6 * * *"
