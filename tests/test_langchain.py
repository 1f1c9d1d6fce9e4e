"""Frameworks built on OpenAI's API work unchanged: LangChain's `with_structured_output`
and `bind_tools` against the real stack (Flask app, Postgres, Redis, a device-group
worker on a random checkpoint, where only the constraint makes the output valid)."""

from __future__ import annotations

from typing import Literal

import langchain_openai
import pytest
from pydantic import BaseModel, Field

import tests.test_openai_api as openai_api_tests

pytestmark = pytest.mark.integration

worker = openai_api_tests.worker


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=150)
    color: Literal["red", "green", "blue"]


class GetWeather(BaseModel):
    """The forecast for a city."""

    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=14)


def _chat(base_url: str, **kwargs):
    return langchain_openai.ChatOpenAI(base_url=f"{base_url}/v1", api_key="unused",
                                       model="tiny", max_tokens=120, temperature=1.0,
                                       max_retries=0, timeout=120, **kwargs)


# NOTE: not method="json_mode": it constrains to any JSON object and leaves the schema to
# the prompt, and a random model's object need not close within a test's max_tokens
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_a_valid_object(base_url, worker, method):
    chat = _chat(base_url, seed=3)
    person = chat.with_structured_output(Person, method=method).invoke("describe a person")
    assert isinstance(person, Person)  # pydantic validated it: the constraint held


def test_bind_tools_gives_calls_whose_arguments_validate(base_url, worker):
    named = _chat(base_url, seed=1).bind_tools([GetWeather], tool_choice="GetWeather")
    message = named.invoke("weather in Oslo?")
    assert [call["name"] for call in message.tool_calls] == ["GetWeather"]
    GetWeather.model_validate(message.tool_calls[0]["args"])

    # one call (a random model may list calls until max_tokens cuts the array)
    required = _chat(base_url, seed=2).bind_tools([GetWeather, Person], tool_choice="any",
                                                  parallel_tool_calls=False)
    message = required.invoke("weather in Oslo?")
    assert len(message.tool_calls) == 1, message
    for call in message.tool_calls:
        {"GetWeather": GetWeather, "Person": Person}[call["name"]].model_validate(call["args"])
