"""The ``environment`` kind of ``env.tasks``: an EnvironmentInterface subclass named by reference and built with its
kwargs; its config-time checks name the entry and the fix; describe_environments records it with secrets redacted."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from rl.config import config_from_dict
from rl.environments import RewardConfigError, SlidingPuzzleEnvironment
from rl.environments.registry import build_environments, check_environment_specs, describe_environments

ROOT = Path(__file__).resolve().parents[3]
PUZZLE = "rl.environments.sliding_puzzle:SlidingPuzzleEnvironment"
RG = {"dataset": "chain_sum", "dataset_kwargs": {}, "seed": 1}
W = "env.tasks.t.environment"

pytestmark = pytest.mark.timeout(60)

ENV_FILE = """
from rl.environments.interfaces import EnvironmentInterface, single_turn_return


class Echo(EnvironmentInterface):
    reward_weights = {"echo": 1.0}

    def __init__(self, api_token, scale=1.0):
        self.api_token, self.scale = api_token, scale
        self.closed = False

    def step(self, message_log_batch, metadata):
        raise NotImplementedError

    def close(self):
        self.closed = True


class Abstract(EnvironmentInterface):
    reward_weights = {"x": 1.0}


class Unnamed(EnvironmentInterface):
    def step(self, message_log_batch, metadata):
        raise NotImplementedError


class Broken(EnvironmentInterface):
    reward_weights = {"x": 1.0}

    def __init__(self):
        raise RuntimeError("no GPU here")

    def step(self, message_log_batch, metadata):
        raise NotImplementedError
"""


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(ENV_FILE)
    return path


def _spec(ref, kwargs=None):
    body = {"class": ref} if kwargs is None else {"class": ref, "kwargs": kwargs}
    return {"t": {"environment": body}}


def test_a_class_builds_with_its_kwargs_and_no_worker_pool():
    envs = build_environments(
        {"puzzle": {"environment": {"class": PUZZLE, "kwargs": {"size": 2, "max_moves": 6}}}},
        num_workers=1,
        timeout_s=5.0,
        reasoning_gym_defaults=RG,
    )
    env = envs["puzzle"]
    assert type(env) is SlidingPuzzleEnvironment and (env.size, env.max_moves) == (2, 6)
    assert env.reward_weights == {"solved": 1.0}
    assert build_environments(_spec(PUZZLE), num_workers=1, timeout_s=5.0, reasoning_gym_defaults=RG)["t"].size == 3


def test_a_class_from_a_file_builds(env_file):
    envs = build_environments(
        _spec(f"{env_file}:Echo", {"api_token": "s3cret", "scale": 2.0}),
        num_workers=1,
        timeout_s=5.0,
        reasoning_gym_defaults=RG,
    )
    assert type(envs["t"]).__name__ == "Echo" and envs["t"].api_token == "s3cret" and envs["t"].scale == 2.0


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"class": 3}, f"{W}.class is 3. Give a string 'package.module:ClassName' or 'path/to/file.py:ClassName'"),
        ({"kwargs": {}}, f'{W} is {{\'kwargs\': {{}}}}. Give {{"class": "package.module:ClassName", "kwargs"'),
        ({"class": PUZZLE, "args": [1]}, f"{W} has unknown keys ['args']. Use only ['class', 'kwargs']."),
        ({"class": "SlidingPuzzle"}, f"{W}.class is 'SlidingPuzzle', not a class reference. Write 'package.module:"),
        ({"class": PUZZLE, "kwargs": [2]}, f"{W}.kwargs is [2]. Give a mapping of keyword arguments"),
    ],
)
def test_the_shape_of_an_environment_spec_is_checked_without_importing(body, expected):
    with pytest.raises(RewardConfigError) as info:
        check_environment_specs({"t": {"environment": body}}, check_functions=False)
    assert str(info.value).startswith(expected), str(info.value)


@pytest.mark.parametrize(
    ("ref", "kwargs", "expected"),
    [
        (
            "rl.environments.sliding_puzzle:make_puzzles",
            None,
            f"{W}.class 'rl.environments.sliding_puzzle:make_puzzles' is a function, not a subclass of "
            "rl.environments.EnvironmentInterface. Subclass rl.environments.EnvironmentInterface and implement step(",
        ),
        (
            "collections:OrderedDict",
            None,
            f"{W}.class 'collections:OrderedDict' is the class OrderedDict, not a subclass of rl.environments.",
        ),
        (
            PUZZLE,
            {"size": 2, "max_turns": 6},
            f"{W}.kwargs {{'size': 2, 'max_turns': 6}} do not fit SlidingPuzzleEnvironment(size: 'int' = 3, "
            "max_moves: 'int' = 12) (got an unexpected keyword argument 'max_turns'). Give only keyword arguments "
            "that SlidingPuzzleEnvironment.__init__ takes, and every one it requires.",
        ),
        (
            "no_such_package.envs:Puzzle",
            None,
            f"{W}.class 'no_such_package.envs:Puzzle' cannot be found (no module 'no_such_package.envs' on sys.path",
        ),
        (
            "rl.environments.sliding_puzzle:Puzzle",
            None,
            f"{W}.class 'rl.environments.sliding_puzzle:Puzzle' does not name a class (rl.environments.sliding_puzzle "
            "has no attribute 'Puzzle'",
        ),
        ("missing/my_env.py:Echo", None, f"{W}.class 'missing/my_env.py:Echo' cannot be found (no file "),
    ],
)
def test_a_bad_class_fails_at_config_time_naming_the_entry(ref, kwargs, expected):
    with pytest.raises(RewardConfigError) as info:
        check_environment_specs(_spec(ref, kwargs))
    assert str(info.value).startswith(expected), str(info.value)
    check_environment_specs(_spec(ref, kwargs), check_functions=False)  # the shape alone is fine


def test_file_classes_are_checked_for_abstract_methods_required_kwargs_and_a_failing_constructor(env_file):
    with pytest.raises(RewardConfigError, match=r"leaves the abstract methods \['step'\] unimplemented. Implement"):
        check_environment_specs(_spec(f"{env_file}:Abstract"))
    with pytest.raises(
        RewardConfigError, match=r"has the reward_weights None, not a class attribute naming its rewards"
    ):
        check_environment_specs(_spec(f"{env_file}:Unnamed"))
    with pytest.raises(RewardConfigError, match=r"\.kwargs \{\} do not fit Echo\(api_token, scale=1.0\) \(missing a"):
        check_environment_specs(_spec(f"{env_file}:Echo"))
    check_environment_specs(_spec(f"{env_file}:Echo", {"api_token": "x"}))
    with pytest.raises(RewardConfigError) as info:
        build_environments(_spec(f"{env_file}:Broken"), num_workers=1, timeout_s=5.0, reasoning_gym_defaults=RG)
    assert str(info.value).startswith(
        f"{W}.class '{env_file}:Broken' raised RuntimeError: no GPU here when constructed with kwargs {{}}. Fix the"
    )
    assert isinstance(info.value.__cause__, RuntimeError)


def test_the_config_refuses_a_bad_class_when_it_is_read():
    base = {"data": {"train": "runs/examples/puzzle.jsonl"}}
    with pytest.raises(ValueError, match=r"^config env.tasks.puzzle.environment.kwargs \{'sizes': 2\} do not fit"):
        config_from_dict(
            {**base, "env": {"tasks": {"puzzle": {"environment": {"class": PUZZLE, "kwargs": {"sizes": 2}}}}}}
        )
    cfg = config_from_dict({**base, "env": {"tasks": {"puzzle": {"environment": {"class": PUZZLE}}}}})
    assert cfg.task_specs() == {"puzzle": {"environment": {"class": PUZZLE}}}


def test_describe_environments_gives_the_class_its_source_hash_and_redacted_kwargs(env_file):
    specs = {
        "puzzle": {"environment": {"class": PUZZLE, "kwargs": {"size": 2, "max_moves": 6}}},
        "plain": {"environment": {"class": PUZZLE}},
        "echo": {
            "environment": {"class": f"{env_file}:Echo", "kwargs": {"api_token": "s3cret", "opts": {"password": 1}}}
        },
    }
    puzzle_sha = hashlib.sha256((ROOT / "rl/environments/sliding_puzzle.py").read_bytes()).hexdigest()[:12]
    file_sha = hashlib.sha256(env_file.read_bytes()).hexdigest()[:12]
    assert describe_environments(specs) == {
        "env.puzzle.environment": f'{PUZZLE} {puzzle_sha} kwargs={{"max_moves": 6, "size": 2}}',
        "env.plain.environment": f"{PUZZLE} {puzzle_sha}",
        "env.echo.environment": f"{env_file}:Echo {file_sha} "
        + 'kwargs={"api_token": "***", "opts": {"password": "***"}}',
    }
