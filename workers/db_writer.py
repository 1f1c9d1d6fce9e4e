"""The writer thread: every Postgres write of a device group, batched off the hot loop.

The batcher never waits on Postgres. It hands first-token times, partial output, finished
results and requeues to this thread (in a worker, a thread of the group's database
process, workers/db_process.py, so none of this Python holds the batcher's GIL), which
flushes whatever has queued up in one transaction, and renews the leases of every job the
group owns in ONE UPDATE every `settings.lease_renew_seconds`.

NOTE (ordering of terminal events): the terminal row is committed BEFORE the terminal
event is published, and both happen here. A client that sees `done`/`error`/`cancelled`
on the stream therefore always reads a terminal row. Token events are published by the
batcher as they are produced; a job's terminal event is handed here only after its last
token event was published, so the stream order is preserved.

Every job-row write is fenced by `status = 'running' AND worker = <this group> AND
attempts = <the attempt>` (workers/job_rows.py): a job whose lease was reclaimed is never
overwritten by the attempt that lost it, and its stream gets no terminal event from it. A
write or a lease renewal that finds the row moved on tells the batcher (`on_lost`), which
drops the attempt. Leases are renewed only while `healthy()` (the batcher completes steps):
a hung group lets its leases run out instead of holding its jobs forever.

Batch lines finish by the hundred a second, and a transaction of one result costs four
to eight times the CPU per result of one of eight (0.47-0.82 against 0.11-0.13 ms), CPU
taken from the cores the engine, the web and Postgres share.
So when everything queued is batch lines' results (`JobResult.background`), the writer
waits up to BACKGROUND_LINGER_SECONDS for more before it writes; anything else that
arrives meanwhile (an interactive job's result or progress, a requeue, a flush) ends the
wait at once. A line's seat is freed by the batcher, not by this write.

Outages: a batch Postgres could not take is retried with backoff, before anything new; a
terminal or restart event Redis could not take is retried the same way (the rows are
committed; the events follow as soon as Redis answers).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from tasks.batches import finalize_if_done
from tasks.db import utcnow
from tasks.protocol import EventType, JobEvent
from tasks.settings import Settings
from tasks.streams.publish import EventFence
from workers.job_rows import (
    JobProgress,
    JobRequeue,
    JobResult,
    JobRows,
    JobWrite,
    unstorable,
)
from workers.thread_names import name_this_thread

logger = logging.getLogger(__name__)

# a job-row write, or a flush marker: set once everything queued before it is written
_Item = JobWrite | threading.Event

__all__ = ["DbWriter", "JobProgress", "JobResult"]

UNPUBLISHED_RETRY_SECONDS = 0.5  # how often events Redis refused are tried again
# how long batch lines' results may wait for others to share their transaction
BACKGROUND_LINGER_SECONDS = 0.05


class DbWriter:
    """A daemon thread owning the group's job-row writes and its lease set.

    `publish(events)` publishes `(job_id, JobEvent)` pairs in one pipeline;
    `send_generate(job_id)` sends a new generate message (requeue after a drain).
    """

    def __init__(
        self,
        settings: Settings,
        session_factory: sessionmaker[Session],
        publish: Callable[[list[tuple[str, JobEvent]], list[EventFence]], object],
        send_generate: Callable[[str], None],
        group_id: str,
        *,
        max_batch: int = 256,
        healthy: Callable[[], bool] | None = None,
        on_lost: Callable[[str, int], None] | None = None,
    ) -> None:
        self.healthy = healthy  # None: always renew
        self.on_lost = on_lost  # (job id, attempt) whose row moved on
        self._unpublished: list[tuple[str, JobEvent, EventFence]] = []  # writer thread
        self.settings = settings
        self.session_factory = session_factory
        self.publish = publish
        self.send_generate = send_generate
        self.group_id = group_id
        self.rows = JobRows(session_factory, group_id)
        self.max_batch = max_batch
        self._queue: queue.Queue[_Item] = queue.Queue()
        self._owned: dict[str, int] = {}  # job id -> attempt whose lease this group renews
        self._owned_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmq-db-writer", daemon=True)
        # batches some of whose lines' results were stored since the finisher last looked
        self._batches_to_look: set[str] = set()
        self._batches_lock = threading.Lock()
        self._batches_stored = threading.Event()
        self._finisher = threading.Thread(target=self._run_finisher, name="llmq-batch-finish",
                                          daemon=True)
        self._next_renewal = 0.0
        self.num_failed_flushes = 0

    # -- called from other threads ---------------------------------------------------------

    def start(self) -> None:
        self._next_renewal = time.monotonic() + self.settings.lease_renew_seconds
        self._thread.start()
        self._finisher.start()

    def own(self, job_id: str, attempt: int) -> None:
        """Start renewing the lease of `attempt` of `job_id` (right after the claim)."""
        with self._owned_lock:
            self._owned[job_id] = attempt

    def owned(self) -> dict[str, int]:
        """Job id -> attempt of every job whose lease this group renews."""
        with self._owned_lock:
            return dict(self._owned)

    def progress(self, items: list[JobProgress]) -> None:
        for item in items:
            self._queue.put(item)

    def finish(self, result: JobResult) -> None:
        """Write the terminal row, then publish `result.event`; stops the lease renewal."""
        self._queue.put(result)

    def requeue(self, job_id: str, attempt: int, *, give_back: bool = True,
                send_message: bool = True) -> None:
        """Give `attempt` of a claimed job back: row to queued, a `restart` event, a new
        generate message (`send_message` False: a batch line, which the batch feeders
        claim from the table). `give_back`: not the job's fault (drain, tripped breaker,
        room for interactive jobs), so the attempt is not spent."""
        self._queue.put(JobRequeue(job_id, attempt, give_back, send_message))

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until everything queued before this call is written. False on timeout."""
        return self.flush_marker().wait(timeout)

    def flush_marker(self) -> threading.Event:
        """An event set once everything queued before this call is written."""
        done = threading.Event()
        self._queue.put(done)
        return done

    def stop(self, timeout: float = 30.0) -> None:
        """Flush what is queued, then end the thread."""
        self.flush(timeout)
        self._stop.set()
        self._queue.put(threading.Event())
        self._thread.join(timeout)
        self._batches_stored.set()  # wake the finisher: a last look, then it ends
        if self._finisher.is_alive():
            self._finisher.join(timeout)

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        name_this_thread()
        retry: list[_Item] = []  # a batch Postgres refused, written again before anything new
        backoff = 0.0
        while not self._stop.is_set():
            wait = max(0.0, self._next_renewal - time.monotonic())
            if retry:
                wait = min(wait, backoff)
            if self._unpublished:
                wait = min(wait, UNPUBLISHED_RETRY_SECONDS)
            try:
                first = self._queue.get(timeout=wait)
            except queue.Empty:
                first = None
            batch = retry + ([] if first is None else [first])
            self._take_queued(batch, self.max_batch + len(retry))
            if batch and not retry and all(_background(item) for item in batch):
                self._linger(batch)
            retry = self._write(batch)
            backoff = min(5.0, max(0.2, backoff * 2)) if retry else 0.0
            if self._unpublished:
                self._publish_pending()
            if time.monotonic() >= self._next_renewal:
                self._renew_leases()
                self._next_renewal = time.monotonic() + self.settings.lease_renew_seconds

    def _take_queued(self, batch: list[_Item], limit: int) -> None:
        """Add what is queued now to `batch`, up to `limit` items."""
        while len(batch) < limit:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                return

    def _linger(self, batch: list[_Item]) -> None:
        """`batch` holds only batch lines' results: add what arrives in the next
        BACKGROUND_LINGER_SECONDS, and stop waiting at the first item that is not one."""
        deadline = time.monotonic() + BACKGROUND_LINGER_SECONDS
        while len(batch) < self.max_batch:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                item = self._queue.get(timeout=remaining)
            except queue.Empty:
                return
            batch.append(item)
            if not _background(item):
                self._take_queued(batch, self.max_batch)
                return

    def _write(self, batch: list[_Item]) -> list[_Item]:
        """Write `batch`; returns what must be retried (all of it when Postgres is down).

        NOTE: retrying an outage forever is safe: every write is conditional on the job
        still being ours, so after a long outage (leases expired, the jobs reclaimed and
        run elsewhere) the late writes match no row. A batch Postgres REJECTS (bad data,
        not an outage) is written item by item instead, so one bad row never blocks the
        others.
        """
        items = [item for item in batch if not isinstance(item, threading.Event)]
        if items:
            try:
                self._store(items)
            except Exception as exc:  # a failed flush must not kill the writer
                self.num_failed_flushes += 1
                if _is_outage(exc):
                    logger.warning("Postgres unavailable (%s); retrying %d job updates",
                                   exc, len(items))
                    return batch  # flush markers wait for their items
                logger.exception("Postgres rejected a batch of %d job updates; writing them "
                                 "one by one", len(items))
                for item in items:
                    self._store_alone(item)
        for marker in batch:
            if isinstance(marker, threading.Event):
                marker.set()
        return []

    def _store_alone(self, item: JobWrite) -> None:
        try:
            self._store([item])
            return
        except Exception as exc:
            if not isinstance(item, JobResult) or _is_outage(exc):
                logger.exception("dropping an update of job %s", item.job_id)
                if not isinstance(item, JobProgress):
                    self._release(item.job_id)
                return
            logger.exception("job %s: its result was rejected; storing a failure", item.job_id)
            try:
                self._store([unstorable(item, exc)])
            except Exception:  # lease reclaim will rerun it
                logger.exception("job %s: could not store a failure either", item.job_id)
                self._release(item.job_id)

    def _release(self, job_id: str) -> None:
        """Stop renewing the lease: reclaim reruns a job whose end we could not store."""
        with self._owned_lock:
            self._owned.pop(job_id, None)

    def _store(self, items: list[JobWrite]) -> None:
        outcome = self.rows.write(items)
        written, requeued = outcome.written, outcome.requeued
        with self._owned_lock:
            for item in items:
                if isinstance(item, JobResult | JobRequeue):
                    self._disown(item.job_id, item.attempt)
        self._lost(outcome.lost, items)
        batches = {r.batch_id for r in written if r.batch_id is not None}
        if batches:
            with self._batches_lock:
                self._batches_to_look |= batches
            self._batches_stored.set()
        self._unpublished += [(r.job_id, r.event, EventFence(r.attempt or 0, 0))
                              for r in written]
        self._unpublished += [(q.job_id, JobEvent(EventType.RESTART, attempt=q.next_attempt),
                               EventFence(0, 0)) for q in requeued]
        self._publish_pending()
        for q in requeued:
            if not q.send_message:
                logger.info("job %s handed back to the table by %s (next attempt %d)",
                            q.job_id, self.group_id, q.next_attempt)
                continue
            try:
                self.send_generate(q.job_id)
            except Exception:
                logger.exception("job %s: generate message not sent; leaving it to lease "
                                 "reclaim", q.job_id)
                try:
                    self.rows.hand_to_reclaim(q.job_id)
                except Exception:
                    logger.exception("job %s is queued without a generate message; "
                                     "resubmit it", q.job_id)
                continue
            logger.info("job %s requeued by %s (next attempt %d)",
                        q.job_id, self.group_id, q.next_attempt)

    def _run_finisher(self) -> None:
        """The batch finisher thread: after results of a batch's lines are stored, finish
        the batch if none of its lines is left (`tasks.batches.finalize_if_done`: its
        files and final status, once, whichever process gets there first). Here, so a
        batch completes as its last line ends, whether or not anyone polls it (the web's
        GET and beat's sweep still finish it too: after an outage here, say). A thread of
        its own: a large batch's files take a while to write, and results, progress and
        leases must not wait for them. While a batch runs, each write of its lines'
        results (which gathers those of up to BACKGROUND_LINGER_SECONDS) brings one look:
        two indexed reads."""
        name_this_thread()
        while True:
            self._batches_stored.wait()
            self._batches_stored.clear()
            with self._batches_lock:
                batches, self._batches_to_look = self._batches_to_look, set()
            for batch_id in sorted(batches):
                try:
                    finalize_if_done(self.session_factory, batch_id)
                except Exception:  # the web's GET or beat's sweep finishes it later
                    logger.warning("batch %s: could not look whether it is done", batch_id,
                                   exc_info=True)
            if self._stop.is_set() and not self._batches_stored.is_set():
                return  # stopped, and no result stored since this look began

    def _publish_pending(self) -> None:
        """Terminal and restart events of committed rows, in order; kept on failure."""
        pending = self._unpublished
        try:
            self.publish([(job_id, event) for job_id, event, _ in pending],
                         [fence for _, _, fence in pending])
        except Exception as exc:  # the rows are right; retried each loop until Redis answers
            logger.warning("publishing %d terminal/restart events failed (%s); retrying",
                           len(pending), exc)
            return
        self._unpublished = []

    def _lost(self, job_ids: list[str], items: list[JobWrite] | None = None) -> None:
        """Tell the batcher these attempts are no longer ours."""
        attempts = {i.job_id: i.attempt for i in items or []
                    if isinstance(i, JobResult | JobRequeue) and i.attempt is not None}
        for job_id in job_ids:
            with self._owned_lock:
                attempt = attempts.get(job_id, self._owned.get(job_id))
                self._disown(job_id, attempt)
            if attempt is not None and self.on_lost is not None:
                self.on_lost(job_id, attempt)

    def _disown(self, job_id: str, attempt: int | None) -> None:
        """Caller holds _owned_lock. Stop renewing `attempt` of `job_id`; a newer claim of
        the same job by this group keeps its lease."""
        if attempt is None or self._owned.get(job_id) == attempt:
            self._owned.pop(job_id, None)

    def _renew_leases(self) -> None:
        owned = self.owned()
        if not owned:
            return
        if self.healthy is not None and not self.healthy():
            logger.warning("no step completed lately; not renewing the leases of %d jobs",
                           len(owned))
            return
        expires = utcnow() + timedelta(seconds=self.settings.lease_seconds)
        try:
            lost = self.rows.renew_leases(owned, expires)
        except Exception as exc:  # retried at the next renewal
            logger.warning("renewing the leases of %d jobs failed (%s)", len(owned), exc)
            return
        if lost:
            logger.warning("%d jobs were reclaimed from %s while it could not renew: %s",
                           len(lost), self.group_id, ", ".join(lost))
            self._lost(lost)


def _is_outage(exc: Exception) -> bool:
    """Connection trouble (retry) rather than a statement Postgres rejects (don't)."""
    if isinstance(exc, OperationalError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def _background(item: _Item) -> bool:
    """A batch line's result: it may wait a little for others (see the module's NOTE)."""
    return isinstance(item, JobResult) and item.background
