"""Tool calling on chat: the constraint a `tool_choice` decodes under, the prompt's tools
when a chat template has no place for them, and model text -> OpenAI `tool_calls`.

Pure functions over plain values (no Flask, no Redis, no tokenizer).

* `required` decodes under a JSON array of `{"name": <a tool>, "arguments": <its
  parameters>}` objects (an `anyOf` over the tools); a named function under its parameters'
  schema alone (the output is the arguments object). So the arguments always validate.
* `auto` reads the model family's own format from the text: Qwen's (Hermes')
  `<tool_call>{"name": .., "arguments": {..}}</tool_call>`, or Llama 3's bare JSON
  `{"name": .., "parameters": {..}}` (several joined by `;`, maybe after
  `<|python_tag|>`). Text that names no known tool stays text.
* A chat template that never mentions `tools` (the random checkpoints' does not) gets
  them from `messages_for_template`: a system-prompt section listing the functions as
  JSON, in the Hermes wording Qwen's template uses, and earlier calls written into the
  assistant's content as `<tool_call>` lines.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

NO_ARGUMENTS_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}
QWEN_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
QWEN_OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"


class ToolMode(str, Enum):
    NONE = "none"  # tools are in the prompt; the text is the answer
    AUTO = "auto"  # the text may hold calls in the model family's format
    REQUIRED = "required"  # decoded as a JSON array of calls
    NAMED = "named"  # decoded as the named function's arguments


@dataclass(slots=True)
class ToolPlan:
    """How a chat request with tools is decoded and answered."""

    mode: ToolMode
    tools: list[dict[str, Any]]  # OpenAI tool objects ({type, function: {name, ...}})
    named: str | None = None  # NAMED: the function
    parallel: bool = True  # REQUIRED: more than one call allowed

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or NO_ARGUMENTS_SCHEMA
        raise KeyError(name)

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output decodes under (None: free text)."""
        if self.mode is ToolMode.NAMED:
            assert self.named is not None
            return self.parameters(self.named)
        if self.mode is not ToolMode.REQUIRED:
            return None
        calls = [{"type": "object",
                  "properties": {"name": {"const": name}, "arguments": self.parameters(name)},
                  "required": ["name", "arguments"]} for name in self.names]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object as a string
    id: str = field(default_factory=lambda: new_call_id())

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_output(text: str, plan: ToolPlan) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished choice's text. Text that is not a call stays content
    (e.g. a constrained output cut short by max_tokens)."""
    if plan.mode is ToolMode.NONE:
        return text, []
    if plan.mode is ToolMode.NAMED:
        assert plan.named is not None
        if _json_object(text) is None:
            return text, []
        return None, [ParsedCall(plan.named, text.strip())]
    if plan.mode is ToolMode.REQUIRED:
        calls = _calls_of(_json_value(text), set(plan.names), "arguments")
        return (None, calls) if calls else (text, [])
    return parse_tool_calls(text, plan.names)


def parse_tool_calls(text: str, tool_names: list[str]) -> tuple[str | None, list[ParsedCall]]:
    """Calls written by the model in Qwen's or Llama 3's format; (content, calls). Only
    calls of known tools count; otherwise the whole text is content."""
    known = set(tool_names)
    if QWEN_OPEN in text:
        calls: list[ParsedCall] = []
        for body in QWEN_CALL.findall(text):
            calls += _calls_of(_json_value(body), known, "arguments")
        if calls:
            content = QWEN_CALL.sub("", text).strip()
            return content or None, calls
    stripped = text.strip().removeprefix(PYTHON_TAG).strip()
    if stripped.startswith("{"):
        calls = []
        for part in stripped.split(";"):
            found = _calls_of(_json_value(part), known, "parameters")
            if not found:
                return text, []
            calls += found
        return None, calls
    return text, []


def _calls_of(value: Any, known: set[str], arguments_key: str) -> list[ParsedCall]:
    """Calls from a decoded call object or a list of them; [] if any is not a call."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in known:
            return []
        arguments = item.get(arguments_key, item.get("arguments", {}))
        if isinstance(arguments, str):
            if _json_object(arguments) is None:
                return []
            calls.append(ParsedCall(item["name"], arguments))
        elif isinstance(arguments, dict):
            calls.append(ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
        else:
            return []
    return calls


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_object(text: str) -> dict[str, Any] | None:
    value = _json_value(text)
    return value if isinstance(value, dict) else None


# --- streaming ---------------------------------------------------------------------------


class ToolCallStream:
    """One choice's text deltas -> OpenAI chat delta objects.

    NAMED streams its arguments as they come (the name is known before the first token).
    REQUIRED holds the text until the end (the calls' names come from the whole JSON).
    AUTO streams text as content until it sees the start of a call (`<tool_call>`, or a
    JSON object or `<|python_tag|>` at the very start), then holds the rest to the end.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self._held = ""  # text not sent yet
        self._calls_started = plan.mode is ToolMode.REQUIRED  # hold everything
        self._sent_any = False
        self._named_id = new_call_id()

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        mode = self.plan.mode
        if mode is ToolMode.NONE:
            return [{"content": text}]
        if mode is ToolMode.NAMED:
            first = self.num_calls == 0
            self.num_calls = 1
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if first:
                call = {"index": 0, "id": self._named_id, "type": "function",
                        "function": {"name": self.plan.named, "arguments": text}}
            return [{"tool_calls": [call]}]
        self._held += text
        if self._calls_started:
            return []
        return self._release_content()

    def _release_content(self) -> list[dict[str, Any]]:
        """AUTO: send what cannot be the start of a call; hold the rest."""
        held = self._held
        if not self._sent_any:
            head = held.lstrip()
            if not head:
                return []
            if head.startswith(("{", PYTHON_TAG, QWEN_OPEN)):
                self._calls_started = True
                return []
            if any(marker.startswith(head) for marker in (PYTHON_TAG, QWEN_OPEN)):
                return []  # maybe a marker: wait for more text
        at = held.find(QWEN_OPEN)
        if at >= 0:
            self._calls_started = True
            content, self._held = held[:at], held[at:]
        else:
            keep = _marker_prefix_len(held, QWEN_OPEN)
            content, self._held = held[:len(held) - keep], held[len(held) - keep:]
        if not content:
            return []
        self._sent_any = True
        return [{"content": content}]

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still owed once the choice's text is complete."""
        held, self._held = self._held, ""
        if not held:
            return []
        content, calls = parse_output(held, self.plan)
        deltas: list[dict[str, Any]] = []
        if content:
            deltas.append({"content": content})
        for call in calls:
            index = self.num_calls
            self.num_calls += 1
            deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index,
                                           "function": {"arguments": call.arguments}}]})
        return deltas


def _marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    """OpenAI's `tool_calls` for a choice that ended on its own with calls."""
    return "tool_calls" if num_calls and reason == "stop" else reason


# --- prompt ------------------------------------------------------------------------------


def messages_for_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          template: str) -> list[dict[str, Any]]:
    """Messages as the chat template takes them. A template that names `tools` gets them
    from `apply_chat_template(tools=...)` and calls as `tool_calls` (arguments decoded, as
    Hugging Face templates expect); one that does not gets the tools as a system-prompt
    section and calls as `<tool_call>` lines in the assistant's content."""
    knows_tools = "tools" in template
    knows_calls = "tool_calls" in template
    out = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            decoded = [{"type": "function", "id": call.get("id"),
                        "function": {"name": call["function"]["name"],
                                     "arguments": _json_value(call["function"]["arguments"])
                                     or {}}} for call in calls]
            if knows_calls:
                message["tool_calls"] = decoded
            else:
                del message["tool_calls"]
                lines = [QWEN_OPEN + "\n" + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False) + "\n</tool_call>" for c in decoded]
                parts = [message["content"]] if message.get("content") else []
                message["content"] = "\n".join(parts + lines)
        if message.get("content") is None and not knows_calls:
            message["content"] = ""
        out.append(message)
    if tools and not knows_tools:
        section = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The tools as a system-prompt section (the Hermes wording of Qwen's templates)."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
