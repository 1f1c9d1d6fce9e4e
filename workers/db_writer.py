"""The writer thread: every Postgres write of a device group, batched off the hot loop.

The batcher never waits on Postgres. It hands first-token times, partial output, finished
results and requeues to this thread, which flushes whatever has queued up in one
transaction, and renews the leases of every job the group owns in ONE UPDATE every
`settings.lease_renew_seconds`.

NOTE (ordering of terminal events): the terminal row is committed BEFORE the terminal
event is published, and both happen here. A client that sees `done`/`error`/`cancelled`
on the stream therefore always reads a terminal row. Token events are published by the
batcher as they are produced; a job's terminal event is handed here only after its last
token event was published, so the stream order is preserved.

Every job-row write is conditional on `status = 'running' AND worker = <this group>`:
a job whose lease was reclaimed by another group is never overwritten, and its stream
gets no terminal event from us.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from tasks.db import utcnow
from tasks.models import Job, JobStatus
from tasks.protocol import EventType, JobEvent

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
class _Requeue:
    job_id: str
    next_attempt: int


class DbWriter:
    """A daemon thread owning the group's job-row writes and its lease set.

    `publish(events)` publishes `(job_id, JobEvent)` pairs in one pipeline;
    `send_generate(job_id)` sends a new generate message (requeue after a drain).
    """

    def __init__(
        self,
        settings: Any,
        session_factory: sessionmaker[Session],
        publish: Callable[[list[tuple[str, JobEvent]]], Any],
        send_generate: Callable[[str], Any],
        group_id: str,
        *,
        max_batch: int = 256,
    ) -> None:
        self.settings = settings
        self.session_factory = session_factory
        self.publish = publish
        self.send_generate = send_generate
        self.group_id = group_id
        self.max_batch = max_batch
        self._queue: queue.Queue[JobResult | JobProgress | _Requeue | threading.Event] = (
            queue.Queue()
        )
        self._owned: set[str] = set()  # jobs whose lease this group renews
        self._owned_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmq-db-writer", daemon=True)
        self._next_renewal = 0.0
        self.num_failed_flushes = 0

    # -- called from other threads ---------------------------------------------------------

    def start(self) -> None:
        self._next_renewal = time.monotonic() + self.settings.lease_renew_seconds
        self._thread.start()

    def own(self, job_id: str) -> None:
        """Start renewing `job_id`'s lease (called right after the claim)."""
        with self._owned_lock:
            self._owned.add(job_id)

    def owned(self) -> list[str]:
        with self._owned_lock:
            return list(self._owned)

    def progress(self, items: list[JobProgress]) -> None:
        for item in items:
            self._queue.put(item)

    def finish(self, result: JobResult) -> None:
        """Write the terminal row, then publish `result.event`; stops the lease renewal."""
        self._queue.put(result)

    def requeue(self, job_id: str, next_attempt: int) -> None:
        """Give a claimed job back: row to queued, a `restart` event, a new generate message."""
        self._queue.put(_Requeue(job_id, next_attempt))

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until everything queued before this call is written. False on timeout."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Flush what is queued, then end the thread."""
        self.flush(timeout)
        self._stop.set()
        self._queue.put(threading.Event())
        self._thread.join(timeout)

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        retry: list[Any] = []  # a batch Postgres refused, written again before anything new
        backoff = 0.0
        while not self._stop.is_set():
            wait = max(0.0, self._next_renewal - time.monotonic())
            if retry:
                wait = min(wait, backoff)
            try:
                first = self._queue.get(timeout=wait)
            except queue.Empty:
                first = None
            batch = retry + ([] if first is None else [first])
            while len(batch) < self.max_batch + len(retry):
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            retry = self._write(batch)
            backoff = min(5.0, max(0.2, backoff * 2)) if retry else 0.0
            if time.monotonic() >= self._next_renewal:
                self._renew_leases()
                self._next_renewal = time.monotonic() + self.settings.lease_renew_seconds

    def _write(self, batch: list[Any]) -> list[Any]:
        """Write `batch`; returns what must be retried (all of it when Postgres failed).

        NOTE: retrying forever is safe: every write is conditional on the job still being
        ours, so after a long outage (our leases expired, the jobs were reclaimed and run
        elsewhere) the late writes match no row and are dropped.
        """
        items = [item for item in batch if not isinstance(item, threading.Event)]
        if items:
            try:
                self._write_items(items)
            except Exception:  # noqa: BLE001 - a failed flush must not kill the writer
                self.num_failed_flushes += 1
                logger.exception("writing %d job updates failed; will retry", len(items))
                return batch  # flush markers wait for their items
        for marker in batch:
            if isinstance(marker, threading.Event):
                marker.set()
        return []

    def _write_items(self, items: list[Any]) -> None:
        progress = [i for i in items if isinstance(i, JobProgress)]
        results = [i for i in items if isinstance(i, JobResult)]
        requeues = [i for i in items if isinstance(i, _Requeue)]
        finished = {r.job_id for r in results} | {r.job_id for r in requeues}
        written: list[JobResult] = []
        requeued: list[_Requeue] = []
        with self.session_factory.begin() as session:
            for p in progress:
                if p.job_id in finished:
                    continue  # the terminal write of the same batch carries more
                values: dict[str, Any] = {
                    "output_text": p.output_text,
                    "completion_tokens": p.completion_tokens,
                }
                if p.first_token_at is not None:
                    values["first_token_at"] = p.first_token_at
                session.execute(self._mine(p.job_id).values(**values))
            for r in results:
                values = {
                    "status": r.status.value,
                    "finish_reason": r.finish_reason,
                    "error": r.error,
                    "output": r.output,
                    "output_text": r.output_text,
                    "prompt_tokens": r.prompt_tokens,
                    "completion_tokens": r.completion_tokens,
                    "cached_tokens": r.cached_tokens,
                    "finished_at": r.finished_at,
                    "lease_expires_at": None,
                }
                if r.first_token_at is not None:
                    values["first_token_at"] = r.first_token_at
                if session.execute(self._mine(r.job_id).values(**values)).rowcount:
                    written.append(r)
                else:
                    logger.warning("job %s is no longer running on %s; result not stored",
                                   r.job_id, self.group_id)
            for q in requeues:
                values = {"status": JobStatus.QUEUED.value, "worker": None,
                          "lease_expires_at": None, "output_text": None,
                          "completion_tokens": None, "first_token_at": None}
                if session.execute(self._mine(q.job_id).values(**values)).rowcount:
                    requeued.append(q)
        with self._owned_lock:
            self._owned.difference_update(finished)
        events = [(r.job_id, r.event) for r in written]
        events += [(q.job_id, JobEvent(EventType.RESTART, attempt=q.next_attempt))
                   for q in requeued]
        if events:
            try:
                self.publish(events)
            except Exception:  # noqa: BLE001 - the rows are right; the web ends streams
                logger.exception("publishing %d terminal/restart events failed", len(events))
        for q in requeued:
            try:
                self.send_generate(q.job_id)
            except Exception:  # noqa: BLE001
                logger.exception("job %s: generate message not sent; leaving it to lease "
                                 "reclaim", q.job_id)
                self._hand_to_reclaim(q.job_id)
                continue
            logger.info("job %s requeued by %s (next attempt %d)",
                        q.job_id, self.group_id, q.next_attempt)

    def _hand_to_reclaim(self, job_id: str) -> None:
        """A queued row with no message would wait forever (reclaim only sees running
        rows): make it a running row with an expired lease, which reclaim requeues."""
        try:
            with self.session_factory.begin() as session:
                session.execute(
                    update(Job)
                    .where(Job.id == uuid.UUID(job_id), Job.status == JobStatus.QUEUED.value,
                           Job.worker.is_(None))
                    .values(status=JobStatus.RUNNING.value, worker=self.group_id,
                            lease_expires_at=utcnow())
                )
        except Exception:  # noqa: BLE001
            logger.exception("job %s is queued without a generate message; resubmit it",
                             job_id)

    def _mine(self, job_id: str) -> Any:
        return update(Job).where(
            Job.id == uuid.UUID(job_id),
            Job.status == JobStatus.RUNNING.value,
            Job.worker == self.group_id,
        )

    def _renew_leases(self) -> None:
        ids = self.owned()
        if not ids:
            return
        expires = utcnow() + timedelta(seconds=self.settings.lease_seconds)
        try:
            with self.session_factory.begin() as session:
                session.execute(
                    update(Job)
                    .where(
                        Job.id.in_([uuid.UUID(i) for i in ids]),
                        Job.status == JobStatus.RUNNING.value,
                        Job.worker == self.group_id,
                    )
                    .values(lease_expires_at=expires)
                )
        except Exception:  # noqa: BLE001 - retried at the next renewal
            logger.exception("renewing the leases of %d jobs failed", len(ids))
