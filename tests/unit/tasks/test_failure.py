"""A failed execution's MLflow run is marked FAILED, not left RUNNING: the ``on_failure`` handler of the
``grpo`` workflows (`tasks.failure`) and the `tasks.tracking` calls it makes, against a real MLflow sqlite store.
The end-to-end case (a local run that fails, then resumes and finishes) is in ``tests/integration/test_resume.py``."""

from __future__ import annotations

from tasks import runtime, tracking
from tasks.failure import run_failed
from tests.helpers import small_config


def _start(uri: str, execution: str) -> str:
    return tracking.start_run(
        uri=uri, experiment_name="test", run_name=None, params={}, tags={"flyte.execution_id": f"p/d/{execution}"}
    )


def _status(uri: str, run_id: str) -> str:
    return tracking.client(uri).get_run(run_id).info.status


def test_a_remote_execution_fails_the_runs_it_started_or_resumed_and_no_other(tmp_path, monkeypatch):
    """The remote handler has no in-process state: it finds runs by the tag of the execution that last started or
    resumed them (``grpoflow.execution_id``); another execution's run, and a run that already ended, stay as they
    are."""
    monkeypatch.setenv("HOME", str(tmp_path))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mine, other, ended, resumed = (_start(uri, e) for e in ("e1", "e2", "e1", "e0"))
    tracking.set_terminated(uri, ended)
    tracking.set_terminated(uri, resumed, "FAILED")  # an earlier execution failed; e1 resumes it
    tracking.reopen_run(uri, resumed, execution="p/d/e1")
    assert _status(uri, resumed) == "RUNNING"
    assert tracking.client(uri).get_run(mine).data.tags[tracking.EXECUTION_TAG] == "p/d/e1"

    assert sorted(tracking.fail_execution_runs(uri, "test", "p/d/e1")) == sorted([mine, resumed])
    assert [_status(uri, r) for r in (mine, other, ended, resumed)] == ["FAILED", "RUNNING", "FINISHED", "FAILED"]
    assert tracking.fail_execution_runs(uri, "no-such-experiment", "p/d/e1") == []


def test_the_local_handler_fails_the_open_runs_of_this_process_in_the_runs_store(tmp_path, monkeypatch):
    """Run as flytekit's local executor runs a workflow's ``on_failure`` node: the runs this process opened in the
    config's store that are still RUNNING become FAILED; a finished one, and one in another store, are left alone;
    the process's collectors and back-ends are released."""

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = small_config(tmp_path / "a", "unused-model")
    uri, elsewhere = cfg.tracking.uri, f"sqlite:///{tmp_path}/b/mlflow.db"
    running, finished = _start(uri, "local"), _start(uri, "local")
    tracking.set_terminated(uri, finished)
    away = _start(elsewhere, "local")
    released = []
    monkeypatch.setattr(runtime, "release_all", lambda: released.append(True))

    run_failed(cfg=cfg, err=None)
    assert (_status(uri, running), _status(uri, finished), _status(elsewhere, away)) == (
        "FAILED",
        "FINISHED",
        "RUNNING",
    )
    assert released == [True]
    run_failed(cfg=cfg, err=None)  # again: nothing left to mark
    assert _status(uri, running) == "FAILED"
