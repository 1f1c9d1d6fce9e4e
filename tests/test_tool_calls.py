"""webapp/tool_calls.py: model text -> OpenAI tool calls, the tool_choice schemas, the
streamed deltas, and the prompt fallback for templates without tools (pure, no services)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from webapp.tool_calls import (
    ToolCallStream,
    ToolMode,
    ToolPlan,
    finish_reason,
    messages_for_template,
    parse_output,
    parse_tool_calls,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
NAMES = ["get_weather", "get_time"]


def test_qwen_calls_with_text_around_them() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert calls[0].id != calls[1].id


def test_llama3_json_calls() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}'
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome", "days": 2})]
    content, calls = parse_tool_calls(
        '{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
        '"parameters": {"city": "X"}}', NAMES)
    assert [c.name for c in calls] == ["get_time", "get_weather"]


@pytest.mark.parametrize("text", [
    "no calls here", '{"name": "unknown_tool", "parameters": {}}', '{"answer": 42}',
    "<tool_call>not json</tool_call>", '<tool_call>{"name": "get_time", "arguments": 3}',
])
def test_text_that_is_not_a_call_stays_text(text: str) -> None:
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_required_schema_accepts_exactly_the_tools_calls() -> None:
    schema = ToolPlan(ToolMode.REQUIRED, TOOLS).schema()
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "a"}},
                         {"name": "get_time", "arguments": {}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}],
                [{"name": "nope", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert ToolPlan(ToolMode.REQUIRED, TOOLS, parallel=False).schema()["maxItems"] == 1
    assert ToolPlan(ToolMode.NAMED, TOOLS, named="get_weather").schema() == \
        WEATHER["function"]["parameters"]
    assert ToolPlan(ToolMode.AUTO, TOOLS).schema() is None


def test_parse_output_per_mode() -> None:
    named = ToolPlan(ToolMode.NAMED, TOOLS, named="get_weather")
    content, calls = parse_output('{"city": "Oslo"}', named)
    assert content is None and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert parse_output('{"city": "Os', named) == ('{"city": "Os', [])  # cut by max_tokens
    required = ToolPlan(ToolMode.REQUIRED, TOOLS)
    content, calls = parse_output('[{"name": "get_time", "arguments": {}}]', required)
    assert content is None and [c.name for c in calls] == ["get_time"]
    assert parse_output("<tool_call>", ToolPlan(ToolMode.NONE, TOOLS)) == ("<tool_call>", [])
    assert finish_reason("stop", 1) == "tool_calls"
    assert finish_reason("length", 1) == "length" and finish_reason("stop", 0) == "stop"


def _join(deltas: list[dict]) -> tuple[str, dict[int, dict]]:
    """OpenAI's rule for a client: content concatenated; tool calls by index, the first
    delta's id and name, arguments concatenated."""
    content = ""
    calls: dict[int, dict] = {}
    for delta in deltas:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            entry["id"] = entry["id"] or call.get("id")
            entry["name"] = entry["name"] or call["function"].get("name")
            entry["arguments"] += call["function"].get("arguments") or ""
    return content, calls


def _stream(plan: ToolPlan, pieces: list[str]) -> tuple[list[dict], ToolCallStream]:
    stream = ToolCallStream(plan)
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    return deltas + stream.finish(), stream


def test_streamed_named_arguments_join_to_the_call() -> None:
    plan = ToolPlan(ToolMode.NAMED, TOOLS, named="get_weather")
    deltas, stream = _stream(plan, ['{"ci', 'ty": "O', 'slo"}'])
    content, calls = _join(deltas)
    assert content == "" and stream.num_calls == 1 and len(deltas) == 3
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}


def test_streamed_auto_sends_text_then_holds_the_call() -> None:
    plan = ToolPlan(ToolMode.AUTO, TOOLS)
    pieces = ["Sure", ", one ", "moment.<tool", '_call>{"name": "get_time", ',
              '"arguments": {}}</tool_call>']
    deltas, stream = _stream(plan, pieces)
    content, calls = _join(deltas)
    assert content == "Sure, one moment."
    assert stream.num_calls == 1 and calls[0]["name"] == "get_time"
    assert calls[0]["arguments"] == "{}"
    # plain text streams as it comes, whole
    deltas, stream = _stream(plan, ["<to", "day is fine"])
    assert _join(deltas) == ("<today is fine", {}) and stream.num_calls == 0
    deltas, _ = _stream(plan, ['{"not": ', '"a call"}'])
    assert _join(deltas) == ('{"not": "a call"}', {})


def test_streamed_required_calls_arrive_at_the_end() -> None:
    plan = ToolPlan(ToolMode.REQUIRED, TOOLS)
    deltas, stream = _stream(plan, ['[{"name": "get_weather", "arguments": ',
                                    '{"city": "Oslo"}}]'])
    _, calls = _join(deltas)
    assert stream.num_calls == 1 and json.loads(calls[0]["arguments"]) == {"city": "Oslo"}


def test_template_without_tools_gets_a_system_section_and_call_lines() -> None:
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    out = messages_for_template(messages, TOOLS, "{{ message['content'] }}")
    assert out[0]["role"] == "system" and "<tools>" in out[0]["content"]
    assert json.dumps(WEATHER) in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "Oslo"}}\n</tool_call>')
    assert "tool_calls" not in out[2] and out[3]["content"] == "sunny"
    # a template that knows tools and calls gets them as Hugging Face templates expect
    out = messages_for_template(messages, TOOLS, "{% for t in tools %}{{ m.tool_calls }}")
    assert len(out) == 3 and out[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Oslo"}
