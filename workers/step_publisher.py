"""Publishes each step's events the moment the step ends, in step order, and never loses
one to a Redis outage.

The batcher thread sends a step's events itself (one EVAL, pipelined on the sender's own
connection, no wait for the reply): waiting for a publisher thread to get the GIL from a
busy batcher made that hand-off most of the token delivery latency. While steps follow
each other, the batcher also reads the replies itself, in order, and only then hands
their steps' finished results on: before each step it reads those that have arrived (the
last step's, as a rule; for a step with finished results it waits up to 2 ms, so a
result never waits for the next step), and after each step again. A publisher thread
woken after every step took the GIL from the batcher between its native calls once a
step; the thread now only reads the replies still owed when the batcher goes idle or a
reply is late, and re-sends during an outage.

Redis outages: a send or a reply that fails (an error reply too: Redis out of memory)
switches the publisher to RECOVERING. From then on the batcher only queues its steps
(bounded: `max_pending_steps`; a full queue blocks the batcher, which is back-pressure,
not loss), and the publisher thread re-sends every step whose reply it did not read, in
order, with backoff, until Redis answers; then it switches back to direct sends. A
re-sent step may have been stored the first time: each event carries its job's attempt
and a sequence number, and the publish script stores an event only if its sequence number
is new (tasks/streams/publish.py), so a client sees every token exactly once. Each step
with events has its place in the publisher's order, and Redis refuses a step while an
earlier one is not stored: a step sent behind one that Redis refused is not stored ahead
of it (its tokens would be ahead of the refused ones, whose re-send the sequence numbers
then drop). The thread's re-sends, one at a time after every earlier reply was read, are
never refused: Redis restored from an older snapshot has lost steps it acknowledged, and
the order goes on.

NOTE (order): one FIFO. A step's finished results are handed to the writer only after that
step's token events are stored, and the writer publishes a terminal event only after
committing its row: a job's stream is its tokens, then one terminal event, and a client
that sees the terminal event reads a terminal row.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tasks.protocol import EventType, JobEvent
from tasks.streams.publish import EventFence
from workers.job_rows import JobResult
from workers.thread_names import name_this_thread

logger = logging.getLogger(__name__)

RETRY_MIN_SECONDS = 0.1
RETRY_MAX_SECONDS = 2.0
# before a step, how long the batcher waits for the reply of a step in flight whose
# finished results would otherwise wait for the step (Redis answers in well under this)
RESULT_REPLY_WAIT_SECONDS = 0.002


class EventSender(Protocol):
    """Sends a step's events without waiting for the reply
    (`tasks.streams.publish.PipelinedSender`)."""

    def send(self, events: list[tuple[str, JobEvent]],
             fences: list[EventFence] | None = None, order: int = 0,
             earlier_stored: bool = False) -> object:
        """Send `events` now, as the `order`-th send (a re-send keeps its place: Redis
        refuses a send while an earlier one is not stored, unless `earlier_stored`: every
        earlier reply was read); returns an opaque handle for `receive`. Raises on
        failure, and keeps raising until `reset`."""
        ...

    def ready(self, handle: object, timeout: float = 0.0) -> bool:
        """Whether `receive(handle)` would not wait (now, or after up to `timeout`
        seconds); raises if the send failed."""
        ...

    def receive(self, handle: object) -> object:
        """Read the reply of the send that returned `handle` (in send order)."""
        ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class _Step:
    """One step's publish: what went out (or must), and what follows its reply."""

    events: list[tuple[str, JobEvent]]
    fences: list[EventFence]  # fences[i] fences events[i]
    results: list[JobResult]  # handed on once the events are stored: terminal rows
    handle: object | None  # None: not sent (the publisher thread sends it)
    order: int = 0  # its place among the steps with events (1, 2, ...), kept by re-sends


class StepPublisher:
    """`submit(events, attempts, results)`: send `events` now, hand `results` on once
    stored."""

    def __init__(
        self,
        sender: EventSender,
        on_published: Callable[[JobResult], None],
        *,
        max_pending_steps: int = 4096,
    ) -> None:
        self.sender = sender
        self.on_published = on_published
        # bounded: a long Redis outage stalls the batcher rather than filling memory
        self._queue: queue.Queue[_Step | None] = queue.Queue(maxsize=max_pending_steps)
        self._thread = threading.Thread(target=self._run, name="llmq-step-publisher",
                                        daemon=True)
        self._lock = threading.Lock()  # guards _direct and the order of queue puts
        self._direct = True  # False while recovering: the thread sends, in order
        self._seq: dict[str, int] = {}  # job id -> last sequence number (batcher thread)
        self._num_ordered = 0  # steps with events so far (batcher thread)
        # steps the batcher sent and reads the replies of itself, oldest first (batcher
        # thread; only while direct and nothing is queued for the thread)
        self._in_flight: deque[_Step] = deque()
        self._closed = False  # set by close(): nothing more is published
        self._stopping = threading.Event()
        self.num_failed = 0  # sends or replies that failed (then re-sent)
        self.num_resent = 0  # steps re-sent after a failure

    def start(self) -> None:
        self._thread.start()

    @property
    def recovering(self) -> bool:
        return not self._direct

    def submit(self, events: list[tuple[str, JobEvent]], attempts: dict[str, int],
               results: list[JobResult]) -> None:
        """From the batcher thread, right after a step. `attempts[job_id]` is the claim
        the job's events belong to."""
        if self._closed:
            return
        fences: list[EventFence] = []
        if events:
            published_at = round(time.time(), 6)
            for job_id, event in events:
                if event.type is EventType.TOKEN:
                    event.ts = published_at
                seq = self._seq.get(job_id, 0) + 1
                self._seq[job_id] = seq
                fences.append(EventFence(attempts.get(job_id, 0), seq))
        for result in results:
            self._seq.pop(result.job_id, None)
        self._read_arrived()
        if not events and not results:
            return
        step = _Step(events, fences, results, None)
        if events:
            self._num_ordered += 1
            step.order = self._num_ordered
        with self._lock:
            if not self._direct:
                self._hand_over()  # what is in flight goes first
            if self._direct and events:
                try:
                    step.handle = self.sender.send(events, fences, step.order)
                except Exception as exc:  # the thread re-sends it, and what follows
                    self.num_failed += 1
                    self._direct = False
                    self._hand_over()
                    logger.warning("publishing %d events failed (%s); buffering until Redis "
                                   "answers", len(events), exc)
            mine = self._direct and self._queue.empty()
            if not mine:
                # NOTE: put under the lock: a step queued after the thread found the queue
                # empty cannot be overtaken by a direct send.
                self._put(step)
            elif step.handle is not None or self._in_flight:
                self._in_flight.append(step)
                return
        if mine:  # results only, nothing before them in flight: they go on now
            for result in results:
                self.on_published(result)

    def before_step(self) -> None:
        """From the batcher thread, before a step: finished results must not wait for it.
        Reads the replies that have arrived; while a step in flight still carries
        results, waits for its reply up to RESULT_REPLY_WAIT_SECONDS, then hands what is
        still in flight to the thread."""
        self._read_arrived()
        deadline = time.monotonic() + RESULT_REPLY_WAIT_SECONDS
        while any(step.results for step in self._in_flight):
            handle = self._in_flight[0].handle
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._arrives(handle, remaining):
                with self._lock:
                    self._hand_over()
                return
            self._read_arrived()

    def _arrives(self, handle: object | None, timeout: float) -> bool:
        """Whether the reply of `handle` arrives within `timeout` (True on a failure:
        `_read_arrived` handles it)."""
        if handle is None:
            return True
        try:
            return self.sender.ready(handle, timeout)
        except Exception:
            return True

    def idle(self) -> None:
        """From the batcher thread, before it waits for work: the thread reads the replies
        still owed (no next step will)."""
        self._read_arrived()
        if self._in_flight:
            with self._lock:
                self._hand_over()

    def _read_arrived(self) -> None:
        """Batcher thread: read the replies that have arrived, oldest first, and hand their
        steps' results on; stop at the first still on its way. A failed one switches to
        recovering and hands every step in flight to the thread, in order."""
        while self._in_flight and not self._closed:
            step = self._in_flight[0]
            if step.handle is not None:
                try:
                    if not self.sender.ready(step.handle):
                        return
                    self.sender.receive(step.handle)
                except Exception as exc:
                    self.num_failed += 1
                    step.handle = None  # its reply is gone: the thread sends it again
                    logger.warning("publishing %d events failed (%s); re-sending",
                                   len(step.events), exc)
                    with self._lock:
                        self._direct = False
                        self._hand_over()
                    return
            self._in_flight.popleft()
            for result in step.results:
                self.on_published(result)

    def _hand_over(self) -> None:
        """Under the lock: the steps in flight go to the thread's queue, in order."""
        while self._in_flight:
            self._put(self._in_flight.popleft())

    def forget(self, job_id: str) -> None:
        """From the batcher thread: `job_id` left without a result (lost, aborted)."""
        self._seq.pop(job_id, None)

    def close(self) -> None:
        """Publish nothing more, queued steps included (a tripped group: its jobs are
        handed back, and a step that wakes up late must not reach their streams)."""
        self._closed = True
        self._stopping.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Publish what is queued and hand its results on, then end the thread. Gives up
        re-sending after `timeout` (the rows stay right; the streams miss the tail).
        From the batcher thread (it hands over what is in flight)."""
        with self._lock:
            self._hand_over()
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._stopping.set()  # a thread still re-sending gives up
        self._thread.join(5.0)
        self.sender.close()

    def _put(self, step: _Step) -> None:
        while True:
            try:
                self._queue.put(step, timeout=1.0)
                return
            except queue.Full:
                if self._stopping.is_set():
                    return
                logger.warning("%d steps wait for Redis; the batcher waits too",
                               self._queue.qsize())

    def _run(self) -> None:
        name_this_thread()
        while True:
            step = self._queue.get()
            if step is None:
                return
            if self._closed:
                continue
            if step.events and not self._publish(step):
                return  # stopping gave up on Redis
            for result in step.results:
                self.on_published(result)
            if not self._direct:
                with self._lock:
                    if self._queue.empty() and not self._closed:
                        self._direct = True
                        logger.info("Redis answers again: buffered events re-sent (%d steps "
                                    "so far); publishing directly", self.num_resent)

    def _publish(self, step: _Step) -> bool:
        """Make sure `step.events` are stored; False if stopped before they were."""
        if step.handle is not None:
            try:
                self.sender.receive(step.handle)
                return True
            except Exception as exc:
                self.num_failed += 1
                with self._lock:
                    self._direct = False
                logger.warning("publishing %d events failed (%s); re-sending", len(step.events),
                               exc)
        backoff = RETRY_MIN_SECONDS
        while not self._stopping.is_set():
            try:
                self.sender.reset()
                # NOTE: the thread sends one step at a time, after every earlier step's
                # reply was read: an order Redis kept behind it is one it lost
                handle = self.sender.send(step.events, step.fences, step.order,
                                          earlier_stored=True)
                self.sender.receive(handle)
                self.num_resent += 1
                return True
            except Exception as exc:
                self.num_failed += 1
                logger.warning("Redis unavailable (%s); retrying %d events in %.1fs",
                               exc, len(step.events), backoff)
                self._stopping.wait(backoff)
                backoff = min(RETRY_MAX_SECONDS, backoff * 2)
        logger.error("stopped with %d events unpublished", len(step.events))
        return False
