"""No queued job is stranded: beat's resend pass gives a `generate` message to every queued
row that has none waiting, against real Postgres, Redis and a worker process."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import update

from tasks.broker_queue import pending_job_ids, queue_keys
from tasks.celery_app import create_celery, send_generate
from tasks.db import utcnow
from tasks.maintenance import resend_stranded_jobs
from tasks.models import Job, JobStatus
from tests.pipeline_helpers import insert_job, running_worker, wait_terminal

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(service_settings):
    # a prefix of its own: the queue this test reads holds only its own messages
    return service_settings.with_overrides(
        redis_prefix=service_settings.redis_prefix + "s" + uuid.uuid4().hex[:6],
        queued_resend_seconds=1.0,
    )


@pytest.fixture
def cleanup(session_factory):
    """Jobs a test leaves queued are cancelled after it: other tests count queued rows."""
    created: list[str] = []
    yield created
    with session_factory.begin() as session:
        session.execute(update(Job).where(Job.id.in_([uuid.UUID(j) for j in created]),
                                          Job.status == JobStatus.QUEUED.value)
                        .values(status=JobStatus.CANCELLED.value, finished_at=utcnow()))


def _age(session_factory, job_id: str, seconds: float) -> None:
    with session_factory.begin() as session:
        session.execute(update(Job).where(Job.id == uuid.UUID(job_id))
                        .values(created_at=utcnow() - timedelta(seconds=seconds)))


def test_resend_only_the_old_queued_jobs_without_a_waiting_message(
    settings, session_factory, redis_client, cleanup
):
    app = create_celery(settings)
    lost = insert_job(session_factory)  # its message never reached the broker
    waiting = insert_job(session_factory)
    send_generate(app, settings, waiting, "tiny")
    fetched = insert_job(session_factory)  # a dead worker's prefetched message: unacked only
    send_generate(app, settings, fetched, "tiny")
    key = queue_keys(settings, "tiny")[0]
    message = redis_client.lpop(key)
    redis_client.hset(f"{settings.redis_prefix}:celery:unacked", "tag-1",
                      json.dumps([json.loads(message), "", settings.queue_for("tiny")]))
    fresh = insert_job(session_factory)  # the web may not have sent it yet
    running = insert_job(session_factory)
    cleanup += [lost, waiting, fetched, fresh, running]
    for job_id in (lost, waiting, fetched, running):
        _age(session_factory, job_id, 30)
    with session_factory.begin() as session:
        session.get(Job, uuid.UUID(running)).status = JobStatus.RUNNING.value

    assert pending_job_ids(redis_client, settings, "tiny") == {waiting}
    # (rows of other tests may be queued in the same database: look at ours only)
    sent = set(resend_stranded_jobs(settings, session_factory, redis_client, app))
    assert {lost, fetched} <= sent and not {waiting, fresh, running} & sent
    assert {waiting, lost, fetched} <= pending_job_ids(redis_client, settings, "tiny")
    # each has its message now: a second pass sends none of them again
    again = set(resend_stranded_jobs(settings, session_factory, redis_client, app))
    assert not {lost, waiting, fetched, fresh, running} & again
    assert fresh not in pending_job_ids(redis_client, settings, "tiny")


def test_jobs_whose_messages_redis_lost_still_finish(
    settings, session_factory, redis_client, tmp_path, cleanup
):
    """Redis restarted without persistence loses the queue: the rows stay queued, and the
    resend pass brings every job to the worker."""
    app = create_celery(settings)
    jobs = [insert_job(session_factory, params={"max_tokens": 4, "temperature": 0.0})
            for _ in range(3)]
    cleanup += jobs
    for job_id in jobs:
        send_generate(app, settings, job_id, "tiny")
        _age(session_factory, job_id, 30)
    for key in queue_keys(settings, "tiny"):
        redis_client.delete(key)  # what a restart without persistence leaves

    with running_worker(settings, redis_client, tmp_path, "stranded"):
        assert set(jobs) <= set(resend_stranded_jobs(settings, session_factory, redis_client,
                                                     app))
        for job_id in jobs:
            job = wait_terminal(session_factory, job_id, timeout=60)
            assert job.status == JobStatus.SUCCEEDED.value, job.error
            assert job.attempts == 1
    assert not set(jobs) & set(resend_stranded_jobs(settings, session_factory, redis_client,
                                                    app))
