"""`BatchFeeder`: a device group's batch lines come from the table, not the broker.

Batch lines (`jobs.batch_id`) have no `generate` messages. This thread waits until the
group has room for one (`JobInbox.batch_capacity`: the capacity and a quarter more, which
waits in the engine for a freed seat; interactive jobs take seats from batch lines in the
engine), then claims any queued batch line of the model with the same conditional UPDATE
a message's `generate` uses (as many as fit, in one statement) and hands them to the
batcher. So an interactive request never waits behind batch lines in the broker, and a
task thread never blocks on a batch line; a lease reclaim just queues a line again for
any group to take.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from sqlalchemy.exc import SQLAlchemyError

from workers.admission import GenerateOutcome
from workers.thread_names import name_this_thread

logger = logging.getLogger(__name__)

# between looks at the table while no batch line is queued (a web process announces a
# validated batch, `wake`, so this only bounds how late a requeued line is seen)
IDLE_POLL_SECONDS = 0.5
ROOM_WAIT_SECONDS = 1.0  # one wait for spare room (the stop flag is checked between)
ERROR_BACKOFF_SECONDS = 2.0  # after a failed claim (Postgres away)
NO_ROOM_PAUSE_SECONDS = 0.05
MAX_CLAIM_BATCH = 16  # lines claimed by one statement at most


class BatchLineClaimer(Protocol):
    """`workers.admission.JobAdmission`."""

    def run_next_batch_jobs(self, model: str, limit: int) -> list[GenerateOutcome]: ...


class RoomWatcher(Protocol):
    """`workers.batcher.Batcher`."""

    def wait_batch_room(self, timeout: float) -> int: ...


class BatchFeeder:
    """Claims the model's queued batch lines while the group has spare room."""

    def __init__(self, admission: BatchLineClaimer, batcher: RoomWatcher, model: str) -> None:
        self.admission = admission
        self.batcher = batcher
        self.model = model
        self.num_claimed = 0
        self._stop = threading.Event()
        self._wake = threading.Event()  # set: batch lines were announced
        self._thread = threading.Thread(target=self._run, name="llmq-batch-feeder",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        """Batch lines of the model were queued: look at the table now."""
        self._wake.set()

    def _run(self) -> None:
        name_this_thread()
        while not self._stop.is_set():
            room = self.batcher.wait_batch_room(ROOM_WAIT_SECONDS)
            if not room:
                # NOTE: also 0 at once while the group stops admitting (drain, trip)
                self._stop.wait(NO_ROOM_PAUSE_SECONDS)
                continue
            self._wake.clear()  # an announcement from here on wakes the wait below
            try:
                outcomes = self.admission.run_next_batch_jobs(
                    self.model, min(room, MAX_CLAIM_BATCH))
            except SQLAlchemyError as exc:
                logger.warning("batch feeder of %s: claim failed (%s); retrying", self.model,
                               exc)
                self._stop.wait(ERROR_BACKOFF_SECONDS)
                continue
            except Exception:
                logger.exception("batch feeder of %s: unexpected error", self.model)
                self._stop.wait(ERROR_BACKOFF_SECONDS)
                continue
            if not outcomes:
                self._wake.wait(IDLE_POLL_SECONDS)
            self.num_claimed += outcomes.count(GenerateOutcome.ADMITTED)
