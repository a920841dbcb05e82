"""`tasks.tracking.start_run` against a real MLflow sqlite store: a retried start of the same Flyte execution
finds its first attempt's run; distinct executions get distinct runs."""

from __future__ import annotations

from tasks import tracking


def _start(uri: str, execution: str, *, reuse: bool) -> str:
    return tracking.start_run(
        uri=uri, experiment_name="test", run_name=None, params={"optim.lr": "1e-05"},
        tags={"flyte.execution_id": f"p/d/{execution}"}, reuse_tag="flyte.execution_id" if reuse else None,
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
