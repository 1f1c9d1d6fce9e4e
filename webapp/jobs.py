"""The jobs API: submit, read, list and cancel jobs (`/v1/jobs`)."""

from __future__ import annotations

import functools
import logging
import uuid
from typing import Any

import redis
import sqlalchemy.exc
from flask import Blueprint, Response, jsonify, request
from pydantic import ValidationError
from sqlalchemy import Insert, bindparam, delete, func, insert, select, update

from tasks.api.fields import StructuredOutputsRequest
from tasks.api.jobs import JOB_STATUSES, JobListQuery
from tasks.celery_app import send_generate
from tasks.db import keyset_after, keyset_order, update_count, utcnow
from tasks.metrics import record_queued_cancel
from tasks.models import Job, JobStatus, job_status_is
from tasks.protocol import EventType, JobEvent, cancel_channel, cancel_flag_key
from tasks.schema import JobRequest, SchemaError, parse_job_request, pin_seed
from tasks.streams.reader import current_output
from webapp.auth import current_api_key_id
from webapp.errors import APIError, redis_unavailable
from webapp.groups import context_len
from webapp.model_registry import ModelLoadError, ServedModel, UnknownModelError
from webapp.openai_format import structured_outputs
from webapp.request_id import current_request_id
from webapp.serialize import is_terminal, job_links, job_to_dict
from webapp.services import Services, services

logger = logging.getLogger(__name__)

bp = Blueprint("jobs", __name__, url_prefix="/v1/jobs")

MAX_IDEMPOTENCY_KEY_CHARS = 200
QUEUE_FULL_RETRY_AFTER_SECONDS = 5  # Retry-After of a 429 for a full model queue
# arrays and objects inside one another; a request body needs 4 (messages[i].content[j])
MAX_JSON_DEPTH = 32


def json_body() -> object:
    """The request's JSON body; a 400 when it is not JSON or nested deeper than
    MAX_JSON_DEPTH (shapes are checked by the schema)."""
    try:
        body = request.get_json(force=True, silent=True)
    except RecursionError:
        # NOTE: json.loads recurses per level; ~1,000 levels exhaust the stack.
        body = None
        too_deep = True
    else:
        too_deep = body is not None and _nested_deeper_than(body, MAX_JSON_DEPTH)
    if too_deep:
        raise APIError(400, "invalid_json", f"the request body nests arrays and objects "
                       f"deeper than {MAX_JSON_DEPTH} levels")
    if body is None:
        raise APIError(400, "invalid_json", "the request body must be JSON (Content-Type: "
                       "application/json) holding an object")
    return body


def _nested_deeper_than(value: object, limit: int) -> bool:
    """Whether arrays/objects nest more than `limit` levels (iterative: no recursion)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = list(item.values()) if isinstance(item, dict) else item
        if isinstance(children, list):
            stack.extend((child, depth + 1) for child in children
                         if isinstance(child, (dict, list)))
    return False


@bp.post("")
def create_job() -> tuple[Response, int]:
    """Validate, tokenize, store the job (queued) and send `generate` for it."""
    svc = services()
    api_key_id = current_api_key_id()
    body = json_body()
    try:
        job_request = parse_job_request(body, max_n=svc.settings.max_n)
        assert isinstance(body, dict)  # parse_job_request refuses anything else
        if body.get("structured_outputs") is not None:
            spec = StructuredOutputsRequest.model_validate(body["structured_outputs"])
            job_request.params.structured_outputs = structured_outputs(
                spec.as_dict(), "structured_outputs")
    except SchemaError as exc:
        raise APIError(400, "invalid_value", exc.message, exc.param) from None
    model = served_model(job_request.model)
    prompt_text, prompt_token_ids = tokenize(model, job_request)
    job, created = submit_job(job_request, prompt_text, prompt_token_ids,
                              api_key_id=api_key_id, idempotency_key=idempotency_key_header())
    if not created:
        return jsonify(job_to_dict(job)), 200
    response = jsonify(job_to_dict(job))
    response.headers["Location"] = job_links(str(job.id))["self"]
    return response, 202


@bp.get("/<job_id>")
def get_job(job_id: str) -> Response:
    """A job's status, output so far (from its stream while it runs), result and usage."""
    job = load_job(job_id)
    live_output = None
    if not is_terminal(job) and job.status == JobStatus.RUNNING.value:
        try:
            live_output = current_output(services().subscriber.read_events(job_id))
        except redis.RedisError:
            # The row's periodic output snapshot still answers the poll.
            logger.warning("job %s: stream unreadable; answering from the row", job_id)
    return jsonify(job_to_dict(job, live_output))


@bp.get("")
def list_jobs() -> Response:
    """The caller's jobs, newest first (`tasks.api.jobs.JobListQuery`): `?limit=`,
    `?after=<job id>`, `?status=a,b`, `?model=`, `?created_after=`, `?created_before=`."""
    svc = services()
    api_key_id = current_api_key_id()
    query = parse_query(JobListQuery)
    statement = select(Job).order_by(*keyset_order(Job.created_at, Job.id)).limit(
        query.limit + 1)
    if svc.settings.auth_enabled:
        statement = statement.where(Job.api_key_id == api_key_id)
    if query.status:
        statuses = [s.strip() for s in query.status.split(",") if s.strip()]
        bad = [s for s in statuses if s not in JOB_STATUSES]
        if bad:
            raise APIError(400, "invalid_value", f"unknown status {bad[0]!r}; use one of "
                           f"{', '.join(JOB_STATUSES)}", "status")
        statement = statement.where(Job.status.in_(statuses))
    if query.model:
        statement = statement.where(Job.model == query.model)
    if query.batch_id:
        statement = statement.where(Job.batch_id == query.batch_id)
    if query.created_after is not None:
        statement = statement.where(Job.created_at >= query.created_after)
    if query.created_before is not None:
        statement = statement.where(Job.created_at < query.created_before)
    with svc.reads() as session:
        if query.after:
            cursor = _visible_job(session, query.after, api_key_id)
            if cursor is None:
                raise APIError(400, "invalid_cursor", "after must be the id of a job from a "
                               "previous page of this listing", "after")
            statement = statement.where(keyset_after(Job.created_at, Job.id, cursor))
        jobs = list(session.scalars(statement))
    has_more = len(jobs) > query.limit
    jobs = jobs[:query.limit]
    return jsonify({
        "object": "list",
        "data": [job_to_dict(job) for job in jobs],
        "has_more": has_more,
        "last_id": str(jobs[-1].id) if jobs else None,
    })


def parse_query(model: type[Any]) -> Any:
    """The request's query string as `model` (extra parameters forbidden): a 400 naming
    the parameter otherwise."""
    try:
        return model.model_validate(request.args.to_dict())
    except ValidationError as exc:
        error = SchemaError.from_validation(exc, model)
        raise APIError(400, "invalid_value", error.message.replace("field", "query parameter",
                                                                   1), error.param) from None


@bp.post("/<job_id>/cancel")
def cancel_job(job_id: str) -> tuple[Response, int]:
    """Cancel: a queued job at once; a running job by asking its worker (202)."""
    job = load_job(job_id)
    if job.status == JobStatus.CANCELLED.value:
        return jsonify(job_to_dict(job)), 200
    if is_terminal(job):
        raise APIError(409, "job_finished", f"job {job_id} already {job.status}; nothing to "
                       "cancel")
    if cancel(services(), job):
        return jsonify(job_to_dict(load_job(job_id))), 200
    body = job_to_dict(load_job(job_id))
    body["cancel_requested"] = True
    return jsonify(body), 202


def cancel(svc: Services, job: Job) -> bool:
    """Cancel an unfinished job: True when it was still queued and is now cancelled,
    False when its worker was asked to stop it (it ends `cancelled` shortly).

    Takes the services explicitly so a streaming response can call it after its
    request context is gone (a client that disconnected).
    """
    job_id = str(job.id)
    if job.status == JobStatus.QUEUED.value:
        now = utcnow()
        with svc.session_factory.begin() as session:
            cancelled = update_count(session, (
                update(Job)
                .where(Job.id == job.id, Job.status == JobStatus.QUEUED.value)
                .values(status=JobStatus.CANCELLED.value, finish_reason="cancelled",
                        finished_at=now)
            ))
        if cancelled:
            usage = {"prompt_tokens": job.prompt_tokens or 0, "completion_tokens": 0,
                     "total_tokens": job.prompt_tokens or 0, "cached_tokens": 0}
            try:
                svc.publisher.publish([(job_id, JobEvent(EventType.CANCELLED,
                                                         finish_reason="cancelled",
                                                         usage=usage))])
            except redis.RedisError:
                # The row is the truth; the event stream falls back to it (see events.py).
                logger.warning("job %s cancelled but its terminal event was not published",
                               job_id)
            record_queued_cancel(svc.redis, svc.settings, job.model)
            logger.info("job %s cancelled while queued", job_id)
            return True
        # it started meanwhile: ask its worker like any running job
    pipe = svc.redis.pipeline(transaction=False)
    # NOTE: the flag outlives a lease reclaim, so a requeued job is cancelled at its claim.
    pipe.set(cancel_flag_key(svc.settings, job_id), b"1", ex=svc.settings.stream_ttl_seconds)
    pipe.publish(cancel_channel(svc.settings), job_id)
    pipe.execute()
    logger.info("job %s: cancel requested from its worker", job_id)
    return False


def submit_job(job_request: JobRequest, prompt_text: str | None, prompt_token_ids: list[int],
               *, api_key_id: uuid.UUID | None,
               idempotency_key: str | None = None) -> tuple[Job, bool]:
    """Store a validated, tokenized job (queued) and send `generate` for it.

    Returns `(job, created)`: `created` is False when `idempotency_key` names an existing
    job of the same key and the same request, which is returned instead (a different
    request under a used key is a 422). Shared by `/v1/jobs` and the OpenAI endpoints, so
    every request is the same kind of job. A job without a seed gets one pinned here
    (`tasks.schema.pin_seed`). Raises APIError: 429 when the model's queue holds
    `settings.max_queued_jobs`, 503 when the broker is unreachable (the row is removed
    again then).
    """
    svc = services()
    if idempotency_key is not None:
        existing = _find_idempotent(api_key_id, idempotency_key)
        if existing is not None:
            return _same_request(existing, job_request, prompt_token_ids,
                                 idempotency_key), False
    seeded = job_request.params.seed is not None
    pin_seed(job_request.params)
    row = dict(
        id=uuid.uuid4(), api_key_id=api_key_id, model=job_request.model,
        kind=job_request.kind.value, prompt=prompt_text, messages=job_request.messages,
        prompt_token_ids=prompt_token_ids, params=job_request.params_dict(),
        priority=job_request.priority, idempotency_key=idempotency_key,
        request_id=current_request_id(), status=JobStatus.QUEUED.value, attempts=0,
        prompt_tokens=len(prompt_token_ids), created_at=utcnow(),
    )
    try:
        with svc.autocommit.connect() as conn:  # one statement: the check and the insert
            if conn.execute(*_insert_if_room(svc, row)).first() is None:
                limit = svc.settings.max_queued_jobs
                raise APIError(429, "queue_full", f"model {job_request.model!r} has {limit} "
                               "jobs queued, the limit (LLMQ_MAX_QUEUED_JOBS); retry later",
                               headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_SECONDS)})
    except sqlalchemy.exc.IntegrityError:
        # NOTE: a concurrent request with the same Idempotency-Key won the insert.
        existing = _find_idempotent(api_key_id, idempotency_key) if idempotency_key else None
        if existing is None or idempotency_key is None:
            raise
        if not seeded:
            job_request.params.seed = None
        return _same_request(existing, job_request, prompt_token_ids, idempotency_key), False
    job = Job(**row)  # the stored row (not bound to a session)
    job_id = str(job.id)
    try:
        send_generate(svc.celery, svc.settings, job_id, job.model)
    except Exception:
        # The row must not stay queued with no message to run it: take it back.
        logger.warning("job %s: could not enqueue generate; removing the row", job_id,
                       exc_info=True)
        with svc.session_factory.begin() as session:
            session.execute(delete(Job).where(Job.id == job.id))
        raise redis_unavailable() from None
    logger.info("job %s queued: model %s, %d prompt tokens, max_tokens %d", job_id, job.model,
                len(prompt_token_ids), job_request.params.max_tokens)
    return job, True


def _insert_if_room(svc: Services, row: dict[str, Any]) -> tuple[Insert, dict[str, Any]]:
    """The INSERT of a job's `row` that inserts nothing when `row`'s model already has
    `max_queued_jobs` queued jobs (0: no limit), with its parameters: the check and the
    insert are one statement, one round trip. RETURNING the id: no row back means the
    queue is full.

    NOTE: counts at most limit + 1 rows (a LIMIT in a subquery) through the partial index
    of queued interactive jobs, so a full queue costs the same as a short one, and a
    queued batch costs nothing. Concurrent submissions may pass the
    check together: the bound is soft by at most the web's concurrency.
    """
    limit = svc.settings.max_queued_jobs
    params = {f"v_{name}": value for name, value in row.items()}
    if limit > 0:
        params.update(queue_limit=limit, queue_scan=limit + 1)
    return _insert_statement(tuple(row), limit > 0), params


@functools.cache
def _insert_statement(names: tuple[str, ...], limited: bool) -> Insert:
    """`_insert_if_room`'s statement, built once per column list: a submission binds
    its values (building it was about a fifth of a POST's CPU in the web)."""
    columns = Job.__table__.c
    values = select(*[bindparam(f"v_{name}", type_=columns[name].type) for name in names])
    if limited:
        # NOTE: batch lines do not count: a big batch must never turn interactive
        # requests away
        queued = (select(Job.id).where(job_status_is(JobStatus.QUEUED),
                                       Job.model == bindparam("v_model"),
                                       Job.batch_id.is_(None))
                  .limit(bindparam("queue_scan")).subquery())
        values = values.where(select(func.count()).select_from(queued).scalar_subquery()
                              < bindparam("queue_limit"))
    return insert(Job).from_select(list(names), values).returning(Job.id)


def _same_request(existing: Job, job_request: JobRequest, prompt_token_ids: list[int],
                  key: str) -> Job:
    """`existing` when it was made from the same request; a 422 naming the conflict when
    the Idempotency-Key is reused for a different one (as Stripe answers)."""
    params = job_request.params_dict()
    stored = dict(existing.params or {})
    if params.get("seed") is None:
        stored["seed"] = None  # the pinned seed is ours, not part of the request
    mine = {"model": job_request.model, "kind": job_request.kind.value,
            "prompt_token_ids": prompt_token_ids, "messages": job_request.messages,
            "priority": job_request.priority, "params": params}
    theirs = {"model": existing.model, "kind": existing.kind,
              "prompt_token_ids": existing.prompt_token_ids, "messages": existing.messages,
              "priority": existing.priority, "params": stored}
    differing = [name for name in mine if mine[name] != theirs[name]]
    if differing:
        raise APIError(422, "idempotency_key_reused",
                       f"Idempotency-Key {key!r} was used for job {existing.id} with a "
                       f"different request ({', '.join(differing)} differ); use a new key "
                       "for a new request", "Idempotency-Key")
    return existing


def load_job(job_id: str) -> Job:
    """The caller's job `job_id`, or a 404 (also for another key's job)."""
    api_key_id = current_api_key_id()
    with services().reads() as session:
        job = _visible_job(session, job_id, api_key_id)
    if job is None:
        raise APIError(404, "job_not_found", f"no job {job_id!r}", "job_id")
    return job


def _visible_job(session: Any, job_id: str, api_key_id: uuid.UUID | None) -> Job | None:
    try:
        job_uuid = uuid.UUID(job_id)
    except ValueError:
        return None
    job = session.get(Job, job_uuid)
    if job is None:
        return None
    if services().settings.auth_enabled and job.api_key_id != api_key_id:
        return None
    return job


def served_model(name: str) -> ServedModel:
    try:
        return services().models.get(name)
    except UnknownModelError as exc:
        raise APIError(404, "model_not_found", str(exc), "model") from None
    except ModelLoadError as exc:
        logger.error("model %s cannot be loaded: %s", name, exc)
        raise APIError(503, "model_unavailable", str(exc), "model") from None


def prompt_text(model: ServedModel, job_request: JobRequest,
                tools: list[dict[str, Any]] | None = None) -> str | None:
    """The text a job's prompt is encoded from: a chat rendered with the model's template
    (and `tools`, OpenAI tool objects), a completion's prompt; None for token ids."""
    if job_request.messages is not None:
        try:
            return model.render_chat(job_request.messages, tools)
        except ValueError as exc:
            raise APIError(400, "invalid_messages", str(exc), "messages") from None
    if job_request.prompt_token_ids is not None:
        return None
    return job_request.prompt or ""


def tokenize(model: ServedModel, job_request: JobRequest,
             tools: list[dict[str, Any]] | None = None, *,
             encoded: tuple[str, list[int]] | None = None
             ) -> tuple[str | None, list[int]]:
    """(prompt text, prompt token ids), the job checked against the served model: its
    context length, vocabulary and sampling limits (400 naming the field otherwise).
    `tools` (OpenAI tool objects) go into a chat's prompt. `encoded`: the text and ids
    already made (`prompt_text`, then the model's encode; a batch encodes many at once)."""
    text: str | None
    if encoded is not None:
        text, token_ids = encoded
    else:
        text = prompt_text(model, job_request, tools)
        if text is None:
            token_ids = list(job_request.prompt_token_ids or [])
        elif job_request.messages is not None:
            token_ids = model.encode_chat(text)
        else:
            token_ids = model.encode(text)
    max_tokens = job_request.params.max_tokens
    limit = context_len(model)
    if len(token_ids) + max_tokens > limit:
        raise APIError(400, "context_length_exceeded",
                       f"the prompt has {len(token_ids)} tokens and max_tokens is {max_tokens}, "
                       f"{len(token_ids) + max_tokens} in all, but model {model.name!r} fits "
                       f"{limit}; shorten the prompt or lower max_tokens",
                       "max_tokens" if len(token_ids) < limit else "prompt")
    try:
        job_request.check(model.limits, token_ids)
    except SchemaError as exc:
        raise APIError(400, "invalid_value", exc.message, exc.param) from None
    return text, token_ids


def idempotency_key_header() -> str | None:
    """The request's `Idempotency-Key` (trimmed), None without one; a 400 when malformed."""
    key = request.headers.get("Idempotency-Key")
    if key is None:
        return None
    key = key.strip()
    if not key or len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
        raise APIError(400, "invalid_idempotency_key", f"Idempotency-Key must be 1 to "
                       f"{MAX_IDEMPOTENCY_KEY_CHARS} characters", "Idempotency-Key")
    return key


def _find_idempotent(api_key_id: uuid.UUID | None, key: str) -> Job | None:
    owner = Job.api_key_id.is_(None) if api_key_id is None else Job.api_key_id == api_key_id
    with services().reads() as session:
        return session.scalar(select(Job).where(owner, Job.idempotency_key == key))


