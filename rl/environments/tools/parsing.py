"""Tool calls in a completion, the built-in tool's schema, and a tools prompt that works with any chat template.

Two formats are parsed:

* the tokenizer's own: where the installed transformers' tokenizer has a ``response_template`` (transformers >= 5,
  ``PreTrainedTokenizerBase.parse_response``), its parser reads the completion and its ``tool_calls``
  (``[{"type": "function", "function": {"name": str, "arguments": dict}}]``) are the calls;
* the fallback (Hermes / Qwen2.5 style, the one ``render_tools_prompt`` teaches a template that ignores ``tools=``,
  as SmolLM2's does): one JSON object per call between tags,
  ``<tool_call>{"name": "python", "arguments": {"code": "print(1 + 1)"}}</tool_call>``. A last ``<tool_call>`` with
  no closing tag is accepted when its JSON is complete, because vLLM drops a matched stop string
  (``</tool_call>``) from the output unless ``include_stop_str_in_output`` is set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

TOOL_NAME = "python"
"""The built-in tool's name."""

OPEN, CLOSE = "<tool_call>", "</tool_call>"

FALLBACK_FORMAT = f'{OPEN}{{"name": "{TOOL_NAME}", "arguments": {{"code": "<Python code>"}}}}{CLOSE}'
"""The fallback call format, as shown to the model."""

TOOLS_INSTRUCTION = (
    "You can run Python code with the tool `python` (a calculator and more). To call it, write exactly\n"
    f"{FALLBACK_FORMAT}\n"
    "with the code as a JSON string (escape newlines as \\n). The code's printed output (and the value of its last "
    "expression) comes back in a message from the tool. When you know the result, answer without a tool call and "
    "put the final answer in <answer>...</answer>."
)
"""The system instruction ``render_tools_prompt`` prepends when the chat template ignores ``tools=``."""


class ParseError(ValueError):
    """A completion contains a tool call that cannot be read; the message says what is wrong and the format."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call: the tool's ``name`` and its ``arguments`` (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


def tool_schema() -> dict[str, Any]:
    """The built-in ``python`` tool as a JSON schema for ``apply_chat_template(tools=[...])`` (the OpenAI /
    transformers function-tool format: ``{"type": "function", "function": {"name", "description", "parameters"}}``)."""
    return {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": (
                "Run Python code and return what it prints; the value of a final expression is printed too, so "
                "'12345*6789' returns 83810205. No network, no files outside a scratch folder, 5 s limit."
            ),
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The Python code to run."}},
                "required": ["code"],
            },
        },
    }


def _to_call(obj: Any, where: str) -> ToolCall:
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]  # the OpenAI / transformers shape {"type": "function", "function": {...}}
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        msg = f"{where} is not an object with a string 'name' (got {json.dumps(obj)[:200]}); write {FALLBACK_FORMAT}"
        raise ParseError(msg)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI serializes arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ParseError(
                f"the arguments of {where} are a string that is not JSON ({e}); write {FALLBACK_FORMAT}"
            ) from e
    if not isinstance(args, dict):
        msg = f"the arguments of {where} are {type(args).__name__}, not an object; write {FALLBACK_FORMAT}"
        raise ParseError(msg)
    return ToolCall(name=obj["name"], arguments=args)


def _parse_json_call(body: str, where: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        msg = (
            f"{where} is not valid JSON ({e.msg} at character {e.pos}: {body.strip()[:200]!r}); write {FALLBACK_FORMAT}"
        )
        raise ParseError(msg) from e
    return _to_call(obj, where)


def parse_fallback(text: str) -> list[ToolCall]:
    """The calls of the fallback format in ``text``, in order; ``[]`` when there is no ``<tool_call>``.

    Raises:
        ParseError: a call's body is not JSON, not an object with a string ``name`` and object ``arguments``, or a
            ``<tool_call>`` is not closed (other than a complete last one, see the module docstring).
    """
    calls: list[ToolCall] = []
    pos = 0
    k = 0
    while (start := text.find(OPEN, pos)) != -1:
        k += 1
        where = f"tool call {k}"
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        nxt = text.find(OPEN, body_start)
        if end == -1 or (nxt != -1 and nxt < end):
            if nxt != -1:
                raise ParseError(f"{where} has no closing {CLOSE} before the next {OPEN}; write {FALLBACK_FORMAT}")
            try:
                calls.append(_parse_json_call(text[body_start:], where))
            except ParseError as e:
                raise ParseError(f"{where} is not closed with {CLOSE} and its text is incomplete: {e}") from e
            return calls
        calls.append(_parse_json_call(text[body_start:end], where))
        pos = end + len(CLOSE)
    return calls


def parse_tool_calls(
    text: str, *, tokenizer: Any = None, prefix: str = "", tools: list[dict] | None = None
) -> list[ToolCall]:
    """The tool calls of one completion, in order; ``[]`` when it has none (a final answer).

    With a ``tokenizer`` whose ``response_template`` is set, its ``parse_response(text, prefix=prefix, tools=tools)``
    (transformers) parses; otherwise the fallback format does (``parse_fallback``).

    Args:
        text: the completion's text (model output only).
        tokenizer: a transformers tokenizer, or None for the fallback format.
        prefix: the rendered prompt before the completion (transformers needs it to parse templates that pre-write
            part of the reply).
        tools: the tool schemas given to the template, to cast arguments by type.

    Raises:
        ParseError: a call cannot be read; the message says why and shows the expected format.
    """
    if tokenizer is not None and getattr(tokenizer, "response_template", None) is not None:
        try:
            message = tokenizer.parse_response(text, prefix=prefix, tools=tools)
        except (ValueError, KeyError) as e:
            raise ParseError(f"the tokenizer's response parser could not read the completion: {e}") from e
        raw = message.get("tool_calls") or []
        return [_to_call(c, f"tool call {k + 1}") for k, c in enumerate(raw)]
    return parse_fallback(text)


def with_tools_instruction(messages: list[dict], instruction: str = TOOLS_INSTRUCTION) -> list[dict]:
    """``messages`` with ``instruction`` prepended: to the first message's content when it is a system message,
    else as a new system message in front."""
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{instruction}\n\n{first['content']}"
        return [first, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]


def template_uses_tools(tokenizer: Any, messages: list[dict], tools: list[dict]) -> bool:
    """Whether the chat template renders ``tools=`` at all (the prompt differs with and without it)."""
    with_tools = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return with_tools != without


def render_tools_prompt(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt text for ``messages`` with ``tools`` (default ``[tool_schema()]``), ready for generation.

    ``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)`` when the
    template renders tools; when it ignores them (same text with and without, e.g. SmolLM2's), the messages get
    ``TOOLS_INSTRUCTION`` (the fallback format and the tool) as a system instruction first
    (``with_tools_instruction``) and are rendered without ``tools``. Note that SmolLM2-style templates also insert
    their default system prompt only when there is no system message, so the instruction replaces it.
    """
    tools = [tool_schema()] if tools is None else tools
    if template_uses_tools(tokenizer, messages, tools):
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer.apply_chat_template(with_tools_instruction(messages), add_generation_prompt=True, tokenize=False)
