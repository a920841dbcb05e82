"""The environment interface, the reasoning-gym environment (the same rewards as rl.data.score) and the registry
that builds a run's environments from its config."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

from rl.data import score, train_problems
from rl.environments import EnvironmentInterface, EnvironmentReturn, RewardConfigError, RewardError, weighted_total
from rl.environments.reasoning_gym import SCORER, ReasoningGymEnvironment
from rl.environments.registry import build_environments, check_environment_specs, describe_environments
from rl.environments.workers import RewardWorkerPool

ROOT = Path(__file__).resolve().parents[3]
FIX = "tests.unit.rl.reward_fixtures"
KW = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
RG = {"dataset": "chain_sum", "dataset_kwargs": KW, "seed": 1}

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pool():
    p = RewardWorkerPool(2, 30.0).attach()
    yield p
    p.shutdown()


# --- weighted_total ---------------------------------------------------------------------------------------------------
def test_weighted_total_of_named_rewards_leaves_nan_terms_out():
    nan = math.nan
    rewards = {"acc": torch.tensor([1.0, 0.0, nan, 1.0]), "fmt": torch.tensor([1.0, nan, 1.0, 0.0])}
    total = weighted_total(rewards, {"acc": 2.0, "fmt": 0.5})
    assert total.dtype == torch.float32
    assert total.tolist() == [2.5, 0.0, 0.5, 2.0]


def test_weighted_total_passes_a_tensor_through_as_float32():
    total = weighted_total(torch.tensor([1.0, 0.25], dtype=torch.float64), {"reasoning_gym": 1.0})
    assert total.dtype == torch.float32 and total.tolist() == [1.0, 0.25]


def test_weighted_total_refuses_a_sample_without_any_reward():
    rewards = {"acc": torch.tensor([1.0, math.nan, math.nan]), "fmt": torch.tensor([0.0, math.nan, math.nan])}
    with pytest.raises(RewardError) as info:
        weighted_total(rewards, {"acc": 1.0, "fmt": 1.0}, row_ids=["a", "b", "c"])
    msg = str(info.value)
    assert "no reward applies to sample 1 of the batch (row_id 'b'): every one of ['acc', 'fmt'] returned None" in msg
    assert "(2 of 3 samples alike)" in msg
    with pytest.raises(RewardError, match=r"the reward of sample 0 of the batch is NaN \(1 of 2 samples\)"):
        weighted_total(torch.tensor([math.nan, 1.0]), {"x": 1.0})
    with pytest.raises(RewardError, match=r"returned rewards \['acc'\] but its reward_weights name \['acc', 'fmt'\]"):
        weighted_total({"acc": torch.tensor([1.0])}, {"acc": 1.0, "fmt": 1.0})


def test_the_interface_defaults():
    class Constant(EnvironmentInterface):
        reward_weights = {"one": 1.0}

        def step(self, message_log_batch, metadata):
            raise NotImplementedError

    with Constant() as env:
        assert env.global_post_process_and_metrics({"x": 1}) == ({"x": 1}, {})
    with pytest.raises(TypeError):
        EnvironmentInterface()


# --- reasoning gym ----------------------------------------------------------------------------------------------------
def test_reasoning_gym_rewards_equal_rl_data_score_sample_by_sample(pool):
    problems = train_problems(dataset="chain_sum", dataset_kwargs=KW, seed=1, val_fraction=0.2, start=0, count=24)
    texts = []
    for i, p in enumerate(problems):
        right, wrong = p.answer, str(int(p.answer) + 1)
        texts.append(
            [
                f"<answer>{right}</answer>",
                f"The answer is {right}.",
                f"<answer>{wrong}</answer>",
                f"{p.question} {wrong}",
                "\u00bf\x00 no idea }{",
                "",
            ][i % 6]
        )
    logs = [
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": p.question},
            {"role": "assistant", "content": t, "token_ids": [1]},
        ]
        for p, t in zip(problems, texts, strict=True)
    ]
    meta = [{**p.entry, "prompt": p.question, "row_id": p.row_id, "task_name": "chain_sum"} for p in problems]
    expected = [score(p, t, "chain_sum", KW, 1) for p, t in zip(problems, texts, strict=True)]
    with ReasoningGymEnvironment("chain_sum", KW, 1, num_workers=2, timeout_s=30.0, pool=pool) as env:
        assert env.reward_weights == {"reasoning_gym": 1.0}
        out = env.step(logs, meta)
    assert isinstance(out, EnvironmentReturn)
    assert out.rewards.dtype == torch.float32 and out.rewards.tolist() == expected
    assert {0.0, 1.0} <= set(expected)  # both right and wrong answers are in the mix
    assert out.answers[0] == problems[0].answer and out.answers[4] == "\u00bf\x00 no idea }{"
    assert out.terminateds.all() and out.metadata == meta


def test_a_bad_reasoning_gym_dataset_fails_at_construction(pool):
    with pytest.raises(ValueError, match="'no_such_dataset' with dataset_kwargs={} is not a valid reasoning-gym"):
        ReasoningGymEnvironment("no_such_dataset", {}, 1, num_workers=1, timeout_s=5.0, pool=pool)


# --- registry ---------------------------------------------------------------------------------------------------------
def test_build_environments_shares_one_pool_and_stops_it_with_the_last_environment():
    specs = {
        "chain_sum": {"reasoning_gym": {}},
        "math": {
            "reward_functions": [
                {"function": f"{FIX}:reward_len", "weight": 0.5, "name": "len"},
                f"{FIX}:math_reward_func",
            ]
        },
    }
    envs = build_environments(specs, num_workers=1, timeout_s=30.0, reasoning_gym_defaults=RG)
    assert isinstance(envs["chain_sum"], ReasoningGymEnvironment)
    assert envs["math"].reward_weights == {"len": 0.5, "math_reward_func": 1.0}
    shared = envs["chain_sum"]._pool
    assert envs["math"]._pool is shared
    log = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "42", "token_ids": [3]}]
    out = envs["math"].step([log], [{"prompt": "q", "task": "math", "row_id": "r", "task_name": "math"}])
    assert out.rewards["len"].tolist() == [-18.0] and out.rewards["math_reward_func"].tolist() == [1.0]
    envs["chain_sum"].close()
    assert shared._executor is not None  # the math environment still uses it
    envs["math"].close()
    assert shared._executor is None and shared._closed


@pytest.mark.parametrize(
    ("specs", "expected"),
    [
        ([], "env.tasks is a list. Give a mapping"),
        ({"t": {"reward_model": {}}}, "env.tasks.t is ['reward_model']. Give exactly one of ['reasoning_gym', 'rew"),
        ({"t": {"reasoning_gym": {"dataset": 3}}}, "env.tasks.t.reasoning_gym.dataset is 3. Give a str."),
        ({"t": {"reasoning_gym": {"size": 3}}}, "env.tasks.t.reasoning_gym has unknown keys ['size']. Use only"),
        ({"t": {"reward_functions": []}}, "env.tasks.t.reward_functions is []. Give a non-empty list"),
        ({"t": {"reward_functions": [{"weight": 1}]}}, "env.tasks.t.reward_functions[0] is {'weight': 1}. Give"),
        (
            {"t": {"reward_functions": [{"function": f"{FIX}:reward_len", "weight": "high"}]}},
            "env.tasks.t.reward_functions[0].weight is 'high'. Give a finite number.",
        ),
        (
            {"t": {"reward_functions": [{"function": f"{FIX}:reward_len", "scale": 2}]}},
            "env.tasks.t.reward_functions[0] has unknown keys ['scale']. Use only ['function', 'weight', 'name'].",
        ),
        (
            {"t": {"reward_functions": [f"{FIX}:reward_len", {"function": "other:fn", "name": "reward_len"}]}},
            "env.tasks.t.reward_functions[1] has the reward name 'reward_len' of entry [0]. Give one of them a",
        ),
        (
            {"t": {"reward_functions": [{"function": f"{FIX}:no_kwargs"}]}},
            "env.tasks.t.reward_functions[0].function: reward function 'tests.unit.rl.reward_fixtures:no_kwargs' "
            "does not accept **kwargs",
        ),
    ],
)
def test_check_environment_specs_names_the_entry_and_the_fix(specs, expected):
    with pytest.raises(RewardConfigError) as info:
        check_environment_specs(specs)
    assert str(info.value).startswith(expected), str(info.value)


def test_check_environment_specs_names_the_entry_where_the_user_wrote_it():
    specs = {"default": {"reward_functions": [{"function": f"{FIX}:reward_len", "weight": None}]}}
    with pytest.raises(RewardConfigError, match=r"^env.reward_functions\[0\].weight is None. Give a finite number."):
        check_environment_specs(specs, task_paths={"default": "env"})


def test_describe_environments_gives_each_reward_its_function_and_source_hash():
    specs = {
        "chain_sum": {"reasoning_gym": {"dataset_kwargs": KW}},
        "math": {"reward_functions": [{"function": f"{FIX}:reward_len", "name": "len"}]},
    }
    assert SCORER == "rl.environments.reasoning_gym:score_completions"
    fixture_sha = hashlib.sha256((ROOT / "tests/unit/rl/reward_fixtures.py").read_bytes()).hexdigest()[:12]
    scorer_sha = hashlib.sha256((ROOT / "rl/environments/reasoning_gym.py").read_bytes()).hexdigest()[:12]
    assert describe_environments(specs, reasoning_gym_defaults=RG) == {
        "env.chain_sum.reasoning_gym": f"{SCORER} {scorer_sha} dataset=chain_sum",
        "env.math.len": f"{FIX}:reward_len {fixture_sha}",
    }
