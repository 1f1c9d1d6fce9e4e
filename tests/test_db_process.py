"""The group's database work in its own process (`workers/db_process.py`), on the real
Postgres and Redis: claims that come back owned, results stored and their terminal events
published, lost attempts reported back, leases renewed only while steps complete, and
either side's end noticed."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import update

from tasks.db import utcnow
from tasks.models import Job, JobStatus
from tasks.protocol import EventType, JobEvent, cancel_flag_key
from tests.batch_helpers import store_queued_lines
from tests.pipeline_helpers import insert_job, read_job, read_stream, wait_for
from workers.claims import ClaimUnavailable
from workers.db_process import DbProcess
from workers.job_rows import JobProgress, JobResult

USAGE = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5, "cached_tokens": 0}


def _claimed(db: DbProcess, session_factory) -> str:
    """A job claimed by `db` (running, its group's, attempt 1, its lease renewed)."""
    # NOTE: a model no worker serves: a later test's beat may queue it again once its
    # lease runs out, and no worker may then claim it ahead of that test's jobs
    job_id = insert_job(session_factory, model=f"unserved-{uuid.uuid4().hex[:6]}",
                        prompt="hello")
    assert [str(row.id) for row in db.claims.one(uuid.UUID(job_id))] == [job_id]
    return job_id


@contextmanager
def _serving(settings, **callbacks: Any) -> Iterator[DbProcess]:
    """A started database process of a new group, stopped after the block."""
    db = DbProcess(settings, f"db-proc-{uuid.uuid4().hex[:6]}", "tiny", **callbacks)
    db.start()
    try:
        yield db
    finally:
        db.stop(10.0)


def _result(job_id: str, text: str = "abc") -> JobResult:
    return JobResult(
        job_id=job_id, status=JobStatus.SUCCEEDED, finish_reason="length", error=None,
        output=[{"index": 0, "text": text, "finish_reason": "length", "token_ids": [1, 2, 3]}],
        output_text=text, prompt_tokens=2, completion_tokens=3, cached_tokens=0,
        event=JobEvent(EventType.DONE, finish_reason="length", usage=USAGE), attempt=1)


@pytest.fixture
def settings(service_settings):
    return service_settings.with_overrides(lease_renew_seconds=0.3, lease_seconds=5.0)


@pytest.fixture
def link(settings):
    """(process handle, group id, lost attempts, exit reasons, health flag)."""
    lost: list[tuple[str, int]] = []
    exits: list[str] = []
    health = {"ok": True}
    with _serving(settings, healthy=lambda: health["ok"],
                  on_lost=lambda job_id, attempt: lost.append((job_id, attempt)),
                  on_exit=exits.append) as db:
        yield db, db.group_id, lost, exits, health


def test_a_result_sent_to_the_database_process_is_stored_then_published(
        link, session_factory, redis_client, settings):
    db, _, lost, exits, _ = link
    job_id = _claimed(db, session_factory)
    db.progress([JobProgress(job_id, "ab", 2, 1, first_token_at=utcnow())])
    assert wait_for(lambda: read_job(session_factory, job_id).output_text == "ab", 10,
                    "the progress row")
    db.finish(_result(job_id))
    assert db.flush(10.0)
    job = read_job(session_factory, job_id)
    assert job.status == JobStatus.SUCCEEDED.value and job.output_text == "abc"
    assert job.completion_tokens == 3 and job.lease_expires_at is None
    events = [event for _, event in read_stream(redis_client, settings, job_id)]
    assert [e.type for e in events] == [EventType.DONE]
    assert db.owned() == {}
    assert lost == [] and exits == []


def test_claims_run_there_and_come_back_owned_with_their_cancel_flags(
        link, session_factory, redis_client, settings):
    db, group_id, _, _, _ = link
    model = f"claims-{uuid.uuid4().hex[:6]}"
    first, ahead, cancelled = (insert_job(session_factory, model=model) for _ in range(3))
    redis_client.set(cancel_flag_key(settings, cancelled), "1")
    rows = db.claims.with_ahead(uuid.UUID(first), model, 5)
    assert {str(row.id) for row in rows} == {first, ahead, cancelled}
    assert {str(row.id) for row in rows if row.cancel_requested} == {cancelled}
    assert all(row.attempts == 1 and row.prompt == "hello" for row in rows)
    assert db.owned() == {first: 1, ahead: 1, cancelled: 1}
    for job_id in (first, ahead, cancelled):
        job = read_job(session_factory, job_id)
        assert job.status == JobStatus.RUNNING.value and job.worker == group_id
    assert db.claims.one(uuid.UUID(first)) == []  # claimed already: nothing
    lines = store_queued_lines(session_factory, model, [0, 1, 2], created_at=utcnow())
    claimed = db.claims.lines(model, 2)
    # the first two in line order (RETURNING gives them in no particular order)
    assert {str(row.id) for row in claimed} == {lines[0], lines[1]}


def test_a_claim_postgres_refuses_raises_and_claims_nothing(settings, session_factory):
    broken = settings.with_overrides(
        database_url="postgresql+psycopg://nobody@127.0.0.1:1/nothing")
    with _serving(broken) as db:
        # NOTE: a model no worker serves: the row stays queued after the test
        job_id = insert_job(session_factory, model=f"unserved-{uuid.uuid4().hex[:6]}")
        with pytest.raises(ClaimUnavailable, match="OperationalError"):
            db.claims.one(uuid.UUID(job_id))
        assert db.owned() == {}


def test_a_write_that_finds_the_row_moved_on_reports_the_lost_attempt(
        link, session_factory, redis_client, settings):
    db, _, lost, _, _ = link
    job_id = _claimed(db, session_factory)
    assert db.owned() == {job_id: 1}
    with session_factory.begin() as session:  # reclaimed and claimed by another group
        session.execute(update(Job).where(Job.id == uuid.UUID(job_id)).values(
            worker="someone-else", attempts=2))
    db.finish(_result(job_id))
    assert db.flush(10.0)
    wait_for(lambda: lost == [(job_id, 1)], 10, "the lost attempt reported back")
    assert read_job(session_factory, job_id).status == JobStatus.RUNNING.value
    assert read_stream(redis_client, settings, job_id) == []  # no terminal event from us


def test_leases_are_renewed_only_while_the_worker_says_steps_complete(
        link, session_factory):
    db, _, _, _, health = link
    job_id = _claimed(db, session_factory)
    first = read_job(session_factory, job_id).lease_expires_at
    renewed = wait_for(
        lambda: (lambda at: at if at > first else None)(
            read_job(session_factory, job_id).lease_expires_at), 10, "a lease renewal")
    health["ok"] = False
    time.sleep(1.5)  # the database process hears "unhealthy" within HEALTH_SECONDS
    held = read_job(session_factory, job_id).lease_expires_at
    time.sleep(1.5)
    assert read_job(session_factory, job_id).lease_expires_at == held >= renewed


def test_a_worker_that_vanishes_still_gets_its_queued_results_written(
        settings, session_factory):
    db = DbProcess(settings, f"db-proc-{uuid.uuid4().hex[:6]}", "tiny")
    db.start()
    job_ids = [_claimed(db, session_factory) for _ in range(3)]
    for job_id in job_ids:
        db.finish(_result(job_id))
    db._stopping = True  # the test ends the link, as a killed worker would
    db._conn.close()
    db._process.wait(30)
    assert db._process.returncode == 0
    for job_id in job_ids:
        assert read_job(session_factory, job_id).status == JobStatus.SUCCEEDED.value


@pytest.mark.alone
def test_a_dead_database_process_is_reported_and_later_writes_fail_fast(link):
    db, _, _, exits, _ = link
    db._process.kill()
    wait_for(lambda: exits, 10, "the exit to be reported")
    assert "database process exited" in exits[0]
    started = time.monotonic()
    assert db.flush(5.0) is False
    db.finish(_result(str(uuid.uuid4())))  # dropped, does not raise
    with pytest.raises(ClaimUnavailable):
        db.claims.one(uuid.uuid4())
    assert time.monotonic() - started < 1.0


def test_a_database_process_that_dies_before_it_serves_fails_the_start(settings):
    db = DbProcess(settings, "db-proc-dead", "tiny")
    db.launch()
    db._process.kill()
    with pytest.raises(RuntimeError, match="database process did not start"):
        db.start(10.0)


def test_a_health_check_that_raises_counts_as_unhealthy_and_keeps_the_link(
        settings, session_factory):
    exits: list[str] = []
    with _serving(settings, healthy=lambda: 1 / 0, on_exit=exits.append) as db:
        job_id = _claimed(db, session_factory)
        held = read_job(session_factory, job_id).lease_expires_at
        time.sleep(1.5)  # several renewal periods
        assert read_job(session_factory, job_id).lease_expires_at == held
        assert db.flush(10.0) and exits == []
