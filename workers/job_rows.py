"""The job-row statements of a device group: what its writer thread executes.

Every write is FENCED: conditional on `status = 'running' AND worker = <this group> AND
attempts = <the attempt that wrote it>`. `attempts` counts claims, so once beat reclaimed a
job (its lease ran out while we could not reach Postgres) and any group, even this one,
claimed it again, a late write of the old attempt matches no row: it never lands as the
job's result. A write that matches no row tells the writer the attempt is lost.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import DateTime, Table, Update, bindparam, func, select, tuple_, update
from sqlalchemy.orm import Session, sessionmaker

from tasks.db import update_count, utcnow
from tasks.models import Job, JobErrorKind, JobStatus
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
    # the claim this result belongs to (jobs.attempts after it); None only for a row
    # written by hand, which is then fenced by status and worker alone
    attempt: int | None = None
    error_kind: JobErrorKind | None = None  # set when status is failed: 400 or 500 to clients
    # the batch it is a line of: once stored, the writer looks whether the batch is done
    batch_id: str | None = None

    @property
    def background(self) -> bool:
        """A batch line's: nobody waits on it, so the writer may hold it back a little to
        write it with others (workers/db_writer.py, BACKGROUND_LINGER_SECONDS)."""
        return self.batch_id is not None


@dataclass(slots=True)
class JobProgress:
    """Partial output of a running job, so polling shows it before the job ends."""

    job_id: str
    output_text: str  # sample 0 so far
    completion_tokens: int
    attempt: int  # the claim that produced it (jobs.attempts after it)
    first_token_at: datetime | None = None


@dataclass(slots=True)
class JobRequeue:
    """Give a claimed job back to the queue.

    `give_back`: the hand-back is not the job's fault (a drain, a tripped breaker), so the
    claim is undone (`attempts - 1` in the same UPDATE) and rolling restarts never spend
    a job's retry budget. The restart event then announces the same attempt number again.
    """

    job_id: str
    attempt: int  # the claim being handed back (jobs.attempts now)
    give_back: bool = True
    # False for a batch line: it has no generate message; a batch feeder claims it from
    # the table (workers/batch_feeder.py)
    send_message: bool = True

    @property
    def next_attempt(self) -> int:
        """The number the next claim will carry."""
        return self.attempt if self.give_back else self.attempt + 1


# what the writer thread hands to `JobRows.write`
JobWrite = JobResult | JobProgress | JobRequeue


@dataclass(slots=True)
class WriteOutcome:
    """What one `JobRows.write` did."""

    written: list[JobResult]  # results stored: publish their terminal events
    requeued: list[JobRequeue]  # rows handed back: publish restart, send generate
    lost: list[str]  # job ids whose attempt matched no row: the job moved on without us


class JobRows:
    """The statements; `write` runs a batch of them in one transaction."""

    def __init__(self, session_factory: sessionmaker[Session], group_id: str) -> None:
        self.session_factory = session_factory
        self.group_id = group_id
        jobs = cast(Table, Job.__table__)  # Core: a list of parameters is a plain executemany
        self._progress_statement = (
            jobs.update()
            .where(jobs.c.id == bindparam("b_id"),
                   jobs.c.status == JobStatus.RUNNING.value, jobs.c.worker == group_id,
                   jobs.c.attempts == bindparam("b_attempt"))
            .values(output_text=bindparam("b_text"), completion_tokens=bindparam("b_tokens"),
                    first_token_at=func.coalesce(bindparam("b_first", type_=DateTime(True)),
                                                 jobs.c.first_token_at))
        )
        # NOTE: one prepared statement for every fenced result of a write, run as one
        # executemany: an ORM UPDATE built per job held the GIL (statement, cache key,
        # session sync) for longer than the batcher's step could spare
        self._result_statement = (
            jobs.update()
            .where(jobs.c.id == bindparam("b_id"),
                   jobs.c.status == JobStatus.RUNNING.value, jobs.c.worker == group_id,
                   jobs.c.attempts == bindparam("b_attempt"))
            .values(**{name: bindparam(f"b_{name}", type_=jobs.c[name].type)
                       for name in _RESULT_COLUMNS},
                    lease_expires_at=None,
                    first_token_at=func.coalesce(bindparam("b_first", type_=DateTime(True)),
                                                 jobs.c.first_token_at))
        )

    def write(self, items: list[JobWrite]) -> WriteOutcome:
        """Write progress, results and requeues in ONE transaction; returns the results
        and requeues that matched a row of ours, and the jobs whose attempt is lost."""
        finished = {i.job_id for i in items if isinstance(i, JobResult | JobRequeue)}
        written: list[JobResult] = []
        requeued: list[JobRequeue] = []
        lost: list[str] = []
        # the terminal write carries more than any progress of the same job
        progress = [_progress(i) for i in items
                    if isinstance(i, JobProgress) and i.job_id not in finished]
        fenced = [i for i in items if isinstance(i, JobResult) and i.attempt is not None]
        with self.session_factory.begin() as session:
            if progress:
                # NOTE: one executemany (pipelined by the driver), not a statement per job.
                session.execute(self._progress_statement, progress)
            if fenced:
                stored = self._write_results(session, fenced)
                written += [i for i in fenced if i.job_id in stored]
                lost += [i.job_id for i in fenced if i.job_id not in stored]
            for item in items:
                if isinstance(item, JobResult) and item.attempt is None:
                    statement = self._mine(item.job_id, item.attempt).values(**_result(item))
                    if update_count(session, statement):
                        written.append(item)
                    else:
                        lost.append(item.job_id)
                elif isinstance(item, JobRequeue):
                    values: dict[str, Any] = {
                        "status": JobStatus.QUEUED.value, "worker": None,
                        "lease_expires_at": None, "output_text": None,
                        "completion_tokens": None, "first_token_at": None}
                    if item.give_back:
                        values["attempts"] = Job.attempts - 1
                    if update_count(session, self._mine(item.job_id, item.attempt)
                                    .values(**values)):
                        requeued.append(item)
                    else:
                        lost.append(item.job_id)
        for job_id in lost:
            logger.warning("job %s is no longer running on %s; result not stored", job_id,
                           self.group_id)
        return WriteOutcome(written, requeued, lost)

    def _write_results(self, session: Session, results: list[JobResult]) -> set[str]:
        """Store fenced results in one executemany; returns the job ids stored."""
        matched = update_count(session, self._result_statement,
                               [_result_params(item) for item in results])
        ids = {item.job_id for item in results}
        if matched == len(results):
            return ids
        # some attempt is lost (rare): a row this write stored carries its exact result
        rows = session.execute(select(Job.id, Job.status, Job.worker, Job.attempts,
                                      Job.finished_at)
                               .where(Job.id.in_([uuid.UUID(i) for i in ids]))).all()
        ours = {(item.job_id, item.status.value, item.attempt, item.finished_at)
                for item in results}
        return {str(row.id) for row in rows if row.worker == self.group_id
                and (str(row.id), row.status, row.attempts, _aware(row.finished_at)) in ours}

    def renew_leases(self, owned: dict[str, int], expires: datetime) -> list[str]:
        """ONE UPDATE for every running job of this group (`owned`: job id -> attempt);
        returns the ids whose row is no longer ours (reclaimed, or claimed again)."""
        jobs = cast(Table, Job.__table__)
        pairs = [(uuid.UUID(job_id), attempt) for job_id, attempt in owned.items()]
        with self.session_factory.begin() as session:
            renewed = session.execute(
                update(jobs)
                .where(tuple_(jobs.c.id, jobs.c.attempts).in_(pairs),
                       jobs.c.status == JobStatus.RUNNING.value, jobs.c.worker == self.group_id)
                .values(lease_expires_at=expires)
                .returning(jobs.c.id)
            ).scalars().all()
        kept = {str(job_uuid) for job_uuid in renewed}
        return [job_id for job_id in owned if job_id not in kept]

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

    def _mine(self, job_id: str, attempt: int | None) -> Update:
        statement = update(Job).where(
            Job.id == uuid.UUID(job_id),
            Job.status == JobStatus.RUNNING.value,
            Job.worker == self.group_id,
        )
        return statement if attempt is None else statement.where(Job.attempts == attempt)


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
                     first_token_at=result.first_token_at, finished_at=result.finished_at,
                     attempt=result.attempt, error_kind=JobErrorKind.SERVER_ERROR,
                     batch_id=result.batch_id)


def _progress(item: JobProgress) -> dict[str, Any]:
    return {"b_id": uuid.UUID(item.job_id), "b_text": item.output_text,
            "b_tokens": item.completion_tokens, "b_first": item.first_token_at,
            "b_attempt": item.attempt}


_RESULT_COLUMNS = ("status", "finish_reason", "error", "error_kind", "output", "output_text",
                   "prompt_tokens", "completion_tokens", "cached_tokens", "finished_at")


def _result_params(item: JobResult) -> dict[str, Any]:
    """`_result` as the parameters of the grouped result statement."""
    values = _result(item)
    params = {f"b_{name}": values[name] for name in _RESULT_COLUMNS}
    params.update(b_id=uuid.UUID(item.job_id), b_attempt=item.attempt,
                  b_first=item.first_token_at)
    return params


def _aware(moment: datetime | None) -> datetime | None:
    """A stored time as an aware UTC datetime (SQLite hands them back naive)."""
    return moment.replace(tzinfo=UTC) if moment is not None and moment.tzinfo is None \
        else moment


def _result(item: JobResult) -> dict[str, Any]:
    values: dict[str, Any] = {
        "status": item.status.value, "finish_reason": item.finish_reason, "error": item.error,
        "error_kind": item.error_kind.value if item.error_kind is not None else None,
        "output": item.output, "output_text": item.output_text,
        "prompt_tokens": item.prompt_tokens, "completion_tokens": item.completion_tokens,
        "cached_tokens": item.cached_tokens, "finished_at": item.finished_at,
        "lease_expires_at": None,
    }
    if item.first_token_at is not None:
        values["first_token_at"] = item.first_token_at
    return values
