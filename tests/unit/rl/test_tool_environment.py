"""``ToolEnvironment``: tool turns, parse errors, final answers, the call cap, metadata and metrics (real sandbox)."""

from __future__ import annotations

import json

import pytest
import torch

from rl.environments.interfaces import RewardError, weighted_total
from rl.environments.tools import PARSE_ERROR_PREFIX, ToolEnvironment, answers_match, final_answer


def _call(code: str, name: str = "python") -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"code": code}}) + "</tool_call>"


def _log(reply: str, question: str = "What is 12345*6789?") -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": reply, "token_ids": [1, 2]}]


def _meta(i: int, answer: object = "83810205", **extra) -> dict:
    return {"answer": answer, "prompt": "What is 12345*6789?", "row_id": f"r{i}", "task_name": "arith", **extra}


def test_a_batch_of_tool_call_bad_call_right_and_wrong_answers():
    env = ToolEnvironment(timeout_s=5.0)
    logs = [
        _log("Let me compute." + _call("12345*6789")),
        _log('<tool_call>{"name": "python", "arguments": {"code": 1+1}}</tool_call>'),
        _log("The product is <answer>83,810,205</answer>"),
        _log("The product is 83810206."),
    ]
    metas = [_meta(i, extra_column=i) for i in range(4)]
    ret = env.step(logs, metas)
    assert ret.observations[0] == {"role": "tool", "content": "83810205"}
    assert ret.observations[1]["role"] == "user"
    assert ret.observations[1]["content"].startswith(PARSE_ERROR_PREFIX + "tool call 1 is not valid JSON")
    assert (
        '<tool_call>{"name": "python", "arguments": {"code": "<Python code>"}}</tool_call>'
        in ret.observations[1]["content"]
    )
    assert ret.terminateds.tolist() == [False, False, True, True]
    assert set(ret.rewards) == {"correct"} and env.reward_weights == {"correct": 1.0}
    assert ret.rewards["correct"].dtype == torch.float32
    assert ret.rewards["correct"].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert weighted_total(ret.rewards, env.reward_weights).tolist() == [0.0, 0.0, 1.0, 0.0]
    assert ret.answers == [None, None, "83,810,205", "83810206"]
    assert ret.next_stop_strings == [None] * 4
    for i, m in enumerate(ret.metadata):  # the input metadata is carried, plus the counts
        assert {k: m[k] for k in ("answer", "row_id", "task_name", "extra_column")} == {
            "answer": "83810205",
            "row_id": f"r{i}",
            "task_name": "arith",
            "extra_column": i,
        }
    assert [(m["tool_calls"], m["tool_errors"], m["parse_errors"]) for m in ret.metadata] == [
        (1, 0, 0),
        (0, 0, 1),
        (0, 0, 0),
        (0, 0, 0),
    ]
    assert "tool_calls" not in metas[0]  # the input is not mutated


def test_counts_carry_over_turns_and_tool_errors_are_counted():
    env = ToolEnvironment(timeout_s=5.0)
    ret = env.step([_log(_call("1/0")), _log(_call("2+2", name="shell"))], [_meta(0, tool_calls=2), _meta(1)])
    assert ret.observations[0] == {"role": "tool", "content": "Error: ZeroDivisionError: division by zero"}
    assert ret.observations[1] == {"role": "tool", "content": "Error: unknown tool 'shell'; the only tool is 'python'"}
    assert [(m["tool_calls"], m["tool_errors"]) for m in ret.metadata] == [(3, 1), (1, 1)]
    two = env.step([_log("Both: " + _call("6*7") + _call("print('hi')"))], [_meta(0)])
    assert two.observations[0] == {"role": "tool", "content": "[1] 42\n[2] hi"}
    assert two.metadata[0]["tool_calls"] == 2


def test_the_tool_call_cap_ends_the_sample_with_reward_zero_but_a_final_answer_is_still_scored():
    env = ToolEnvironment(max_tool_calls=2)
    capped = _meta(0, tool_calls=1, parse_errors=1)
    ret = env.step(
        [_log(_call("1")), _log("<tool_call>{oops</tool_call>"), _log("<answer>83810205</answer>")],
        [
            capped,
            dict(capped, row_id="r1"),
            dict(capped, row_id="r2"),
        ],
    )
    assert ret.terminateds.tolist() == [True, True, True]
    assert ret.rewards["correct"].tolist() == [0.0, 0.0, 1.0]
    assert [m["tool_calls"] for m in ret.metadata] == [1, 1, 1]  # the capped call did not run
    assert [m["parse_errors"] for m in ret.metadata] == [1, 2, 1]
    under = env.step([_log(_call("1"))], [_meta(0, tool_calls=1)])
    assert under.terminateds.tolist() == [False] and under.metadata[0]["tool_calls"] == 2
    over = env.step([_log(_call("1") + _call("2"))], [_meta(0, tool_calls=1)])  # two calls, one left
    assert over.terminateds.tolist() == [True] and over.observations[0]["role"] == "environment"


def test_metrics_from_the_last_metadata_or_from_the_message_logs():
    env = ToolEnvironment()
    metas = [
        _meta(0, tool_calls=2, tool_errors=1, parse_errors=0),
        _meta(1, tool_calls=0, tool_errors=0, parse_errors=3),
    ]
    batch = {"metadata": metas, "rewards": torch.zeros(2)}
    out, metrics = env.global_post_process_and_metrics(batch)
    assert out is batch
    assert metrics == {"tool_calls": 1.0, "tool_errors": 1.0, "parse_errors": 3.0}
    logs = [
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": _call("1/0")},
            {"role": "tool", "content": "Error: ZeroDivisionError: division by zero"},
            {"role": "assistant", "content": _call("2")},
            {"role": "tool", "content": "2"},
            {"role": "assistant", "content": "<answer>2</answer>"},
        ],
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "<tool_call>x</tool_call>"},
            {"role": "user", "content": PARSE_ERROR_PREFIX + "tool call 1 is not valid JSON"},
            {"role": "assistant", "content": "2"},
        ],
    ]
    _, from_logs = env.global_post_process_and_metrics({"message_log": logs, "metadata": [None, None]})
    assert from_logs == {"tool_calls": 1.0, "tool_errors": 1.0, "parse_errors": 1.0}
    assert env.global_post_process_and_metrics({}) == ({}, {})


def test_metadata_without_the_answer_key_names_the_sample_and_the_fix():
    env = ToolEnvironment(answer_key="target")
    with pytest.raises(RewardError) as err:
        env.step([_log("42"), _log("43")], [{"target": "42", "row_id": "a"}, {"answer": "43", "row_id": "b"}])
    msg = str(err.value)
    assert "sample 1 of the batch (row_id 'b') has no 'target' in its metadata" in msg
    assert "kwargs.answer_key" in msg
    with pytest.raises(RewardError, match="does not end with an assistant message"):
        env.step([[{"role": "user", "content": "q"}]], [{"target": "1"}])
    with pytest.raises(ValueError, match="must be positive"):
        ToolEnvironment(max_tool_calls=0)


@pytest.mark.parametrize(
    ("text", "ref", "want"),
    [
        ("so it is 83810205", 83810205, True),
        ("<answer>83,810,205.0</answer>", "83810205", True),
        ("<answer>x = 42</answer> then 7", "42", True),
        ("<answer>41</answer> 42", "42", False),
        ("no number", "42", False),
        ("<answer>Paris</answer>", "Paris", True),
        ("-3.50", "-3.5", True),
    ],
)
def test_final_answers_are_compared_numerically(text, ref, want):
    assert answers_match(final_answer(text), ref) is want


def test_the_example_dataset_is_seeded_and_solved_by_a_tool_call_then_the_answer():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[3] / "examples" / "tool_arithmetic" / "make_dataset.py"
    spec = importlib.util.spec_from_file_location("tool_arithmetic_make_dataset", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.rows(3, seed=7)
    assert rows == mod.rows(3, seed=7) and rows != mod.rows(3, seed=8)
    python = {" plus ": " + ", ", all times ": ") * ", " times ": " * ", " minus ": " - "}
    for r in rows:
        words = r["prompt"].split("What is ")[1].split("?")[0]
        numbers = [int(x) for x in words.replace(",", " ").split() if x.isdigit()]
        assert all(10**4 <= x < 10**6 for x in numbers) and len(numbers) in (2, 3) and r["task"] == "arith"
        expr = "(" * ("all times" in words) + words
        for w, op in python.items():
            expr = expr.replace(w, op)
        assert r["answer"] == str(eval(expr, {"__builtins__": {}}))  # noqa: S307  (digits and + - * ( ) only)
    messages = mod.rows(1, seed=0, messages=True)[0]["prompt"]
    assert [m["role"] for m in messages] == ["system", *["user", "assistant", "tool", "assistant"] * 2, "user"]
    env = ToolEnvironment()
    question = rows[0]["prompt"]
    words = question.split("What is ")[1].split("?")[0]
    expr = "(" * ("all times" in words) + words
    for w, op in python.items():
        expr = expr.replace(w, op)
    log = _log(_call(expr), question=question)
    meta = {"answer": rows[0]["answer"], "row_id": "r0"}
    first = env.step([log], [meta])
    assert first.observations[0] == {"role": "tool", "content": rows[0]["answer"]}
    log = [
        *log,
        first.observations[0],
        {"role": "assistant", "content": f"<answer>{first.observations[0]['content']}</answer>"},
    ]
    second = env.step([log], first.metadata)
    assert second.terminateds.tolist() == [True] and second.rewards["correct"].tolist() == [1.0]
    assert env.global_post_process_and_metrics({"metadata": second.metadata})[1] == {
        "tool_calls": 1.0,
        "tool_errors": 0.0,
        "parse_errors": 0.0,
    }


def test_the_config_loader_accepts_the_readme_spec():
    from rl.environments.registry import environment_class

    kwargs = {"answer_key": "answer", "max_tool_calls": 3, "timeout_s": 5.0, "memory_mb": 256}
    cls = environment_class("rl.environments.tools:ToolEnvironment", kwargs=kwargs)
    assert cls is ToolEnvironment and cls.reward_weights == {"correct": 1.0}
    assert cls(**kwargs).max_tool_calls == 3
