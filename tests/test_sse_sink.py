"""Direct delivery of live events by the hub to a client socket (real Redis, socketpairs)."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from tasks.protocol import EventType, JobEvent
from tasks.streams.live_hub import Delivery
from tasks.streams.publish import EventPublisher
from tasks.streams.reader import EventSubscriber
from webapp.events import format_entry
from webapp.sse_sink import SocketSink


@pytest.fixture
def subscriber(redis_client, service_settings) -> Iterator[EventSubscriber]:
    sub = EventSubscriber(redis_client, service_settings)
    yield sub
    sub.close()


def _token(i: int, text: str = "") -> JobEvent:
    return JobEvent(EventType.TOKEN, text=text or f"t{i} ", token_ids=[i])


def _serve(entries: Iterator, sock: socket.socket) -> threading.Thread:
    """What the server does with the generator: write whatever it yields, in order."""
    def run() -> None:
        for entry in entries:
            if entry is not None:
                sock.sendall(format_entry(entry).encode())
        sock.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _read_ids(sock: socket.socket) -> list[str]:
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    return [line[4:].decode() for line in data.split(b"\n") if line.startswith(b"id: ")]


def _wait_direct(subscriber: EventSubscriber) -> None:
    deadline = time.monotonic() + 10
    while not any(listener.sink is not None for listeners in
                  subscriber._hub._channels.values() for listener in listeners):
        assert time.monotonic() < deadline, "direct delivery never started"
        time.sleep(0.01)


def test_the_hub_writes_live_events_while_the_reader_sleeps(redis_client, service_settings,
                                                            subscriber):
    publisher = EventPublisher(redis_client, service_settings)
    job = str(uuid.uuid4())
    server_side, client_side = socket.socketpair()
    sink = SocketSink(server_side, chunked=False)
    ids = publisher.publish([(job, _token(0))])
    entries = subscriber.iter_entries(job, sink=sink)
    first = next(entries)  # the replay goes through the server, as usual
    assert first.entry_id == ids[0]
    server_side.sendall(format_entry(first).encode())
    yielded: list = []
    reader = threading.Thread(target=lambda: yielded.extend(entries), daemon=True)
    reader.start()
    _wait_direct(subscriber)

    ids += [publisher.publish([(job, _token(i))])[0] for i in range(1, 6)]
    ids += publisher.publish([(job, JobEvent(EventType.DONE, finish_reason="length"))])
    reader.join(10)
    assert not reader.is_alive() and yielded == []  # the generator yielded nothing live
    server_side.shutdown(socket.SHUT_WR)
    assert _read_ids(client_side) == ids  # all of them, once, in order


def test_a_slow_client_gets_every_event_once_in_order(redis_client, service_settings,
                                                      subscriber):
    publisher = EventPublisher(redis_client, service_settings)
    job = str(uuid.uuid4())
    server_side, client_side = socket.socketpair()
    server_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client_side.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sink = SocketSink(server_side, chunked=False)
    entries = subscriber.iter_entries(job, sink=sink)
    ids = publisher.publish([(job, _token(0))])
    server = _serve(entries, server_side)
    _wait_direct(subscriber)

    # the client reads nothing yet: big events fill the socket, the hub's writes fall
    # short, the reader thread takes over (blocking) and later events queue up for it
    big = "x" * 20_000
    ids += [publisher.publish([(job, _token(i, big))])[0] for i in range(1, 12)]
    ids += publisher.publish([(job, JobEvent(EventType.DONE, finish_reason="length"))])
    assert _read_ids(client_side) == ids
    server.join(10)
    assert not server.is_alive()


def test_socket_sink_frames_chunks_and_leaves_restarts_to_the_reader():
    server_side, client_side = socket.socketpair()
    sink = SocketSink(server_side, chunked=True)
    assert sink.deliver(b"1-0", b"token", b'{"text":"a"}') is Delivery.DONE
    body = b'id: 1-0\nevent: token\ndata: {"text":"a"}\n\n'
    assert client_side.recv(1024) == b"%x\r\n" % len(body) + body + b"\r\n"
    assert sink.deliver(b"2-0", b"restart", b"{}") is Delivery.REFUSED
    client_side.close()
    assert sink.deliver(b"3-0", b"token", b"{}") is Delivery.PARTIAL  # the client left
    assert sink.broken and not sink.flush()
