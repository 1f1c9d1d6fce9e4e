"""OpenAI's Batch API (`/v1/batches`): create, get, list and cancel batches.

Creating a batch checks what is cheap (the body; the input file exists, is the caller's
and has purpose batch), stores it `validating` and answers at once, as OpenAI does. The
lines are validated and turned into jobs off the request, by a web process's validator
thread (webapp/batch_validation.py, the lines themselves in webapp/batch_lines.py); a GET
of a validating batch wakes it. Batch lines get no broker message: a device group's batch
feeder (workers/batch_feeder.py) claims them from the table while it has spare room, so
they never sit ahead of an interactive request in the broker. The rest of a batch's life
(cancel, expiry, the output and error files) is `tasks/batches.py`'s.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack
from datetime import timedelta
from typing import Any

import redis
from flask import Blueprint, Response, jsonify
from pydantic import ValidationError
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from tasks.api.batches import BatchCreateRequest, BatchListQuery
from tasks.api.errors import SchemaError
from tasks.batches import (
    EXPIRABLE,
    FINAL_STATUS,
    BatchProgress,
    batch_progress,
    cancel_batch_jobs,
    expire_batch,
    finalize_if_done,
    new_batch_id,
)
from tasks.db import has_passed, keyset_after, keyset_order, update_count, utcnow
from tasks.models import Batch, BatchStatus
from tasks.protocol import batch_progress_key, batch_progress_lock_key
from webapp.auth import current_api_key_id
from webapp.batch_validation import batch_validator
from webapp.errors import APIError
from webapp.files import load_owned, page, visible, visible_file
from webapp.jobs import json_body, parse_query
from webapp.services import Services, services

logger = logging.getLogger(__name__)

bp = Blueprint("batches", __name__, url_prefix="/v1/batches")

CANCELLABLE = (BatchStatus.VALIDATING.value, BatchStatus.IN_PROGRESS.value)


@bp.post("")
def create_batch() -> Response:
    """Store the batch `validating` (its validator wakes) and answer it."""
    svc = services()
    api_key_id = current_api_key_id()
    body = json_body()
    try:
        req = BatchCreateRequest.model_validate(body)
    except ValidationError as exc:
        error = SchemaError.from_validation(exc, BatchCreateRequest)
        raise APIError(400, "invalid_value", error.message, error.param) from None
    with svc.reads() as session:
        input_file = visible_file(session, req.input_file_id, api_key_id)
        if input_file is None or input_file.purpose != "batch":
            raise APIError(400, "invalid_value", f"input_file_id {req.input_file_id!r} is not "
                           "a file uploaded with purpose batch", "input_file_id")
    now = utcnow()
    keep = (req.output_expires_after.seconds if req.output_expires_after is not None
            else svc.settings.batch_output_expires_seconds)
    batch = Batch(id=new_batch_id(), api_key_id=api_key_id, endpoint=req.endpoint,
                  input_file_id=req.input_file_id, completion_window=req.completion_window,
                  status=BatchStatus.VALIDATING.value, metadata_=req.metadata, errors=None,
                  num_total=0, num_completed=0, num_failed=0, created_at=now,
                  expires_at=now + timedelta(
                      seconds=svc.settings.batch_completion_window_seconds),
                  output_expires_seconds=keep, validation_attempts=0)
    with svc.session_factory.begin() as session:
        session.add(batch)
        answer = batch_to_dict(batch, batch_progress(session, batch))
    batch_validator().wake()
    logger.info("batch %s validating: file %s for %s", answer["id"], req.input_file_id,
                req.endpoint)
    return jsonify(answer)


@bp.get("/<batch_id>")
def get_batch(batch_id: str) -> Response:
    """A batch; finished here when its last job has ended (or its window passed)."""
    svc = services()
    batch = load_batch(batch_id)
    if batch.status == BatchStatus.VALIDATING.value:
        batch_validator().wake()  # this process validates it if nobody else does
    if batch.status in EXPIRABLE and has_passed(batch.expires_at) and expire_batch(
            svc.session_factory, svc.redis, svc.settings, batch.id):
        finalize_if_done(svc.session_factory, batch.id)
        return jsonify(_answer(svc, batch.id))
    # NOTE: clients poll a running batch (a benchmark's 10 a second); its answer is the row
    # read above and one pass over its lines (shared for a moment), which also says
    # whether any is left: only then does the GET try to finish it (each finalizer look
    # is two more reads)
    (progress,) = shared_progress(svc, [batch])
    if (BatchStatus(batch.status) in FINAL_STATUS and progress.unfinished == 0
            and finalize_if_done(svc.session_factory, batch.id)):
        return jsonify(_answer(svc, batch.id))
    return jsonify(batch_to_dict(batch, progress))


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
    with svc.reads() as session:
        if query.after:
            cursor = visible(session, Batch, query.after, api_key_id)
            if cursor is None:
                raise APIError(400, "invalid_cursor", "after must be the id of a batch from "
                               "a previous page of this listing", "after")
            statement = statement.where(keyset_after(Batch.created_at, Batch.id, cursor))
        rows = list(session.scalars(statement))
        listed = rows[:query.limit]  # the one row more only says whether a page follows
        data = [batch_to_dict(row, progress) for row, progress
                in zip(listed, shared_progress(svc, listed, session))]
    if any(row["status"] == BatchStatus.VALIDATING.value for row in data):
        batch_validator().wake()
    return jsonify(page(data, query.limit, has_more=len(rows) > query.limit))


@bp.post("/<batch_id>/cancel")
def cancel_batch(batch_id: str) -> Response:
    """Cancel: `cancelling` while its running jobs stop, then `cancelled` with what was
    done in the output file (a `validating` batch: the lines its validator committed so
    far are cancelled with the rest, and it commits nothing more). Cancelling a cancelled
    batch answers it again."""
    svc = services()
    batch = load_batch(batch_id)
    status = BatchStatus(batch.status)
    if status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        return jsonify(_answer(svc, batch.id))
    with svc.session_factory.begin() as session:
        won = update_count(session, update(Batch).where(
            Batch.id == batch.id, Batch.status.in_(CANCELLABLE)).values(
            status=BatchStatus.CANCELLING.value, cancelling_at=utcnow()))
    if not won:
        current = load_batch(batch_id).status
        raise APIError(409, "batch_not_cancellable", f"batch {batch_id} is {current}; only "
                       "a validating or in_progress batch can be cancelled", "batch_id")
    cancel_batch_jobs(svc.session_factory, svc.redis, svc.settings, batch.id)
    finalize_if_done(svc.session_factory, batch.id)
    return jsonify(_answer(svc, batch.id))


# --- answers -----------------------------------------------------------------------------


def _answer(svc: Services, batch_id: str) -> dict[str, Any]:
    with svc.reads() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None  # batches are never deleted
        return batch_to_dict(batch, batch_progress(session, batch))


# the batches whose figures the web processes share: running or being validated (a
# validating 50,000-line batch polled ten times a second made a pass each poll)
SHARED_FIGURES = {*FINAL_STATUS, BatchStatus.VALIDATING}
# how long a web process computing a batch's figures anew holds the others off (a pass
# over 50,000 lines is 40-160 ms of Postgres); its figures are served stale that long at most
PROGRESS_LOCK_SECONDS = 5.0


def shared_progress(svc: Services, batches: list[Batch],
                    session: Session | None = None) -> list[BatchProgress]:
    """`batch_progress` of each of `batches`; for a running one (validating, in progress,
    cancelling, expiring) the figures a web process computed less than
    `batch_progress_cache_seconds` ago, kept in Redis for every web process (one read for
    all of them). A pass over 2,000 lines is 2-4 ms of Postgres and 2 of the web, 27-160
    ms of Postgres at 50,000; a client polling ten times a second (or ten clients once a
    second, or a listing of ten running batches) costs one pass a batch a second. (A
    validating batch's figures were not shared: polled ten times a second, a 50,000-line
    batch made 172 passes while validated, 5.7 s of Postgres.) Figures past that age are
    computed anew by the one web process that takes the batch's lock
    (`batch_progress_lock_key`); the others serve the older figures meanwhile. Figures
    are served for the status they were computed at only. Redis unreachable: a pass each.
    `session`: where the passes read (one is opened when needed and none is given)."""
    seconds = svc.settings.batch_progress_cache_seconds
    # by index in `batches`: the running ones' keys
    keys = {i: batch_progress_key(svc.settings, batch.id) for i, batch in enumerate(batches)
            if seconds > 0 and BatchStatus(batch.status) in SHARED_FIGURES}
    shared: dict[int, BatchProgress] = {}
    stale: dict[int, BatchProgress] = {}
    if keys:
        try:
            values = svc.redis.mget(list(keys.values()))
        except redis.RedisError:
            values = [None] * len(keys)
        now = time.time()
        for i, value in zip(keys, values):
            figures = _shared_figures(value)
            # figures of the status the batch had then only (a batch still validating
            # shows no request counts yet)
            if figures is not None and figures[1] == batches[i].status:
                computed_at, _, progress = figures
                (shared if 0 <= now - computed_at < seconds else stale)[i] = progress
    if stale:
        shared.update((i, progress) for i, progress in stale.items()
                      if not _take_progress_lock(svc, batches[i].id))
    computed: dict[int, BatchProgress] = {}
    missing = [i for i in range(len(batches)) if i not in shared]
    if missing:
        with ExitStack() as stack:
            reads = session if session is not None else stack.enter_context(svc.reads())
            for i in missing:
                computed[i] = batch_progress(reads, batches[i])
    to_share = [(i, progress) for i, progress in computed.items() if i in keys]
    if to_share:
        at = time.time()
        try:
            with svc.redis.pipeline(transaction=False) as pipe:
                for i, progress in to_share:
                    pipe.set(keys[i], json.dumps([at, batches[i].status, progress._asdict()]),
                             px=max(1, round(1000 * (seconds + PROGRESS_LOCK_SECONDS))))
                    pipe.delete(batch_progress_lock_key(svc.settings, batches[i].id))
                pipe.execute()
        except redis.RedisError:
            pass  # the next read makes a pass of its own
    return [shared[i] if i in shared else computed[i] for i in range(len(batches))]


def _shared_figures(value: bytes | str | None) -> tuple[float, str, BatchProgress] | None:
    """What `shared_progress` stored: when, for a batch of which status, and the figures
    (None: nothing, or not what this version writes)."""
    if value is None:
        return None
    try:
        computed_at, status, fields = json.loads(value)
        return float(computed_at), str(status), BatchProgress(**fields)
    except (ValueError, TypeError):
        return None


def _take_progress_lock(svc: Services, batch_id: str) -> bool:
    """Whether this process computes `batch_id`'s figures anew (no other one does)."""
    try:
        return bool(svc.redis.set(batch_progress_lock_key(svc.settings, batch_id), b"1",
                                  nx=True, px=round(1000 * PROGRESS_LOCK_SECONDS)))
    except redis.RedisError:
        return True  # Redis away: a pass of its own


def batch_to_dict(batch: Batch, progress: BatchProgress) -> dict[str, Any]:
    counts, model, usage, _ = progress

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
        "request_counts": counts, "metadata": batch.metadata_, "model": model, "usage": usage,
    }


def load_batch(batch_id: str) -> Batch:
    """The caller's batch `batch_id`, or a 404 (also for another key's batch)."""
    return load_owned(Batch, batch_id, "batch")
