"""A tool-calling environment: the model may run Python in a limited subprocess before it answers.

Modules: ``sandbox`` (``evaluate``: one call in a fresh subprocess with time, memory, network, file and process
guards; read its docstring for what it does not protect against), ``parsing`` (tool calls in a completion, the tool's
schema, a tools prompt for any chat template), ``answers`` (final answer and comparison), ``environment``
(``ToolEnvironment``). Use it in a config as ``class: "rl.environments.tools:ToolEnvironment"`` with the multi-turn
rollout loop (``grpo.max_rollout_turns > 1``).
"""

from __future__ import annotations

from rl.environments.tools.answers import answers_match, final_answer
from rl.environments.tools.environment import PARSE_ERROR_PREFIX, ToolEnvironment
from rl.environments.tools.parsing import (
    TOOLS_INSTRUCTION,
    ParseError,
    ToolCall,
    parse_fallback,
    parse_tool_calls,
    render_tools_prompt,
    tool_schema,
)
from rl.environments.tools.sandbox import ToolResult, evaluate

__all__ = [
    "PARSE_ERROR_PREFIX",
    "TOOLS_INSTRUCTION",
    "ParseError",
    "ToolCall",
    "ToolEnvironment",
    "ToolResult",
    "answers_match",
    "evaluate",
    "final_answer",
    "parse_fallback",
    "parse_tool_calls",
    "render_tools_prompt",
    "tool_schema",
]
