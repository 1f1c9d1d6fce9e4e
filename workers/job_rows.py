"""The job-row statements of a device group: what its writer thread executes.

Every write is conditional on `status = 'running' AND worker = <this group>`: a job whose
lease was reclaimed by another group is never overwritten by a late write from us.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from sqlalchemy import DateTime, Table, Update, bindparam, func, update
from sqlalchemy.orm import Session, sessionmaker

from tasks.db import update_count, utcnow
from tasks.models import Job, JobStatus
from tasks.protocol import JobEvent

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class JobResult:
    """The terminal record of one job, written to its row before `event` is published."""

    job_id: str
    status: JobStatus  # succeeded | failed | cancelled
    finish_reason: str | None
    error: str | None
    output: list[dict[str, Any]]  # per sample: {"index", "text", "finish_reason", "token_ids"}
    output_text: str  # sample 0
    prompt_tokens: int
    completion_tokens: int  # summed over samples
    cached_tokens: int
    event: JobEvent  # the terminal stream event
    first_token_at: datetime | None = None
    finished_at: datetime = field(default_factory=utcnow)


@dataclass(slots=True)
class JobProgress:
    """Partial output of a running job, so polling shows it before the job ends."""

    job_id: str
    output_text: str  # sample 0 so far
    completion_tokens: int
    first_token_at: datetime | None = None


@dataclass(slots=True)
class JobRequeue:
    """Give a claimed job back to the queue (drain)."""

    job_id: str
    next_attempt: int


# what the writer thread hands to `JobRows.write`
JobWrite = JobResult | JobProgress | JobRequeue


class JobRows:
    """The statements; `write` runs a batch of them in one transaction."""

    def __init__(self, session_factory: sessionmaker[Session], group_id: str) -> None:
        self.session_factory = session_factory
        self.group_id = group_id
        jobs = cast(Table, Job.__table__)  # Core: a list of parameters is a plain executemany
        self._progress_statement = (
            jobs.update()
            .where(jobs.c.id == bindparam("b_id"),
                   jobs.c.status == JobStatus.RUNNING.value, jobs.c.worker == group_id)
            .values(output_text=bindparam("b_text"), completion_tokens=bindparam("b_tokens"),
                    first_token_at=func.coalesce(bindparam("b_first", type_=DateTime(True)),
                                                 jobs.c.first_token_at))
        )

    def write(self, items: list[JobWrite]) -> tuple[list[JobResult], list[JobRequeue]]:
        """Write progress, results and requeues in ONE transaction; returns the results
        and requeues that matched a row of ours (the others were reclaimed meanwhile)."""
        finished = {i.job_id for i in items if isinstance(i, JobResult | JobRequeue)}
        written: list[JobResult] = []
        requeued: list[JobRequeue] = []
        # the terminal write carries more than any progress of the same job
        progress = [_progress(i) for i in items
                    if isinstance(i, JobProgress) and i.job_id not in finished]
        with self.session_factory.begin() as session:
            if progress:
                # NOTE: one executemany (pipelined by the driver), not a statement per job.
                session.execute(self._progress_statement, progress)
            for item in items:
                if isinstance(item, JobResult):
                    if update_count(session, self._mine(item.job_id).values(**_result(item))):
                        written.append(item)
                    else:
                        logger.warning("job %s is no longer running on %s; result not stored",
                                       item.job_id, self.group_id)
                elif isinstance(item, JobRequeue):
                    values = {"status": JobStatus.QUEUED.value, "worker": None,
                              "lease_expires_at": None, "output_text": None,
                              "completion_tokens": None, "first_token_at": None}
                    if update_count(session, self._mine(item.job_id).values(**values)):
                        requeued.append(item)
        return written, requeued

    def renew_leases(self, job_ids: list[str], expires: datetime) -> None:
        """ONE UPDATE for every running job of this group."""
        with self.session_factory.begin() as session:
            session.execute(
                update(Job)
                .where(Job.id.in_([uuid.UUID(i) for i in job_ids]),
                       Job.status == JobStatus.RUNNING.value, Job.worker == self.group_id)
                .values(lease_expires_at=expires)
            )

    def hand_to_reclaim(self, job_id: str) -> None:
        """A queued row with no message would wait forever (reclaim only looks at running
        rows): make it a running row with an expired lease, which reclaim requeues."""
        with self.session_factory.begin() as session:
            session.execute(
                update(Job)
                .where(Job.id == uuid.UUID(job_id), Job.status == JobStatus.QUEUED.value,
                       Job.worker.is_(None))
                .values(status=JobStatus.RUNNING.value, worker=self.group_id,
                        lease_expires_at=utcnow())
            )

    def _mine(self, job_id: str) -> Update:
        return update(Job).where(
            Job.id == uuid.UUID(job_id),
            Job.status == JobStatus.RUNNING.value,
            Job.worker == self.group_id,
        )


def unstorable(result: JobResult, exc: Exception) -> JobResult:
    """The failed result to store when Postgres rejects `result` itself (not an outage)."""
    error = (f"the worker could not store the job's result ({type(exc).__name__}); "
             "resubmit the job")
    event = JobEvent(result.event.type.ERROR, finish_reason="error", error=error,
                     usage=result.event.usage)
    return JobResult(job_id=result.job_id, status=JobStatus.FAILED, finish_reason="error",
                     error=error, output=[], output_text="", prompt_tokens=result.prompt_tokens,
                     completion_tokens=result.completion_tokens,
                     cached_tokens=result.cached_tokens, event=event,
                     first_token_at=result.first_token_at, finished_at=result.finished_at)


def _progress(item: JobProgress) -> dict[str, Any]:
    return {"b_id": uuid.UUID(item.job_id), "b_text": item.output_text,
            "b_tokens": item.completion_tokens, "b_first": item.first_token_at}


def _result(item: JobResult) -> dict[str, Any]:
    values: dict[str, Any] = {
        "status": item.status.value, "finish_reason": item.finish_reason, "error": item.error,
        "output": item.output, "output_text": item.output_text,
        "prompt_tokens": item.prompt_tokens, "completion_tokens": item.completion_tokens,
        "cached_tokens": item.cached_tokens, "finished_at": item.finished_at,
        "lease_expires_at": None,
    }
    if item.first_token_at is not None:
        values["first_token_at"] = item.first_token_at
    return values
