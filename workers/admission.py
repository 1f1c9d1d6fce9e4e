"""The body of the `generate(job_id)` Celery task: claim, wait for room, hand over.

Idempotent: it only claims a row that is still `queued` (one conditional UPDATE), so a
redelivered or duplicated message, or a job cancelled while queued, is skipped. The claim
sets `attempts = attempts + 1` (attempts counts claims; lease reclaim does not add to it),
the worker (device group), `started_at` and a first lease. Generation itself runs in the
batcher thread: this returns as soon as the batcher has taken the job.

Claims ahead: given the group's model, the statement that claims the message's job also
claims other queued interactive jobs of the model, as many as the group has room for (up
to `MAX_CLAIM_AHEAD`, highest priority and oldest first, SKIP LOCKED), and hands them
over too; their own messages then find them claimed and are skipped. So a burst of
submissions reaches the engine at the pace of the claims, not of the broker's deliveries
to the task threads. A message whose job this worker claimed ahead and still runs, when
the group has no room for more, is skipped without a statement: its claim would find the
row running and have room for nothing else. In a burst that fills the group, most
messages come after their jobs were claimed ahead (about 43 of 64 in a full-stack benchmark
round), and their claims cost the database and the cores it shares with the web. With
room, such a message's claim still runs: it takes the jobs queued since the last claim.

Batch lines have no message: `run_next_batch_jobs` claims queued ones straight from the
table for the group's batch feeder (workers/batch_feeder.py), oldest batch first and in line
order, with the same claim and hand-over.

The statements themselves (and the cancel flags of what they claimed) are
`workers/claims.py`'s; a worker runs them in its database process.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC
from enum import Enum
from typing import Protocol

from sqlalchemy.exc import SQLAlchemyError

from tasks.api.batches import is_batch_priority
from tasks.models import JobErrorKind, JobStatus
from tasks.params import SamplingParams
from tasks.protocol import EventType, JobEvent
from tasks.settings import Settings
from workers.admitted import AdmittedJob
from workers.claims import ClaimedRow, Claims, ClaimUnavailable
from workers.engine.outputs import FinishReason
from workers.job_rows import JobResult

logger = logging.getLogger(__name__)


class JobTaker(Protocol):
    """Where admitted jobs go (`workers.batcher.Batcher`)."""

    def admit(self, job: AdmittedJob, timeout: float | None = None) -> bool:
        """False when the job was not taken (the group is draining)."""
        ...

    def interactive_room(self) -> int:
        """One-sample interactive jobs that would be admitted now without waiting."""
        ...

    def holds(self, job_id: str) -> bool:
        """Whether an attempt of `job_id` was admitted and has not finished."""
        ...


# queued interactive jobs a message's claim takes beside its own, at most
MAX_CLAIM_AHEAD = 16
# jobs claimed ahead whose messages have not come yet, kept at most; beyond it those the
# batcher no longer holds are forgotten (their messages went to another group, or the
# job ended before its message came: such a message then runs its claim, which skips)
MAX_AWAITED_MESSAGES = 1024


class ClaimWriter(Protocol):
    """The writes admission hands on (`workers.db_writer.DbWriter`, or the group's
    database process). The claims own what they claim."""

    def finish(self, result: JobResult) -> None: ...

    def requeue(self, job_id: str, attempt: int, *, give_back: bool = True,
                send_message: bool = True) -> None: ...


class GenerateOutcome(str, Enum):
    ADMITTED = "admitted"  # the batcher runs it
    SKIPPED = "skipped"  # not queued any more (done, cancelled, or claimed elsewhere)
    FAILED = "failed"  # bad request: the job is failed with a reason
    CANCELLED = "cancelled"  # its cancel flag was set before it started
    REQUEUED = "requeued"  # this group is shutting down: given back to the queue


class AdmissionRetry(Exception):
    """Postgres was unreachable before the claim: run this message again later."""


class JobAdmission:
    """Runs `generate(job_id)` for one device group."""

    def __init__(
        self,
        settings: Settings,
        claims: Claims,
        batcher: JobTaker,
        writer: ClaimWriter,
        group_id: str,
        send_generate: Callable[[str], None],
        model: str | None = None,
    ) -> None:
        """`claims`: where the claim statements run (`workers.claims.JobClaims`, or the
        group's database process)."""
        self.settings = settings
        self.model = model  # the group's model: claims ahead among its jobs (None: never)
        self.claims = claims
        self.batcher = batcher
        self.writer = writer
        self.group_id = group_id
        self.send_generate = send_generate  # re-sends a message this group will not run
        self._closed = False
        self._num_in_flight = 0
        self._cv = threading.Condition()
        # ids of jobs this worker claimed ahead whose own messages have not come yet
        self._claimed_ahead: set[str] = set()

    def close(self) -> None:
        """From now on, `run` gives every job back to the queue (drain)."""
        with self._cv:
            self._closed = True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no `run` is in progress. False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._num_in_flight == 0, timeout)

    def run(self, job_id: str) -> GenerateOutcome:
        with self._cv:
            closed = self._closed
            if not closed:
                self._num_in_flight += 1
        if closed:
            # NOTE: the message is already acked; re-send it rather than lose the job.
            logger.info("job %s handed back: %s is draining", job_id, self.group_id)
            self.send_generate(str(job_id))
            return GenerateOutcome.REQUEUED
        try:
            return self._run(job_id)
        finally:
            with self._cv:
                self._num_in_flight -= 1
                self._cv.notify_all()

    def _run(self, job_id: str) -> GenerateOutcome:
        try:
            job_uuid = uuid.UUID(str(job_id))
        except ValueError:
            logger.error("generate called with a malformed job id %r; ignored", job_id)
            return GenerateOutcome.SKIPPED
        job_id = str(job_uuid)
        awaited = self._awaited(job_id)
        ahead = 0
        if self.model is not None:
            ahead = max(0, min(MAX_CLAIM_AHEAD, self.batcher.interactive_room() - 1))
        if awaited and not ahead and self.batcher.holds(job_id):
            # NOTE: its row is running under this worker's claim and there is no room to
            # claim others ahead: the claim would take nothing. (With room it runs: it
            # takes the jobs queued since.) Were the row queued again meanwhile (a lease
            # lost while it ran here), beat's reclaim sends it another message, or its
            # resend pass does.
            logger.info("job %s was claimed ahead here and runs; its message is skipped",
                        job_id)
            return GenerateOutcome.SKIPPED
        try:
            if ahead and self.model is not None:
                rows = self.claims.with_ahead(job_uuid, self.model, ahead)
            else:
                rows = self.claims.one(job_uuid)
        except (SQLAlchemyError, ClaimUnavailable) as exc:
            # NOTE: nothing changed yet; the job is still queued and needs this message.
            logger.warning("job %s: claim failed (%s); retrying", job_id, exc)
            raise AdmissionRetry(str(exc)) from exc
        if ahead:
            self._await_messages([str(row.id) for row in rows if str(row.id) != job_id])
        outcomes = self._take_all(rows)
        if job_id not in outcomes:
            logger.info("job %s is not queued any more; skipped", job_id)
            return GenerateOutcome.SKIPPED
        return outcomes[job_id]

    def _await_messages(self, job_ids: list[str]) -> None:
        """`job_ids` were claimed ahead: their messages are still to come."""
        if not job_ids:
            return
        with self._cv:
            self._claimed_ahead.update(job_ids)
            if len(self._claimed_ahead) > MAX_AWAITED_MESSAGES:
                self._claimed_ahead = {j for j in self._claimed_ahead
                                       if self.batcher.holds(j)}

    def _awaited(self, job_id: str) -> bool:
        """Whether `job_id` was claimed ahead here and this is its first message since
        (forgotten from now on)."""
        with self._cv:
            if job_id not in self._claimed_ahead:
                return False
            self._claimed_ahead.discard(job_id)
            return True

    def run_next_batch_jobs(self, model: str, limit: int) -> list[GenerateOutcome]:
        """Claim up to `limit` queued batch lines of `model` in one statement and hand them
        to the batcher, as `run` does for a message; empty when there is none (or the
        group is draining). The caller (the batch feeder) asks only for the spare room."""
        with self._cv:
            if self._closed:
                return []
            self._num_in_flight += 1
        try:
            rows = self.claims.lines(model, limit)
            return list(self._take_all(rows).values())
        finally:
            with self._cv:
                self._num_in_flight -= 1
                self._cv.notify_all()

    def _take_all(self, rows: list[ClaimedRow]) -> dict[str, GenerateOutcome]:
        """Every claimed row to the batcher (`_take`); the outcomes by job id, in the
        rows' order."""
        return {str(row.id): self._take(str(row.id), row) for row in rows}

    def _take(self, job_id: str, row: ClaimedRow) -> GenerateOutcome:
        """The claimed row `job_id` (its lease already renewed) to the batcher (or failed,
        cancelled, given back)."""
        attempt = int(row.attempts)
        logger.info("job %s claimed by %s (attempt %d)", job_id, self.group_id, attempt)
        try:
            job = _admitted_job(job_id, row, attempt)
        except (TypeError, ValueError) as exc:
            logger.info("job %s has bad parameters: %s", job_id, exc)
            self._end(job_id, attempt, JobStatus.FAILED, f"invalid job parameters: {exc}",
                      JobErrorKind.INVALID_REQUEST, batch_id=row.batch_id)
            return GenerateOutcome.FAILED
        if row.cancel_requested:
            logger.info("job %s was cancelled before it started", job_id)
            self._end(job_id, attempt, JobStatus.CANCELLED, None, batch_id=row.batch_id)
            return GenerateOutcome.CANCELLED
        if not self.batcher.admit(job):
            # NOTE: shutting down; the job never ran here, so give it straight back
            # (the claim is undone: it spent nothing).
            logger.info("job %s not admitted: %s is draining", job_id, self.group_id)
            self.writer.requeue(job_id, attempt, give_back=True,
                                send_message=not is_batch_priority(job.priority))
            return GenerateOutcome.REQUEUED
        return GenerateOutcome.ADMITTED

    def _end(self, job_id: str, attempt: int, status: JobStatus, error: str | None,
             error_kind: JobErrorKind | None = None, *, batch_id: str | None = None) -> None:
        """Finish a job that never reached the engine (row first, then the event)."""
        reason = FinishReason.ERROR if status is JobStatus.FAILED else FinishReason.CANCELLED
        event_type = EventType.ERROR if status is JobStatus.FAILED else EventType.CANCELLED
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                 "cached_tokens": 0}
        self.writer.finish(JobResult(
            job_id=job_id, status=status, finish_reason=reason.value, error=error,
            output=[], output_text="", prompt_tokens=0, completion_tokens=0, cached_tokens=0,
            event=JobEvent(event_type, finish_reason=reason.value, error=error, usage=usage),
            attempt=attempt, error_kind=error_kind, batch_id=batch_id,
        ))


def _admitted_job(job_id: str, row: ClaimedRow, attempt: int) -> AdmittedJob:
    """Raises TypeError/ValueError on parameters a worker cannot run."""
    params = SamplingParams(**dict(row.params or {}))
    prompt: str | list[int]
    if row.prompt_token_ids:
        prompt = [int(t) for t in row.prompt_token_ids]
    elif row.prompt:
        prompt = str(row.prompt)
    else:
        raise ValueError("the job has neither a prompt nor prompt token ids")
    created = row.created_at  # (SQLite returns it naive; it is UTC)
    return AdmittedJob(job_id=job_id, prompt=prompt, params=params,
                       priority=int(row.priority or 0), attempt=attempt,
                       created_at=created.replace(tzinfo=created.tzinfo or UTC).timestamp()
                       if created is not None else None, claimed_at=time.time(),
                       batch_id=row.batch_id)
