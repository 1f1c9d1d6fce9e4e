"""Direct delivery of live SSE events to a client socket, from the live-event hub thread.

With a thread per stream, each token event woke that stream's thread, which took the GIL,
formatted one line and wrote it: at 64 streams the wake-ups and GIL hand-offs cost more
than the events. A `SocketSink` lets the hub write a live event straight to the client's
socket (non-blocking, framed as the server frames the response) while the stream's thread
sleeps. The thread stays in charge of everything else (headers, replay, heartbeats, the
end of the response) and takes writing back whenever it needs to write itself.

Only under gunicorn's threaded workers, over plain TCP: there the raw socket is in the
environ and the framing follows the request (HTTP/1.1: chunked; HTTP/1.0: as is). Any
other server, TLS or worker class gets no sink, and the thread writes every event.
"""

from __future__ import annotations

import socket
from typing import Any

from tasks.protocol import EventType
from tasks.streams.live_hub import Delivery

RESTART = EventType.RESTART.value.encode()


class SocketSink:
    """Writes SSE events to one response's socket without blocking."""

    def __init__(self, sock: socket.socket, chunked: bool) -> None:
        self._sock = sock
        self._chunked = chunked  # HTTP/1.1 streamed responses are chunk-encoded
        self._unsent = b""  # the tail of an event the socket would not take at once
        self.broken = False  # the client went away

    @classmethod
    def for_request(cls, environ: dict[str, Any]) -> SocketSink | None:
        sock = environ.get("gunicorn.socket")
        # NOTE: exactly socket.socket: TLS sockets and green (gevent) sockets subclass it
        if type(sock) is not socket.socket:
            return None
        protocol = environ.get("SERVER_PROTOCOL", "")
        if protocol not in ("HTTP/1.0", "HTTP/1.1"):
            return None
        return cls(sock, chunked=protocol == "HTTP/1.1")

    def deliver(self, entry_id: bytes, event_type: bytes, data: bytes) -> Delivery:
        """Write one event now, or as much of it as the socket takes (the rest is kept
        for `flush`). A restart event is the thread's to write (it carries a message)."""
        if event_type == RESTART:
            return Delivery.REFUSED
        body = b"id: " + entry_id + b"\nevent: " + event_type + b"\ndata: " + data + b"\n\n"
        if self._chunked:
            body = b"%x\r\n" % len(body) + body + b"\r\n"
        try:
            sent = self._sock.send(body, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return Delivery.REFUSED
        except OSError:
            self.broken = True
            return Delivery.PARTIAL
        if sent == len(body):
            return Delivery.DONE
        self._unsent = body[sent:]
        return Delivery.PARTIAL

    def flush(self) -> bool:
        """From the stream's thread: write what `deliver` could not (blocking). False
        when the client is gone."""
        if self.broken:
            return False
        try:
            if self._unsent:
                self._sock.sendall(self._unsent)
        except OSError:
            self.broken = True
            return False
        self._unsent = b""
        return True
