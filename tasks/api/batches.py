"""The Batch API's bodies (`/v1/batches`, OpenAI's shapes): the create request, the batch
object, a listing, the listing's query, and the lines of input, output and error files.

Batch lines run as jobs in their own priority band, `BATCH_PRIORITY`, below every
priority an interactive request may ask for (`tasks.api.fields.PRIORITY_RANGE`): the
scheduler orders them last and admission keeps room for interactive jobs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tasks.api.fields import PRIORITY_RANGE, RequestModel, Text
from tasks.api.files import ExpiresAfter

BATCH_PRIORITY = PRIORITY_RANGE[1] + 1  # the band of batch jobs: after every interactive one
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired",
                  "cancelling", "cancelled")
MAX_BATCH_PAGE_SIZE = 100
DEFAULT_BATCH_PAGE_SIZE = 20
MAX_METADATA_PAIRS = 16  # OpenAI's metadata: 16 pairs, keys 64 and values 512 characters
MAX_CUSTOM_ID_CHARS = 512


def is_batch_priority(priority: int) -> bool:
    """Whether a job of `priority` belongs to the batch band."""
    return priority >= BATCH_PRIORITY


class BatchCreateRequest(RequestModel):
    """`POST /v1/batches`."""

    input_file_id: Annotated[Text, Field(min_length=1)] = Field(
        description="a file uploaded with purpose `batch`")
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)],
                             Annotated[str, Field(max_length=512)]],
                        Field(max_length=MAX_METADATA_PAIRS)] | None = None
    output_expires_after: ExpiresAfter | None = Field(
        None, description="when the output and error files expire (anchor: their "
        "creation); by default after LLMQ_BATCH_OUTPUT_EXPIRES_SECONDS")


class BatchError(BaseModel):
    code: str  # invalid_json_line, invalid_request, duplicate_custom_id, invalid_file, ...
    message: str
    param: str | None = None
    line: int | None = None  # 1-based line of the input file


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchInputTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens found in the prefix cache


class BatchOutputTokensDetails(BaseModel):
    reasoning_tokens: int  # always 0 here: no output is set apart as reasoning


class BatchUsage(BaseModel):
    """The tokens of the batch's requests that ran and ended (OpenAI's `usage`)."""

    input_tokens: int
    input_tokens_details: BatchInputTokensDetails
    output_tokens: int
    output_tokens_details: BatchOutputTokensDetails
    total_tokens: int


class Batch(BaseModel):
    """A batch: its status, its files and how many of its requests ended which way."""

    id: str  # batch_<hex>
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed",
                    "expired", "cancelling", "cancelled"]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int  # unix seconds, like every *_at here
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None
    model: str | None  # the model every line names (None while validating, or if they differ)
    usage: BatchUsage


class BatchList(BaseModel):
    """The caller's batches, newest first."""

    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None  # pass as `after` for the next page
    has_more: bool


class BatchListQuery(BaseModel):
    """`GET /v1/batches` query; unknown parameters are a 400."""

    model_config = ConfigDict(extra="forbid")

    after: str | None = Field(None, description="the `last_id` of the previous page")
    limit: Annotated[int, Field(ge=1, le=MAX_BATCH_PAGE_SIZE)] = Field(
        DEFAULT_BATCH_PAGE_SIZE, description="batches per page")


class BatchInputLine(BaseModel):
    """One line of an input file: a request to `url` (the batch's endpoint)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    custom_id: Annotated[str, Field(min_length=1, max_length=MAX_CUSTOM_ID_CHARS)]
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


class BatchResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]  # what the direct request answers (or its error body)


class BatchLineError(BaseModel):
    code: str  # batch_expired, batch_cancelled
    message: str


class BatchOutputLine(BaseModel):
    """One line of an output or error file."""

    id: str  # batch_req_<hex>
    custom_id: str
    response: BatchResponse | None
    error: BatchLineError | None
