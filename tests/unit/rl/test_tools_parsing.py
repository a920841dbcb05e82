"""Tool calls in completions (fallback format and a tokenizer's own parser) and the tools prompt."""

from __future__ import annotations

import json

import pytest

from rl.environments.tools.parsing import (
    FALLBACK_FORMAT,
    TOOLS_INSTRUCTION,
    ParseError,
    ToolCall,
    parse_fallback,
    parse_tool_calls,
    render_tools_prompt,
    tool_schema,
    with_tools_instruction,
)

HERMES = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "content": {},
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "content": "json",
            "repeats": True,
            "transform": {"type": "function", "function": "{content}"},
        },
    },
}
"""A Hermes / Qwen2.5 ``response_template`` for transformers' ``parse_response``."""


def _call(code: str, name: str = "python") -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"code": code}}) + "</tool_call>"


@pytest.fixture(scope="module")
def tok(real_model_dir):
    from rl.model import load_tokenizer

    return load_tokenizer(real_model_dir)


def test_fallback_calls_are_read_in_order_with_text_around_them():
    text = "Let me compute. " + _call("12345*6789") + " and " + _call("print(1)\nprint(2)") + " done"
    assert parse_fallback(text) == [
        ToolCall("python", {"code": "12345*6789"}),
        ToolCall("python", {"code": "print(1)\nprint(2)"}),
    ]
    assert parse_tool_calls(text) == parse_fallback(text)
    assert parse_fallback("The answer is <answer>42</answer>") == []


def test_an_unclosed_last_call_with_complete_json_is_accepted_as_vllm_drops_the_stop_string():
    text = '<tool_call>{"name": "python", "arguments": {"code": "2**10"}}'
    assert parse_fallback(text) == [ToolCall("python", {"code": "2**10"})]


def test_the_openai_shape_and_string_arguments_are_accepted():
    openai = {"type": "function", "function": {"name": "python", "arguments": json.dumps({"code": "1"})}}
    text = f"<tool_call>{json.dumps(openai)}</tool_call>"
    assert parse_fallback(text) == [ToolCall("python", {"code": "1"})]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('<tool_call>{"name": "python", "arguments": {"code": 1+1}}</tool_call>', "tool call 1 is not valid JSON"),
        ('<tool_call>{"name": "python", "arguments": {"code": "1"</tool_call>', "tool call 1 is not valid JSON"),
        ('<tool_call>["python", "1"]</tool_call>', "is not an object with a string 'name'"),
        ('<tool_call>{"name": "python", "arguments": ["1"]}</tool_call>', "are list, not an object"),
        ('<tool_call>{"name": "python", "arguments": "not json"}</tool_call>', "a string that is not JSON"),
        ('<tool_call>{"name": "python", "arguments": {"code": "1"', "is not closed with </tool_call>"),
        ('<tool_call>{"name": "python"} <tool_call>{"name": "python"}</tool_call>', "no closing </tool_call> before"),
        (_call("1") + '<tool_call>{"nam', "tool call 2 is not closed"),
    ],
)
def test_malformed_calls_raise_a_parse_error_saying_why_and_showing_the_format(text, fragment):
    with pytest.raises(ParseError) as err:
        parse_fallback(text)
    assert fragment in str(err.value)
    assert FALLBACK_FORMAT in str(err.value)


def test_the_tool_schema_is_a_function_tool_with_a_required_code_string():
    s = tool_schema()
    assert s["type"] == "function"
    assert s["function"]["name"] == "python"
    assert s["function"]["parameters"]["properties"]["code"]["type"] == "string"
    assert s["function"]["parameters"]["required"] == ["code"]


def test_a_tokenizer_with_a_response_template_parses_with_transformers(tok):
    messages = [{"role": "user", "content": "What is 12345*6789?"}]
    prefix = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text = "I will compute it." + _call("12345*6789")
    assert getattr(tok, "response_template", None) is None  # SmolLM2 has no parser: the fallback reads it
    assert parse_tool_calls(text, tokenizer=tok, prefix=prefix) == [ToolCall("python", {"code": "12345*6789"})]
    tok.response_template = HERMES
    try:
        assert parse_tool_calls(text, tokenizer=tok, prefix=prefix, tools=[tool_schema()]) == [
            ToolCall("python", {"code": "12345*6789"})
        ]
        assert parse_tool_calls("It is 83810205.", tokenizer=tok, prefix=prefix) == []
        with pytest.raises(ParseError, match="the tokenizer's response parser could not read the completion"):
            parse_tool_calls("<tool_call>{bad</tool_call>", tokenizer=tok, prefix=prefix)
    finally:
        tok.response_template = None


def test_a_template_that_ignores_tools_gets_the_fallback_instruction_as_system_message(tok):
    messages = [{"role": "user", "content": "What is 12345*6789?"}]
    text = render_tools_prompt(tok, messages)
    assert text == tok.apply_chat_template(with_tools_instruction(messages), add_generation_prompt=True, tokenize=False)
    assert TOOLS_INSTRUCTION in text and FALLBACK_FORMAT in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "named SmolLM" not in text  # the instruction is the system message, replacing the template's default
    with_system = render_tools_prompt(tok, [{"role": "system", "content": "Be brief."}, *messages])
    assert f"{TOOLS_INSTRUCTION}\n\nBe brief." in with_system


class _ToolsTemplate:
    """A chat template that renders ``tools=``."""

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=True):
        head = f"TOOLS {json.dumps(tools)}\n" if tools else ""
        return head + "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def test_a_template_that_renders_tools_is_used_as_is():
    messages = [{"role": "user", "content": "hi"}]
    text = render_tools_prompt(_ToolsTemplate(), messages)
    assert text == f"TOOLS {json.dumps([tool_schema()])}\nuser: hi\nassistant: "
    assert TOOLS_INSTRUCTION not in text
