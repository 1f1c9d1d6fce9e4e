"""Field types the request models share: request text, token ids, and the sampling
fields of every endpoint (OpenAI's names plus vLLM's extra sampling parameters).

Types here are strict (a boolean is not an integer, a string is not a number): a client's
mistake is reported, never coerced. The documented ranges are `tasks.params`' own
constants; `SamplingParams.validate()` still checks them (and what spans fields, such as
min_tokens <= max_tokens), so the engine is guarded whatever the entry point.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue

from tasks.params import (
    MAX_ABS_PENALTY,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    text_problem,
)

PRIORITY_RANGE = (-1_000_000, 1_000_000)  # lower runs first
MAX_MESSAGES = 1024


def _usable_text(value: str) -> str:
    problem = text_problem(value)
    if problem is not None:
        raise ValueError(f"must not contain {problem}")
    return value


# request text: no NUL, no lone surrogates (Postgres, tokenizers and UTF-8 take neither)
Text = Annotated[str, AfterValidator(_usable_text)]
TokenId = Annotated[int, Field(ge=0)]


class RequestModel(BaseModel):
    """A request body: strict types, unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


class SamplingFields(RequestModel):
    """The fields every generation endpoint takes (OpenAI's, then vLLM's extras).
    `null` means the same as leaving a field out."""

    model: Annotated[Text, Field(min_length=1, description="a served model (GET /v1/models)")]
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)] | None \
        = Field(None, description="0 samples greedily; default 1")
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = Field(
        None, description="vLLM: keep the k most likely tokens; 0 disables")
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = Field(
        None, description="vLLM: drop tokens below min_p times the top probability")
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = Field(
        None, description="same seed, same tokens; a job without one gets one pinned at "
        "submission, so a restarted job repeats itself")
    stop: Text | list[Text] | None = Field(None, description="up to 16 strings of 1 to 200 "
                                           "characters; excluded from the text")
    stop_token_ids: list[TokenId] | None = Field(None, description="vLLM: token ids that end "
                                                 "a sample")
    ignore_eos: bool | None = Field(None, description="vLLM: keep going past EOS")
    min_tokens: Annotated[int, Field(ge=0)] | None = Field(
        None, description="vLLM: no EOS or stop token before this many tokens")
    n: Annotated[int, Field(ge=1)] | None = Field(None, description="samples of the prompt "
                                                   "(at most the server's LLMQ_MAX_N)")
    presence_penalty: Annotated[float, Field(ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY,
                                             allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY,
                                              allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY,
                                               le=MAX_REPETITION_PENALTY,
                                               allow_inf_nan=False)] | None = Field(
        None, description="vLLM: HF/CTRL repetition penalty over prompt and output")
    priority: Annotated[int, Field(ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])] | None = Field(
        None, description="vLLM: lower runs first; default 0")


LogprobsCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs`: exactly one constraint on the generated text."""

    json_: dict[str, JsonValue] | str | None = Field(
        None, alias="json", description="a JSON schema (object or JSON string); the output "
        "is one JSON value valid against it")
    regex: Text | None = Field(None, description="the output fully matches it")
    choice: Annotated[list[Text], Field(min_length=1)] | None = Field(
        None, description="the output is exactly one of these strings")
    grammar: Text | None = Field(None, description="an EBNF grammar (`root ::= ...`)")
    json_object: bool | None = Field(None, description="true: the output is a JSON object")

    def as_dict(self) -> dict[str, object]:
        """The constraint as `tasks.structured.StructuredOutputs` takes it."""
        return {name: value for name, value in (
            ("json", self.json_), ("regex", self.regex), ("choice", self.choice),
            ("grammar", self.grammar), ("json_object", self.json_object)) if value is not None}
