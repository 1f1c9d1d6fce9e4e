"""The batcher: the one thread that owns a device group's engine.

Celery task threads hand claimed jobs to `Batcher.admit`, which blocks while the group is
full: a blocked task thread stops the worker from fetching more messages, so other device
groups take them (back-pressure without a router). Every loop the batcher

  1. applies cancel requests (between steps, never inside one),
  2. adds the admitted jobs to the engine,
  3. runs `engine.step()`,
  4. turns the deltas into `JobEvent`s and sends ALL of them in one Redis call, without
     waiting for the reply (the step publisher thread reads it during the next step),
  5. hands first-token times, partial output and finished results to the writer thread
     (results only once their token events are out; the writer commits a terminal row
     before publishing the terminal event).

It waits idle when nothing runs. An exception in a step fails the jobs that were in the
engine with a terminal `error` event and a reason; the thread keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field, is_dataclass
from datetime import datetime
from typing import Any

from tasks.db import utcnow
from tasks.metrics import JobFigures, WorkerMetrics
from tasks.params import SamplingParams
from tasks.protocol import JobEvent
from tasks.streams.publish import EventPublisher
from workers.db_writer import DbWriter
from workers.engine.outputs import CompletionDelta
from workers.job_rows import JobResult
from workers.job_state import JobState
from workers.step_publisher import StepPublisher

logger = logging.getLogger(__name__)

# how long a cancel for a job this group has not seen yet is remembered
EARLY_CANCEL_SECONDS = 300.0


@dataclass(slots=True)
class AdmittedJob:
    """A claimed job as the batcher needs it: ids and plain values, no ORM row."""

    job_id: str
    prompt: str | list[int]  # token ids when the web tokenized it, else the prompt text
    params: SamplingParams
    priority: int = 0
    attempt: int = 1  # this claim's number (jobs.attempts after the claim)
    created_at: float | None = None  # unix seconds the API stored the job (metrics)
    claimed_at: float | None = None  # unix seconds this group claimed it (metrics)


@dataclass(slots=True)
class BatcherLoad:
    """Live load figures for the heartbeat."""

    num_jobs: int  # admitted jobs not finished (in the engine or about to be added)
    num_active_samples: int  # what admission counts against `capacity`
    capacity: int
    num_steps: int
    engine: dict[str, Any] = field(default_factory=dict)  # EngineStats fields
    updated_at: float = 0.0  # time.time() of the engine figures


class Batcher:
    """Owns `engine`; everything else talks to it through admit/cancel/drain."""

    def __init__(
        self,
        engine: Any,
        publisher: EventPublisher,
        writer: DbWriter,
        *,
        capacity: int,
        progress_interval: float = 2.0,
        stats_interval: float = 0.5,
    ) -> None:
        self.engine = engine
        self.writer = writer
        self.capacity = capacity  # samples admitted at once (= the engine's max_num_seqs)
        self.progress_interval = progress_interval
        self.stats_interval = stats_interval
        self._cv = threading.Condition()
        self._inbox: list[AdmittedJob] = []
        self._cancels: set[str] = set()  # new cancel requests, for the next loop
        # every recent cancel request: job id -> time.monotonic(). Catches a job whose
        # cancel came before the job reached the engine (waiting in admit, or in transit).
        self._cancelled_at: dict[str, float] = {}
        self._active_samples = 0
        self._admitting = True
        self._stopping = False
        self._abort_all = False
        self._jobs: dict[str, JobState] = {}  # batcher thread only
        self._num_jobs = 0
        self._num_steps = 0
        self._engine_stats: dict[str, Any] = {}
        self._stats_at = 0.0
        self._next_progress = 0.0
        self._finished: list[JobState] = []
        self._first_tokens: list[JobState] = []  # results to hand over after this step's events
        self.aborted: list[AdmittedJob] = []  # set when the loop ends: jobs given back
        self._publisher = StepPublisher(publisher.sender(), writer.finish)
        # figures of finished jobs; the heartbeat writes them to Redis (no I/O here)
        self.metrics = WorkerMetrics()
        self._thread = threading.Thread(target=self._run, name="llmq-batcher", daemon=True)

    # -- other threads -------------------------------------------------------------------

    def start(self) -> None:
        self._refresh_stats(force=True)
        self._publisher.start()
        self._thread.start()

    def admit(self, job: AdmittedJob, timeout: float | None = None) -> bool:
        """Queue `job` for the engine, blocking while the group is full.

        Returns False (the job was NOT taken) when the batcher stops admitting (drain) or
        `timeout` passes; the caller then gives the job back to the queue.
        """
        need = max(1, job.params.n)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            # NOTE: a job bigger than the whole capacity still runs, alone; a job cancelled
            # while it waits goes through at once (the batcher ends it without running it).
            while self._admitting and self._active_samples > 0 and (
                self._active_samples + need > self.capacity
            ) and job.job_id not in self._cancelled_at:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cv.wait(remaining)
            if not self._admitting:
                return False
            self._active_samples += need
            self._num_jobs += 1
            self._inbox.append(job)
            self._cv.notify_all()
        return True

    def cancel(self, job_id: str) -> None:
        """Ask to cancel `job_id` before the next step (ignored if it is not ours)."""
        with self._cv:
            self._cancels.add(job_id)
            self._cancelled_at[job_id] = time.monotonic()
            self._cv.notify_all()

    def load(self) -> BatcherLoad:
        with self._cv:
            return BatcherLoad(
                num_jobs=self._num_jobs,
                num_active_samples=self._active_samples,
                capacity=self.capacity,
                num_steps=self._num_steps,
                engine=dict(self._engine_stats),
                updated_at=self._stats_at,
            )

    def stop_admitting(self) -> None:
        """Every blocked and future `admit` returns False."""
        with self._cv:
            self._admitting = False
            self._cv.notify_all()

    def drain(self, grace_seconds: float) -> list[AdmittedJob]:
        """Stop admitting, let running jobs finish within `grace_seconds`, then abort the
        rest and end the thread. Returns the aborted jobs (the caller requeues them)."""
        self.stop_admitting()
        deadline = time.monotonic() + grace_seconds
        with self._cv:
            while self._num_jobs > 0 and time.monotonic() < deadline:
                self._cv.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            self._abort_all = True
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=60.0)
        return self.aborted

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        logger.info("batcher started (capacity %d samples)", self.capacity)
        while True:
            with self._cv:
                while not (self._inbox or self._cancels or self._stopping
                           or self._jobs or self.engine.has_unfinished_requests()):
                    self._cv.wait(self.stats_interval)
                    if not (self._inbox or self._cancels or self._stopping):
                        self._refresh_stats_locked()
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, set()
                self._prune_cancels()
                cancelled_inbox = {j.job_id for j in inbox if j.job_id in self._cancelled_at}
                stopping, abort_all = self._stopping, self._abort_all
            if abort_all:
                self._abort_everything(inbox)
                break
            events: list[tuple[str, JobEvent]] = []
            # NOTE: cancels first, so a cancel that arrives with its job's admission (the
            # early-cancel memory) still catches it in _add_jobs.
            self._apply_cancels(cancels, events)
            self._add_jobs(inbox, cancelled_inbox, events)
            if self.engine.has_unfinished_requests():
                self._step(events)
            elif self._jobs:
                self._fail_orphans(events)
            self._emit(events)
            self._send_progress()
            self._refresh_stats()
            if stopping and not self._jobs:
                break
        self._publisher.stop()
        logger.info("batcher stopped after %d steps", self._num_steps)

    def _prune_cancels(self) -> None:
        """Forget cancel requests older than EARLY_CANCEL_SECONDS (caller holds _cv)."""
        if len(self._cancelled_at) < 1024:
            return
        horizon = time.monotonic() - EARLY_CANCEL_SECONDS
        self._cancelled_at = {k: t for k, t in self._cancelled_at.items() if t > horizon}

    def _apply_cancels(self, cancels: set[str], events: list[tuple[str, JobEvent]]) -> None:
        for job_id in cancels:
            state = self._jobs.get(job_id)
            if state is None:
                continue  # not ours, or not here yet: _cancelled_at catches it on arrival
            try:
                deltas = self.engine.abort_request(job_id)
            except Exception as exc:
                logger.exception("aborting job %s failed", job_id)
                self._fail(state, f"cancel failed: {exc}", events)
                continue
            logger.info("job %s cancelled", job_id)
            self._handle_deltas(deltas, events)
            if job_id in self._jobs:  # the engine had no unfinished sample left: end it anyway
                state.cancel_all()
                self._finish(state, events)

    def _add_jobs(self, inbox: list[AdmittedJob], cancelled: set[str],
                  events: list[tuple[str, JobEvent]]) -> None:
        for job in inbox:
            state = JobState(job)
            self._jobs[job.job_id] = state
            if job.job_id in cancelled:
                logger.info("job %s cancelled before it started", job.job_id)
                state.cancel_all()
                self._finish(state, events)
                continue
            try:
                num_prompt_tokens = self.engine.add_request(
                    job.job_id, job.prompt, job.params, job.priority
                )
            except ValueError as exc:
                logger.info("job %s rejected by the engine: %s", job.job_id, exc)
                self._fail(state, str(exc), events)
                continue
            except Exception as exc:
                logger.exception("adding job %s to the engine failed", job.job_id)
                self._fail(state, f"could not start the job: {exc}", events)
                continue
            state.num_prompt_tokens = int(num_prompt_tokens or 0)

    def _step(self, events: list[tuple[str, JobEvent]]) -> None:
        try:
            deltas = self.engine.step()
        except Exception as exc:  # fail the batch, keep the thread
            logger.exception("engine step failed; failing %d jobs", len(self._jobs))
            reason = f"engine step failed: {type(exc).__name__}: {exc}"
            for state in list(self._jobs.values()):
                try:
                    self.engine.abort_request(state.job.job_id)
                except Exception:  # the engine may be in a bad state
                    logger.warning("could not abort job %s after a failed step",
                                   state.job.job_id)
                self._fail(state, reason, events)
            return
        self._num_steps += 1
        self._handle_deltas(deltas, events)

    def _fail_orphans(self, events: list[tuple[str, JobEvent]]) -> None:
        """Jobs the engine holds no request for: end them rather than wait forever."""
        for state in list(self._jobs.values()):
            logger.error("job %s: the engine dropped it without finishing it", state.job.job_id)
            self._fail(state, "internal error: the engine lost the request; resubmit the job",
                       events)

    def _handle_deltas(self, deltas: list[CompletionDelta],
                       events: list[tuple[str, JobEvent]]) -> None:
        now: datetime | None = None
        for delta in deltas:
            state = self._jobs.get(delta.request_id)
            if state is None:
                continue
            if state.first_token_at is None and delta.new_token_ids:
                now = now or utcnow()
                state.first_token_at = now
                self._first_tokens.append(state)
            event = state.apply(delta)
            if event is not None:
                events.append((state.job.job_id, event))
            if state.all_finished:
                self._finish(state, events)

    def _fail(self, state: JobState, reason: str, events: list[tuple[str, JobEvent]]) -> None:
        state.fail(reason)
        self._finish(state, events)

    def _finish(self, state: JobState, events: list[tuple[str, JobEvent]]) -> None:
        """Hand the result to the writer once this step's token events are out."""
        job_id = state.job.job_id
        if self._jobs.pop(job_id, None) is None:
            return
        self._finished.append(state)

    def _emit(self, events: list[tuple[str, JobEvent]]) -> None:
        """Send this step's events (one publish call); its finished results follow them."""
        finished, self._finished = self._finished, []
        results = [state.result() for state in finished]
        self._publisher.submit(events, results)
        for state, result in zip(finished, results):
            self.metrics.observe_job(_job_figures(state, result))
        if finished:
            with self._cv:
                self._active_samples -= sum(max(1, s.job.params.n) for s in finished)
                self._num_jobs -= len(finished)
                self._cv.notify_all()

    def _send_progress(self) -> None:
        """First-token times at once; partial output of every job each progress_interval."""
        first, self._first_tokens = self._first_tokens, []
        now = time.monotonic()
        if now >= self._next_progress and self._jobs:
            self._next_progress = now + self.progress_interval
            self.writer.progress([s.progress() for s in self._jobs.values() if s.has_output])
        elif first:
            self.writer.progress([s.progress() for s in first if s.job.job_id in self._jobs])

    def _abort_everything(self, inbox: list[AdmittedJob]) -> None:
        aborted = list(inbox)
        for state in list(self._jobs.values()):
            try:
                self.engine.abort_request(state.job.job_id)
            except Exception:
                logger.warning("could not abort job %s at shutdown", state.job.job_id)
            aborted.append(state.job)
        self._jobs.clear()
        self.aborted = aborted
        with self._cv:
            self._active_samples = 0
            self._num_jobs = 0
            self._cv.notify_all()
        self._refresh_stats(force=True)

    def _refresh_stats(self, force: bool = False) -> None:
        if not force and time.time() - self._stats_at < self.stats_interval:
            return
        with self._cv:
            self._refresh_stats_locked()

    def _refresh_stats_locked(self) -> None:
        try:
            stats = self.engine.stats()
        except Exception:  # figures only
            logger.exception("reading engine stats failed")
            return
        # EngineStats is a dataclass instance; anything else with attributes works too
        is_instance = is_dataclass(stats) and not isinstance(stats, type)
        self._engine_stats = asdict(stats) if is_instance else dict(vars(stats))
        self._stats_at = time.time()


def _job_figures(state: JobState, result: JobResult) -> JobFigures:
    first = state.first_token_at
    return JobFigures(
        status=result.status.value, num_prompt_tokens=result.prompt_tokens,
        num_completion_tokens=result.completion_tokens, num_samples=len(result.output) or 1,
        created_at=state.job.created_at, claimed_at=state.job.claimed_at,
        first_token_at=first.timestamp() if first is not None else None,
        finished_at=result.finished_at.timestamp(),
    )
