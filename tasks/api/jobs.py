"""The jobs API's bodies (`/v1/jobs`): what a client submits, what it reads back, and the
listing's query."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tasks.api.fields import (
    MAX_MESSAGES,
    LogprobsCount,
    RequestModel,
    SamplingFields,
    StructuredOutputsRequest,
    Text,
    TokenId,
)

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
MAX_PAGE_SIZE = 100
DEFAULT_PAGE_SIZE = 20


class JobMessage(RequestModel):
    """One chat message of a job."""

    role: Literal["system", "user", "assistant", "tool"]
    content: Text
    name: Text | None = None


class JobCreateRequest(SamplingFields):
    """`POST /v1/jobs`: exactly one of `prompt` (a completion) or `messages` (a chat)."""

    prompt: Annotated[Text, Field(min_length=1)] | Annotated[
        list[TokenId], Field(min_length=1)] | None = Field(
        None, description="completion text, or its token ids")
    messages: Annotated[list[JobMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None \
        = Field(None, description="a chat, rendered with the model's chat template")
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(None, description="default 16")
    logprobs: LogprobsCount | None = Field(None, description="top-n logprobs per token")
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="constrain the output: a JSON schema, regex, choice or grammar")


class JobListQuery(BaseModel):
    """`GET /v1/jobs` query: newest first, `after` pages on; unknown parameters are a 400."""

    model_config = ConfigDict(extra="forbid")

    limit: Annotated[int, Field(ge=1, le=MAX_PAGE_SIZE)] = Field(
        DEFAULT_PAGE_SIZE, description="jobs per page")
    after: str | None = Field(None, description="the `last_id` of the previous page")
    status: str | None = Field(None, description="comma-separated statuses: "
                               + ", ".join(JOB_STATUSES))
    model: str | None = Field(None, description="only this model's jobs")
    created_after: datetime | None = Field(None, description="ISO 8601; created at or after")
    created_before: datetime | None = Field(None, description="ISO 8601; created before")
    batch_id: str | None = Field(None, description="only the lines of this batch")


class JobChoice(BaseModel):
    index: int
    text: str | None = None
    finish_reason: str | None = None  # stop, length, cancelled, error; null while running


class JobUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int


class JobTimings(BaseModel):
    created_at: str | None
    started_at: str | None
    first_token_at: str | None
    finished_at: str | None
    queue_seconds: float | None
    time_to_first_token_seconds: float | None
    run_seconds: float | None
    total_seconds: float | None


class JobLinks(BaseModel):
    self: str
    events: str  # text/event-stream of the job's events
    cancel: str


class Job(BaseModel):
    """A job as the API shows it (create, get, list and cancel answer with it)."""

    id: str
    object: Literal["job"]
    model: str
    kind: Literal["completion", "chat"]
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    priority: int
    attempts: int
    params: dict[str, Any]  # the sampling parameters the job runs with
    text: str | None  # sample 0's text so far
    choices: list[JobChoice]
    finish_reason: str | None
    error: str | None
    error_kind: Literal["invalid_request", "server_error"] | None = Field(
        None, description="why a failed job failed: its request (a 400 from the OpenAI "
        "endpoints) or the service (500); null otherwise, and on rows older than the field")
    request_id: str | None = Field(None, description="the X-Request-Id of the request that "
                                   "created the job (the client's, or one the server made)")
    usage: JobUsage | None
    timings: JobTimings
    created_at: str | None
    links: JobLinks
    cancel_requested: bool | None = Field(None, description="cancel: the worker was asked "
                                          "to stop the job (202)")
    batch_id: str | None = Field(None, description="the batch of a batch line's job")
    custom_id: str | None = Field(None, description="the batch line's custom_id")


class JobList(BaseModel):
    """A page of jobs, newest first."""

    object: Literal["list"]
    data: list[Job]
    has_more: bool
    last_id: str | None  # pass as `after` for the next page
