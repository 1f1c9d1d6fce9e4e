"""The messages of refused request fields (`tasks.api.errors.SchemaError`): a field of
several shapes whose value has the right type but unusable content says what is wrong
with it, not only which shapes it may take."""

from __future__ import annotations

import pytest

from tasks.api.errors import SchemaError
from tasks.api.openai import ChatCompletionRequest, CompletionRequest
from tasks.schema import validate_body

SURROGATE = "must not contain unpaired surrogate code points"
NUL = "must not contain NUL"


def _refusal(model, body) -> SchemaError:
    with pytest.raises(SchemaError) as caught:
        validate_body(model, body)
    return caught.value


@pytest.mark.parametrize(("model", "body", "starts", "param"), [
    (CompletionRequest, {"model": "m", "prompt": "lone \ud800"}, f"prompt {SURROGATE}",
     "prompt"),
    (CompletionRequest, {"model": "m", "prompt": "a\x00b"}, f"prompt {NUL}", "prompt"),
    (CompletionRequest, {"model": "m", "prompt": ["\udfff"]}, f"prompt[0] {SURROGATE}",
     "prompt"),
    (CompletionRequest, {"model": "m", "prompt": "x", "stop": "\ud800"}, f"stop {SURROGATE}",
     "stop"),
    (CompletionRequest, {"model": "m", "prompt": "x", "stop": ["ok", "a\x00"]},
     f"stop[1] {NUL}", "stop"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "\x00"}]},
     f"messages[0].content {NUL}", "messages[0].content"),
    (ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi \ud800"}]}]},
     f"messages[0].content[0].text {SURROGATE}", "messages[0].content[0].text"),
])
def test_text_of_the_right_type_with_unusable_content_says_what_is_wrong(
        model, body, starts, param) -> None:
    error = _refusal(model, body)
    assert error.message.startswith(starts), error.message
    assert error.param == param
    error.message.encode("utf-8")  # stored and logged: no lone surrogate of the input


@pytest.mark.parametrize(("model", "body", "message", "param"), [
    (CompletionRequest, {"model": "m", "prompt": 5},
     "prompt must be a string or a list of token ids (or a one-element list of either)",
     "prompt"),
    (CompletionRequest, {"model": "m", "prompt": [1, "2"]},
     "prompt must be a string or a list of token ids (or a one-element list of either)",
     "prompt"),
    (CompletionRequest, {"model": "m", "prompt": "x", "stop": 3},
     "stop must be a string or a list of strings", "stop"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": 5}]},
     'messages[0].content must be a string or a list of text parts ({"type": "text", '
     '"text": ...})', "messages[0].content"),
])
def test_a_value_no_shape_takes_is_told_the_shapes(model, body, message, param) -> None:
    error = _refusal(model, body)
    assert (error.message, error.param) == (message, param)


@pytest.mark.parametrize(("body", "message"), [
    ({"model": "m", "prompt": "x", "max_tokens": 1e9},
     "max_tokens must be an integer, got 1000000000.0"),
    ({"model": "m", "prompt": "x", "max_tokens": 2.5}, "max_tokens must be an integer, got 2.5"),
    ({"model": "m", "prompt": "x", "top_p": float("inf")},
     "top_p must be a finite number, got inf"),
    ({"model": "m", "prompt": "x", "max_tokens": "8"},
     "max_tokens must be an integer, got a string"),
])
def test_a_number_of_the_wrong_kind_is_shown(body, message) -> None:
    assert _refusal(CompletionRequest, body).message == message


CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(("model", "body", "message", "param"), [
    # a tagged union's tag (`type`) is not part of the path
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": "json_schema"}},
     "response_format.json_schema is required", "response_format.json_schema"),
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": 5}}},
     "response_format.json_schema.name must be a string, got a number",
     "response_format.json_schema.name"),
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": "json_schema",
                                                         "json_schema": 5}},
     "response_format.json_schema must be an object, got a number",
     "response_format.json_schema"),
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": "xml"}},
     "response_format.type must be one of 'text', 'json_object', 'json_schema', got 'xml'",
     "response_format.type"),
    (ChatCompletionRequest, {**CHAT, "response_format": {}},
     "response_format.type is required", "response_format.type"),
    # a tag or a literal that is not text is shown as the client sent it
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": None}},
     "response_format.type must be one of 'text', 'json_object', 'json_schema', got null",
     "response_format.type"),
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": 3}},
     "response_format.type must be one of 'text', 'json_object', 'json_schema', got 3",
     "response_format.type"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": [
        {"type": None, "text": "x"}]}]},
     "messages[0].content[0].type must be 'text', got null", "messages[0].content[0].type"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": True, "content": "x"}]},
     "messages[0].role must be 'system', 'user', 'assistant' or 'tool', got a boolean",
     "messages[0].role"),
    # a key that is also its object's type stays in the path
    (ChatCompletionRequest, {**CHAT, "tools": [{"type": "function", "function": {"name": 5}}]},
     "tools[0].function.name must be a string, got a number", "tools[0].function.name"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text"}]}]}, "messages[0].content[0].text is required",
     "messages[0].content[0].text"),
    # the shape that took the value's type says what it refused
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type must be 'text', got 'image_url'",
     "messages[0].content[0].type"),
    (CompletionRequest, {"model": "m", "prompt": [5, -1]}, "prompt[1] must be >= 0, got -1",
     "prompt"),
    (CompletionRequest, {"model": "m", "prompt": [[1, -2]]},
     "prompt[0][1] must be >= 0, got -2", "prompt"),
])
def test_the_path_names_the_field_as_the_client_wrote_it(model, body, message, param) -> None:
    error = _refusal(model, body)
    assert (error.message, error.param) == (message, param)


@pytest.mark.parametrize("key", ["", "a-b", "list[int]", "str"])
def test_an_unknown_key_of_any_name_is_named(key) -> None:
    error = _refusal(CompletionRequest, {"model": "m", "prompt": "x", key: 1, "other": 2})
    assert error.message.startswith(f"unknown field {key!r}")
