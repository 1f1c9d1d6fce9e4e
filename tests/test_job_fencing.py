"""Job-row writes are fenced by attempt (real Postgres): once a job was claimed again, the
older attempt's result, progress, requeue and lease renewal match nothing and say so."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from sqlalchemy import update

from tasks.db import utcnow
from tasks.models import Job, JobStatus
from tasks.protocol import EventType, JobEvent
from tests.pipeline_helpers import insert_job, read_job
from workers.job_rows import JobProgress, JobRequeue, JobResult, JobRows

pytestmark = pytest.mark.integration


def _claimed(session_factory, group: str, attempts: int) -> str:
    job_id = insert_job(session_factory)
    with session_factory.begin() as session:
        session.execute(update(Job).where(Job.id == uuid.UUID(job_id)).values(
            status=JobStatus.RUNNING.value, worker=group, attempts=attempts,
            lease_expires_at=utcnow() + timedelta(seconds=30)))
    return job_id


def _result(job_id: str, attempt: int, text: str) -> JobResult:
    return JobResult(job_id=job_id, status=JobStatus.SUCCEEDED, finish_reason="stop",
                     error=None, output=[{"index": 0, "text": text}], output_text=text,
                     prompt_tokens=1, completion_tokens=1, cached_tokens=0,
                     event=JobEvent(EventType.DONE, finish_reason="stop"), attempt=attempt)


def test_an_older_attempt_writes_nothing_and_learns_it_is_lost(session_factory):
    group = f"fence-{uuid.uuid4().hex[:6]}"
    rows = JobRows(session_factory, group)
    job_id = _claimed(session_factory, group, attempts=2)  # claimed again by the same group
    stale = rows.write([JobProgress(job_id, "stale", 1, attempt=1), _result(job_id, 1, "old")])
    assert stale.written == [] and stale.lost == [job_id]
    assert rows.renew_leases({job_id: 1}, utcnow()) == [job_id]
    assert rows.renew_leases({job_id: 2}, utcnow() + timedelta(seconds=30)) == []
    row = read_job(session_factory, job_id)
    assert row.status == JobStatus.RUNNING.value and row.output_text is None
    fresh = rows.write([_result(job_id, 2, "new")])
    assert [r.job_id for r in fresh.written] == [job_id]
    assert read_job(session_factory, job_id).output_text == "new"


def test_results_written_together_store_each_current_attempt_and_name_the_lost_one(
        session_factory):
    group = f"fence-{uuid.uuid4().hex[:6]}"
    rows = JobRows(session_factory, group)
    current = [_claimed(session_factory, group, attempts=1) for _ in range(3)]
    moved_on = _claimed(session_factory, group, attempts=2)
    first_token_at = utcnow()
    results = [_result(job_id, 1, f"text {i}") for i, job_id in enumerate(current)]
    results[1].first_token_at = first_token_at
    outcome = rows.write([results[0], _result(moved_on, 1, "stale"), *results[1:]])
    assert [r.job_id for r in outcome.written] == current and outcome.lost == [moved_on]
    for i, job_id in enumerate(current):
        row = read_job(session_factory, job_id)
        assert (row.status, row.output_text, row.output, row.lease_expires_at) == (
            JobStatus.SUCCEEDED.value, f"text {i}", [{"index": 0, "text": f"text {i}"}], None)
        assert row.finished_at == results[i].finished_at
    assert read_job(session_factory, current[1]).first_token_at == first_token_at
    stale = read_job(session_factory, moved_on)
    assert stale.status == JobStatus.RUNNING.value and stale.output_text is None
    # every one of them current: the fast path (no read back)
    again = [_claimed(session_factory, group, attempts=3) for _ in range(2)]
    outcome = rows.write([_result(job_id, 3, "x") for job_id in again])
    assert [r.job_id for r in outcome.written] == again and outcome.lost == []


def test_a_give_back_requeue_does_not_spend_the_attempt(session_factory):
    group = f"fence-{uuid.uuid4().hex[:6]}"
    rows = JobRows(session_factory, group)
    drained = _claimed(session_factory, group, attempts=1)
    failed = _claimed(session_factory, group, attempts=1)
    outcome = rows.write([JobRequeue(drained, 1, give_back=True),
                          JobRequeue(failed, 1, give_back=False)])
    assert [q.next_attempt for q in outcome.requeued] == [1, 2]
    assert read_job(session_factory, drained).attempts == 0
    assert read_job(session_factory, failed).attempts == 1
    assert {read_job(session_factory, j).status for j in (drained, failed)} == {
        JobStatus.QUEUED.value}
