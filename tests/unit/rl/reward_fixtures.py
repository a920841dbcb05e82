"""Reward functions for the environment tests: the examples of TRL's ``GRPOTrainer`` documentation, unchanged, and
misbehaving ones (hang, crash, raise, wrong results) that trigger on a marker in the completion text."""

import os
import re
import signal
import sys
import time


# --- TRL documentation examples (GRPOTrainer, "Using a custom reward function"), verbatim -----------------------------
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def reward_num_tokens(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            rewards.append(1.0 if "42" in completion else 0.0)
        else:
            rewards.append(None)  # "does not apply" for other tasks
    return rewards


# --- what the worker sees ---------------------------------------------------------------------------------------------
def sees(prompts, completions, completion_ids, **kwargs):
    """1.0 where every argument arrived for the sample, as TRL passes them (row_id and task_name among the columns)."""
    ok = len(prompts) == len(completions) == len(completion_ids) == len(kwargs["row_id"]) == len(kwargs["task_name"])
    kwargs["log_metric"]("seen", 1.0)
    kwargs["log_extra"]("column", list(completions))
    return [float(ok and "trainer_state" not in kwargs) for _ in completions]


def torch_imported(completions, **kwargs):
    return [float("torch" in sys.modules) for _ in completions]


def main_module_file(completions, **kwargs):
    """1.0 where the worker's ``__main__`` is the parent's script re-run (it should not be)."""
    return [float(sys.modules["__main__"].__name__ == "__mp_main__") for _ in completions]


# --- misbehaving ------------------------------------------------------------------------------------------------------
def sleeps_forever(completions, **kwargs):
    if any("HANG" in c for c in completions):
        while True:
            time.sleep(0.05)
    return [0.0 for _ in completions]


def crashes(completions, **kwargs):
    if any("CRASH" in c for c in completions):
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0 for _ in completions]


def exits(completions, **kwargs):
    if any("EXIT" in c for c in completions):
        os._exit(3)
    return [0.0 for _ in completions]


def raises(completions, **kwargs):
    return [1.0 / ("BOOM" not in c) for c in completions]


def wrong_length(completions, **kwargs):
    return [0.0 for _ in completions][:-1]


def nan_on_marker(completions, **kwargs):
    return [float("nan") if "NAN" in c else 0.0 for c in completions]


def inf_on_marker(completions, **kwargs):
    return [float("inf") if "INF" in c else 0.0 for c in completions]


def string_on_marker(completions, **kwargs):
    return ["1.0" if "STR" in c else 0.0 for c in completions]


def returns_dict(completions, **kwargs):
    return {"reward": [0.0 for _ in completions]}


def no_kwargs(completions):
    return [0.0 for _ in completions]


NOT_A_FUNCTION = 3
