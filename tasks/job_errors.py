"""What a client is answered for a failed job: the OpenAI error of its HTTP status.

A failed row says whose fault it was (`jobs.error_kind`, `tasks.models.JobErrorKind`):
the request itself (the engine's `add_request` guards, the worker's parameter check, a
grammar that does not compile) answers 400, anything else (a step that raised, a lost
worker) 500. The param and code of a 400 are read from the worker's wording; rows from
before the kind was stored (NULL), and stream error events, which carry no kind, are
judged by the wording alone. Shared by the direct answers (`webapp/errors.py`) and a
batch's error file (`tasks/batches.py`), so a batch line fails exactly as its direct
request would.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tasks.models import JobErrorKind

_PARAM_FAILURE = re.compile(  # tasks.params.InvalidParamError, maybe behind the prefix
    r"^(?:invalid job parameters: )?(?P<param>[a-z_]+)(?:\[\d+\])? must be ")
_CONTEXT_FAILURES = (
    re.compile(r"> max_model_len \d+; shorten the prompt or lower max_tokens"),
    re.compile(r"KV blocks .* lower max_tokens"),
)
_REQUEST_FAILURES = (re.compile(r"^invalid job parameters: "), re.compile(r"^prompt is empty"),
                     # the grammar backend refused the request's constraint
                     re.compile(r"^structured_outputs\.[a-z_]+ is not usable: "))


@dataclass(slots=True, frozen=True)
class JobFailure:
    """The error answered for a failed job."""

    status: int  # 400: the request's fault; 500: the service's
    code: str
    message: str
    param: str | None

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"type": self.type, "message": self.message, "param": self.param,
                          "code": self.code}}


def job_failure(job_id: str, error: str | None, kind: str | None = None) -> JobFailure:
    """The error of a job that failed with `error` (its row's text) and `kind` (its row's
    `error_kind`; None: judged by the wording)."""
    message = f"job {job_id} failed: {error or 'unknown error'}"
    if kind == JobErrorKind.SERVER_ERROR.value:
        return JobFailure(500, "job_failed", message, None)
    text = error or ""
    match = _PARAM_FAILURE.match(text)
    if match is not None:
        return JobFailure(400, "invalid_value", message, match["param"])
    if any(pattern.search(text) for pattern in _CONTEXT_FAILURES):
        return JobFailure(400, "context_length_exceeded", message, "max_tokens")
    if kind == JobErrorKind.INVALID_REQUEST.value or any(
            pattern.search(text) for pattern in _REQUEST_FAILURES):
        return JobFailure(400, "invalid_value", message, None)
    return JobFailure(500, "job_failed", message, None)


def refused_request(error: str) -> JobFailure:
    """The 400 of a request refused before it became a running job (a batch line whose
    body the served model refuses): its message as the direct request's answer words it,
    the param read from that wording."""
    match = _PARAM_FAILURE.match(error)
    return JobFailure(400, "invalid_value", error, match["param"] if match else None)
