"""OpenAI's Batch API (`/v1/batches`): create, get, list and cancel batches.

Creating a batch validates its input file line by line. A line that is not a request of
the batch's endpoint (not JSON, no unique `custom_id`, not `POST`, another `url`) fails
the whole batch at validation, its problems in `errors.data` with their line numbers (as
OpenAI does). Every other line becomes a job (`jobs.batch_id`, `custom_id`,
`batch_index`) in the batch band (`tasks.api.batches.BATCH_PRIORITY`): a body the served
model refuses is a failed job from the start, so it reaches the error file as a failed
request (status 400) like at OpenAI. Batch lines get no broker message: a device group's
batch feeder (workers/batch_feeder.py) claims them from the table while it has spare room,
so they never sit ahead of an interactive request in the broker. The rest of a batch's
life (cancel, expiry, the output and error files) is `tasks/batches.py`'s.
"""

from __future__ import annotations

import json
import logging
import uuid
from datetime import timedelta
from typing import Any

from flask import Blueprint, Response, jsonify
from pydantic import ValidationError
from sqlalchemy import select, update

from tasks.api.batches import (
    BATCH_PRIORITY,
    BatchCreateRequest,
    BatchInputLine,
    BatchListQuery,
)
from tasks.api.errors import SchemaError
from tasks.batches import (
    FINAL_STATUS,
    cancel_batch_jobs,
    expire_batch,
    finalize_if_done,
    new_batch_id,
    request_counts,
    window_passed,
)
from tasks.db import keyset_after, keyset_order, update_count, utcnow
from tasks.files import read_file_bytes
from tasks.models import Batch, BatchStatus, Job, JobErrorKind, JobKind, JobStatus
from tasks.schema import pin_seed
from webapp.auth import current_api_key_id
from webapp.errors import APIError
from webapp.files import load_owned, page, visible, visible_file
from webapp.groups import context_len
from webapp.jobs import json_body, parse_query, served_model, tokenize
from webapp.openai_format import parse_openai_request
from webapp.services import Services, services

logger = logging.getLogger(__name__)

bp = Blueprint("batches", __name__, url_prefix="/v1/batches")

KIND_OF_ENDPOINT = {"/v1/completions": JobKind.COMPLETION,
                    "/v1/chat/completions": JobKind.CHAT}
MAX_REPORTED_ERRORS = 1000  # validation errors kept in errors.data


@bp.post("")
def create_batch() -> tuple[Response, int] | Response:
    """Validate the input file; a failed batch, or one job per line (`in_progress`)."""
    svc = services()
    api_key_id = current_api_key_id()
    body = json_body()
    try:
        req = BatchCreateRequest.model_validate(body)
    except ValidationError as exc:
        error = SchemaError.from_validation(exc, BatchCreateRequest)
        raise APIError(400, "invalid_value", error.message, error.param) from None
    with svc.session_factory() as session:
        input_file = visible_file(session, req.input_file_id, api_key_id)
        if input_file is None or input_file.purpose != "batch":
            raise APIError(400, "invalid_value", f"input_file_id {req.input_file_id!r} is not "
                           "a file uploaded with purpose batch", "input_file_id")
        data = read_file_bytes(session, input_file.id)
    now = utcnow()
    batch = Batch(id=new_batch_id(), api_key_id=api_key_id, endpoint=req.endpoint,
                  input_file_id=req.input_file_id, completion_window=req.completion_window,
                  status=BatchStatus.VALIDATING.value, metadata_=req.metadata, errors=None,
                  num_total=0, num_completed=0, num_failed=0, created_at=now)
    lines, errors = _parse_lines(data, req.endpoint, svc.settings.max_batch_lines)
    if errors:
        batch.status = BatchStatus.FAILED.value
        batch.errors = errors[:MAX_REPORTED_ERRORS]
        batch.failed_at = utcnow()
        with svc.session_factory.begin() as session:
            session.add(batch)
            answer = batch_to_dict(session, batch)
        logger.info("batch %s failed validation: %d bad lines", batch.id, len(errors))
        return jsonify(answer)
    kind = KIND_OF_ENDPOINT[req.endpoint]
    batch_id = batch.id
    jobs = [_line_job(svc, kind, index, line, api_key_id, batch_id, now)
            for index, line in enumerate(lines)]
    batch.status = BatchStatus.IN_PROGRESS.value
    batch.num_total = len(jobs)
    batch.in_progress_at = now
    batch.expires_at = now + timedelta(seconds=svc.settings.batch_completion_window_seconds)
    with svc.session_factory.begin() as session:
        session.add(batch)
        session.flush()  # the batch before its jobs (their foreign key)
        session.add_all(jobs)
    finalize_if_done(svc.session_factory, batch_id)  # every line may have failed already
    logger.info("batch %s in progress: %d requests to %s", batch_id, len(jobs), req.endpoint)
    return jsonify(_answer(svc, batch_id))


@bp.get("/<batch_id>")
def get_batch(batch_id: str) -> Response:
    """A batch; finished here when its last job has ended (or its window passed)."""
    svc = services()
    batch = load_batch(batch_id)
    if batch.status == BatchStatus.IN_PROGRESS.value and window_passed(batch.expires_at):
        expire_batch(svc.session_factory, svc.redis, svc.settings, batch.id)
    if BatchStatus(batch.status) in FINAL_STATUS:
        finalize_if_done(svc.session_factory, batch.id)
    return jsonify(_answer(svc, batch.id))


@bp.get("")
def list_batches() -> Response:
    """The caller's batches, newest first (`?after=`, `?limit=`)."""
    svc = services()
    api_key_id = current_api_key_id()
    query = parse_query(BatchListQuery)
    statement = select(Batch).order_by(*keyset_order(Batch.created_at, Batch.id)).limit(
        query.limit + 1)
    if svc.settings.auth_enabled:
        statement = statement.where(Batch.api_key_id == api_key_id)
    with svc.session_factory() as session:
        if query.after:
            cursor = visible(session, Batch, query.after, api_key_id)
            if cursor is None:
                raise APIError(400, "invalid_cursor", "after must be the id of a batch from "
                               "a previous page of this listing", "after")
            statement = statement.where(keyset_after(Batch.created_at, Batch.id, cursor))
        rows = list(session.scalars(statement))
        data = [batch_to_dict(session, row) for row in rows]
    return jsonify(page(data, query.limit))


@bp.post("/<batch_id>/cancel")
def cancel_batch(batch_id: str) -> Response:
    """Cancel: `cancelling` while its running jobs stop, then `cancelled` with what was
    done in the output file. Cancelling a cancelled batch answers it again."""
    svc = services()
    batch = load_batch(batch_id)
    status = BatchStatus(batch.status)
    if status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        return jsonify(_answer(svc, batch.id))
    with svc.session_factory.begin() as session:
        won = update_count(session, update(Batch).where(
            Batch.id == batch.id, Batch.status == BatchStatus.IN_PROGRESS.value).values(
            status=BatchStatus.CANCELLING.value, cancelling_at=utcnow()))
    if not won:
        current = load_batch(batch_id).status
        raise APIError(409, "batch_not_cancellable", f"batch {batch_id} is {current}; only "
                       "an in_progress batch can be cancelled", "batch_id")
    cancel_batch_jobs(svc.session_factory, svc.redis, svc.settings, batch.id)
    finalize_if_done(svc.session_factory, batch.id)
    return jsonify(_answer(svc, batch.id))


# --- lines -------------------------------------------------------------------------------


def _parse_lines(data: bytes, endpoint: str,
                 max_lines: int) -> tuple[list[BatchInputLine], list[dict[str, Any]]]:
    """The requests of an input file, or its problems (`{code, message, param, line}`,
    1-based lines). Blank lines are skipped."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [{"code": "invalid_file", "message": f"the file is not UTF-8 text "
                     f"(byte {exc.start})", "param": None, "line": None}]
    lines: list[BatchInputLine] = []
    errors: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    numbered = [(n, raw) for n, raw in enumerate(text.split("\n"), start=1) if raw.strip()]
    if not numbered:
        return [], [{"code": "empty_file", "message": "the input file holds no requests",
                     "param": None, "line": None}]
    if len(numbered) > max_lines:
        return [], [{"code": "too_many_requests", "message": f"the input file holds "
                     f"{len(numbered)} requests; a batch takes at most {max_lines} "
                     "(LLMQ_MAX_BATCH_LINES): split it", "param": None, "line": None}]
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


def _line_job(svc: Services, kind: JobKind, index: int, line: BatchInputLine,
              api_key_id: uuid.UUID | None, batch_id: str, now: Any) -> Job:
    """The job of one valid line: queued, or failed when the served model refuses its
    body (the error file then answers it with a 400, as the direct request would)."""
    job = Job(id=uuid.uuid4(), api_key_id=api_key_id, batch_id=batch_id, custom_id=line.custom_id,
              batch_index=index, kind=kind.value, priority=BATCH_PRIORITY, attempts=0,
              created_at=now)
    try:
        _fill_job(svc, kind, line.body, job)
    except APIError as exc:
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



# --- answers -----------------------------------------------------------------------------


def _answer(svc: Services, batch_id: str) -> dict[str, Any]:
    with svc.session_factory() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None  # batches are never deleted
        return batch_to_dict(session, batch)


def batch_to_dict(session: Any, batch: Batch) -> dict[str, Any]:
    def unix(name: str) -> int | None:
        when = getattr(batch, name)
        return int(when.timestamp()) if when is not None else None

    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
        "status": batch.status, "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id, "created_at": unix("created_at"),
        **{name: unix(name) for name in ("in_progress_at", "expires_at", "finalizing_at",
                                         "completed_at", "failed_at", "expired_at",
                                         "cancelling_at", "cancelled_at")},
        "request_counts": request_counts(session, batch), "metadata": batch.metadata_,
    }


def load_batch(batch_id: str) -> Batch:
    """The caller's batch `batch_id`, or a 404 (also for another key's batch)."""
    return load_owned(Batch, batch_id, "batch")
