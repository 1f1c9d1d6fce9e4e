"""Publishes each step's events off the batcher thread, in step order.

Packing a pipeline of a few dozen commands costs milliseconds of Python; done inline it
would delay the next model step by that much. Here it overlaps the next step's forward
pass (torch releases the GIL), so the engine keeps its speed and tokens still leave the
moment their step ends.

NOTE (order): one thread, one FIFO. A step's finished results are handed to the writer
only after that step's token events are published, and the writer publishes a terminal
event only after committing its row: a job's stream is its tokens, then one terminal
event, and a client that sees the terminal event reads a terminal row.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from tasks.protocol import EventType, JobEvent
from workers.job_rows import JobResult

logger = logging.getLogger(__name__)

_Item = tuple[list[tuple[str, JobEvent]], list[JobResult]]


class StepPublisher:
    """`submit(events, results)`: publish `events` in one call, then hand `results` on."""

    def __init__(
        self,
        publish: Callable[[list[tuple[str, JobEvent]]], Any],
        on_published: Callable[[JobResult], None],
        *,
        max_pending_steps: int = 64,
    ) -> None:
        self.publish = publish
        self.on_published = on_published
        # bounded: if Redis stalls, the batcher stalls too instead of buffering forever
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=max_pending_steps)
        self._thread = threading.Thread(target=self._run, name="llmq-step-publisher",
                                        daemon=True)
        self.num_failed = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, events: list[tuple[str, JobEvent]], results: list[JobResult]) -> None:
        if events or results:
            self._queue.put((events, results))

    def stop(self, timeout: float = 30.0) -> None:
        """Publish what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            events, results = item
            # NOTE: merge the steps that queued up meanwhile: one pipeline for all of them.
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._publish(events, results)
                    return
                events = events + more[0]
                results = results + more[1]
            self._publish(events, results)

    def _publish(self, events: list[tuple[str, JobEvent]], results: list[JobResult]) -> None:
        if events:
            published_at = round(time.time(), 6)
            for _job_id, event in events:
                if event.type is EventType.TOKEN:
                    event.ts = published_at
            try:
                self.publish(events)
            except Exception:  # live readers lose tokens; rows stay right
                self.num_failed += 1
                logger.exception("publishing %d events failed", len(events))
        for result in results:
            self.on_published(result)
