"""The config of a user's task (``data`` with files, ``env`` with tasks and reward functions): what it resolves to,
and every inconsistency refused at config time with the key and the fix."""

from __future__ import annotations

import pytest

from rl.config import config_from_dict
from tasks.run_config import check_placement, run_config_from_dict

RF = {"reward_functions": [{"function": "tests.rewards:earnable"}]}


def test_the_default_is_reasoning_gym_scored_by_its_own_scorer():
    cfg = config_from_dict({})
    assert not cfg.data.from_files
    assert cfg.task_specs() == {
        "chain_sum": {"reasoning_gym": {"dataset": "chain_sum", "dataset_kwargs": cfg.data.dataset_kwargs, "seed": 42}}
    }
    assert cfg.default_task == "chain_sum"


def test_one_task_of_files_is_named_default():
    cfg = config_from_dict({"data": {"train": "x.jsonl"}, "env": {"reward_functions": RF["reward_functions"]}})
    assert cfg.task_specs() == {"default": RF}
    assert cfg.default_task == "default"


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"data": {"train": "x.jsonl"}}, r"^config env: has no reward for the prompts of data.train='x.jsonl'"),
        ({"data": {"task_key": "task", "train": "x.jsonl"}, "env": RF}, r"^config data.task_key: is 'task' but env"),
        (
            {"data": {"train": "x.jsonl"}, "env": {"tasks": {"a": RF, "b": RF}}},
            r"^config data.task_key: is null with 2 tasks in env.tasks \(\['a', 'b'\]\); name the column",
        ),
        ({"env": {"tasks": {"a": RF}, **RF}}, r"^config env.reward_functions: is set beside env.tasks"),
        ({"env": {"tasks": {"a": RF}}}, r"^config env.tasks: has no entry for the reasoning-gym dataset 'chain_sum'"),
        ({"data": {"validation": "v.jsonl"}}, r"^config data.validation: is set without data.train"),
        ({"data": {"on_overlong_prompt": "truncate"}}, r"^config data.on_overlong_prompt: is 'truncate'; use one of"),
        ({"data": {"prompt_key": ""}}, r"^config data.prompt_key: is an empty string"),
        ({"env": {"timeout_s": 0}}, r"^config env.timeout_s: is 0.0; use a positive number"),
        ({"env": {"reward_functions": ["tests.rewards:earnable"]}}, r"^config env.reward_functions: expected a list"),
        (
            {"data": {"train": "s3://bucket/x.jsonl", "validation": "https://u:p@host/v.jsonl"}, "env": RF},
            r"data.validation",
        ),
        (
            {"data": {"train": "s3://bucket/x.jsonl?token=1", "validation": "https://host/v.jsonl"}, "env": RF},
            r"^config data.train: 's3://bucket/x.jsonl\?token=\*\*\*' holds credentials \(the parameter 'token'\)",
        ),
    ],
)
def test_inconsistent_tasks_are_refused_with_the_key_and_the_fix(values, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict(values)


def test_a_reward_function_that_does_not_exist_is_refused_at_config_time():
    with pytest.raises(ValueError, match=r"tests\.rewards:no_such_function"):
        config_from_dict({"env": {"reward_functions": [{"function": "tests.rewards:no_such_function"}]}})
    with pytest.raises(ValueError, match=r"missing_file\.py"):
        config_from_dict({"env": {"reward_functions": [{"function": "missing_file.py:f"}]}})


def test_a_remote_run_refuses_a_local_dataset_and_reward_code_its_pods_cannot_import(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "2+2?"}\n')
    remote = {"dataplane": {"root": "s3://bucket/runs"}, "env": RF}
    cfg = run_config_from_dict({**remote, "data": {"train": str(data)}})
    with pytest.raises(ValueError, match=r"^config data.train: is '.*prompts.jsonl', a path on this machine"):
        check_placement(cfg, local=False)
    check_placement(cfg, local=True)  # a local run reads it where it is

    outside = tmp_path / "my_rewards.py"
    outside.write_text("def r(completions, **kw):\n    return [1.0 for _ in completions]\n")
    cfg = run_config_from_dict(
        {
            **remote,
            "data": {"train": "s3://bucket/p.jsonl"},
            "env": {"reward_functions": [{"function": f"{outside}:r"}]},
        }
    )
    with pytest.raises(ValueError, match=r"^config env.reward_functions\[0\]: .*cannot be imported in the run's pods"):
        check_placement(cfg, local=False)
    check_placement(
        run_config_from_dict({**remote, "data": {"train": "s3://bucket/p.jsonl"}}), local=False
    )  # a module of the project folder ships with fast registration
