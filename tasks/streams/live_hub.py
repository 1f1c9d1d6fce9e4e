"""One Redis pub/sub connection per process, fanning live job events out to local readers.

A web process serves many event streams at once. With a pub/sub connection per stream,
every batcher step woke one reader thread per stream just to parse one message each, and
that wake-up storm cost more than the events themselves. Here one hub thread reads every
live message of the process and hands it, unparsed, to the reader registered for its
channel: a `SimpleQueue` put per message.

Protocol of a `Listener` (see `EventSubscriber.iter_entries`): register, wait until the
SUBSCRIBE is confirmed (`subscribed`), replay the stream, then take live messages from
`queue`. `GAP` in the queue means messages may have been missed (the hub lost its
connection, or the reader fell `MAX_QUEUED` behind): wait for `subscribed` again and
re-read the stream. Nothing is lost; duplicates are left to the reader's id check.

Direct delivery: a reader may hand the hub a `Sink` (the SSE client's socket) and sleep;
the hub then writes each live event there itself and wakes the reader only when the
stream ended (`SINK_ENDED`) or a write fell short (`SINK_FELL_SHORT...`).
"""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Any, Protocol

import redis
from redis import Redis

from tasks.redis_client import dedicated_connection

logger = logging.getLogger(__name__)

GAP = object()  # queued instead of messages that may have been missed
MAX_QUEUED = 4096  # a reader this far behind gets GAP and catches up from the stream
PING_SECONDS = 10.0  # an idle hub connection is pinged this often (dead peers, proxies)
RECONNECT_BACKOFF_SECONDS = (0.05, 0.2, 0.5, 1.0, 2.0)


class Delivery(Enum):
    DONE = "done"  # written whole
    PARTIAL = "partial"  # partly written (the sink holds the rest), or the client is gone
    REFUSED = "refused"  # nothing written: the reader must handle this event itself


class Sink(Protocol):
    """Where the hub may write a reader's live events itself (see webapp/sse_sink.py)."""

    def deliver(self, entry_id: bytes, event_type: bytes, data: bytes) -> Delivery:
        """Write one event without blocking (from the hub thread)."""
        ...

    def flush(self) -> bool:
        """Write what a PARTIAL delivery left, blocking (from the reader's thread); False
        when the client is gone."""
        ...


SINK_ENDED = object()  # queued after the hub delivered the terminal event to the sink
SINK_FELL_SHORT = object()  # a delivery was PARTIAL: the reader flushes and takes over
SINK_FELL_SHORT_AT_END = object()  # ... and that event was the terminal one
_TERMINAL_TYPES = (b"done", b"error", b"cancelled")


class Listener:
    """One reader's view of one channel."""

    __slots__ = ("channel", "dropping", "last", "lock", "queue", "sink", "subscribed", "wake")

    def __init__(self, channel: bytes) -> None:
        self.channel = channel
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()  # bytes payloads or GAP
        self.subscribed = threading.Event()  # set while the hub's SUBSCRIBE is confirmed
        self.dropping = False  # GAP queued; messages dropped until the reader takes it
        # direct delivery: while `sink` is set the hub writes the reader's events there
        # itself, skipping ids up to `last`. Switched under `lock`, which the hub holds
        # while it delivers.
        self.lock = threading.Lock()
        self.sink: Sink | None = None
        self.last: tuple[int, int] = (0, 0)
        # called (from the hub thread) after every item put in `queue`: a reader that
        # parks instead of blocking on the queue is woken this way (webapp/stream_server.py)
        self.wake: Callable[[], None] | None = None

    def put(self, item: Any) -> None:
        self.queue.put(item)
        wake = self.wake
        if wake is not None:
            wake()

    def take_gap(self) -> None:
        """The reader took GAP: queue messages again (it re-reads the stream next)."""
        self.dropping = False

    def start_direct(self, sink: Sink, last: tuple[int, int]) -> None:
        """Let the hub deliver to `sink` from now on, unless messages wait in the queue:
        the reader handles those first (and tries again after)."""
        with self.lock:
            if self.queue.empty():
                self.sink, self.last = sink, last

    def stop_direct(self) -> tuple[int, int]:
        """Take delivery back; returns the id of the last event the hub delivered."""
        with self.lock:
            self.sink = None
            return self.last


class LiveHub:
    """Started on first use in each process (a forked child starts its own)."""

    def __init__(self, redis_client: Redis) -> None:
        self._redis = redis_client  # the hub connection takes this client's settings
        self._lock = threading.Lock()
        self._channels: dict[bytes, set[Listener]] = {}
        self._pending: dict[bytes, int] = {}  # SUBSCRIBEs sent, not yet confirmed
        self._conn: Any = None  # the hub connection while it is up
        self._pid: int | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._wake_r, self._wake_w = -1, -1  # a pipe that interrupts the hub's select

    # -- readers (any thread) --------------------------------------------------------------

    def listen(self, channel: str) -> Listener:
        """Register for `channel`; wait on the listener's `subscribed` before replaying."""
        self._ensure_started()
        listener = Listener(channel.encode())
        with self._lock:
            listeners = self._channels.setdefault(listener.channel, set())
            listeners.add(listener)
            if len(listeners) > 1 and not self._pending.get(listener.channel):
                listener.subscribed.set()  # the channel is already subscribed
            elif len(listeners) == 1:
                self._send_locked("SUBSCRIBE", listener.channel)
        return listener

    def num_listeners(self) -> int:
        """Readers registered in this process (each open event stream holds one)."""
        with self._lock:
            return sum(len(listeners) for listeners in self._channels.values())

    def leave(self, listener: Listener) -> None:
        with self._lock:
            listeners = self._channels.get(listener.channel)
            if listeners is None:
                return
            listeners.discard(listener)
            if not listeners:
                del self._channels[listener.channel]
                self._send_locked("UNSUBSCRIBE", listener.channel)

    def close(self) -> None:
        self._stopped.set()
        self._wake()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        with self._lock:
            self._disconnect_locked()
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
            self._thread = None

    # -- the hub thread ----------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._pid == os.getpid() and self._thread is not None:
            return
        with self._lock:
            if self._pid == os.getpid() and self._thread is not None:
                return
            # NOTE: after a fork the parent's thread and connection do not exist here.
            self._pid, self._conn = os.getpid(), None
            self._channels, self._pending = {}, {}
            self._wake_r, self._wake_w = os.pipe()
            self._stopped.clear()
            self._thread = threading.Thread(target=self._run, name="llmq-live-hub",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        attempt = 0
        while not self._stopped.is_set():
            try:
                self._connect()
                attempt = 0
                self._serve()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                if self._stopped.is_set():
                    break
                delay = RECONNECT_BACKOFF_SECONDS[min(attempt, len(RECONNECT_BACKOFF_SECONDS) - 1)]
                attempt += 1
                logger.warning("live events: Redis connection lost (%s); reconnecting in "
                               "%.2fs", exc, delay)
                self._mark_gap()
                self._stopped.wait(delay)
        with self._lock:
            self._disconnect_locked()

    def _connect(self) -> None:
        conn = dedicated_connection(self._redis)
        conn.connect()
        with self._lock:
            self._conn = conn
            self._pending = {}
            for channel in self._channels:  # every channel readers hold, again
                self._send_locked("SUBSCRIBE", channel)

    def _serve(self) -> None:
        conn = self._conn
        sock = conn._sock  # NOTE: redis-py keeps the socket private; select needs it
        idle_since = time.monotonic()
        while not self._stopped.is_set():
            while conn.can_read(timeout=0):
                self._dispatch(conn.read_response(push_request=True))
                idle_since = time.monotonic()
            readable, _, _ = select.select([sock, self._wake_r], [], [], PING_SECONDS)
            if self._wake_r in readable:
                os.read(self._wake_r, 4096)
            if not readable and time.monotonic() - idle_since >= PING_SECONDS:
                with self._lock:
                    self._send_locked("PING")
                idle_since = time.monotonic()

    def _dispatch(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == b"message":
            listeners = self._channels.get(message[1])
            if not listeners:
                return  # unsubscribed a moment ago
            for listener in tuple(listeners):
                self._offer(listener, message[2])
        elif kind == b"subscribe":
            with self._lock:
                channel = message[1]
                left = self._pending.get(channel, 0) - 1
                if left > 0:
                    self._pending[channel] = left
                    return
                self._pending.pop(channel, None)
                for listener in self._channels.get(channel, ()):
                    listener.subscribed.set()
        # unsubscribe confirmations and pongs need nothing

    @staticmethod
    def _offer(listener: Listener, payload: bytes) -> None:
        """Deliver `payload` to the listener's sink, or queue it for the reader.

        NOTE: under the listener's lock, like `start_direct`: a message is queued only
        while no sink is attached, and a sink is attached only to an empty queue, so the
        hub and the reader never write to the client at the same time.
        """
        with listener.lock:
            sink = listener.sink
            if sink is not None:
                entry_id, event_type, data = payload.split(b" ", 2)
                ms, _, seq = entry_id.partition(b"-")
                key = (int(ms), int(seq or 0))
                if key <= listener.last:
                    return  # the reader's replay had it
                delivery = sink.deliver(entry_id, event_type, data)
                if delivery is not Delivery.REFUSED:
                    listener.last = key
                    terminal = event_type in _TERMINAL_TYPES
                    if delivery is Delivery.PARTIAL:
                        listener.sink = None
                        listener.put(SINK_FELL_SHORT_AT_END if terminal
                                     else SINK_FELL_SHORT)
                    elif terminal:
                        listener.sink = None
                        listener.put(SINK_ENDED)
                    return
                listener.sink = None  # refused: the reader writes this one itself
            if listener.dropping:
                return
            if listener.queue.qsize() >= MAX_QUEUED:
                listener.dropping = True
                listener.put(GAP)
                logger.warning("live events: a reader of %s is %d messages behind; it "
                               "catches up from the stream", listener.channel.decode(),
                               MAX_QUEUED)
                return
            listener.put(payload)

    def _mark_gap(self) -> None:
        with self._lock:
            self._disconnect_locked()
            # every channel needs its SUBSCRIBE again before a reader may replay
            self._pending = {channel: 1 for channel in self._channels}
            for listeners in self._channels.values():
                for listener in listeners:
                    listener.subscribed.clear()
                    # NOTE: no direct delivery until the reader has caught up: an event
                    # delivered now would jump ahead of the ones the gap lost
                    listener.stop_direct()
                    listener.put(GAP)

    # -- helpers (caller holds _lock) ------------------------------------------------------

    def _send_locked(self, *args: Any) -> None:
        """Send a command on the hub connection; a broken connection is the hub's to fix."""
        if args[0] == "SUBSCRIBE":
            self._pending[args[1]] = self._pending.get(args[1], 0) + 1
        if self._conn is None:
            return  # subscribed again on reconnect
        try:
            self._conn.send_command(*args)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            logger.debug("live events: %s failed; the hub reconnects", args[0], exc_info=True)
            self._wake()

    def _disconnect_locked(self) -> None:
        if self._conn is not None:
            try:
                self._conn.disconnect()
            except Exception:
                logger.debug("live events: closing the hub connection failed", exc_info=True)
            self._conn = None

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
