"""Periodic maintenance run by beat's worker: lease reclaim, stranded-job resend, stream
expiry, batch and file expiry, and the queue timeout (`LLMQ_QUEUE_TIMEOUT_SECONDS`: a
job queued too long fails).

A running job's device group renews `lease_expires_at` every few seconds. A lease that
passed means the group died (or lost Postgres for longer than the lease): the job goes
back to the queue for another group, or fails once it has used `settings.max_attempts`
claims. `jobs.attempts` counts claims (the worker's `generate` adds one when it claims),
so reclaim leaves it as is and announces the attempt that follows.

A `queued` row must always have a `generate` message on its way. Messages get lost: a
Redis restarted without persistence, a worker killed holding prefetched messages (they
sit in the broker's unacked set until its visibility timeout), a send that failed while
Redis was down. The resend pass gives such a row a new message; the worker's conditional
claim makes a duplicate harmless.

Batch lines (`jobs.batch_id`) have no messages: each device group's batch feeder
(workers/batch_feeder.py) claims them from the table when it has spare room. So reclaim
only queues them again, and neither the resend pass nor the queue timeout touches them.
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from typing import Any

from celery import Celery
from redis import Redis
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from tasks.batches import sweep_batches
from tasks.broker_queue import pending_job_ids
from tasks.celery_app import send_generate
from tasks.db import create_db_engine, make_sessionmaker, update_count, utcnow
from tasks.files import delete_expired_files
from tasks.models import Job, JobErrorKind, JobStatus, job_status_is
from tasks.protocol import (
    BATCH_SWEEP_TASK,
    EXPIRE_STREAMS_TASK,
    RECLAIM_TASK,
    RESEND_QUEUED_TASK,
    EventType,
    JobEvent,
    group_alive_key,
)
from tasks.redis_client import as_text, make_redis
from tasks.settings import Settings
from tasks.streams.publish import EventPublisher

logger = logging.getLogger(__name__)

RECLAIM_BATCH = 500  # jobs handled per reclaim pass; the next pass takes the rest
EXPIRE_SCAN_COUNT = 1000


def reclaim_expired_leases(
    settings: Settings,
    session_factory: sessionmaker[Session],
    redis: Redis,
    celery_app: Celery,
) -> int:
    """Requeue (or fail) running jobs whose lease expired; returns how many were handled.

    Each row changes with a conditional UPDATE (still running, lease still expired), so a
    group renewing at the last moment, or a second beat, never double-handles a job. The
    row is written before the event and the new `generate` message go out.
    """
    now = utcnow()
    requeued: list[tuple[str, str, int, bool]] = []  # (job id, model, next attempt, batch)
    failed: list[tuple[str, str]] = []  # (job id, error)
    with session_factory.begin() as session:
        expired = session.execute(
            select(Job.id, Job.model, Job.attempts, Job.worker, Job.batch_id)
            .where(Job.status == JobStatus.RUNNING.value, Job.lease_expires_at < now)
            .order_by(Job.lease_expires_at)
            .limit(RECLAIM_BATCH)
        ).all()
        for job_uuid, model, attempts, worker, batch_id in expired:
            still_expired = update(Job).where(
                Job.id == job_uuid,
                Job.status == JobStatus.RUNNING.value,
                Job.lease_expires_at < now,
            )
            if attempts >= settings.max_attempts:
                error = f"worker lost; gave up after {attempts} attempts"
                values: dict[str, Any] = {
                    "status": JobStatus.FAILED.value, "finish_reason": "error", "error": error,
                    "error_kind": JobErrorKind.SERVER_ERROR.value, "finished_at": now,
                    "lease_expires_at": None,
                }
                if update_count(session, still_expired.values(**values)):
                    failed.append((str(job_uuid), error))
                    logger.warning("job %s: lease of %s expired; %s", job_uuid, worker, error)
                continue
            values = {
                "status": JobStatus.QUEUED.value, "worker": None, "lease_expires_at": None,
                "output_text": None, "completion_tokens": None, "first_token_at": None,
            }
            if update_count(session, still_expired.values(**values)):
                requeued.append((str(job_uuid), model, attempts + 1, batch_id is not None))
                logger.warning("job %s: lease of %s expired; requeued for attempt %d",
                               job_uuid, worker, attempts + 1)
    events = [(job_id, JobEvent(EventType.RESTART, attempt=attempt))
              for job_id, _model, attempt, _batch in requeued]
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cached_tokens": 0}
    events += [(job_id, JobEvent(EventType.ERROR, finish_reason="error", error=error,
                                 usage=usage))
               for job_id, error in failed]
    if events:
        EventPublisher(redis, settings).publish(events)
    for job_id, model, _attempt, batch in requeued:
        if batch:
            continue  # a batch line is queued again: a group's feeder claims it
        try:
            send_generate(celery_app, settings, job_id, model)
        except Exception:
            logger.exception("job %s: requeued but the generate message could not be sent",
                             job_id)
    return len(requeued) + len(failed)


def fail_overdue_queued_jobs(settings: Settings, session_factory: sessionmaker[Session],
                             redis: Redis) -> list[str]:
    """Fail jobs queued longer than `settings.queue_timeout_seconds` (None: never); returns
    their ids.

    One conditional UPDATE per batch (still queued, still older than the cutoff), so a
    job a worker claims meanwhile is left alone; the rows are committed before their
    terminal `error` event goes out, as reclaim does. The age is `created_at`: the time
    the client has waited.
    """
    timeout = settings.queue_timeout_seconds
    if timeout is None:
        return []
    now = utcnow()
    cutoff = now - timedelta(seconds=timeout)
    error = (f"waited longer than {timeout:g}s in the queue (LLMQ_QUEUE_TIMEOUT_SECONDS) "
             "without a worker taking it; resubmit, or add workers for the model")
    with session_factory.begin() as session:
        candidates = dict(session.execute(
            select(Job.id, Job.prompt_tokens)
            .where(job_status_is(JobStatus.QUEUED), Job.created_at < cutoff,
                   Job.batch_id.is_(None))  # a batch line waits for its window instead
            .order_by(Job.created_at)
            .limit(RECLAIM_BATCH)
        ).all())
        if not candidates:
            return []
        changed = session.scalars(
            update(Job)
            .where(Job.id.in_(list(candidates)), Job.status == JobStatus.QUEUED.value,
                   Job.created_at < cutoff)
            .values(status=JobStatus.FAILED.value, finish_reason="error", error=error,
                    error_kind=JobErrorKind.SERVER_ERROR.value, finished_at=now)
            .returning(Job.id)
        ).all()
    failed = [(job_uuid, candidates[job_uuid]) for job_uuid in changed]
    if not failed:
        return []
    events = [(str(job_uuid), JobEvent(EventType.ERROR, finish_reason="error", error=error,
                                       usage={"prompt_tokens": prompt_tokens or 0,
                                              "completion_tokens": 0,
                                              "total_tokens": prompt_tokens or 0,
                                              "cached_tokens": 0}))
              for job_uuid, prompt_tokens in failed]
    EventPublisher(redis, settings).publish(events)
    for job_uuid, _ in failed:
        logger.warning("job %s: %s", job_uuid, error)
    return [str(job_uuid) for job_uuid, _ in failed]


def resend_stranded_jobs(
    settings: Settings,
    session_factory: sessionmaker[Session],
    redis: Redis,
    celery_app: Celery,
) -> list[str]:
    """Send `generate` again for queued jobs older than `settings.queued_resend_seconds`
    with no message waiting in their model's queue; returns their ids.

    NOTE: the age is the row's `created_at`: a fresh row may be inserted before its
    message goes out, an old requeued one is re-sent at once when its message is missing.
    A message a live worker fetched a moment ago is not "waiting" either, so that job may
    get a second message: its claim then finds the row running and skips it.
    """
    cutoff = utcnow() - timedelta(seconds=settings.queued_resend_seconds)
    with session_factory() as session:
        rows = session.execute(
            select(Job.id, Job.model)
            .where(job_status_is(JobStatus.QUEUED), Job.created_at < cutoff,
                   Job.batch_id.is_(None))  # batch lines have no messages (see below)
            .order_by(Job.created_at)
            .limit(RECLAIM_BATCH)
        ).all()
    pending: dict[str, set[str]] = {}
    sent: list[str] = []
    for job_uuid, model in rows:
        if model not in pending:
            pending[model] = pending_job_ids(redis, settings, model)
        job_id = str(job_uuid)
        if job_id in pending[model]:
            continue
        send_generate(celery_app, settings, job_id, model)
        pending[model].add(job_id)
        sent.append(job_id)
        logger.warning("job %s: queued with no generate message waiting; sent one again",
                       job_id)
    return sent


def expire_streams(settings: Settings, session_factory: sessionmaker[Session],
                   redis: Redis) -> int:
    """Give every finished job's stream a TTL; returns how many streams got one.

    A terminal event sets the TTL itself; this catches streams left without one (a job
    whose row was finished without its event, an orphan of a deleted row).
    """
    pattern = settings.key("job", "*", "events")
    candidates: dict[uuid.UUID, bytes] = {}
    for key in redis.scan_iter(match=pattern, count=EXPIRE_SCAN_COUNT, _type="stream"):
        parts = key.decode().split(":")
        try:
            candidates[uuid.UUID(parts[-2])] = key
        except (ValueError, IndexError):
            continue
    if not candidates:
        return 0
    pipe = redis.pipeline(transaction=False)
    for key in candidates.values():
        pipe.ttl(key)
    without_ttl = [job_uuid for job_uuid, ttl in zip(candidates, pipe.execute()) if ttl == -1]
    if not without_ttl:
        return 0
    with session_factory() as session:
        live = set(session.scalars(
            select(Job.id).where(
                Job.id.in_(without_ttl),
                Job.status.in_([JobStatus.QUEUED.value, JobStatus.RUNNING.value]),
            )
        ))
    pipe = redis.pipeline(transaction=False)
    expired = [job_uuid for job_uuid in without_ttl if job_uuid not in live]
    for job_uuid in expired:
        pipe.expire(candidates[job_uuid], settings.stream_ttl_seconds)
    pipe.execute()
    if expired:
        logger.info("set a %ds TTL on %d finished job streams", settings.stream_ttl_seconds,
                    len(expired))
    return len(expired)


def forget_dead_groups(settings: Settings, redis: Redis) -> list[str]:
    """Remove the heartbeat fields of device groups whose alive key has expired (a group
    killed without its drain); returns "model/group" of each one removed.

    NOTE: readers already skip them (they check the alive key); this keeps the groups
    hashes from growing with every crashed worker. A group that was only slow re-adds its
    field with its next beat.
    """
    prefix = settings.key("groups") + ":"
    removed: list[str] = []
    for key in redis.scan_iter(match=prefix + "*", count=EXPIRE_SCAN_COUNT, _type="hash"):
        model = as_text(key)[len(prefix):]
        group_ids = [as_text(g) for g in redis.hkeys(key)]
        pipe = redis.pipeline(transaction=False)
        for group_id in group_ids:
            pipe.exists(group_alive_key(settings, model, group_id))
        dead = [g for g, alive in zip(group_ids, pipe.execute()) if not alive]
        if dead:
            redis.hdel(key, *dead)
            removed += [f"{model}/{g}" for g in dead]
    if removed:
        logger.info("forgot %d dead device groups: %s", len(removed), ", ".join(removed))
    return removed


class _Resources:
    """Connections of the maintenance tasks, opened on first use (not at registration)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._session_factory: sessionmaker[Session] | None = None
        self._redis: Redis | None = None

    @property
    def session_factory(self) -> sessionmaker[Session]:
        if self._session_factory is None:
            self._session_factory = make_sessionmaker(create_db_engine(self.settings.database_url))
        return self._session_factory

    @property
    def redis(self) -> Redis:
        if self._redis is None:
            self._redis = make_redis(self.settings.redis_url)
        return self._redis


def register_maintenance_tasks(app: Celery, settings: Settings) -> None:
    """Register `RECLAIM_TASK`, `RESEND_QUEUED_TASK`, `EXPIRE_STREAMS_TASK` and
    `BATCH_SWEEP_TASK` on `app` (bodies above and in `tasks.batches`)."""
    resources = _Resources(settings)

    @app.task(name=RECLAIM_TASK, ignore_result=True)
    def reclaim_task() -> int:
        # NOTE: the queue timeout rides on reclaim's schedule (every lease_renew_seconds)
        timed_out = fail_overdue_queued_jobs(settings, resources.session_factory,
                                             resources.redis)
        return len(timed_out) + reclaim_expired_leases(
            settings, resources.session_factory, resources.redis, app)

    @app.task(name=RESEND_QUEUED_TASK, ignore_result=True)
    def resend_task() -> int:
        return len(resend_stranded_jobs(settings, resources.session_factory, resources.redis,
                                        app))

    @app.task(name=BATCH_SWEEP_TASK, ignore_result=True)
    def sweep_batches_task() -> int:
        # NOTE: expired files ride on the batch sweep (batch output files expire)
        delete_expired_files(resources.session_factory)
        return sweep_batches(resources.session_factory, resources.redis, settings)

    @app.task(name=EXPIRE_STREAMS_TASK, ignore_result=True)
    def expire_streams_task() -> int:
        forget_dead_groups(settings, resources.redis)
        return expire_streams(settings, resources.session_factory, resources.redis)
