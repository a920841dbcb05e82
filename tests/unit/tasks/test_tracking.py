"""`tasks.tracking.start_run` against a real MLflow sqlite store: a retried start of the same Flyte execution
finds its first attempt's run; distinct executions get distinct runs."""

from __future__ import annotations

from tasks import tracking


def _start(uri: str, execution: str, *, reuse: bool) -> str:
    return tracking.start_run(
        uri=uri,
        experiment_name="test",
        run_name=None,
        params={"optim.lr": "1e-05"},
        tags={"flyte.execution_id": f"p/d/{execution}"},
        reuse_tag="flyte.execution_id" if reuse else None,
    )


def test_a_retried_start_reuses_the_run_of_its_execution(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = _start(uri, "exec-a", reuse=True)
    assert _start(uri, "exec-a", reuse=True) == first
    other = _start(uri, "exec-b", reuse=True)
    assert other != first
    assert _start(uri, "exec-a", reuse=False) not in (first, other)  # local runs never reuse
    run = tracking.client(uri).get_run(first)
    assert run.data.params == {"optim.lr": "1e-05"}
    assert run.data.tags["flyte.execution_id"] == "p/d/exec-a"


def test_the_experiment_is_marked_as_model_development(tmp_path, monkeypatch):
    """MLflow's ``mlflow.experimentKind`` tag: set on a new experiment, added to an existing one without it, left
    alone where a kind was chosen."""
    monkeypatch.setenv("HOME", str(tmp_path))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    c = tracking.client(uri)
    _start(uri, "exec-a", reuse=False)
    assert c.get_experiment_by_name("test").tags["mlflow.experimentKind"] == "custom_model_development"
    older = c.create_experiment("older")  # made before the tag existed
    chosen = c.create_experiment("chosen", tags={"mlflow.experimentKind": "genai_development"})
    for name in ("older", "chosen"):
        tracking.start_run(uri=uri, experiment_name=name, run_name=None, params={}, tags={})
    assert c.get_experiment(older).tags["mlflow.experimentKind"] == "custom_model_development"
    assert c.get_experiment(chosen).tags["mlflow.experimentKind"] == "genai_development"


def test_runs_table_url_opens_the_machine_learning_view():
    assert tracking.runs_table_url("http://127.0.0.1:5000/", "3") == (
        "http://127.0.0.1:5000/#/experiments/3/runs?workflowType=machine_learning"
    )
