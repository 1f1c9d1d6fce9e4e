"""OpenAI's Responses API bodies (`/v1/responses`), text generation only, named as OpenAI
names them, with vLLM's extra sampling fields (`tasks.api.fields.SamplingFields`).

Tools, images, files and other non-text input are accepted by shape here and refused with
a 400 naming the field by the web layer (`webapp/responses.py`), never ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from tasks.api.fields import MAX_MESSAGES, RequestModel, SamplingFields, Text

MAX_METADATA_KEYS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
RESPONSE_STATUSES = ("queued", "in_progress", "completed", "incomplete", "failed", "cancelled")

MetadataKey = Annotated[Text, Field(max_length=MAX_METADATA_KEY_CHARS)]
MetadataValue = Annotated[Text, Field(max_length=MAX_METADATA_VALUE_CHARS)]


class InputContentPart(RequestModel):
    """One part of an input message. Only text parts (`input_text`, and `output_text` in an
    assistant message) are supported; `input_image`, `input_file`... are a 400."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: Text = Field(description="input_text (output_text in an assistant message)")
    text: Text | None = None


class InputMessage(RequestModel):
    """A message item of `input` (`type` may be left out, as OpenAI allows)."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | Annotated[list[InputContentPart], Field(min_length=1)]
    id: Text | None = Field(None, description="accepted, ignored")
    status: JsonValue = Field(None, description="accepted, ignored")


class TextFormat(RequestModel):
    type: Literal["text"] = Field(description="only text is supported")


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: JsonValue = Field(None, description="accepted, ignored")


class ResponseCreateRequest(SamplingFields):
    """`POST /v1/responses`: a chat job underneath."""

    input: Text | Annotated[list[InputMessage], Field(min_length=1, max_length=MAX_MESSAGES)] \
        = Field(description="a string (one user message) or message items of input_text")
    instructions: Text | None = Field(None, description="a system message first; not "
                                      "carried over by previous_response_id")
    previous_response_id: Text | None = Field(None, description="continue the conversation "
                                              "of a stored response of the same key")
    max_output_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="default: the rest of the model's context; reaching it ends the "
        "response `incomplete`")
    stream: bool | None = Field(None, description="answer as text/event-stream events")
    background: bool | None = Field(None, description="answer the queued response at once; "
                                    "poll, stream or cancel it later")
    store: bool | None = Field(None, description="default true; false: the response cannot "
                               "be retrieved (not allowed with background)")
    metadata: Annotated[dict[MetadataKey, MetadataValue],
                        Field(max_length=MAX_METADATA_KEYS)] | None = None
    text: TextConfig | None = None
    tools: list[JsonValue] | None = Field(None, description="not supported: refused unless "
                                          "empty")
    tool_choice: JsonValue = Field(None, description="accepted; no tools run")
    parallel_tool_calls: bool | None = Field(None, description="accepted; no tools run")
    truncation: Literal["disabled"] | None = Field(None, description="only disabled")
    user: JsonValue = Field(None, description="accepted, ignored")
    service_tier: JsonValue = Field(None, description="accepted, ignored")


class ResponseRetrieveQuery(BaseModel):
    """`GET /v1/responses/{id}` query: `stream=true` replays the events and follows."""

    model_config = ConfigDict(extra="forbid")

    stream: bool | None = Field(None, description="answer the response's events "
                                "(text/event-stream): the stored ones, then live ones")
    starting_after: Annotated[int, Field(ge=-1)] | None = Field(
        None, description="with stream=true: only the events after this sequence_number")


class InputItemListQuery(BaseModel):
    """`GET /v1/responses/{id}/input_items` query (unknown parameters are a 400)."""

    model_config = ConfigDict(extra="forbid")

    limit: Annotated[int, Field(ge=1, le=100)] = Field(20, description="items per page")
    order: Literal["asc", "desc"] = Field("desc", description="desc: the last item first")
    after: str | None = Field(None, description="an item id: the items after it, in order")


# --- responses ------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[JsonValue]


class OutputMessage(BaseModel):
    id: str  # msg_<job id hex>
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    """A response: OpenAI's shape plus `job_id`, the job that runs it (`/v1/jobs/{id}`)."""

    id: str  # resp_<job id hex>
    object: Literal["response"]
    created_at: int  # unix seconds
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    background: bool
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float | None
    top_p: float | None
    text: dict[str, JsonValue]
    tool_choice: Literal["auto", "none"]
    tools: list[JsonValue]
    truncation: Literal["disabled"]
    metadata: dict[str, str]
    usage: ResponseUsage | None
    job_id: str


class InputText(BaseModel):
    type: Literal["input_text", "output_text"]  # output_text: an assistant message's text
    text: str


class InputItem(BaseModel):
    id: str  # msg_<job id hex>_<position in the input>
    type: Literal["message"]
    role: Literal["user", "system", "assistant"]  # developer messages are system ones
    status: Literal["completed"]
    content: list[InputText]


class InputItemList(BaseModel):
    """The request's own input items (not those of previous responses)."""

    object: Literal["list"]
    data: list[InputItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class ResponseStreamEvent(BaseModel):
    """One server-sent event of a response stream (`event: <type>`, `data: <this>`).
    `sequence_number`s are stable: a replay gives the same numbers to the same events."""

    type: str  # response.created, response.output_text.delta, response.completed, ...
    sequence_number: int
    response: Response | None = None  # response.created, .in_progress and the terminal one
    output_index: int | None = None
    content_index: int | None = None
    item_id: str | None = None
    item: OutputMessage | None = None  # output_item.added / .done
    part: OutputText | None = None  # content_part.added / .done
    delta: str | None = None  # output_text.delta
    text: str | None = None  # output_text.done
