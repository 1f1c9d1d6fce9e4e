"""The job request: a validated body (`tasks.api`) -> `JobRequest`, or a `SchemaError`
naming the field.

Shapes and types are the pydantic models' (`tasks.api.jobs.JobCreateRequest`, and the
OpenAI ones in the web layer, which build a `JobRequest` with `build_job_request`).
Model-dependent checks (does the model exist, does the prompt fit its context) happen
where the tokenizer is, in the web layer, which then runs `JobRequest.check` against the
model's limits (vocabulary, sampling ranges).
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tasks.api.errors import SchemaError
from tasks.api.fields import MAX_MESSAGES, PRIORITY_RANGE, SamplingFields
from tasks.api.jobs import JobCreateRequest
from tasks.models import JobKind
from tasks.params import (
    MAX_SEED,
    InvalidParamError,
    ModelLimits,
    SamplingParams,
    check_token_ids,
)

__all__ = ["MAX_MESSAGES", "PRIORITY_RANGE", "JobRequest", "SchemaError", "build_job_request",
           "parse_job_request", "pin_seed"]

# SamplingFields that go to SamplingParams as they are (model and priority do not)
_SAMPLING_FIELDS = tuple(name for name in SamplingFields.model_fields
                         if name not in ("model", "priority"))


@dataclass(slots=True)
class JobRequest:
    model: str
    kind: JobKind
    prompt: str | None  # completion text (kind == COMPLETION and not token ids)
    prompt_token_ids: list[int] | None  # completion given as token ids
    messages: list[dict[str, str]] | None  # chat (kind == CHAT)
    params: SamplingParams
    priority: int  # lower runs first

    def params_dict(self) -> dict[str, Any]:
        """The `jobs.params` column: `SamplingParams(**params_dict())` rebuilds it."""
        return asdict(self.params)

    def check(self, limits: ModelLimits, prompt_token_ids: list[int]) -> None:
        """The job against the served model: its sampling parameters and its prompt token
        ids, given or tokenized (a tokenizer may know more tokens than the model's
        embedding has rows). Raises SchemaError naming the field."""
        try:
            check_token_ids(prompt_token_ids, "messages" if self.messages else "prompt",
                            limits.vocab_size)
            self.params.check(limits)
        except InvalidParamError as exc:
            raise SchemaError.from_invalid_param(exc) from None


BodyModel = TypeVar("BodyModel", bound=BaseModel)


def validate_body(model: type[BodyModel], body: Any) -> BodyModel:
    """A decoded JSON request body as `model`; raises SchemaError naming the field."""
    if not isinstance(body, dict):
        raise SchemaError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise SchemaError.from_validation(exc, model, body) from None


def parse_job_request(body: Any, *, max_n: int) -> JobRequest:
    """Validate a decoded JSON body of `POST /v1/jobs`; raises SchemaError on the first
    problem found."""
    request = validate_body(JobCreateRequest, body)
    if (request.prompt is None) == (request.messages is None):
        raise SchemaError("give exactly one of prompt (completion) or messages (chat)",
                          "prompt" if request.prompt is not None else "messages")
    prompt, prompt_token_ids = (request.prompt, None) if isinstance(request.prompt, str) \
        else (None, request.prompt)
    messages = None if request.messages is None else [
        message.model_dump(exclude_none=True) for message in request.messages]
    return build_job_request(request, prompt=prompt, prompt_token_ids=prompt_token_ids,
                             messages=messages, max_tokens=request.max_tokens,
                             logprobs=request.logprobs, max_n=max_n)


def build_job_request(fields: SamplingFields, *, prompt: str | None,
                      prompt_token_ids: list[int] | None,
                      messages: list[dict[str, str]] | None, max_tokens: int | None,
                      logprobs: int | None, max_n: int) -> JobRequest:
    """The job of a validated request: its sampling parameters checked together (ranges
    that span fields, the server's `max_n`). Raises SchemaError naming the field."""
    sampling: dict[str, Any] = {name: getattr(fields, name) for name in _SAMPLING_FIELDS
                                if getattr(fields, name) is not None}
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    if sampling.get("n", 1) > max_n:
        raise SchemaError(f"n must be between 1 and {max_n} on this server, got {sampling['n']}",
                          "n")
    try:
        params = SamplingParams(**sampling)
    except InvalidParamError as exc:
        raise SchemaError.from_invalid_param(exc) from None
    kind = JobKind.CHAT if messages is not None else JobKind.COMPLETION
    return JobRequest(model=fields.model, kind=kind, prompt=prompt,
                      prompt_token_ids=prompt_token_ids, messages=messages, params=params,
                      priority=fields.priority if fields.priority is not None else 0)


def pin_seed(params: SamplingParams) -> None:
    """Give unseeded params a seed of their own, drawn now.

    NOTE: stored with the job, so a job restarted after a lost worker samples the same
    tokens as its first attempt (a stream that already sent attempt 1's prefix continues
    it exactly). Sampling stays random from one job to the next.
    """
    if params.seed is None:
        params.seed = secrets.randbelow(MAX_SEED + 1)
