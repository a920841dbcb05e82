"""Environments: what turns a batch of completions into rewards (NeMo-RL's ``EnvironmentInterface``), with
reasoning-gym scoring and TRL-signature reward functions run in isolated worker processes.

Modules: ``interfaces`` (the interface, ``weighted_total``, the errors), ``workers`` (the process pool),
``reasoning_gym``, ``reward_functions``, ``rewards`` (built-in reward functions), ``sliding_puzzle`` (a multi-turn
game), ``registry`` (from the config).
The names below are imported on first use, so a reward worker that imports this package loads nothing else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "EnvironmentInterface": "interfaces",
    "EnvironmentReturn": "interfaces",
    "RewardConfigError": "interfaces",
    "RewardError": "interfaces",
    "weighted_total": "interfaces",
    "ReasoningGymEnvironment": "reasoning_gym",
    "SlidingPuzzleEnvironment": "sliding_puzzle",
    "RewardFunctionEnvironment": "reward_functions",
    "RewardFunctionSpec": "reward_functions",
    "check_reward_function": "reward_functions",
    "importable_in_pod": "reward_functions",
    "source_hash": "reward_functions",
    "build_environments": "registry",
    "check_environment_specs": "registry",
    "describe_environments": "registry",
    "RewardWorkerPool": "workers",
    "ToolEnvironment": "tools",
    "ToolCall": "tools",
    "ToolResult": "tools",
    "ParseError": "tools",
    "evaluate": "tools",
    "parse_tool_calls": "tools",
    "render_tools_prompt": "tools",
    "tool_schema": "tools",
}

__all__ = [
    "EnvironmentInterface",
    "EnvironmentReturn",
    "ReasoningGymEnvironment",
    "RewardConfigError",
    "RewardError",
    "RewardFunctionEnvironment",
    "RewardFunctionSpec",
    "RewardWorkerPool",
    "ParseError",
    "SlidingPuzzleEnvironment",
    "ToolCall",
    "ToolEnvironment",
    "ToolResult",
    "build_environments",
    "check_environment_specs",
    "check_reward_function",
    "describe_environments",
    "evaluate",
    "importable_in_pod",
    "parse_tool_calls",
    "render_tools_prompt",
    "source_hash",
    "tool_schema",
    "weighted_total",
]

if TYPE_CHECKING:
    from rl.environments.interfaces import (
        EnvironmentInterface,
        EnvironmentReturn,
        RewardConfigError,
        RewardError,
        weighted_total,
    )
    from rl.environments.reasoning_gym import ReasoningGymEnvironment
    from rl.environments.registry import build_environments, check_environment_specs, describe_environments
    from rl.environments.reward_functions import (
        RewardFunctionEnvironment,
        RewardFunctionSpec,
        check_reward_function,
        importable_in_pod,
        source_hash,
    )
    from rl.environments.sliding_puzzle import SlidingPuzzleEnvironment
    from rl.environments.tools import (
        ParseError,
        ToolCall,
        ToolEnvironment,
        ToolResult,
        evaluate,
        parse_tool_calls,
        render_tools_prompt,
        tool_schema,
    )
    from rl.environments.workers import RewardWorkerPool


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rl.environments' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rl.environments.{module}"), name)
