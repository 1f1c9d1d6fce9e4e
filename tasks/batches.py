"""A batch's life after its jobs are queued: cancel, expiry, and finalization.

(Before, while it is `validating`, a web process holds it under a lease:
webapp/batch_validation.py. Beat expires one whose window passed with no live validator.)

A batch is finished by whichever process first sees that none of its jobs is queued or
running (the device group's writer that stored a line's result, a web process answering a
GET, beat's sweep): `finalize_if_done` writes the output and error files and the final
status in one transaction whose conditional UPDATE (`WHERE status = <what it read>`) lets
exactly one process win; a loser's files are rolled back with its transaction. Nothing
is counted in memory, so a restarted web process or worker changes nothing: the job rows
are the truth.

Every line of the input ends in exactly one of the two files: a job that succeeded in the
output file, a failed one in the error file with its HTTP status and error body, and a
job cancelled by the batch's cancel or expiry in the error file with `batch_cancelled` or
`batch_expired`.
"""

from __future__ import annotations

import json
import logging
import uuid
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from redis import Redis
from sqlalchemy import (
    JSON,
    ColumnElement,
    Row,
    and_,
    bindparam,
    case,
    func,
    null,
    or_,
    select,
    type_coerce,
    update,
)
from sqlalchemy.orm import Session, sessionmaker

from tasks.db import has_passed, update_count, utcnow
from tasks.files import new_file_id, store_file
from tasks.job_errors import job_failure, refused_request
from tasks.models import Batch, BatchStatus, Job, JobErrorKind, JobKind, JobStatus, job_status_is
from tasks.openai_body import completion_object, response_id
from tasks.protocol import EventType, JobEvent, cancel_channel, cancel_flag_key
from tasks.settings import Settings
from tasks.streams.publish import EventPublisher

logger = logging.getLogger(__name__)

UNFINISHED = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
# the same statuses written into the SQL: ix_jobs_unfinished_batch_lines' predicate holds
_UNFINISHED_INLINE = job_status_is(JobStatus.QUEUED, JobStatus.RUNNING)
# one queued or running line of a batch, if any
_ANY_UNFINISHED = select(Job.id).where(Job.batch_id == bindparam("batch_id"),
                                       _UNFINISHED_INLINE).limit(1)
# what a batch becomes once none of its jobs is left, by the status it had
FINAL_STATUS = {BatchStatus.IN_PROGRESS: BatchStatus.COMPLETED,
                BatchStatus.CANCELLING: BatchStatus.CANCELLED,
                BatchStatus.FINALIZING: BatchStatus.EXPIRED}
_FINAL_TIME = {BatchStatus.COMPLETED: "completed_at", BatchStatus.CANCELLED: "cancelled_at",
               BatchStatus.EXPIRED: "expired_at"}
_ENDED_BY = {BatchStatus.CANCELLED: ("batch_cancelled", "the batch was cancelled before this "
                                     "request finished"),
             BatchStatus.EXPIRED: ("batch_expired", "this request could not be executed "
                                   "before the completion window expired")}
SWEEP_BATCH = 200  # batches looked at per sweep
# the statuses a batch may expire in (`validating` only once no process validates it)
EXPIRABLE = (BatchStatus.IN_PROGRESS.value, BatchStatus.VALIDATING.value)


def new_batch_id() -> str:
    return "batch_" + uuid.uuid4().hex


# NOTE: built once (bound batch id): building this select took a third of a running
# batch's GET, which clients poll
_RAN = and_(Job.status.not_in(UNFINISHED), Job.started_at.is_not(None))
_PROGRESS = select(
    Job.status, func.count(), func.min(Job.model), func.max(Job.model),
    func.coalesce(func.sum(case((_RAN, Job.prompt_tokens), else_=0)), 0),
    func.coalesce(func.sum(case((_RAN, Job.cached_tokens), else_=0)), 0),
    func.coalesce(func.sum(case((_RAN, Job.completion_tokens), else_=0)), 0),
).where(Job.batch_id == bindparam("batch_id")).group_by(Job.status)


class BatchProgress(NamedTuple):
    """A batch's figures as OpenAI shows them, and what is left of it."""

    counts: dict[str, int]  # `request_counts`: total, completed, failed
    model: str | None  # the model its lines all name (None where they differ)
    usage: dict[str, Any]  # the tokens of its requests that ran and ended
    # lines queued or running (None: not looked at, a finished batch's stored figures)
    unfinished: int | None


def batch_progress(session: Session, batch: Batch) -> BatchProgress:
    """`batch`'s figures: `request_counts` `{total, completed, failed}` (failed: failed or
    cancelled), its model and usage, and how many of its lines are still queued or
    running. A finished batch's stored figures; else ONE pass over its lines (two took
    47 ms of Postgres at 50,000 lines, one 27-29)."""
    terminal = BatchStatus(batch.status).is_terminal
    stored = {"total": batch.num_total, "completed": batch.num_completed,
              "failed": batch.num_failed}
    if terminal and batch.usage is not None:
        return BatchProgress(stored, batch.model, batch.usage, None)
    rows = session.execute(_PROGRESS, {"batch_id": batch.id}).all()
    counts = {status: count for status, count, *_ in rows}
    models = {name for row in rows for name in row[2:4]}
    prompt, cached, completion = (sum(int(row[i]) for row in rows) for i in (4, 5, 6))
    if not terminal and batch.status != BatchStatus.VALIDATING.value:
        failed = counts.get(JobStatus.FAILED.value, 0) + counts.get(JobStatus.CANCELLED.value, 0)
        stored = {"total": batch.num_total,
                  "completed": counts.get(JobStatus.SUCCEEDED.value, 0), "failed": failed}
    return BatchProgress(stored, the_one_model(models), usage_object(prompt, cached, completion),
                         sum(counts.get(status, 0) for status in UNFINISHED))


def the_one_model(models: set[str]) -> str | None:
    """A batch's `model`: the one its lines all name, None where they differ."""
    return next(iter(models)) if len(models) == 1 else None


def usage_object(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    """A batch's `usage` (OpenAI's shape) from its requests' token sums."""
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def finalize_if_done(session_factory: sessionmaker[Session], batch_id: str) -> bool:
    """Finish `batch_id` when none of its jobs is queued or running: its files, counts
    and final status. Returns whether this call finished it (False: not done yet, already
    finished, or another process won)."""
    with session_factory() as session:
        # NOTE: one unfinished line answers, from an index of unfinished lines only
        # (ix_jobs_unfinished_batch_lines): a probe, however many lines ended, where a count
        # over the batch's lines took 8 ms at 50,000 lines. First: a device group's writer
        # looks after every write of lines' results, and while any line is left (every look
        # but the last) this is the only statement (1.6-1.9 ms of CPU a look with the batch
        # row read first, 0.6-0.7 without)
        if session.scalar(_ANY_UNFINISHED, {"batch_id": batch_id}) is not None:
            return False
        batch = session.get(Batch, batch_id)
        if batch is None:
            return False
        status = BatchStatus(batch.status)
        if status not in FINAL_STATUS:
            return False
    final = FINAL_STATUS[status]
    now = utcnow()
    with session_factory() as session, session.begin():
        # NOTE: the conditional UPDATE first: it locks the row, so a concurrent
        # finalizer waits here, then matches nothing and writes no files.
        won = update_count(session, update(Batch).where(
            Batch.id == batch_id, Batch.status == status.value).values(
            status=final.value, finalizing_at=func.coalesce(Batch.finalizing_at, now),
            **{_FINAL_TIME[final]: now}))
        if not won:
            return False  # another process finished it (nothing was written here)
        # NOTE: the columns a line needs, not whole Job objects (their prompts and messages
        # too): a 2,000-line batch's last job is waited on this long
        jobs = session.execute(select(*_LINE_COLUMNS).where(Job.batch_id == batch_id)
                               .order_by(Job.batch_index)).all()
        output: list[str] = []
        errors: list[str] = []
        tokens = [0, 0, 0]  # prompt, cached, completion of the requests that ran
        for job in jobs:
            line, ok = output_line(job, final)
            (output if ok else errors).append(json.dumps(line, separators=(",", ":")))
            if job.started_at is not None:
                tokens[0] += job.prompt_tokens or 0
                tokens[1] += job.cached_tokens or 0
                tokens[2] += job.completion_tokens or 0
        models = {job.model for job in jobs}
        values: dict[str, Any] = {"num_completed": len(output), "num_failed": len(errors),
                                  "model": the_one_model(models),
                                  "usage": usage_object(*tokens)}
        keep = batch.output_expires_seconds
        expires_at = now + timedelta(seconds=keep) if keep is not None else None
        for name, lines in (("output_file_id", output), ("error_file_id", errors)):
            if lines:
                data = ("\n".join(lines) + "\n").encode()
                row = store_file(session, api_key_id=batch.api_key_id, purpose="batch_output",
                                 filename=f"{batch_id}_{name.split('_')[0]}.jsonl", data=data,
                                 num_lines=len(lines), file_id=new_file_id(),
                                 expires_at=expires_at)
                values[name] = row.id
        session.execute(update(Batch).where(Batch.id == batch_id).values(**values))
    logger.info("batch %s %s: %d requests succeeded, %d failed", batch_id, final.value,
                len(output), len(errors))
    return True


# NOTE: the JSON a line needs, not the whole: its `n` out of the params, and its samples
# only where it asked for more than one (a single sample is the row's `output_text` and
# `finish_reason`; decoding every `output` with its token ids was a third of a batch's
# finalizing)
_LINE_N = func.coalesce(Job.params["n"].as_integer(), 1)
# what `output_line` reads of a job
_LINE_COLUMNS = (Job.id, Job.custom_id, Job.status, Job.kind, Job.model, _LINE_N.label("n"),
                 type_coerce(case((_LINE_N > 1, Job.output), else_=null()), JSON)
                 .label("output"), Job.output_text, Job.finish_reason, Job.prompt_tokens,
                 Job.completion_tokens, Job.cached_tokens, Job.created_at, Job.started_at,
                 Job.error, Job.error_kind)


def output_line(job: Row[Any], final: BatchStatus) -> tuple[dict[str, Any], bool]:
    """A job's line in the output file (True) or the error file (False); `job` is a row
    of `_LINE_COLUMNS`."""
    line: dict[str, Any] = {"id": "batch_req_" + job.id.hex, "custom_id": job.custom_id,
                            "response": None, "error": None}
    if job.status == JobStatus.SUCCEEDED.value:
        kind = JobKind(job.kind)
        output = job.output if job.output is not None else [
            {"index": 0, "text": job.output_text or "", "finish_reason": job.finish_reason}]
        body = completion_object(
            kind=kind, id=response_id(kind, job.id.hex), created=_unix(job.created_at),
            model=job.model, n=int(job.n), output=output, finish_reason=job.finish_reason,
            usage={"prompt_tokens": job.prompt_tokens or 0,
                   "completion_tokens": job.completion_tokens or 0,
                   "cached_tokens": job.cached_tokens or 0})
        line["response"] = {"status_code": 200, "request_id": str(job.id), "body": body}
        return line, True
    if job.status == JobStatus.CANCELLED.value and final in _ENDED_BY:
        code, message = _ENDED_BY[final]
        line["error"] = {"code": code, "message": message}
        return line, False
    # NOTE: the direct request's error (kind and wording as its answer reads them): a body
    # refused at submission never ran, the direct request's 400 has no job in it
    if job.started_at is None and job.error_kind == JobErrorKind.INVALID_REQUEST.value:
        failure = refused_request(job.error or "the request was refused")
    else:
        failure = job_failure(str(job.id), job.error or f"job {job.id} ended {job.status}",
                              job.error_kind)
    line["response"] = {"status_code": failure.status, "request_id": str(job.id),
                        "body": failure.body()}
    return line, False


def cancel_batch_jobs(session_factory: sessionmaker[Session], redis: Redis, settings: Settings,
                      batch_id: str) -> tuple[int, int]:
    """Cancel every unfinished job of `batch_id`: queued ones at once (one UPDATE, their
    terminal events published), running ones by asking their workers. Returns
    (cancelled now, asked)."""
    now = utcnow()
    with session_factory() as session, session.begin():
        cancelled = session.execute(
            update(Job).where(Job.batch_id == batch_id, Job.status == JobStatus.QUEUED.value)
            .values(status=JobStatus.CANCELLED.value, finish_reason="cancelled",
                    finished_at=now)
            .returning(Job.id, Job.prompt_tokens)).all()
    with session_factory() as session:
        running = [str(job_id) for job_id in session.scalars(select(Job.id).where(
            Job.batch_id == batch_id, Job.status == JobStatus.RUNNING.value))]
    events = []
    for job_uuid, prompt_tokens in cancelled:
        usage = {"prompt_tokens": prompt_tokens or 0, "completion_tokens": 0,
                 "total_tokens": prompt_tokens or 0, "cached_tokens": 0}
        events.append((str(job_uuid), JobEvent(EventType.CANCELLED, finish_reason="cancelled",
                                             usage=usage)))
    if events:
        EventPublisher(redis, settings).publish(events)
    if running:
        pipe = redis.pipeline(transaction=False)
        for job_id in running:
            # NOTE: the flag outlives a lease reclaim: a requeued job is cancelled at its claim
            pipe.set(cancel_flag_key(settings, job_id), b"1", ex=settings.stream_ttl_seconds)
            pipe.publish(cancel_channel(settings), job_id)
        pipe.execute()
    logger.info("batch %s: %d queued jobs cancelled, %d running asked to stop", batch_id,
                len(cancelled), len(running))
    return len(cancelled), len(running)


def validation_unclaimed(now: datetime) -> ColumnElement[bool]:
    """The condition of a `validating` batch no live process validates: never claimed,
    or its validator's lease lapsed."""
    return and_(Batch.status == BatchStatus.VALIDATING.value,
                or_(Batch.validation_lease_expires_at.is_(None),
                    Batch.validation_lease_expires_at < now))


def expire_batch(session_factory: sessionmaker[Session], redis: Redis, settings: Settings,
                 batch_id: str) -> bool:
    """Past its window: `in_progress` (or `validating` with no live validator) ->
    `finalizing` (it ends `expired`), its unfinished jobs cancelled. Returns whether this
    call expired it."""
    now = utcnow()
    with session_factory() as session, session.begin():
        won = update_count(session, update(Batch).where(
            Batch.id == batch_id, Batch.expires_at < now,
            or_(Batch.status == BatchStatus.IN_PROGRESS.value, validation_unclaimed(now)))
            .values(status=BatchStatus.FINALIZING.value, finalizing_at=now))
    if won:
        logger.warning("batch %s passed its completion window; expiring it", batch_id)
        cancel_batch_jobs(session_factory, redis, settings, batch_id)
    return bool(won)


def sweep_batches(session_factory: sessionmaker[Session], redis: Redis,
                  settings: Settings) -> int:
    """Beat's pass: expire batches past their window (a `validating` one too, once no
    process validates it), finalize those whose jobs all ended (nobody may be polling
    them). Returns how many batches it finished."""
    with session_factory() as session:
        rows = session.execute(
            select(Batch.id, Batch.status, Batch.expires_at)
            .where(Batch.status.in_({s.value for s in FINAL_STATUS} | set(EXPIRABLE)))
            .order_by(Batch.created_at).limit(SWEEP_BATCH)).all()
    now = utcnow()
    finished = 0
    for batch_id, status, expires_at in rows:
        if status in EXPIRABLE and has_passed(expires_at, now):
            expire_batch(session_factory, redis, settings, batch_id)
        finished += finalize_if_done(session_factory, batch_id)
    return finished


def _unix(when: datetime | None) -> int:
    return int(when.timestamp()) if when is not None else 0
