"""The batcher's inbox: where other threads hand it work, and where admission waits.

Celery task threads `admit` claimed jobs; the cancel listener adds `cancel` requests; the
runtime's drain stops the loop. The batcher thread `take`s all of it at once between
steps. The inbox also keeps the group's admission ledger: samples and jobs admitted and
not finished yet. `admit` blocks while the group is full, and a blocked task thread stops
its worker from fetching more messages, so other device groups take them
(back-pressure without a router).

Two bands share the ledger. Interactive jobs wait only for each other: they are admitted
while their own samples fit the capacity, whatever batch lines hold. Batch lines
(`tasks.api.batches.BATCH_PRIORITY`) fill what is left: they are admitted while all
samples together fit `batch_capacity`, a quarter more than the capacity, and while no
interactive job waits. The quarter beyond the capacity waits in the engine, so a seat a
finished line frees is taken in the same step, not after the feeder's next claim. The
engine's scheduler (workers/engine/priority_bands.py) gives an interactive sequence the
seat of a running batch sequence when every seat is taken (that one is preempted by
recompute and resumes later, its output kept), and runs interactive prompt chunks
without the batch band.

One condition variable guards everything here; every change that can unblock a waiter
notifies it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from tasks.api.batches import is_batch_priority
from workers.admitted import AdmittedJob
from workers.cancel_requests import CancelRequests

# batch lines admitted beyond the capacity (they wait in the engine for a seat): 1/4
BATCH_LOOKAHEAD_DIVISOR = 4


class StopFlagLike(Protocol):
    """`kernels.native.StopFlag`: set on an interactive admission, cleared on a take."""

    def set(self) -> None: ...

    def clear(self) -> None: ...


@dataclass(slots=True)
class InboxTake:
    """Everything the loop takes at once, under the inbox lock."""

    jobs: list[AdmittedJob]  # admitted since the last take, in admission order
    cancels: set[str]  # job ids whose cancel was requested since the last take
    cancelled_jobs: set[str]  # ids among `jobs` with a recent cancel: end them unrun
    lost: set[tuple[str, int]]  # (job id, attempt) the row moved on from: drop them silently
    stopping: bool  # the drain's grace is over: abort everything and end the loop


class JobInbox:
    """Admitted jobs and cancel requests waiting for the loop, plus the admission ledger."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # samples running at once (= the engine's max_num_seqs)
        # what batch lines may fill with every other admitted sample
        lookahead = max(1, capacity // BATCH_LOOKAHEAD_DIVISOR)
        self.batch_capacity = capacity + lookahead
        # the feeder claims once this much room is free (lines still wait in the engine),
        # so one claim takes several lines
        self.batch_claim_room = max(1, lookahead // 4)
        self._cv = threading.Condition()
        self._jobs: list[AdmittedJob] = []
        self._cancels = CancelRequests()
        self._num_active_samples = 0  # admitted, not finished, both bands
        self._num_interactive_samples = 0  # the interactive ones among them
        self._num_waiting_interactive = 0  # samples of interactive jobs blocked in admit
        self._lost: set[tuple[str, int]] = set()
        # admitted, not finished (in the engine or about to be added): job id -> attempts
        self._held: Counter[str] = Counter()
        # an interactive job was admitted since the last take (read without the lock, by
        # the engine between layers: `interactive_waiting`)
        self._interactive_admitted = False
        # set and cleared with it: a flag the native decoder reads between layers without
        # the GIL (kernels.native.StopFlag; the batcher gives it, None: none)
        self.stop_flag: StopFlagLike | None = None
        self._admitting = True
        self._stopping = False

    # -- task, listener and runtime threads ------------------------------------------------

    def admit(self, job: AdmittedJob, timeout: float | None = None) -> bool:
        """Queue `job` for the loop, blocking while the group is full.

        Returns False (the job was NOT taken) once admission stops (drain) or when
        `timeout` passes; the caller then gives the job back to the queue.
        """
        need = job.num_samples
        batch = is_batch_priority(job.priority)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            # NOTE: a job bigger than the whole capacity still runs, alone; a job cancelled
            # while it waits goes through at once (the loop ends it without running it).
            waiting = False
            try:
                while self._admitting and self._must_wait(need, batch) \
                        and job.job_id not in self._cancels:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    if not batch and not waiting:
                        waiting = True  # no batch line is admitted before it
                        self._num_waiting_interactive += need
                    self._cv.wait(remaining)
            finally:
                if waiting:
                    self._num_waiting_interactive -= need
            if not self._admitting:
                return False
            self._num_active_samples += need
            if not batch:
                self._num_interactive_samples += need
            self._held[job.job_id] += 1
            self._jobs.append(job)
            if not batch:
                self._interactive_admitted = True
                if self.stop_flag is not None:
                    self.stop_flag.set()
            self._cv.notify_all()
        return True

    def wait_batch_room(self, timeout: float) -> int:
        """Wait up to `timeout` seconds for room for `batch_claim_room` one-sample batch
        lines: how many would be admitted now without waiting (0: not that many, or the
        group stops admitting). The batch feeder asks before it claims, so it claims only
        what fits."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._admitting and self._must_wait(self.batch_claim_room, True):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return 0
                self._cv.wait(remaining)
            if not self._admitting:
                return 0
            return max(1, self.batch_capacity - self._num_active_samples)

    def interactive_room(self) -> int:
        """How many one-sample interactive jobs would be admitted now without waiting."""
        with self._cv:
            if not self._admitting:
                return 0
            return max(0, self.capacity - self._num_interactive_samples)

    def holds(self, job_id: str) -> bool:
        """Whether an attempt of `job_id` was admitted here and has not finished."""
        with self._cv:
            return job_id in self._held

    def cancel(self, job_id: str) -> None:
        """Record a cancel request; it also releases `job_id` if it waits in `admit`."""
        with self._cv:
            self._cancels.add(job_id, time.monotonic())
            self._cv.notify_all()

    def lose(self, job_id: str, attempt: int) -> None:
        """`attempt` of `job_id` is no longer ours (its row moved on): the loop drops it
        without a result or another event. Keyed by attempt: a later claim of the same
        job by this group is not touched."""
        with self._cv:
            self._lost.add((job_id, attempt))
            self._cv.notify_all()

    def stop_admitting(self) -> None:
        """Every blocked and future `admit` returns False."""
        with self._cv:
            self._admitting = False
            self._cv.notify_all()

    def wait_empty(self, deadline: float) -> bool:
        """Wait until no admitted job is unfinished, or until `deadline` (time.monotonic()).
        Returns whether it is empty."""
        with self._cv:
            while self._held and time.monotonic() < deadline:
                self._cv.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            return not self._held

    def stop(self) -> None:
        """Tell the loop to abort what it holds and end (its next `take` says so)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    def figures(self) -> tuple[int, int]:
        """(jobs, samples) admitted and not finished, read together."""
        with self._cv:
            return sum(self._held.values()), self._num_active_samples

    # -- the batcher thread ------------------------------------------------------------------

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for something to take; returns whether there is."""
        with self._cv:
            if not self._has_work():
                self._cv.wait(timeout)
            return self._has_work()

    def interactive_waiting(self) -> bool:
        """Whether an interactive job was admitted and not taken yet. Lock-free (one
        attribute read): the engine asks it between layers of a batch-only step."""
        return self._interactive_admitted

    def take(self) -> InboxTake:
        """Take every admitted job and new cancel request (without waiting)."""
        with self._cv:
            self._interactive_admitted = False
            if self.stop_flag is not None:
                self.stop_flag.clear()
            jobs, self._jobs = self._jobs, []
            cancels = self._cancels.take_new()
            self._cancels.prune(time.monotonic())
            cancelled_jobs = {job.job_id for job in jobs if job.job_id in self._cancels}
            lost, self._lost = self._lost, set()
            return InboxTake(jobs, cancels, cancelled_jobs, lost, self._stopping)

    def release(self, jobs: list[AdmittedJob]) -> None:
        """`jobs` finished: their samples no longer count against the capacity."""
        if not jobs:
            return
        with self._cv:
            self._num_active_samples -= sum(job.num_samples for job in jobs)
            self._num_interactive_samples -= sum(job.num_samples for job in jobs
                                                 if not is_batch_priority(job.priority))
            for job in jobs:
                self._held[job.job_id] -= 1
                if self._held[job.job_id] <= 0:
                    del self._held[job.job_id]
            self._cv.notify_all()

    def release_all(self) -> None:
        """The loop gave every job back (drain): nothing counts any more."""
        with self._cv:
            self._num_active_samples = 0
            self._num_interactive_samples = 0
            self._held.clear()
            self._cv.notify_all()

    def _must_wait(self, need: int, batch: bool) -> bool:
        """Whether a job of `need` samples in that band waits (under the lock)."""
        if batch:
            return self._num_active_samples > 0 and (
                self._num_active_samples + need > self.batch_capacity
                or self._num_waiting_interactive > 0)
        return (self._num_interactive_samples > 0
                and self._num_interactive_samples + need > self.capacity)

    def _has_work(self) -> bool:
        return bool(self._jobs) or self._cancels.has_new or bool(self._lost) or self._stopping
