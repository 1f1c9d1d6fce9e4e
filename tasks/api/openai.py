"""OpenAI's bodies (`/v1/completions`, `/v1/chat/completions`, `/v1/models`), named as
OpenAI names them, with vLLM's extra sampling fields (`tasks.api.fields.SamplingFields`).

Structured outputs come as OpenAI's `response_format` (`text`, `json_object`,
`json_schema`), vLLM's `structured_outputs` and its older `guided_*` fields, and chat's
`tools` with `tool_choice`; the web layer (`webapp/openai_format.py`) allows one
constraint per request. Fields that would change a request's meaning but are not
implemented (`suffix`, `best_of` != `n`, `logit_bias`, legacy `functions`) are accepted
by shape here and refused with a 400 by the web layer, never ignored. Bookkeeping fields
clients commonly send (`user`, `metadata`, ...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, JsonValue

from tasks.api.fields import (
    MAX_MESSAGES,
    LogprobsCount,
    RequestModel,
    SamplingFields,
    StructuredOutputsRequest,
    Text,
    TokenId,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(RequestModel):
    include_usage: bool | None = Field(None, description="a last chunk with the usage")
    continuous_usage_stats: bool | None = Field(None, description="vLLM; accepted, ignored")


class JsonSchemaFormat(RequestModel):
    name: Annotated[Text, Field(min_length=1, max_length=64)]
    description: Text | None = None
    schema_: dict[str, JsonValue] | None = Field(
        None, alias="schema", description="the JSON schema; none: any JSON object")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseFormatText(RequestModel):
    type: Literal["text"]


class ResponseFormatJsonObject(RequestModel):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(RequestModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject
                           | ResponseFormatJsonSchema, Field(discriminator="type")]


class _OpenAIFields(SamplingFields):
    stream: bool | None = Field(None, description="answer as text/event-stream chunks")
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, JsonValue] | None = Field(None, description="not supported: "
                                                    "refused unless empty")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object, or json_schema {name, schema, strict}")
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="vLLM: constrain the output (json, regex, choice, grammar, "
        "json_object)")
    guided_json: dict[str, JsonValue] | str | None = Field(
        None, description="vLLM (older name): structured_outputs.json")
    guided_regex: Text | None = Field(None, description="vLLM (older name): "
                                      "structured_outputs.regex")
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = Field(
        None, description="vLLM (older name): structured_outputs.choice")
    guided_grammar: Text | None = Field(None, description="vLLM (older name): "
                                        "structured_outputs.grammar")
    # accepted and ignored
    user: JsonValue = None
    metadata: JsonValue = None
    store: JsonValue = None
    service_tier: JsonValue = None
    parallel_tool_calls: JsonValue = None
    skip_special_tokens: JsonValue = None
    spaces_between_special_tokens: JsonValue = None


class CompletionRequest(_OpenAIFields):
    """`POST /v1/completions`. One prompt per request: a batch of several is a 400."""

    prompt: Text | Annotated[list[TokenId], Field(min_length=1)] | Annotated[
        list[Text], Field(min_length=1)] | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)] = Field(
        description="a string, token ids, or a one-element list of either")
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description=f"default {DEFAULT_COMPLETION_MAX_TOKENS}")
    logprobs: LogprobsCount | None = Field(None, description="top-n logprobs per token")
    echo: bool | None = Field(None, description="the prompt goes before the text")
    suffix: Text | None = Field(None, description="not supported: refused unless empty")
    best_of: Annotated[int, Field(ge=1)] | None = Field(None, description="only best_of == n")


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: Text


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionCall(RequestModel):
    name: FunctionName
    arguments: Text = Field(description="the arguments as a JSON string")


class ToolCallParam(RequestModel):
    """A call an earlier assistant message made."""

    id: Annotated[Text, Field(min_length=1, max_length=200)]
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = Field(
        None, description="required, except on an assistant message with tool_calls")
    name: Text | None = None
    tool_calls: list[ToolCallParam] | None = Field(None, description="assistant: its calls")
    tool_call_id: Text | None = Field(None, description="tool: the call this answers")


class FunctionDefinition(RequestModel):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, JsonValue] | None = Field(
        None, description="a JSON schema of the arguments object; none: no arguments")
    strict: bool | None = Field(None, description="accepted; the schema is enforced when "
                                "tool_choice is required or names the function")


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(RequestModel):
    name: FunctionName


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_OpenAIFields):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="deprecated name of max_completion_tokens")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="default: the rest of the model's context")
    logprobs: bool | None = Field(None, description="logprobs of the sampled tokens")
    top_logprobs: LogprobsCount | None = Field(None, description="needs logprobs: true")
    tools: Annotated[list[Tool], Field(max_length=128)] | None = Field(
        None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default auto with tools; required and a named function decode "
        "under the parameters' JSON schema")
    functions: list[JsonValue] | None = Field(None, description="legacy; not supported: use "
                                              "tools")
    function_call: JsonValue = None


# --- responses ------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(BaseModel):
    """`text_completion`; a stream sends the same shape per chunk, then `data: [DONE]`."""

    id: str  # cmpl-<job id hex>
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(BaseModel):
    id: str  # call_<random>
    type: Literal["function"]
    function: FunctionCallOut


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # null when the answer is only tool calls
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str  # chatcmpl-<job id hex>
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage
    system_fingerprint: str | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None  # on a call's first delta
    arguments: str | None = None  # pieces to join


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None  # on a call's first delta
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChoiceDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatCompletionChunkChoice(BaseModel):
    index: int
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    """One `data:` line of a chat stream (`text/event-stream`), then `data: [DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: CompletionUsage | None = None


class Model(BaseModel):
    """A served model, OpenAI's shape plus vLLM's `root` and `max_model_len`, and its live
    device groups."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int | None
    groups: list[dict[str, Any]]
    num_live_groups: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]
