"""Reward code in worker processes: every failure becomes one RewardError naming the function and the first offending
sample, hangs and crashes return promptly, and the pool keeps working afterwards."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rl.environments.interfaces import RewardError
from rl.environments.workers import RewardWorkerPool, absolute_ref, load_function, split_ref

ROOT = Path(__file__).resolve().parents[3]
FIX = "tests.unit.rl.reward_fixtures"
FILE = "tests/unit/rl/reward_fixtures.py"
TIMEOUT_S = 1.5
ROWS = [f"train:chain_sum:1:{i}" for i in range(8)]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pool():
    p = RewardWorkerPool(2, TIMEOUT_S).attach()
    p.warm_up([f"{FIX}:reward_len"])
    yield p
    p.shutdown()


def batch(marker: str | None = None, at: int = 5, n: int = 8) -> dict[str, list]:
    texts = [f"completion {i}" + (f" {marker}" if marker and i == at else "") for i in range(n)]
    return {"completions": texts}


def run(pool, fn: str, columns: dict[str, list], **kw):
    return pool.run(f"{FIX}:{fn}", columns, len(columns["completions"]), row_ids=ROWS, **kw)


def test_a_good_function_gives_floats_in_order(pool):
    out = run(pool, "reward_len", batch())
    assert out == [float(-abs(20 - len(f"completion {i}"))) for i in range(8)] == [-8.0] * 8


def test_a_file_reference_and_a_module_reference_both_load_in_the_workers(pool, monkeypatch):
    monkeypatch.chdir(ROOT)
    by_file = pool.run(f"{FILE}:reward_len", batch(), 8)
    assert by_file == run(pool, "reward_len", batch())
    assert absolute_ref(f"{FILE}:reward_len") == f"{ROOT / FILE}:reward_len"
    assert split_ref(f"{FILE}:reward_len") == (FILE, "reward_len", True)
    assert split_ref(f"{FIX}:reward_len") == (FIX, "reward_len", False)


def test_the_worker_imports_no_torch(pool):
    assert "torch" in sys.modules  # the test process has it (conftest): the worker does not inherit it
    assert run(pool, "torch_imported", batch()) == [0.0] * 8


def test_a_hanging_function_is_killed_and_named_within_seconds(pool):
    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        run(pool, "sleeps_forever", batch("HANG", at=5))
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert f"'{FIX}:sleeps_forever' did not finish within timeout_s=1.5 s" in msg
    # two workers: samples 0-3 finished, 4-7 did not; the first of those is named with its row
    assert "samples 4-7 of the batch of 8 (the first: sample 4 of the batch (row_id 'train:chain_sum:1:4'))" in msg
    assert "raise env.timeout_s" in msg
    assert elapsed < 20  # the timeout is 1.5 s: a hang would block until pytest-timeout
    assert run(pool, "reward_len", batch()) == [-8.0] * 8  # the pool rebuilt itself


@pytest.mark.parametrize(
    ("fn", "marker", "how"), [("crashes", "CRASH", "SIGKILL"), ("exits", "EXIT", "exited with code 3")]
)
def test_a_dying_worker_names_the_first_sample_that_kills_it(pool, fn, marker, how):
    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        run(pool, fn, batch(marker, at=6))
    msg = str(info.value)
    assert f"the worker process running reward function '{FIX}:{fn}' died on sample 6 of the batch" in msg
    assert "(row_id 'train:chain_sum:1:6')" in msg
    assert how in msg
    assert time.monotonic() - start < 20
    assert run(pool, "reward_len", batch()) == [-8.0] * 8


def test_an_exception_names_its_type_frame_and_first_sample(pool):
    with pytest.raises(RewardError) as info:
        run(pool, "raises", batch("BOOM", at=2))
    msg = str(info.value)
    assert f"reward function '{FIX}:raises' raised ZeroDivisionError: float division by zero" in msg
    assert re.search(r"\(at \S+/reward_fixtures\.py:\d+ in \S+: return \[1\.0 / \(\"BOOM\" not in c\)", msg), msg
    assert "on sample 2 of the batch (row_id 'train:chain_sum:1:2')" in msg


@pytest.mark.parametrize(
    ("fn", "marker", "expected"),
    [
        ("nan_on_marker", "NAN", "returned nan (float) for sample 6 of the batch (row_id 'train:chain_sum:1:6')"),
        ("inf_on_marker", "INF", "returned inf (float) for sample 6 of the batch"),
        ("string_on_marker", "STR", "returned '1.0' (str) for sample 6 of the batch"),
        ("wrong_length", None, "returned 3 rewards for the 4 samples 0-3 of the batch (the first: sample 0"),
        ("returns_dict", None, "returned a dict for samples 0-3 (the first: sample 0 of the batch"),
    ],
)
def test_a_result_that_is_not_one_number_per_sample_is_named(pool, fn, marker, expected):
    with pytest.raises(RewardError) as info:
        run(pool, fn, batch(marker, at=6))
    msg = str(info.value)
    assert f"reward function '{FIX}:{fn}' " in msg and expected in msg
    assert "one float (or None where the reward does not apply) per completion" in msg


def test_none_means_does_not_apply(pool):
    cols = {"completions": ["42", "x", "42"], "prompts": ["p"] * 3, "task": ["math", "code", "code"]}
    assert pool.run(f"{FIX}:math_reward_func", cols, 3) == [1.0, None, None]


def test_a_function_that_does_not_load_fails_the_warm_up():
    p = RewardWorkerPool(1, TIMEOUT_S).attach()
    try:
        with pytest.raises(RewardError, match=rf"'{FIX}:nope' could not be loaded in a worker process: AttributeError"):
            p.warm_up([f"{FIX}:nope"])
        p.warm_up([f"{FIX}:reward_len"])  # the bad one is forgotten: the pool still starts
    finally:
        p.close()
        p.close()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        p.run(f"{FIX}:reward_len", batch(), 8)


def test_a_module_the_workers_cannot_import_is_named(pool):
    with pytest.raises(RewardError) as info:
        pool.run("no_such_package.rewards:fn", batch(), 8)
    msg = str(info.value)
    assert "reward function 'no_such_package.rewards:fn' could not be loaded in a worker process: " in msg
    assert "ModuleNotFoundError: No module named 'no_such_package'" in msg


def test_load_function_errors():
    with pytest.raises(ValueError, match="not of the form"):
        load_function("no_colon")
    with pytest.raises(AttributeError, match="has no attribute 'nope'.*reward_len"):
        load_function(f"{FIX}:nope")
    with pytest.raises(TypeError, match="is a int, not a function"):
        load_function(f"{FIX}:NOT_A_FUNCTION")


def test_a_script_without_a_main_guard_starts_workers_that_do_not_rerun_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import torch  # the trainer's imports must not reach the workers
        from rl.environments.workers import RewardWorkerPool
        pool = RewardWorkerPool(1, 30).attach()
        cols = {{"completions": ["a", "b"]}}
        print(pool.run("{FILE}:torch_imported", cols, 2), pool.run("{FILE}:main_module_file", cols, 2))
        pool.close()
        """)
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0.0, 0.0] [0.0, 0.0]"


def test_a_column_that_cannot_be_pickled_is_named(pool):
    cols = {"completions": ["a", "b", "c", "d"], "extra": [1, 2, lambda: 3, 4]}
    with pytest.raises(RewardError) as info:
        pool.run(f"{FIX}:reward_len", cols, 4, row_ids=ROWS)
    msg = str(info.value)
    assert (
        f"reward function '{FIX}:reward_len' could not be run on samples 2-3 of the batch (the first: sample 2" in msg
    )
    assert "Every column value passed to a reward function must be picklable" in msg
    assert pool.run(f"{FIX}:reward_len", batch(), 8) == [-8.0] * 8


def test_a_process_with_a_deep_temp_folder_gets_spawn_workers_that_score(tmp_path):
    """A pod's TMPDIR can be deeper than an AF_UNIX socket path allows (107 bytes), where the forkserver cannot bind
    its socket: the pool starts spawn workers there instead, and they score."""
    import subprocess
    import sys

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    code = (
        "from rl.environments.workers import RewardWorkerPool\n"
        "p = RewardWorkerPool(1, 60)\n"
        "print(p._ctx.get_start_method())\n"
        "p.warm_up(['tests.rewards:earnable'])\n"
        "print(p.run('tests.rewards:earnable', {'completions': ['ab', 'abc']}, 2, shared={}, row_ids=['a', 'b']))\n"
        "p.close()\n"
    )
    import os

    env = {**os.environ, "TMPDIR": str(deep)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0] == "spawn"
    assert out.stdout.splitlines()[1] == "[1.0, 0.0]"


def test_workers_end_when_the_process_that_owns_them_is_killed(tmp_path):
    """A trainer killed with SIGKILL runs no cleanup: its reward workers notice it is gone and exit within seconds."""
    import subprocess
    import sys
    import time

    code = (
        "import os, signal\n"
        "from rl.environments.workers import RewardWorkerPool\n"
        "p = RewardWorkerPool(2, 60)\n"
        "p.warm_up(['tests.rewards:earnable'])\n"
        "print(' '.join(str(pid) for pid in p._executor._processes), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    log = tmp_path / "out.txt"
    with log.open("w") as out:  # a file, not a pipe: the orphaned forkserver keeps the trainer's stdout open
        proc = subprocess.run([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, timeout=120)
    workers = [int(pid) for pid in log.read_text().split()[-2:] if pid.isdigit()]
    assert proc.returncode == -9 and len(workers) == 2, log.read_text()[-2000:]

    def running(pid: int) -> bool:  # a zombie (exited, not yet reaped) counts as gone
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        return state != "Z"

    deadline = time.monotonic() + 10
    while any(running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(pid) for pid in workers)
