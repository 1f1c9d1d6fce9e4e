"""The client socket of one detached event stream: non-blocking writes with a bounded
buffer, written by the live-event hub thread and the stream server's threads alike.

A write goes straight to the socket when nothing waits before it; what the socket does not
take at once is kept, in order, and the stream server's loop sends it when the socket is
writable again. So no writer ever blocks on a slow client, and the bytes of the hub's
direct deliveries and of the stream's own output never interleave: every write appends
under one lock.

As the hub's `Sink` (tasks/streams/live_hub.py) it takes token events while the stream's
generator is parked; past `MAX_BUFFERED_BYTES` unsent it refuses, the hub queues the
events for the generator instead, and a generator that falls `MAX_QUEUED` behind catches
up from the job's stream: memory per slow client stays bounded.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from tasks.protocol import EventType
from tasks.streams.live_hub import Delivery

RESTART = EventType.RESTART.value.encode()
MAX_BUFFERED_BYTES = 256 * 1024  # unsent bytes a client may leave before writers back off


class StreamSocket:
    """One streaming response's socket after its headers were sent."""

    def __init__(self, sock: socket.socket, chunked: bool,
                 notify: Callable[[StreamSocket], None]) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.chunked = chunked  # HTTP/1.1 streamed responses are chunk-encoded
        self.lock = threading.Lock()
        self.unsent = bytearray()  # what the socket did not take yet, in order
        # NOTE: only the loop thread closes the socket and unregisters it (a file number
        # closed elsewhere could be reused by a new connection while the loop still
        # watches it); any other thread sets these flags and notifies the loop.
        self.closed = False  # the client went away (or the server stops): write nothing
        self.ending = False  # the response is complete: close once `unsent` is sent
        self._notify = notify  # the loop looks at the flags and `unsent` again

    # -- writers (any thread) ----------------------------------------------------------------

    def write(self, data: bytes) -> bool:
        """Send `data` (framed) now or after what waits before it; False when closed."""
        if self.chunked and data:
            data = b"%x\r\n" % len(data) + data + b"\r\n"
        with self.lock:
            return self._write_locked(data)

    def deliver(self, entry_id: bytes, event_type: bytes, data: bytes) -> Delivery:
        """The hub's direct delivery of one live event (never blocks). A restart event is
        the generator's to write (it carries a message)."""
        if event_type == RESTART:
            return Delivery.REFUSED
        body = b"id: " + entry_id + b"\nevent: " + event_type + b"\ndata: " + data + b"\n\n"
        if self.chunked:
            body = b"%x\r\n" % len(body) + body + b"\r\n"
        with self.lock:
            if self.closed:
                return Delivery.PARTIAL  # the hub hands the stream back; it ends
            if len(self.unsent) > MAX_BUFFERED_BYTES:
                return Delivery.REFUSED
            self._write_locked(body)
            return Delivery.DONE

    def flush(self) -> bool:
        """Nothing to do here (the loop sends what waits); False when the client is gone."""
        return not self.closed

    @property
    def backed_up(self) -> bool:
        """The client reads slower than the stream writes: pause the generator."""
        return len(self.unsent) > MAX_BUFFERED_BYTES

    # -- the loop thread -----------------------------------------------------------------------

    def send_unsent(self) -> bool:
        """Send what waits, as much as the socket takes; True when nothing waits any more
        (or the socket is closed)."""
        with self.lock:
            if self.closed or not self.unsent:
                return True
            try:
                sent = self.sock.send(self.unsent)
            except BlockingIOError:
                return False
            except OSError:
                self._close_locked()
                return True
            del self.unsent[:sent]
            return not self.unsent

    def end(self) -> None:
        """The response is complete: the loop closes the socket once everything is sent
        (chunked: with the last, empty chunk, so a client reading to the end sees a whole
        body)."""
        with self.lock:
            if self.chunked:
                self._write_locked(b"0\r\n\r\n")
            self.ending = True
        self._notify(self)

    def abort(self) -> None:
        """Stop writing (the client is gone, or the server stops); the loop closes."""
        with self.lock:
            self._close_locked()

    # -- helpers (caller holds lock) -----------------------------------------------------------

    def _write_locked(self, data: bytes) -> bool:
        if self.closed:
            return False
        if not data:
            return True
        if self.unsent:
            self.unsent += data
            return True
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close_locked()
            return False
        if sent < len(data):
            self.unsent += data[sent:]
            self._notify(self)
        return True

    def _close_locked(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.unsent.clear()
        self._notify(self)
