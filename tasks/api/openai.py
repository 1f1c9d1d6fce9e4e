"""OpenAI's bodies (`/v1/completions`, `/v1/chat/completions`, `/v1/models`), named as
OpenAI names them, with vLLM's extra sampling fields (`tasks.api.fields.SamplingFields`).

Fields that would change a request's meaning but are not implemented (`suffix`, `best_of`
!= `n`, `logit_bias`, tools, non-text `response_format`) are accepted by shape here and
refused with a 400 by the web layer, never ignored. Bookkeeping fields clients commonly
send (`user`, `metadata`, ...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, JsonValue

from tasks.api.fields import (
    MAX_MESSAGES,
    LogprobsCount,
    RequestModel,
    SamplingFields,
    Text,
    TokenId,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(RequestModel):
    include_usage: bool | None = Field(None, description="a last chunk with the usage")
    continuous_usage_stats: bool | None = Field(None, description="vLLM; accepted, ignored")


class _OpenAIFields(SamplingFields):
    stream: bool | None = Field(None, description="answer as text/event-stream chunks")
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, JsonValue] | None = Field(None, description="not supported: "
                                                    "refused unless empty")
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


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text | list[TextContentPart]
    name: Text | None = None


class ResponseFormat(RequestModel):
    type: Literal["text"] = Field(description="only text is supported")


class ChatCompletionRequest(_OpenAIFields):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="deprecated name of max_completion_tokens")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="default: the rest of the model's context")
    logprobs: bool | None = Field(None, description="logprobs of the sampled tokens")
    top_logprobs: LogprobsCount | None = Field(None, description="needs logprobs: true")
    tools: list[JsonValue] | None = Field(None, description="not supported: refused unless "
                                          "empty")
    functions: list[JsonValue] | None = Field(None, description="not supported")
    tool_choice: JsonValue = None
    function_call: JsonValue = None
    response_format: ResponseFormat | None = None


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


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


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


class ChoiceDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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
