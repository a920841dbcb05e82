"""TRL-signature reward functions: called as TRL's GRPOTrainer calls them, None as 'does not apply', the built-ins,
and the config-time checks of references."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rl.environments.interfaces import RewardConfigError, RewardError, weighted_total
from rl.environments.reward_functions import (
    RewardFunctionEnvironment,
    RewardFunctionSpec,
    check_reward_function,
    importable_in_pod,
    source_hash,
    trl_arguments,
)
from rl.environments.rewards import answer_tag_format, completion_length, exact_match, math_verify_accuracy
from rl.environments.workers import RewardWorkerPool

ROOT = Path(__file__).resolve().parents[3]
FIX = "tests.unit.rl.reward_fixtures"
FILE = "tests/unit/rl/reward_fixtures.py"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pool():
    p = RewardWorkerPool(2, 20.0).attach()
    yield p
    p.shutdown()


def sample(prompt, text: str, ids: list[int], **columns) -> tuple[list[dict], dict]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    log = [*messages, {"role": "assistant", "content": text, "token_ids": ids}]
    return log, {**columns, "prompt": prompt}


def unzip(samples):
    return [s[0] for s in samples], [s[1] for s in samples]


def env_of(pool, *specs: RewardFunctionSpec) -> RewardFunctionEnvironment:
    return RewardFunctionEnvironment(list(specs), num_workers=2, timeout_s=20.0, pool=pool)


def test_trl_documentation_reward_functions_run_unchanged_on_text_prompts(pool, monkeypatch):
    monkeypatch.chdir(ROOT)
    logs, meta = unzip(
        [
            sample("q0", "x" * 20, [1, 2, 3], ground_truth="4", row_id="r0", task_name="t"),
            sample("q1", r"so \boxed{4}", [5], ground_truth="4", row_id="r1", task_name="t"),
            sample("q2", r"\boxed{5}", [], ground_truth="4", row_id="r2", task_name="t"),
        ]
    )
    env = env_of(
        pool,
        RewardFunctionSpec(f"{FIX}:reward_len", weight=0.5),
        RewardFunctionSpec(f"{FILE}:reward_func", name="boxed"),  # a file reference, renamed
        RewardFunctionSpec(f"{FIX}:reward_num_tokens", weight=2.0),
        RewardFunctionSpec(f"{FIX}:sees"),
    )
    with env:
        assert env.reward_weights == {"reward_len": 0.5, "boxed": 1.0, "reward_num_tokens": 2.0, "sees": 1.0}
        out = env.step(logs, meta)
    r = out.rewards
    # reward_len: -|20 - len|, len 20, 12, 9; boxed: content == ground_truth; tokens: len(ids)
    assert r["reward_len"].tolist() == [0.0, -8.0, -11.0]
    assert r["boxed"].tolist() == [0.0, 1.0, 0.0]
    assert r["reward_num_tokens"].tolist() == [3.0, 1.0, 0.0]
    assert r["sees"].tolist() == [1.0, 1.0, 1.0]
    assert all(t.dtype == torch.float32 and t.shape == (3,) for t in r.values())
    assert out.terminateds.tolist() == [True] * 3 and out.next_stop_strings == [None] * 3
    assert out.observations == [{"role": "environment", "content": ""}] * 3 and out.metadata == meta
    # 0.5 * reward_len + boxed + 2 * tokens + sees
    assert weighted_total(r, env.reward_weights).tolist() == [7.0, 0.0 - 4.0 + 1.0 + 2.0 + 1.0, -5.5 + 0 + 0 + 1]


def test_conversational_prompts_get_completions_as_assistant_messages(pool):
    convo = [{"role": "system", "content": "Think, then answer."}, {"role": "user", "content": "2+2?"}]
    logs, meta = unzip(
        [sample(convo, "<think>4</think><answer>4</answer>", [1]), sample(convo, "<answer>4</answer>", [1])]
    )
    kwargs = trl_arguments(logs, meta)
    assert kwargs["prompts"] == [convo, convo]
    assert kwargs["completions"][0] == [{"role": "assistant", "content": "<think>4</think><answer>4</answer>"}]
    with env_of(pool, RewardFunctionSpec(f"{FIX}:format_reward_func")) as env:
        assert env.step(logs, meta).rewards["format_reward_func"].tolist() == [1.0, 0.0]


def test_none_is_nan_and_left_out_of_the_total_but_a_sample_with_no_reward_is_an_error(pool):
    logs, meta = unzip(
        [
            sample("a", "42", [1], task="math", row_id="r0"),
            sample("b", "42", [1], task="code", row_id="r1"),
            sample("c", "7", [1], task="math", row_id="r2"),
        ]
    )
    with env_of(pool, RewardFunctionSpec(f"{FIX}:math_reward_func")) as env:
        out = env.step(logs, meta)
        math_r = out.rewards["math_reward_func"]
        assert math_r[0].item() == 1.0 and math.isnan(math_r[1].item()) and math_r[2].item() == 0.0
        with pytest.raises(RewardError) as info:
            weighted_total(out.rewards, env.reward_weights, row_ids=[m["row_id"] for m in meta])
        assert "no reward applies to sample 1 of the batch (row_id 'r1')" in str(info.value)
    with env_of(
        pool, RewardFunctionSpec(f"{FIX}:math_reward_func", weight=2.0), RewardFunctionSpec(f"{FIX}:reward_len")
    ) as env:
        out = env.step(logs, meta)
        # sample 1: math is NaN, left out: only reward_len = -|20 - 2| = -18
        assert weighted_total(out.rewards, env.reward_weights).tolist() == [2.0 - 18, -18.0, 0.0 - 19]


def test_a_failing_function_fails_the_step_with_its_name(pool):
    logs, meta = unzip([sample("a", "fine", [1], row_id="r0"), sample("b", "BOOM", [1], row_id="r1")])
    with env_of(pool, RewardFunctionSpec(f"{FIX}:raises")) as env:
        with pytest.raises(RewardError, match=r"'tests.unit.rl.reward_fixtures:raises' raised ZeroDivisionError"):
            env.step(logs, meta)
        env.close()
        env.close()  # idempotent
        with pytest.raises(RewardError, match="closed"):
            env.step(logs, meta)


def test_malformed_batches_are_refused():
    logs, meta = unzip([sample("a", "x", [1], answer="1"), sample("b", "y", [2], solution="2")])
    with pytest.raises(ValueError, match=r"metadata 1 of the batch has columns \['solution'\] but metadata 0 has"):
        trl_arguments(logs, meta)
    logs, meta = unzip([sample("a", "x", [1], completions="oops")])
    with pytest.raises(ValueError, match=r"column\(s\) \['completions'\] have the name of an argument"):
        trl_arguments(logs, meta)
    with pytest.raises(ValueError, match="message log 0 of the batch does not end with an assistant message"):
        trl_arguments([[{"role": "user", "content": "q"}]], [{"prompt": "q"}])


def test_environment_config_errors(pool):
    with pytest.raises(RewardConfigError, match=r"reward names \['reward_len'\] appear more than once"):
        env_of(pool, RewardFunctionSpec(f"{FIX}:reward_len"), RewardFunctionSpec(f"{FIX}:reward_len", weight=2))
    with pytest.raises(RewardConfigError, match="has weight nan"):
        env_of(pool, RewardFunctionSpec(f"{FIX}:reward_len", weight=float("nan")))


# --- built-in reward functions ----------------------------------------------------------------------------------------
def test_math_verify_accuracy():
    completions = [r"\boxed{\frac{1}{2}}", "The answer is 3", "The answer is 4", "<answer>7</answer>", "7", "x"]
    answers = ["0.5", "3", "3", "7", "hello", None]
    assert math_verify_accuracy(completions, answers) == [1.0, 1.0, 0.0, 1.0, None, None]
    convo = [[{"role": "assistant", "content": r"so $\frac{2}{4}$"}]]
    assert math_verify_accuracy(convo, [r"\frac{1}{2}"]) == [1.0]


def test_answer_tag_format():
    completions = [
        "<answer>7</answer>",
        "<think>3 + 4</think>\n<answer>7</answer>\n",
        "so <answer>7</answer>",
        "<answer>7</answer><answer>8</answer>",
        "<think>a</think><think>b</think><answer>7</answer>",
        "<answer>7",
    ]
    assert answer_tag_format(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert answer_tag_format([[{"role": "assistant", "content": "<answer>1</answer>"}]]) == [1.0]


def test_exact_match_and_completion_length():
    assert exact_match(["<answer> 7 </answer>", "it is 12", "12", "x"], [" 7", "12", "13", None]) == [
        1.0,
        1.0,
        0.0,
        None,
    ]
    assert completion_length([[1] * 250, []]) == [-0.25, 0.0]


def test_built_ins_run_in_the_workers_by_reference(pool):
    logs, meta = unzip([sample("q", r"\boxed{0.5}", [1], answer=r"\frac{1}{2}"), sample("q", "9", [1], answer="8")])
    specs = [RewardFunctionSpec(f"rl.environments.rewards:{f}") for f in ("math_verify_accuracy", "exact_match")]
    with env_of(pool, *specs) as env:
        r = env.step(logs, meta).rewards
    assert r["math_verify_accuracy"].tolist() == [1.0, 0.0] and r["exact_match"].tolist() == [0.0, 0.0]


# --- config-time checks -----------------------------------------------------------------------------------------------
def test_check_reward_function_accepts_module_and_file_references(monkeypatch):
    monkeypatch.chdir(ROOT)
    check_reward_function(f"{FIX}:reward_len")
    check_reward_function(f"{FILE}:reward_func")
    check_reward_function("rl.environments.rewards:math_verify_accuracy")


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("reward_len", "cannot be found (reward function reference 'reward_len' is not of the form"),
        ("tests/unit/rl/missing.py:fn", "cannot be found (no file /"),
        ("no_such_package.mod:fn", "cannot be found (no module 'no_such_package.mod'"),
        (f"{FIX}:nope", "does not name a function (tests.unit.rl.reward_fixtures has no attribute 'nope'"),
        (f"{FIX}:NOT_A_FUNCTION", "does not name a function (tests.unit.rl.reward_fixtures:NOT_A_FUNCTION is a int"),
        (f"{FIX}:no_kwargs", "does not accept **kwargs. Give it TRL's signature"),
    ],
)
def test_check_reward_function_names_the_entry_and_the_problem(monkeypatch, ref, expected):
    monkeypatch.chdir(ROOT)
    with pytest.raises(RewardConfigError) as info:
        check_reward_function(ref, where="env.tasks.math.reward_functions[1].function")
    assert str(info.value).startswith(f"env.tasks.math.reward_functions[1].function: reward function {ref!r} ")
    assert expected in str(info.value)


def test_check_reward_function_reports_an_import_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("import no_such_dependency\n\ndef fn(completions, **kwargs):\n    return []\n")
    with pytest.raises(RewardConfigError, match="fails to import: ModuleNotFoundError: No module named 'no_such_dep"):
        check_reward_function("broken.py:fn")


def test_importable_in_pod(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert importable_in_pod(f"{FILE}:reward_len", str(ROOT)) is None
    assert importable_in_pod(f"{FIX}:reward_len", str(ROOT)) is None
    assert importable_in_pod("rl.environments.rewards:exact_match", str(ROOT)) is None
    assert importable_in_pod("math_verify:parse", str(ROOT)) is None  # installed
    assert importable_in_pod("json:dumps", str(ROOT)) is None  # standard library
    assert "is an absolute path" in importable_in_pod(f"{ROOT / FILE}:reward_len", str(ROOT))
    outside = tmp_path / "mine.py"
    outside.write_text("def fn(completions, **kwargs):\n    return []\n")
    monkeypatch.chdir(tmp_path)
    reason = importable_in_pod("mine.py:fn", str(ROOT))
    assert reason == f"{outside} is outside the project folder {ROOT}, which is all that fast registration ships"
    monkeypatch.syspath_prepend(str(tmp_path))
    reason = importable_in_pod("mine:fn", str(ROOT))
    assert reason.startswith(f"module 'mine' is neither under the project folder {ROOT} nor an installed package")


def test_source_hash_is_the_sha256_of_the_module_file(monkeypatch):
    import hashlib

    monkeypatch.chdir(ROOT)
    expected = hashlib.sha256((ROOT / FILE).read_bytes()).hexdigest()
    assert source_hash(f"{FIX}:reward_len") == source_hash(f"{FILE}:raises") == expected


def test_an_environment_with_its_own_pool_stops_it_on_close():
    with RewardFunctionEnvironment([RewardFunctionSpec(f"{FIX}:reward_len")], num_workers=1, timeout_s=20.0) as env:
        logs, meta = unzip([sample("q", "abc", [1])])
        assert env.step(logs, meta).rewards["reward_len"].tolist() == [-17.0]
        own = env._pool
    assert own._closed and own._executor is None
