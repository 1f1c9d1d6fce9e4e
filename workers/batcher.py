"""The batcher: the one thread that owns a device group's engine.

Other threads talk to it through its `JobInbox` (`admit`, which blocks while the group is
full, `cancel`, `drain`). Every loop the batcher

  1. takes what the inbox holds, and applies cancel requests (between steps, never
     inside one),
  2. adds the admitted jobs to the engine,
  3. runs `engine.step()`,
  4. turns the deltas into `JobEvent`s and sends ALL of them in one Redis call, without
     waiting for the reply (the step publisher thread reads it during the next step),
  5. hands first-token times, partial output and finished results to the writer (in the
     group's database process, workers/db_process.py; results only once their token
     events are out; the writer commits a terminal row before publishing the terminal
     event).

It waits idle when nothing runs. An exception in a step fails the jobs that were in the
engine with a terminal `error` event and a reason; the thread keeps serving.

Health (the group's circuit breaker, DESIGN.md section 1): the engine isolates a failing
request itself and counts consecutive failed steps (`num_consecutive_failed_steps`); an
exception that escapes `engine.step()` counts as a failed step too (`workers/step_health.py`).
Once that count reaches `max_consecutive_failed_steps`, the step's jobs are NOT failed: the
batcher stops and hands every job back (`on_unhealthy`), since a device that keeps failing
says nothing about the jobs. A `DeviceGroupError` (a lost tensor-parallel rank, a broken
device) trips it at the first step, and so does `trip()` from another thread (the runner's
failure callback while the group is idle).

Fencing: every event carries its job's attempt; a job whose row moved on (the writer's
write matched no row, or a lease renewal found it reclaimed) is dropped between steps
without a result or another event (`lose`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, is_dataclass
from datetime import datetime
from typing import Any, Protocol

from tasks.api.batches import is_batch_priority
from tasks.db import utcnow
from tasks.metrics import WorkerMetrics
from tasks.models import JobErrorKind
from tasks.params import SamplingParams
from tasks.protocol import JobEvent
from tasks.streams.publish import EventPublisher
from workers.admitted import AdmittedJob
from workers.engine.config import EngineStats
from workers.engine.errors import DeviceGroupError
from workers.engine.outputs import CompletionDelta
from workers.inbox import JobInbox
from workers.job_rows import JobProgress, JobResult
from workers.job_state import JobState
from workers.step_health import StepHealth
from workers.step_publisher import StepPublisher
from workers.thread_names import name_this_thread
from workers.thread_priority import set_this_thread_nice
from workers.token_coalescer import TokenCoalescer

logger = logging.getLogger(__name__)
# the engine loop's thread (its OS name too: workers/thread_names.py); benchmarks read
# its CPU time by this name
THREAD_NAME = "llmq-batcher"

# a batch line's token events go out merged, this many tokens per event (its stream is
# rarely read while it runs; workers/token_coalescer.py)
BATCH_LINE_EVENT_TOKENS = 32


class BatchEngine(Protocol):
    """What the batcher calls on its engine (`workers.engine.core.Engine`); the batcher
    thread is its only caller."""

    def has_unfinished_requests(self) -> bool: ...

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0) -> int:
        """Returns the number of prompt tokens; ValueError for a request it refuses."""
        ...

    def abort_request(self, request_id: str) -> list[CompletionDelta]: ...

    def step(self) -> list[CompletionDelta]: ...

    def stats(self) -> EngineStats: ...

    # consecutive steps that failed a request (0 after a step that succeeded)
    num_consecutive_failed_steps: int


class ResultWriter(Protocol):
    """Where the batcher hands job rows (`workers.db_process.DbProcess`, or a
    `workers.db_writer.DbWriter` in this process)."""

    def progress(self, items: list[JobProgress]) -> None: ...

    def finish(self, result: JobResult) -> None: ...


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
        engine: BatchEngine,
        publisher: EventPublisher,
        writer: ResultWriter,
        *,
        capacity: int,
        progress_interval: float = 2.0,
        stats_interval: float = 0.5,
        max_consecutive_failed_steps: int = 3,
        on_unhealthy: Callable[[str], None] | None = None,
        fault_inject_step_failures: int = 0,
        stream_interval: float = 0.0,
        nice: int = 0,
    ) -> None:
        """`nice`: the batcher thread's nice value (0: the process's own; what the group
        may take: workers/thread_priority.py)."""
        self.engine = engine
        self.writer = writer
        self.capacity = capacity  # samples admitted at once (= the engine's max_num_seqs)
        self.progress_interval = progress_interval
        self.stats_interval = stats_interval
        # seconds between a streaming job's token events after its first (0: every step's);
        # workers/token_coalescer.py
        self.stream_interval = stream_interval
        self.nice = nice
        self._inbox = JobInbox(capacity)
        self._jobs: dict[str, JobState] = {}  # batcher thread only
        # the jobs among them whose token events go out by the interval rule (held tokens
        # are due by the clock, so each step looks at them); may keep ids that left
        self._timed: dict[str, JobState] = {}
        self._next_due_check = 0.0  # time.monotonic() from which _emit looks at them again
        self._num_steps = 0
        # (EngineStats fields, time.time() read): replaced whole, never changed in place
        self._engine_stats: tuple[dict[str, Any], float] = ({}, 0.0)
        self._next_progress = 0.0
        self._finished: list[JobState] = []
        self._first_tokens: list[JobState] = []  # results to hand over after this step's events
        self.aborted: list[AdmittedJob] = []  # set when the loop ends: jobs given back
        self.on_unhealthy = on_unhealthy  # called (batcher thread) when the breaker trips
        self.health = StepHealth(max_consecutive_failed_steps,
                                 fault_inject_step_failures=fault_inject_step_failures)
        self.publisher = StepPublisher(publisher.sender(), self._on_published)
        # figures of finished jobs; the heartbeat writes them to Redis (no I/O here)
        self.metrics = WorkerMetrics()
        # NOTE: a batch-only step stops between layers when an interactive job arrives, so
        # the job waits for a layer, not for the step (Engine.set_step_yield)
        set_step_yield = getattr(engine, "set_step_yield", None)
        self.interrupts_steps = bool(set_step_yield is not None
                                     and set_step_yield(self._inbox.interactive_waiting))
        if self.interrupts_steps:  # the native decoder's steps stop between layers too
            self._inbox.stop_flag = getattr(engine, "step_stop_flag", None)
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    # -- other threads -------------------------------------------------------------------

    def start(self) -> None:
        self._refresh_stats(force=True)
        self.publisher.start()
        self._thread.start()

    def admit(self, job: AdmittedJob, timeout: float | None = None) -> bool:
        """Queue `job` for the engine, blocking while the group is full.

        Returns False (the job was NOT taken) when the batcher stops admitting (drain) or
        `timeout` passes; the caller then gives the job back to the queue.
        """
        return self._inbox.admit(job, timeout)

    def interactive_room(self) -> int:
        """One-sample interactive jobs that would be admitted now without waiting."""
        return self._inbox.interactive_room()

    def holds(self, job_id: str) -> bool:
        """Whether an attempt of `job_id` was admitted here and has not finished."""
        return self._inbox.holds(job_id)

    def wait_batch_room(self, timeout: float) -> int:
        """How many batch lines would be admitted now, waiting up to `timeout` seconds for
        one."""
        return self._inbox.wait_batch_room(timeout)

    def cancel(self, job_id: str) -> None:
        """Ask to cancel `job_id` before the next step (ignored if it is not ours)."""
        self._inbox.cancel(job_id)

    def load(self) -> BatcherLoad:
        num_jobs, num_active_samples = self._inbox.figures()
        engine_stats, updated_at = self._engine_stats
        return BatcherLoad(
            num_jobs=num_jobs,
            num_active_samples=num_active_samples,
            capacity=self.capacity,
            num_steps=self._num_steps,
            engine=dict(engine_stats),
            updated_at=updated_at,
        )

    def stop_admitting(self) -> None:
        """Every blocked and future `admit` returns False."""
        self._inbox.stop_admitting()

    def drain(self, grace_seconds: float) -> list[AdmittedJob]:
        """Stop admitting, let running jobs finish within `grace_seconds`, then abort the
        rest and end the thread. Returns the aborted jobs (the caller requeues them)."""
        self._inbox.stop_admitting()
        self._inbox.wait_empty(time.monotonic() + grace_seconds)
        self._inbox.stop()
        self._thread.join(timeout=60.0)
        return self.aborted

    def lose(self, job_id: str, attempt: int) -> None:
        """`attempt` of `job_id` is no longer ours: drop it between steps, silently."""
        self._inbox.lose(job_id, attempt)

    def trip(self, reason: str) -> None:
        """The device group failed: end the loop after the step in flight (or at once when
        idle) and hand every job back through `on_unhealthy`."""
        self.health.trip(reason)
        self._inbox.stop_admitting()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        """Wait for the loop to end (drain, trip); False if it is still running (hung)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        name_this_thread()
        # NOTE: before the first step: the engine's pool threads started from this thread
        # inherit the value
        if self.nice and set_this_thread_nice(self.nice):
            logger.info("batcher runs at nice %d", self.nice)
        logger.info("batcher started (capacity %d samples)", self.capacity)
        while True:
            # NOTE: only this thread changes _jobs and the engine's requests, so neither
            # can change while it waits: only the inbox can bring work.
            if not (self._jobs or self.engine.has_unfinished_requests()):
                self.publisher.idle()
                while not self._inbox.wait(self.stats_interval):
                    if self.health.tripped is not None:
                        break
                    self.health.idle()
                    self._refresh_stats(force=True)  # idle: keep the load figures fresh
            work = self._inbox.take()
            if work.stopping or self.health.tripped is not None:  # drain, or trip() idle
                self._inbox.stop_admitting()
                self._abort_everything(work.jobs)
                break
            events: list[tuple[str, JobEvent]] = []
            # NOTE: cancels first, so a cancel that arrives with its job's admission (the
            # early-cancel memory) still catches it in _add_jobs.
            self._apply_cancels(work.cancels, events)
            self._add_jobs(work.jobs, work.cancelled_jobs, events)
            self._drop_lost(work.lost)
            if self.engine.has_unfinished_requests():
                self.publisher.before_step()
                self._step(events)
            elif self._jobs:
                self._fail_orphans(events)
            self._emit(events)
            if self.health.tripped is not None:
                self._inbox.stop_admitting()
                self._abort_everything(self._inbox.take().jobs)
                break
            self._send_progress()
            # NOTE: forced when the engine just went idle, so the idle figures (no KV blocks
            # in use) are read at once rather than one stats interval later
            self._refresh_stats(force=not self.engine.has_unfinished_requests())
        self.publisher.stop()
        logger.info("batcher stopped after %d steps", self._num_steps)
        if self.health.tripped is not None and self.on_unhealthy is not None:
            # NOTE: after the publisher stopped: every event of the jobs handed back is
            # stored before their `restart` goes out
            self.on_unhealthy(self.health.tripped)  # hands self.aborted back

    def _apply_cancels(self, cancels: set[str], events: list[tuple[str, JobEvent]]) -> None:
        for job_id in cancels:
            state = self._jobs.get(job_id)
            if state is None:
                continue  # not ours, or not here yet: the inbox catches it on arrival
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
            older = self._jobs.get(job.job_id)
            if older is not None:
                # NOTE: this group claimed the job again (beat reclaimed it while we could
                # not renew): the older attempt is lost, whether or not we heard so yet.
                self._drop_lost({(job.job_id, older.job.attempt)})
            state = JobState(job, self._coalescer(job))
            self._jobs[job.job_id] = state
            if state.coalescer is not None and state.coalescer.interval > 0:
                self._timed[job.job_id] = state
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
                self._fail(state, str(exc), events, JobErrorKind.INVALID_REQUEST)
                continue
            except Exception as exc:
                logger.exception("adding job %s to the engine failed", job.job_id)
                self._fail(state, f"could not start the job: {exc}", events)
                continue
            state.num_prompt_tokens = int(num_prompt_tokens or 0)

    def _coalescer(self, job: AdmittedJob) -> TokenCoalescer | None:
        if is_batch_priority(job.priority):
            return TokenCoalescer(BATCH_LINE_EVENT_TOKENS)
        if self.stream_interval > 0:
            return TokenCoalescer(interval=self.stream_interval)
        return None

    def _on_published(self, result: JobResult) -> None:
        """From the step publisher, once the step's events are stored: the result goes to
        its row."""
        self.writer.finish(result)

    def _drop_lost(self, lost: set[tuple[str, int]]) -> None:
        for job_id, attempt in lost:
            state = self._jobs.get(job_id)
            if state is None or state.job.attempt != attempt:
                continue
            logger.warning("job %s: attempt %d is no longer ours (reclaimed); dropped",
                           job_id, attempt)
            try:
                self.engine.abort_request(job_id)
            except Exception:
                logger.warning("could not abort lost job %s", job_id, exc_info=True)
            del self._jobs[job_id]
            self.publisher.forget(job_id)
            self._inbox.release([state.job])

    def _step(self, events: list[tuple[str, JobEvent]]) -> None:
        try:
            deltas = self.health.run(self.engine.step)
        except DeviceGroupError as exc:
            # NOTE: the group, not the jobs: hand them back (the loop ends)
            logger.error("device group failed in a step (%s); handing back %d jobs", exc,
                         len(self._jobs))
            self.health.trip(f"device error: {exc}")
            return
        except Exception as exc:  # fail the batch, keep the thread
            reason = f"engine step failed: {type(exc).__name__}: {exc}"
            if self.health.step_raised(reason):
                # NOTE: the device, not the jobs: hand them back (the loop ends)
                logger.exception("engine step failed %d times in a row; the group stops",
                                 self.health.num_consecutive_failed_steps)
                return
            logger.exception("engine step failed; failing %d jobs", len(self._jobs))
            for state in list(self._jobs.values()):
                try:
                    self.engine.abort_request(state.job.job_id)
                except Exception:  # the engine may be in a bad state
                    logger.warning("could not abort job %s after a failed step",
                                   state.job.job_id)
                self._fail(state, reason, events)
            return
        self._num_steps += 1
        # NOTE: getattr until every engine counts its isolated failures (workers/engine)
        self.health.step_completed(self.engine.num_consecutive_failed_steps)
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
        clock = time.monotonic()
        for delta in deltas:
            state = self._jobs.get(delta.request_id)
            if state is None:
                continue
            if state.first_token_at is None and delta.new_token_ids:
                now = now or utcnow()
                state.first_token_at = now
                # NOTE: a batch line's row gets it with the next progress write or its
                # result: nobody waits on a batch line's first token
                if not is_batch_priority(state.job.priority):
                    self._first_tokens.append(state)
            event = state.apply(delta, clock)
            if event is not None:
                events.append((state.job.job_id, event))
            if delta.finished and state.all_finished:
                self._finish(state, events)

    def _fail(self, state: JobState, reason: str, events: list[tuple[str, JobEvent]],
              kind: JobErrorKind = JobErrorKind.SERVER_ERROR) -> None:
        state.fail(reason, kind)
        self._finish(state, events)

    def _finish(self, state: JobState, events: list[tuple[str, JobEvent]]) -> None:
        """Hand the result to the writer once this step's token events are out."""
        job_id = state.job.job_id
        if self._jobs.pop(job_id, None) is None:
            return
        events.extend((job_id, event) for event in state.held_events())
        self._finished.append(state)

    def _emit(self, events: list[tuple[str, JobEvent]]) -> None:
        """Send this step's events (one publish call); its finished results follow them."""
        clock = time.monotonic()
        if self._timed and clock >= self._next_due_check:
            # NOTE: held tokens of jobs the step left out (preempted, waiting) go out on
            # time, give or take a quarter interval: a job the step ran had its held
            # tokens checked against the clock as its delta came in
            self._next_due_check = clock + self.stream_interval / 4
            for job_id, state in list(self._timed.items()):
                if self._jobs.get(job_id) is not state:
                    del self._timed[job_id]  # it left (its held tokens went with it)
                elif state.coalescer is not None and state.coalescer.holding:
                    events.extend((job_id, event) for event in state.coalescer.due(clock))
        finished, self._finished = self._finished, []
        results = [state.result() for state in finished]
        # the claim each event belongs to (only jobs with events this step)
        attempts = {state.job.job_id: state.job.attempt for state in finished}
        for job_id, _ in events:
            if job_id not in attempts:
                live = self._jobs.get(job_id)
                if live is not None:
                    attempts[job_id] = live.job.attempt
        self.publisher.submit(events, attempts, results)
        for state, result in zip(finished, results):
            self.metrics.observe_job(state.figures(result))
        self._inbox.release([state.job for state in finished])

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
            self.publisher.forget(state.job.job_id)
        self._jobs.clear()
        self.aborted = aborted
        self._inbox.release_all()
        self._refresh_stats(force=True)

    def _refresh_stats(self, force: bool = False) -> None:
        if not force and time.time() - self._engine_stats[1] < self.stats_interval:
            return
        try:
            stats = self.engine.stats()
        except Exception:  # figures only
            logger.exception("reading engine stats failed")
            return
        # EngineStats is a dataclass instance; anything else with attributes works too
        is_instance = is_dataclass(stats) and not isinstance(stats, type)
        self._engine_stats = (asdict(stats) if is_instance else dict(vars(stats)), time.time())

