"""Event streams without a thread each: one loop thread per web process owns their sockets.

With a thread per open stream, a few hundred idle streams used up every thread of the
web process and `/health`, submissions and polls waited behind them. Here a streaming view
validates the request and returns at once; the worker (webapp/stream_worker.py) sends the
headers and hands the socket and the stream's generator to this server, and its thread
takes the next request. An open stream then costs a socket, a generator and a listener of
the live-event hub: a few KB.

* The generators are cooperative (`EventSubscriber.iter_entries(cooperative=True)`): where
  they would wait for live events they yield a `Park(listener, deadline)` instead. A small
  pool of threads resumes a generator when its listener gets an item (the hub calls
  `listener.wake`) or its deadline passes (heartbeats, catch-up reads, row checks). Short
  blocking work (replaying the stream, reading the row) runs there.
* Live token events mostly skip the generator: the hub writes them to the stream's socket
  itself (`StreamSocket` is its sink), as before.
* The loop thread watches every socket: a client that closes its connection is seen at
  once, and its generator is closed (listener released, an OpenAI job cancelled) within
  milliseconds, not at the next heartbeat. It also sends what a slow client did not take
  and pauses the generator of a client that falls behind.

Under any other server (werkzeug's, the Flask test client, a stock gunicorn worker) the
views get no server in their environ and stream from the request's thread, as before.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from tasks.streams.reader import Park
from webapp.stream_socket import StreamSocket

logger = logging.getLogger(__name__)

STREAM_SERVER_KEY = "llmq.stream_server"  # in the environ when streams may be detached
DETACHED_KEY = "llmq.detached_stream"  # set by a view: the stream to hand over
NUM_THREADS = 4  # threads that resume generators; their work is short
MAX_WAIT_SECONDS = 1.0  # the loop wakes at least this often (to notice `close`)

StreamFactory = Callable[[StreamSocket], Iterator[Any]]  # the sink -> str | Park items


class _Stream:
    """One detached stream: its socket, its generator and who runs it now."""

    __slots__ = ("deadline", "done", "gen", "lock", "out", "registered", "running",
                 "wanted")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.out: StreamSocket
        self.gen: Iterator[Any] | None = None
        self.running = False  # a pool thread runs the generator now
        self.wanted = False  # ... and must run it again before it stops
        self.done = False  # the generator is closed
        self.deadline = 0.0  # of the last Park (monotonic seconds)
        self.registered = 0  # selector events the loop watches (0: not registered)


class StreamServer:
    """Started in each web worker process (after the fork); see the module docstring."""

    def __init__(self, num_threads: int = NUM_THREADS) -> None:
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="llmq-stream")
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()  # guards the fields below
        self._notified: list[_Stream] = []  # streams whose socket state the loop re-reads
        self._timers: list[tuple[float, int, _Stream]] = []  # a heap of Park deadlines
        self._next_wake = 0.0  # when the loop wakes next, unless woken
        self._streams: set[_Stream] = set()
        self._seq = itertools.count()
        self._stopped = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name="llmq-stream-loop",
                                        daemon=True)
        self._thread.start()

    @property
    def num_streams(self) -> int:
        """Streams this process holds open."""
        return len(self._streams)

    def adopt(self, sock: socket.socket, chunked: bool, factory: StreamFactory) -> None:
        """Take over `sock` (the response headers are sent) and stream `factory(sink)` to it."""
        st = _Stream()
        st.out = StreamSocket(sock, chunked, lambda _out: self._notify(st))
        st.gen = factory(st.out)
        with self._lock:
            self._streams.add(st)
        self._notify(st)  # the loop registers the socket
        self._schedule(st)

    def close(self) -> None:
        """End every stream (clients reconnect with Last-Event-ID) and stop."""
        for st in list(self._streams):
            st.out.abort()
        deadline = time.monotonic() + 2.0
        while self._streams and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stopped.set()
        self._wake()
        self._thread.join(timeout=2.0)
        self._pool.shutdown(wait=False)

    # -- running generators (pool threads) -----------------------------------------------------

    def _schedule(self, st: _Stream) -> None:
        with st.lock:
            if st.done:
                return
            if st.running:
                st.wanted = True
                return
            st.running = True
        try:
            self._pool.submit(self._run, st)
        except RuntimeError:  # the pool is shut down: the process is stopping
            st.out.abort()

    def _run(self, st: _Stream) -> None:
        """Advance the generator until it parks, ends, or its client falls behind."""
        assert st.gen is not None
        while True:
            with st.lock:
                st.wanted = False
            if st.out.closed:
                self._finish(st, "the client went away")
                return
            if not st.out.backed_up:
                try:
                    item = next(st.gen)
                except StopIteration:
                    st.out.end()
                    self._finish(st, None)
                    return
                except Exception:
                    logger.exception("an event stream failed; closing it")
                    st.out.abort()
                    self._finish(st, None)
                    return
                if not isinstance(item, Park):
                    st.out.write(item.encode())
                    continue
                self._park(st, item)
                if not item.listener.queue.empty():
                    continue
            # NOTE: parked (or waiting for the client to read): stop unless someone asked
            # for another run meanwhile; whoever asks later submits a new run.
            with st.lock:
                if st.wanted:
                    continue
                st.running = False
                return

    def _park(self, st: _Stream, park: Park) -> None:
        if park.listener.wake is None:
            park.listener.wake = lambda: self._schedule(st)
        st.deadline = park.deadline
        with self._lock:
            heapq.heappush(self._timers, (park.deadline, next(self._seq), st))
            earlier = park.deadline < self._next_wake
        if earlier:
            self._wake()

    def _finish(self, st: _Stream, reason: str | None) -> None:
        with st.lock:
            st.done = True
        gen, st.gen = st.gen, None
        if gen is not None and reason is not None:
            logger.debug("closing an event stream: %s", reason)
        if gen is not None:
            try:
                # its finally clauses: leave the hub, cancel an OpenAI job (the factories
                # return generators)
                cast(Generator[Any, None, None], gen).close()
            except Exception:
                logger.exception("closing an event stream failed")
        with self._lock:
            self._streams.discard(st)

    # -- the loop thread -----------------------------------------------------------------------

    def _notify(self, st: _Stream) -> None:
        with self._lock:
            self._notified.append(st)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # already woken (the pipe is full), or closed at exit

    def _loop(self) -> None:
        while not self._stopped.is_set():
            now = time.monotonic()
            with self._lock:
                due = self._timers[0][0] if self._timers else now + MAX_WAIT_SECONDS
                self._next_wake = min(due, now + MAX_WAIT_SECONDS)
            for key, mask in self._selector.select(max(0.0, self._next_wake - now)):
                if key.data is None:
                    try:
                        os.read(self._wake_r, 65536)
                    except BlockingIOError:
                        pass
                    continue
                st = key.data
                if mask & selectors.EVENT_READ:
                    self._on_readable(st)
                if mask & selectors.EVENT_WRITE and st.out.send_unsent():
                    self._update(st)
                    self._schedule(st)  # a generator paused for this client goes on
            with self._lock:
                notified, self._notified = self._notified, []
            for st in notified:
                self._update(st)
            self._fire_timers()
        for key in list(self._selector.get_map().values()):
            if key.data is not None:
                key.data.out.sock.close()
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _fire_timers(self) -> None:
        now = time.monotonic()
        due: list[_Stream] = []
        with self._lock:
            while self._timers and self._timers[0][0] <= now:
                _, _, st = heapq.heappop(self._timers)
                if st.deadline <= now:  # else a later Park replaced this deadline
                    due.append(st)
        for st in due:
            self._schedule(st)

    def _on_readable(self, st: _Stream) -> None:
        try:
            data = st.out.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the client closed its connection (or it broke)
            st.out.abort()
        # anything else is a request pipelined behind the stream: never answered (the
        # response said Connection: close)

    def _update(self, st: _Stream) -> None:
        """Make the selector match the stream's socket state (loop thread only)."""
        out = st.out
        with out.lock:
            closing = out.closed or (out.ending and not out.unsent)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if out.unsent else 0)
        if closing:
            if st.registered:
                self._selector.unregister(out.sock)
                st.registered = 0
            if out.sock.fileno() >= 0:
                try:
                    out.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                out.sock.close()
            with out.lock:
                out.closed = True
            self._schedule(st)  # a running generator is closed
            return
        if not st.registered:
            self._selector.register(out.sock, events, st)
        elif events != st.registered:
            self._selector.modify(out.sock, events, st)
        st.registered = events
