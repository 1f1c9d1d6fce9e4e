"""Structured outputs and tool calling over HTTP: the Flask app, real Postgres and Redis,
a real device-group worker on a random checkpoint (only the constraint makes its output
valid), and the official `openai` client."""

from __future__ import annotations

import json
import re
import uuid

import jsonschema
import pytest
import requests

import tests.test_openai_api as openai_api_tests
from tasks.models import JobErrorKind, JobStatus
from tasks.params import SamplingParams
from tests.pipeline_helpers import read_job, wait_terminal

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "color"],
}
REGEX = r"[a-z]{2,6}-\d{3}"
CHOICES = ["yes", "no", "maybe so"]
MESSAGES = [{"role": "user", "content": "what is the weather in Oslo?"}]
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14},
                   "unit": {"enum": ["c", "f"]}},
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "a forecast",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"]}}},
]
PARAMS_OF = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


# the OpenAI tests' worker (module-scoped: one per module); base_url and client are shared
worker = openai_api_tests.worker


def _check_calls(message, finish_reason: str, expect_name: str | None = None) -> list:
    assert finish_reason == "tool_calls"
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        if expect_name is not None:
            assert call.function.name == expect_name
        jsonschema.validate(json.loads(call.function.arguments), PARAMS_OF[call.function.name])
    return message.tool_calls


# ---- structured outputs ---------------------------------------------------------------


def test_json_schema_response_format_validates_for_every_seed(client, worker):
    for seed in range(4):
        response = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=200, seed=seed, temperature=1.0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": SCHEMA,
                                             "strict": True}})
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_completions_regex_choice_grammar_and_json_object(client, worker):
    cases = [({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
             ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
             ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
             ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
             ({"guided_grammar": 'root ::= "ab" [0-9] [0-9]?'},
              lambda t: re.fullmatch(r"ab\d\d?", t)),
             ({"guided_json": json.dumps(SCHEMA)},
              lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None)]
    for extra, ok in cases:
        for seed in (1, 2):
            response = client.completions.create(model="tiny", prompt="the river",
                                                 max_tokens=200, seed=seed, extra_body=extra)
            text = response.choices[0].text
            assert ok(text), (extra, text)
            assert response.choices[0].finish_reason == "stop"
    response = client.completions.create(model="tiny", prompt="x", max_tokens=200, seed=3,
                                         extra_body={"response_format": {
                                             "type": "json_object"},
                                             "max_tokens": 300})
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].text), dict)
    else:  # a random model may nest deeper than max_tokens: then it is a prefix of one
        assert response.choices[0].text.startswith("{")


def test_jobs_api_takes_structured_outputs_beside_a_free_job(base_url, worker,
                                                              session_factory,
                                                              service_settings):
    """A constrained and a free job submitted together: the constrained one validates and
    the free one gets exactly its unconstrained tokens (the offline engine's)."""
    free = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 24,
            "temperature": 0.0, "ignore_eos": True}
    ids = []
    for body in ({"model": "tiny", "prompt": "a person:", "max_tokens": 200, "seed": 7,
                  "structured_outputs": {"json": SCHEMA}}, free,
                 {"model": "tiny", "prompt": "pick", "max_tokens": 20, "seed": 8,
                  "structured_outputs": {"choice": CHOICES}}):
        response = requests.post(base_url + "/v1/jobs", json=body, timeout=30)
        assert response.status_code == 202, response.text
        assert response.json()["params"]["structured_outputs"] == (
            body.get("structured_outputs") and {
                "json": None, "regex": None, "choice": None, "grammar": None,
                "json_object": False, **body["structured_outputs"]})
        ids.append(response.json()["id"])
    rows = [wait_terminal(session_factory, job_id, timeout=120) for job_id in ids]
    assert all(row.status == JobStatus.SUCCEEDED.value for row in rows), [r.error for r in rows]
    jsonschema.validate(json.loads(rows[0].output[0]["text"]), SCHEMA)
    assert rows[2].output[0]["text"] in CHOICES

    from workers.engine.llm import LLM

    with LLM(service_settings.models["tiny"], max_num_seqs=8,
             kv_cache_bytes=16 * 1024 * 1024) as llm:
        expected = llm.generate([free["prompt"]], SamplingParams(
            max_tokens=24, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    assert rows[1].output[0]["text"] == expected


# ---- tool calling ---------------------------------------------------------------------


def test_tool_choice_required_and_named_decode_valid_arguments(client, worker):
    for seed in range(3):
        response = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
            max_tokens=300, seed=seed)
        _check_calls(response.choices[0].message, response.choices[0].finish_reason)
        response = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        calls = _check_calls(response.choices[0].message, response.choices[0].finish_reason,
                             "get_weather")
        assert len(calls) == 1


def test_streamed_tool_call_deltas_join_to_the_final_calls(client, worker):
    for tool_choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                      max_tokens=300, seed=11, parallel_tool_calls=False)
        final = client.chat.completions.create(**kwargs)
        expected = [(c.function.name, c.function.arguments)
                    for c in _check_calls(final.choices[0].message,
                                          final.choices[0].finish_reason)]
        calls: dict[int, dict] = {}
        reasons = []
        num_deltas = 0
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                reasons.append(choice.finish_reason)
                assert not choice.delta.content
                for delta in choice.delta.tool_calls or []:
                    num_deltas += 1
                    entry = calls.setdefault(delta.index, {"id": None, "name": None,
                                                           "arguments": ""})
                    if delta.id is not None:
                        assert entry["id"] is None and delta.function.name
                        entry["id"], entry["name"] = delta.id, delta.function.name
                    entry["arguments"] += delta.function.arguments or ""
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
        assert all(c["id"].startswith("call_") for c in calls.values())
        assert reasons[-1] == "tool_calls" and num_deltas >= 2


def test_conversation_with_tool_calls_and_auto(client, worker, session_factory):
    """An assistant message with tool_calls (content null) and the tool's answer are
    accepted; auto answers text or calls of known tools; the tools reach the prompt
    (this checkpoint's template has no tools: the system-section fallback)."""
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                              max_tokens=16, seed=1)
    message = response.choices[0].message
    assert message.content is not None or message.tool_calls
    row = read_job(session_factory, str(uuid.UUID(response.id.removeprefix("chatcmpl-"))))
    assert "<tools>" in row.prompt and '"name": "get_weather"' in row.prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}' \
        in row.prompt and "sunny" in row.prompt


# ---- refusals -------------------------------------------------------------------------


def _post(base_url: str, path: str, body: dict) -> requests.Response:
    return requests.post(base_url + path, json=body, timeout=60)


CHAT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8}


@pytest.mark.parametrize(("path", "extra", "param", "message"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}}, "response_format",
     "response_format.json_schema.schema: 'type' at # must be one of"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "allOf": [{"required": ["a"]}]}}}},
     "response_format", "keyword 'allOf' at # is not supported"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "[a-z"}, "guided_regex",
     "guided_regex is not a valid regular expression"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(?=a)b"}},
     "structured_outputs", "lookahead"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": 'start ::= "a"'}, "guided_grammar",
     "guided_grammar has no root rule"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"},
                              "guided_regex": "a+"}, "response_format",
     "got guided_regex and response_format"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs", "exactly one of .* got regex, choice"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "launch"}}}, "tool_choice",
     "names function 'launch', which is not among the tools"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "x": {"type": "string", "format": "idn-email"}}}}}]},
     "tools[0].function.parameters", "format' at #/properties/x must be one of"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "tool_choice",
     "got response_format and tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "requires tools"),
    ("/v1/jobs", {"prompt": "x", "structured_outputs": {"json": {"not": {}}}},
     "structured_outputs", "keyword 'not'"),
])
def test_bad_constraints_are_a_400_naming_the_field(base_url, path, extra, param, message):
    body = {**CHAT, **extra}
    if "prompt" in body:
        body.pop("messages")
    response = _post(base_url, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error
    assert error["type"] == "invalid_request_error"


def test_a_grammar_only_the_worker_can_refuse_fails_the_job_with_a_400(base_url, worker,
                                                                      session_factory):
    response = _post(base_url, "/v1/completions", {
        "model": "tiny", "prompt": "x", "max_tokens": 8,
        "guided_grammar": "root ::= undefined_rule"})
    assert response.status_code == 400, response.text
    assert re.search(r"structured_outputs.grammar is not usable: .*not defined",
                     response.json()["error"]["message"])
    job_id = response.json()["error"]["message"].split()[1]
    row = read_job(session_factory, job_id)
    assert row.status == JobStatus.FAILED.value
    assert row.error_kind == JobErrorKind.INVALID_REQUEST.value  # the request's fault


def test_streamed_auto_joins_to_the_non_streamed_answer(client, worker):
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=24, seed=5,
                  temperature=1.0)
    final = client.chat.completions.create(**kwargs).choices[0]
    content, names, reasons = "", [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            names += [d.function.name for d in choice.delta.tool_calls or [] if d.id]
            reasons.append(choice.finish_reason)
    assert content == (final.message.content or "")
    assert names == [c.function.name for c in final.message.tool_calls or []]
    assert reasons[-1] == final.finish_reason
