"""Publishes each step's events the moment the step ends, in step order.

The batcher thread sends a step's events itself (one EVAL, pipelined on the sender's own
connection, no wait for the reply): waiting for a publisher thread to get the GIL from a
busy batcher made that hand-off most of the token delivery latency. A publisher thread
reads the replies, in order, and only then hands the step's finished results on.

NOTE (order): one connection, one FIFO. A step's finished results are handed to the
writer only after that step's token events are stored, and the writer publishes a
terminal event only after committing its row: a job's stream is its tokens, then one
terminal event, and a client that sees the terminal event reads a terminal row.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from tasks.protocol import EventType, JobEvent
from workers.job_rows import JobResult

logger = logging.getLogger(__name__)


class EventSender(Protocol):
    """Sends a step's events without waiting for the reply
    (`tasks.streams.publish.PipelinedSender`)."""

    def send(self, events: list[tuple[str, JobEvent]]) -> object:
        """Send `events` now; returns an opaque handle for `receive`. Raises on failure."""
        ...

    def receive(self, handle: object) -> object:
        """Read the reply of the send that returned `handle` (in send order)."""
        ...

    def close(self) -> None: ...


# (send handle or None, number of events, results to hand on after the reply)
_Item = tuple[object | None, int, list[JobResult]]


class StepPublisher:
    """`submit(events, results)`: send `events` now, hand `results` on once stored."""

    def __init__(
        self,
        sender: EventSender,
        on_published: Callable[[JobResult], None],
        *,
        max_pending_steps: int = 64,
    ) -> None:
        self.sender = sender
        self.on_published = on_published
        # bounded: if Redis stalls, the batcher stalls too instead of buffering forever
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=max_pending_steps)
        self._thread = threading.Thread(target=self._run, name="llmq-step-publisher",
                                        daemon=True)
        self.num_failed = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, events: list[tuple[str, JobEvent]], results: list[JobResult]) -> None:
        """From the batcher thread, right after a step."""
        handle = None
        if events:
            published_at = round(time.time(), 6)
            for _job_id, event in events:
                if event.type is EventType.TOKEN:
                    event.ts = published_at
            try:
                handle = self.sender.send(events)
            except Exception:  # live readers lose tokens; rows stay right
                self.num_failed += 1
                logger.exception("publishing %d events failed", len(events))
        if handle is not None or results:
            self._queue.put((handle, len(events), results))

    def stop(self, timeout: float = 30.0) -> None:
        """Read the replies still owed and hand their results on, then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout)
        self.sender.close()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, num_events, results = item
            if handle is not None:
                try:
                    self.sender.receive(handle)
                except Exception:  # live readers lose tokens; rows stay right
                    self.num_failed += 1
                    logger.exception("publishing %d events failed", num_events)
            for result in results:
                self.on_published(result)
