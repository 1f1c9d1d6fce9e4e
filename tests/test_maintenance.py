"""Lease reclaim and stream expiry against real Postgres and Redis."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest

from tasks.celery_app import create_celery
from tasks.db import utcnow
from tasks.maintenance import expire_streams, reclaim_expired_leases, register_maintenance_tasks
from tasks.models import Job, JobStatus
from tasks.protocol import (
    EXPIRE_STREAMS_TASK,
    GENERATE_TASK,
    RECLAIM_TASK,
    EventType,
    JobEvent,
    events_key,
)
from tasks.streams.publish import EventPublisher
from tasks.streams.reader import EventSubscriber


@pytest.fixture
def settings(service_settings):
    # a prefix of its own: the generate messages this test counts are only its own
    return service_settings.with_overrides(
        redis_prefix=service_settings.redis_prefix + "m" + uuid.uuid4().hex[:6], max_attempts=3
    )


def _running_job(session_factory, *, attempts: int, lease_delta: float) -> str:
    now = utcnow()
    job = Job(model="tiny", kind="completion", prompt="hi", prompt_token_ids=[1, 2],
              params={"max_tokens": 4}, status=JobStatus.RUNNING.value, attempts=attempts,
              worker="group-a", created_at=now, started_at=now, output_text="partial",
              lease_expires_at=now + timedelta(seconds=lease_delta))
    with session_factory.begin() as session:
        session.add(job)
    return str(job.id)


def _queued_messages(redis_client, settings) -> list[dict]:
    key = f"{settings.redis_prefix}:celery:{settings.queue_for('tiny')}"
    return [json.loads(raw) for raw in redis_client.lrange(key, 0, -1)]


def test_expired_lease_requeues_with_restart_event_and_new_message(
    settings, session_factory, redis_client
):
    expired = _running_job(session_factory, attempts=1, lease_delta=-1)
    healthy = _running_job(session_factory, attempts=1, lease_delta=+60)
    app = create_celery(settings)

    assert reclaim_expired_leases(settings, session_factory, redis_client, app) >= 1

    with session_factory() as session:
        row = session.get(Job, uuid.UUID(expired))
        other = session.get(Job, uuid.UUID(healthy))
    assert row.status == JobStatus.QUEUED.value
    assert row.worker is None and row.lease_expires_at is None and row.output_text is None
    # attempts counts claims: the next claim makes it 2
    assert row.attempts == 1
    assert other.status == JobStatus.RUNNING.value and other.worker == "group-a"

    events = EventSubscriber(redis_client, settings).read_events(expired)
    assert [e for _, e in events] == [JobEvent(EventType.RESTART, attempt=2)]
    sent = [m for m in _queued_messages(redis_client, settings)
            if m["headers"]["argsrepr"] == repr([expired])]
    assert len(sent) == 1 and sent[0]["headers"]["task"] == GENERATE_TASK

    # a second pass finds nothing to do for this job
    reclaim_expired_leases(settings, session_factory, redis_client, app)
    assert len(EventSubscriber(redis_client, settings).read_events(expired)) == 1


def test_past_max_attempts_fails_with_a_terminal_error_event(
    settings, session_factory, redis_client
):
    job_id = _running_job(session_factory, attempts=3, lease_delta=-5)
    app = create_celery(settings)
    reclaim_expired_leases(settings, session_factory, redis_client, app)

    with session_factory() as session:
        row = session.get(Job, uuid.UUID(job_id))
    assert row.status == JobStatus.FAILED.value
    assert row.error == "worker lost; gave up after 3 attempts"
    assert row.finished_at is not None and row.finish_reason == "error"
    ((_, event),) = EventSubscriber(redis_client, settings).read_events(job_id)
    assert event.type is EventType.ERROR and "gave up after 3 attempts" in event.error
    assert not [m for m in _queued_messages(redis_client, settings)
                if m["headers"]["argsrepr"] == repr([job_id])]
    # the terminal event started the stream's expiry
    assert redis_client.ttl(events_key(settings, job_id)) > 0


def test_registered_tasks_run_and_expire_finished_streams(settings, session_factory,
                                                          redis_client):
    app = create_celery(settings, beat=True)
    register_maintenance_tasks(app, settings)
    assert {RECLAIM_TASK, EXPIRE_STREAMS_TASK} <= set(app.tasks)

    running = _running_job(session_factory, attempts=1, lease_delta=+60)
    finished = _running_job(session_factory, attempts=1, lease_delta=+60)
    with session_factory.begin() as session:
        session.get(Job, uuid.UUID(finished)).status = JobStatus.SUCCEEDED.value
    publisher = EventPublisher(redis_client, settings)
    for job_id in (running, finished):
        publisher.publish([(job_id, JobEvent(EventType.TOKEN, text="x"))])  # no TTL yet

    assert app.tasks[EXPIRE_STREAMS_TASK].apply().get() == 1
    assert redis_client.ttl(events_key(settings, finished)) > 0
    assert redis_client.ttl(events_key(settings, running)) == -1
    assert expire_streams(settings, session_factory, redis_client) == 0
    app.tasks[RECLAIM_TASK].apply().get()  # runs against real services without error


def test_dead_groups_leave_the_groups_hash(settings, redis_client):
    from tasks.maintenance import forget_dead_groups
    from tasks.protocol import group_alive_key, groups_key

    key = groups_key(settings, "tiny")
    redis_client.hset(key, mapping={"alive-group": "{}", "crashed-group": "{}"})
    redis_client.set(group_alive_key(settings, "tiny", "alive-group"), 1, ex=60)
    assert forget_dead_groups(settings, redis_client) == ["tiny/crashed-group"]
    assert set(redis_client.hkeys(key)) == {b"alive-group"}
    assert forget_dead_groups(settings, redis_client) == []
