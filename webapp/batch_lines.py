"""The lines of a batch's input file: parsed and checked against the batch's endpoint,
then each one turned into its job.

A line that is not a request of the batch's endpoint (not JSON, no unique `custom_id`,
not `POST`, another `url`) fails the whole batch, its problems in `errors.data` with their
line numbers (as OpenAI does). Every other line becomes a job (`jobs.batch_id`,
`custom_id`, `batch_index`) in the batch band (`tasks.api.batches.BATCH_PRIORITY`): a body
the served model refuses is a failed job from the start, so it reaches the error file as a
failed request (status 400) like at OpenAI. Tokenizing needs the served model, so this
runs in a web process (webapp/batch_validation.py).
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from tasks.api.batches import BATCH_PRIORITY, BatchInputLine
from tasks.api.errors import SchemaError
from tasks.models import Job, JobErrorKind, JobKind, JobStatus
from tasks.schema import pin_seed
from webapp.errors import APIError
from webapp.groups import context_len
from webapp.jobs import served_model, tokenize
from webapp.openai_format import parse_openai_request
from webapp.services import Services

KIND_OF_ENDPOINT = {"/v1/completions": JobKind.COMPLETION,
                    "/v1/chat/completions": JobKind.CHAT}


def parse_lines(data: bytes, endpoint: str,
                max_lines: int) -> tuple[list[BatchInputLine], list[dict[str, Any]]]:
    """The requests of an input file, or its problems (`{code, message, param, line}`,
    1-based lines). Blank lines are skipped."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [file_problem("invalid_file", f"the file is not UTF-8 text "
                                 f"(byte {exc.start})")]
    lines: list[BatchInputLine] = []
    errors: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    numbered = [(n, raw) for n, raw in enumerate(text.split("\n"), start=1) if raw.strip()]
    if not numbered:
        return [], [file_problem("empty_file", "the input file holds no requests")]
    if len(numbered) > max_lines:
        return [], [file_problem("too_many_requests", f"the input file holds "
                                 f"{len(numbered)} requests; a batch takes at most "
                                 f"{max_lines} (LLMQ_MAX_BATCH_LINES): split it")]
    for number, raw in numbered:
        def problem(code: str, message: str, param: str | None = None,
                    line_number: int = number) -> None:
            errors.append({"code": code, "message": message, "param": param,
                           "line": line_number})
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            problem("invalid_json_line", "the line is not a JSON object")
            continue
        try:
            line = BatchInputLine.model_validate(value)
        except ValidationError as exc:
            error = SchemaError.from_validation(exc, BatchInputLine)
            problem("invalid_request", error.message, error.param)
            continue
        if line.url != endpoint:
            problem("mismatched_endpoint", f"url {line.url!r} is not the batch's endpoint "
                    f"{endpoint!r}", "url")
            continue
        if line.custom_id in seen:
            problem("duplicate_custom_id", f"custom_id {line.custom_id!r} is also on line "
                    f"{seen[line.custom_id]}; every request needs its own", "custom_id")
            continue
        seen[line.custom_id] = number
        lines.append(line)
    return lines, errors


def file_problem(code: str, message: str) -> dict[str, Any]:
    """A problem of the whole input file (no line), as `errors.data` holds it."""
    return {"code": code, "message": message, "param": None, "line": None}


def line_job(svc: Services, kind: JobKind, index: int, line: BatchInputLine,
             api_key_id: uuid.UUID | None, batch_id: str, now: datetime) -> Job:
    """The job of one valid line: queued, or failed when the served model refuses its
    body (the error file then answers it with a 400, as the direct request would).

    A 5xx APIError (the served model cannot load its tokenizer) is the server's problem,
    not the line's: it propagates, and the batch is validated again later."""
    job = Job(id=uuid.uuid4(), api_key_id=api_key_id, batch_id=batch_id, custom_id=line.custom_id,
              batch_index=index, kind=kind.value, priority=BATCH_PRIORITY, attempts=0,
              created_at=now)
    try:
        _fill_job(svc, kind, line.body, job)
    except APIError as exc:
        if exc.status >= 500:
            raise
        model = line.body.get("model")
        job.model = model[:200] if isinstance(model, str) else ""
        job.params = job.params or {}
        job.status = JobStatus.FAILED.value
        job.finish_reason = "error"
        job.error = exc.message
        job.error_kind = JobErrorKind.INVALID_REQUEST.value
        job.finished_at = now
    return job


def _fill_job(svc: Services, kind: JobKind, body: dict[str, Any], job: Job) -> None:
    """The request of a line's body, as `webapp.openai_api` reads a direct one; raises
    APIError (4xx) for what it refuses."""
    try:
        req = parse_openai_request(body, kind, max_n=svc.settings.max_n)
    except SchemaError as exc:
        raise APIError(400, "invalid_value", exc.message, exc.param) from None
    # NOTE: a batch's bodies are built from the job row (tasks/batches.py), which keeps
    # neither the token logprobs, how the prompt was echoed, nor the request's tool plan:
    # refused, not ignored.
    for name, asked in (("stream", req.stream), ("echo", req.echo),
                        ("logprobs", req.num_logprobs is not None),
                        ("tools", req.tools is not None)):
        if asked:
            raise APIError(400, "invalid_value", f"{name} is not supported in a batch "
                           "request; send it as a direct request", name)
    model = served_model(req.job.model)
    prompt_text, prompt_token_ids = tokenize(model, req.job)
    if req.fill_max_tokens:
        req.job.params.max_tokens = max(req.job.params.min_tokens, 1,
                                        context_len(model) - len(prompt_token_ids))
    pin_seed(req.job.params)
    job.model = req.job.model
    job.prompt = prompt_text
    job.messages = req.job.messages
    job.prompt_token_ids = prompt_token_ids
    job.params = req.job.params_dict()
    job.prompt_tokens = len(prompt_token_ids)
    job.status = JobStatus.QUEUED.value
