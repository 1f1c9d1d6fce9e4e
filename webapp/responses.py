"""OpenAI's Responses API over durable jobs (`/v1/responses`): create, retrieve (or replay
and follow its events), cancel, delete.

A response is a chat job underneath (its `job_id` is in the body and the `X-Llmq-Job-Id`
header, so `/v1/jobs/<id>` shows it too) plus a `responses` row with what only the
response has. `background: true` answers the queued response at once; the job runs
whatever the client does. Without it, a non-streaming request waits for the job (up to
`settings.request_timeout_seconds`, then it is cancelled: a 504), and a streaming
request whose client disconnects cancels the job, as the OpenAI endpoints do.
Stream events and their numbering: `webapp/response_events.py`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

import redis
from flask import Blueprint, Response, jsonify
from sqlalchemy import select, update

from tasks.api.responses import (
    InputItemListQuery,
    ResponseCreateRequest,
    ResponseRetrieveQuery,
)
from tasks.db import utcnow
from tasks.models import Job, JobStatus, StoredResponse
from tasks.schema import SchemaError, build_job_request
from webapp.auth import current_api_key_id
from webapp.errors import APIError
from webapp.groups import context_len
from webapp.jobs import (
    cancel,
    idempotency_key_header,
    json_body,
    parse_query,
    served_model,
    submit_job,
    tokenize,
)
from webapp.openai_api import cancel_quietly, reload_job
from webapp.response_events import text_so_far
from webapp.response_objects import (
    conversation,
    input_items_page,
    input_messages,
    parse_response_request,
    response_id,
    response_object,
)
from webapp.response_stream import stream_events, wait_for_job
from webapp.services import Services, services
from webapp.streaming import event_stream_response

logger = logging.getLogger(__name__)

bp = Blueprint("responses", __name__, url_prefix="/v1/responses")

CANCEL_WAIT_SECONDS = 5.0  # a running job's worker stops it at its next step
# a retried create finds the first request's job at once, its response row a moment later
IDEMPOTENT_ROW_WAIT_SECONDS = 2.0
_POLL_SECONDS = 0.05


@bp.post("")
def create_response() -> Response:
    """Validate, build the conversation, submit its chat job, store the response row."""
    svc = services()
    api_key_id = current_api_key_id()
    try:
        req = parse_response_request(json_body())
        own_input = input_messages(req)
    except SchemaError as exc:
        raise APIError(400, "invalid_value", exc.message, exc.param) from None
    previous = None
    if req.previous_response_id is not None:
        previous = _previous(svc, req.previous_response_id, api_key_id)
    messages = conversation(req, own_input, previous)
    max_tokens = req.max_output_tokens or max(req.min_tokens or 1, 1)  # placeholder: below
    try:
        job_request = build_job_request(req, prompt=None, prompt_token_ids=None,
                                        messages=messages, max_tokens=max_tokens,
                                        logprobs=None, max_n=1)
    except SchemaError as exc:
        raise _renamed(APIError(400, "invalid_value", exc.message, exc.param)) from None
    model = served_model(req.model)
    try:
        prompt_text, prompt_token_ids = tokenize(model, job_request)
    except APIError as exc:
        raise _renamed(exc) from None
    if req.max_output_tokens is None:
        job_request.params.max_tokens = max(job_request.params.min_tokens, 1,
                                            context_len(model) - len(prompt_token_ids))
    job, created = submit_job(job_request, prompt_text, prompt_token_ids,
                              api_key_id=api_key_id, idempotency_key=idempotency_key_header())
    stored = _store(svc, req, job, own_input) if created else _stored_for(svc, job)
    headers = {"X-Llmq-Job-Id": str(job.id)}
    if req.stream:
        background = bool(req.background)
        return event_stream_response(
            lambda _sink, cooperative: stream_events(svc, stored, job, -1, not background,
                                                     cooperative), headers)
    if not req.background:
        wait_for_job(svc, str(job.id))
        job = reload_job(svc, str(job.id)) or job
    return Response(json.dumps(response_object(stored, job), separators=(",", ":")),
                    mimetype="application/json", headers=headers)


@bp.get("/<response_id>")
def get_response(response_id: str) -> Response:
    """The response (output so far while it runs); `?stream=true[&starting_after=N]`: its
    events after N, stored then live, until the terminal one."""
    svc = services()
    query: ResponseRetrieveQuery = parse_query(ResponseRetrieveQuery)
    if query.starting_after is not None and not query.stream:
        raise APIError(400, "invalid_value", "starting_after needs stream=true",
                       "starting_after")
    stored, job = load_response(response_id)
    if query.stream:
        svc.redis.ping()  # Redis down -> 503 now, not a broken stream later
        after = -1 if query.starting_after is None else query.starting_after
        return event_stream_response(
            lambda _sink, cooperative: stream_events(svc, stored, job, after, False,
                                                     cooperative),
            {"X-Llmq-Job-Id": str(job.id)})
    text = None
    if not JobStatus(job.status).is_terminal:
        # NOTE: from the stream, as a stream client has it: a job requeued after its worker
        # died keeps the text it had (the re-run repeats it) instead of starting over
        try:
            text = text_so_far(e for _, e in svc.subscriber.read_events(str(job.id))) or None
        except redis.RedisError:
            logger.warning("response %s: stream unreadable; answering from the row", stored.id)
        if text is None and job.status == JobStatus.RUNNING.value:
            text = ""
    return jsonify(response_object(stored, job, text=text))


@bp.get("/<response_id>/input_items")
def list_input_items(response_id: str) -> Response:
    """The response's own input items, a page at a time (`?limit=&order=&after=`)."""
    query: InputItemListQuery = parse_query(InputItemListQuery)
    stored, job = load_response(response_id)
    page = input_items_page(stored, job, limit=query.limit, order=query.order,
                            after=query.after)
    if page is None:
        raise APIError(400, "invalid_cursor", "after must be the id of an input item of this "
                       "response", "after")
    return jsonify(page)


@bp.post("/<response_id>/cancel")
def cancel_response(response_id: str) -> Response:
    """Cancel a background response. A finished one is answered as it is (cancelling is
    idempotent, as OpenAI's background mode documents)."""
    svc = services()
    stored, job = load_response(response_id)
    if not stored.background:
        raise APIError(400, "invalid_value", f"response {response_id} was not created with "
                       "background: true; only background responses can be cancelled",
                       "response_id")
    job_id = str(job.id)
    if not JobStatus(job.status).is_terminal:
        cancel(svc, job)
        deadline = time.monotonic() + CANCEL_WAIT_SECONDS
        while time.monotonic() < deadline:
            job = reload_job(svc, job_id) or job
            if JobStatus(job.status).is_terminal:
                break
            time.sleep(_POLL_SECONDS)
    return jsonify(response_object(stored, job))


@bp.delete("/<response_id>")
def delete_response(response_id: str) -> Response:
    """Delete a response (and cancel its job if it still runs): later reads are a 404."""
    svc = services()
    stored, job = load_response(response_id)
    with svc.session_factory.begin() as session:
        session.execute(update(StoredResponse).where(StoredResponse.id == stored.id)
                        .values(deleted=True))
    if not JobStatus(job.status).is_terminal:
        cancel_quietly(svc, str(job.id))
    logger.info("response %s deleted (job %s)", stored.id, job.id)
    return jsonify({"id": stored.id, "object": "response.deleted", "deleted": True})


def _renamed(error: APIError) -> APIError:
    """An error about the job's fields in the Responses API's names (`max_output_tokens`,
    `input`)."""
    names = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input"}
    if error.param not in names:
        return error
    name = names[error.param]
    return APIError(error.status, error.code, error.message.replace(error.param, name), name)


def load_response(response_id: str) -> tuple[StoredResponse, Job]:
    """The caller's stored response and its job, or a 404 (also for another key's
    response, a deleted one and one created with store: false)."""
    found = _visible(services(), response_id, current_api_key_id())
    if found is None:
        raise APIError(404, "response_not_found", f"no response {response_id!r}",
                       "response_id")
    return found


def _visible(svc: Services, response_id: str,
             api_key_id: uuid.UUID | None) -> tuple[StoredResponse, Job] | None:
    with svc.reads() as session:
        stored = session.get(StoredResponse, response_id)
        if stored is None or stored.deleted or not stored.store:
            return None
        if svc.settings.auth_enabled and stored.api_key_id != api_key_id:
            return None
        job = session.get(Job, stored.job_id)
    return None if job is None else (stored, job)


def _previous(svc: Services, previous_id: str,
              api_key_id: uuid.UUID | None) -> tuple[StoredResponse, Job]:
    found = _visible(svc, previous_id, api_key_id)
    if found is None:
        raise APIError(400, "previous_response_not_found", f"previous response with id "
                       f"{previous_id!r} not found", "previous_response_id")
    if not JobStatus(found[1].status).is_terminal:
        raise APIError(400, "previous_response_in_progress", f"previous response "
                       f"{previous_id!r} has not finished; continue it once it has",
                       "previous_response_id")
    return found


def _stored_for(svc: Services, job: Job) -> StoredResponse:
    """The response of `job`, which a repeated Idempotency-Key found: the first request's
    row (waited for briefly: it is written just after its job), or a 422 when the key was
    used for a job that is not a response."""
    deadline = time.monotonic() + IDEMPOTENT_ROW_WAIT_SECONDS
    while True:
        with svc.reads() as session:
            stored = session.scalars(select(StoredResponse).where(
                StoredResponse.job_id == job.id)).first()
        if stored is not None and not stored.deleted:
            return stored
        if stored is not None or time.monotonic() >= deadline:
            raise APIError(422, "idempotency_key_reused",
                           f"Idempotency-Key was used for job {job.id}, which is not a "
                           "(live) response; use a new key for a new request",
                           "Idempotency-Key")
        time.sleep(_POLL_SECONDS)


def _store(svc: Services, req: ResponseCreateRequest, job: Job,
           own_input: list[dict[str, str]]) -> StoredResponse:
    stored = StoredResponse(
        id=response_id(job), job_id=job.id, api_key_id=job.api_key_id,
        previous_response_id=req.previous_response_id, instructions=req.instructions,
        input=own_input, background=bool(req.background), store=req.store is not False,
        max_output_tokens=req.max_output_tokens, meta=req.metadata, created_at=utcnow(),
        deleted=False)
    try:
        with svc.session_factory.begin() as session:
            session.add(stored)
    except Exception:
        # the job must not run for a response nobody can see
        cancel_quietly(svc, str(job.id))
        raise
    logger.info("response %s stored (job %s, background %s)", stored.id, job.id,
                stored.background)
    return stored
