"""The per-process live hub on real Redis: one connection, reconnects, slow readers."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from tasks.protocol import EventType, JobEvent
from tasks.streams import live_hub
from tasks.streams.publish import EventPublisher
from tasks.streams.reader import EventSubscriber, StreamEntry


def _token(i: int) -> JobEvent:
    return JobEvent(EventType.TOKEN, text=f"t{i} ", token_ids=[i])


@pytest.fixture
def subscriber(redis_client, service_settings) -> Iterator[EventSubscriber]:
    sub = EventSubscriber(redis_client, service_settings)
    yield sub
    sub.close()


def _read_in_thread(subscriber: EventSubscriber, job_id: str) -> tuple[threading.Thread,
                                                                          list[StreamEntry]]:
    received: list[StreamEntry] = []

    def read() -> None:
        for entry in subscriber.iter_entries(job_id, heartbeat_seconds=0.2):
            if entry is not None:
                received.append(entry)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, received


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _hub_clients(redis_client, subscriber: EventSubscriber) -> list[dict]:
    sock = subscriber._hub._conn._sock
    addr = "%s:%d" % sock.getsockname()[:2]
    return [c for c in redis_client.client_list() if c["addr"] == addr]


def test_one_connection_serves_every_reader(redis_client, service_settings, subscriber):
    publisher = EventPublisher(redis_client, service_settings)
    jobs = [str(uuid.uuid4()) for _ in range(12)]
    readers = [_read_in_thread(subscriber, job) for job in jobs]
    _wait_for(lambda: len(subscriber._hub._channels) == len(jobs)
              and not subscriber._hub._pending)
    (client,) = _hub_clients(redis_client, subscriber)
    assert int(client["sub"]) == len(jobs)  # every channel on the one hub connection

    for i in range(5):
        publisher.publish([(job, _token(i)) for job in jobs])
    publisher.publish([(job, JobEvent(EventType.DONE, finish_reason="length")) for job in jobs])
    for thread, received in readers:
        thread.join(10)
        assert not thread.is_alive()
        assert [e.type for e in received] == [EventType.TOKEN] * 5 + [EventType.DONE]
        assert [e.event().token_ids for e in received[:5]] == [[i] for i in range(5)]
    # the readers left: their channels are unsubscribed, the connection stays
    _wait_for(lambda: int(_hub_clients(redis_client, subscriber)[0]["sub"]) == 0)


def test_a_killed_hub_connection_loses_nothing(redis_client, service_settings, subscriber):
    publisher = EventPublisher(redis_client, service_settings)
    job = str(uuid.uuid4())
    thread, received = _read_in_thread(subscriber, job)
    _wait_for(lambda: subscriber._hub._channels and not subscriber._hub._pending)
    ids = publisher.publish([(job, _token(i)) for i in range(3)])
    _wait_for(lambda: len(received) == 3)

    (client,) = _hub_clients(redis_client, subscriber)
    redis_client.client_kill_filter(_id=client["id"])
    # published while the hub is down or resubscribing: only the stream has them
    ids += publisher.publish([(job, _token(i)) for i in range(3, 8)])
    ids += publisher.publish([(job, JobEvent(EventType.DONE, finish_reason="length"))])

    thread.join(15)
    assert not thread.is_alive()
    assert _hub_clients(redis_client, subscriber)[0]["id"] != client["id"]  # reconnected
    assert [e.entry_id for e in received] == ids  # all, once, in order
    assert [e.event().token_ids for e in received[:8]] == [[i] for i in range(8)]


def test_a_reader_far_behind_catches_up_from_the_stream(redis_client, service_settings,
                                                        subscriber, monkeypatch):
    monkeypatch.setattr(live_hub, "MAX_QUEUED", 4)
    publisher = EventPublisher(redis_client, service_settings)
    job = str(uuid.uuid4())
    first = publisher.publish([(job, _token(0))])
    entries = subscriber.iter_entries(job)
    assert next(entries).entry_id == first[0]  # replayed; the reader is subscribed now
    # the reader does not read while 30 more arrive: its queue overflows
    ids = first + [publisher.publish([(job, _token(i))])[0] for i in range(1, 31)]
    ids += publisher.publish([(job, JobEvent(EventType.DONE, finish_reason="length"))])
    _wait_for(lambda: any(listener.dropping for listeners in subscriber._hub._channels.values()
                          for listener in listeners))

    rest = list(entries)
    assert [first[0]] + [e.entry_id for e in rest] == ids
    assert rest[-1].type is EventType.DONE
