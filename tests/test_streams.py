"""Job event streams on real Redis: replay, reconnect, live/replay overlap, heartbeats."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import pytest
import redis

from tasks.protocol import EventType, JobEvent, events_key
from tasks.streams.publish import EventPublisher, SenderBroken
from tasks.streams.reader import EventSubscriber, current_output, parse_stream_id


def _tokens(n: int, start: int = 0) -> list[JobEvent]:
    return [JobEvent(EventType.TOKEN, text=f"t{i} ", token_ids=[i])
            for i in range(start, start + n)]


def _done() -> JobEvent:
    return JobEvent(EventType.DONE, finish_reason="stop", usage={"prompt_tokens": 3})


@pytest.fixture
def job_id() -> str:
    return str(uuid.uuid4())


def test_late_subscriber_gets_every_event_in_order(redis_client, service_settings, job_id):
    publisher = EventPublisher(redis_client, service_settings)
    ids = publisher.publish([(job_id, e) for e in _tokens(5)] + [(job_id, _done())])
    assert len(ids) == 6
    assert [parse_stream_id(i) for i in ids] == sorted(parse_stream_id(i) for i in ids)

    received = list(EventSubscriber(redis_client, service_settings).iter_events(job_id))
    assert [entry_id for entry_id, _ in received] == ids
    assert [e.text for _, e in received[:5]] == [f"t{i} " for i in range(5)]
    assert [e.token_ids for _, e in received[:5]] == [[i] for i in range(5)]
    assert received[-1][1].type is EventType.DONE
    assert received[-1][1].usage == {"prompt_tokens": 3}
    # a terminal event starts the stream's expiry
    ttl = redis_client.ttl(events_key(service_settings, job_id))
    assert 0 < ttl <= service_settings.stream_ttl_seconds


def test_reconnect_from_last_id_gets_exactly_the_rest(redis_client, service_settings, job_id):
    publisher = EventPublisher(redis_client, service_settings)
    ids = publisher.publish([(job_id, e) for e in _tokens(6)] + [(job_id, _done())])
    subscriber = EventSubscriber(redis_client, service_settings)

    rest = list(subscriber.iter_events(job_id, last_id=ids[2]))
    assert [entry_id for entry_id, _ in rest] == ids[3:]
    assert [e.token_ids for _, e in rest[:-1]] == [[3], [4], [5]]
    assert [i for i, _ in subscriber.read_events(job_id, after_id=ids[5])] == ids[6:]


def test_events_published_while_subscribing_are_yielded_once(redis_client, service_settings,
                                                            job_id):
    publisher = EventPublisher(redis_client, service_settings)
    publisher.publish([(job_id, e) for e in _tokens(20)])  # replayed part

    def publish_more() -> None:
        # one event at a time so replay and live overlap while the subscriber starts
        for event in _tokens(60, start=20):
            publisher.publish([(job_id, event)])
        publisher.publish([(job_id, _done())])

    thread = threading.Thread(target=publish_more)
    thread.start()
    received = list(EventSubscriber(redis_client, service_settings).iter_events(job_id))
    thread.join()

    assert [e.token_ids[0] for _, e in received[:-1]] == list(range(80))
    entry_ids = [parse_stream_id(i) for i, _ in received]
    assert entry_ids == sorted(set(entry_ids))
    assert received[-1][1].type is EventType.DONE


def test_live_events_after_replay_and_heartbeat_ticks(redis_client, service_settings, job_id):
    publisher = EventPublisher(redis_client, service_settings)
    first = publisher.publish([(job_id, _tokens(1)[0])])[0]
    events = EventSubscriber(redis_client, service_settings).iter_events(
        job_id, heartbeat_seconds=0.2
    )
    assert next(events) == (first, _tokens(1)[0])
    started = time.monotonic()
    assert next(events) is None  # nothing arrived: a heartbeat tick
    assert next(events) is None
    assert time.monotonic() - started >= 0.35
    second = publisher.publish([(job_id, _tokens(1, start=1)[0]), (job_id, _done())])
    assert next(events) == (second[0], _tokens(1, start=1)[0])
    assert next(events)[1].type is EventType.DONE
    assert next(events, "end") == "end"


def test_restart_voids_the_output_so_far(redis_client, service_settings, job_id):
    publisher = EventPublisher(redis_client, service_settings)
    publisher.publish([(job_id, e) for e in _tokens(3)])
    publisher.publish([(job_id, JobEvent(EventType.RESTART, attempt=2))])
    publisher.publish([(job_id, JobEvent(EventType.TOKEN, text="again", index=0)),
                       (job_id, JobEvent(EventType.TOKEN, text="second", index=1))])
    events = EventSubscriber(redis_client, service_settings).read_events(job_id)
    assert current_output(events) == {0: "again", 1: "second"}


def test_a_token_event_written_out_is_the_json_the_encoder_writes():
    # the hot path of to_fields writes a plain token event by hand; it must be byte for
    # byte the generic encoding (the SSE `data:` line and what replays decode)
    texts = ["", " word", "quote\" back\\slash", "tab\tnew\nline\r\x00\x1f\x7f", "é中文🙂",
             "\ud800 lone surrogate", "</script>", "\u2028\u2029"]
    events = [JobEvent(EventType.TOKEN, index=index, text=text, token_ids=ids, ts=ts)
              for text in texts for index in (0, 3) for ids in ([], [7], [0, 151643, 12])
              for ts in (None, 1795697813.4658263, 1e-7, 1.0)]
    events += [  # these go the long way: the result must still be the encoder's
        JobEvent(EventType.TOKEN, text="x", token_ids=[1], ts=float("nan")),
        JobEvent(EventType.TOKEN, text="x", token_ids=[True]),
        JobEvent(EventType.TOKEN, text="x", token_ids=[1],
                 logprobs=[{"token": "x", "logprob": -0.5}]),
        JobEvent(EventType.TOKEN, text="x", token_ids=[1], attempt=2, ts=3.5),
    ]
    assert events[0]._plain_token_json() is not None
    assert events[-1]._plain_token_json() is None
    for event in events:
        fields = event.to_fields()
        assert fields == {"type": "token",
                          "data": json.dumps(event._payload(), separators=(",", ":"))}
        assert JobEvent.from_fields(fields).text == event.text


def test_parse_stream_id_rejects_garbage():
    assert parse_stream_id("1700000000000-3") == (1700000000000, 3)
    assert parse_stream_id(b"12-0") == (12, 0)
    with pytest.raises(ValueError, match="not a stream entry id"):
        parse_stream_id("abc")


def test_pipelined_sender_sends_now_and_reads_replies_later(redis_client, service_settings,
                                                            job_id):
    sender = EventPublisher(redis_client, service_settings).sender()
    handles = [sender.send([(job_id, e)]) for e in _tokens(3)]  # no reply read yet
    ids = [sender.receive(h)[0] for h in handles]
    assert [i for i, _ in EventSubscriber(redis_client, service_settings).read_events(job_id)] \
        == ids

    # a dead connection fails the replies it owed; sends are refused until the owner
    # resets the sender (it re-sends what failed first), then a new connection opens
    pending = sender.send([(job_id, _tokens(1, 3)[0])])
    sender.receive(pending)
    sock = pending._sock
    addr = "%s:%d" % sock.getsockname()[:2]
    (client,) = [c for c in redis_client.client_list() if c["addr"] == addr]
    redis_client.client_kill_filter(_id=client["id"])
    with pytest.raises((redis.ConnectionError, OSError)):  # on send or on its reply
        sender.receive(sender.send([(job_id, _tokens(1, 4)[0])]))
    with pytest.raises(SenderBroken):
        sender.send([(job_id, _tokens(1, 5)[0])])
    sender.reset()
    after = sender.receive(sender.send([(job_id, _tokens(1, 5)[0])]))
    stored = [e.token_ids for _, e in
              EventSubscriber(redis_client, service_settings).read_events(job_id)]
    assert stored[-1] == [5] and after
    sender.close()


def test_the_fence_drops_duplicates_stale_attempts_and_events_after_the_end(
        redis_client, service_settings, job_id):
    """Per job: a re-sent event is stored once, an older attempt's events stop once a
    restart announced a newer one, and nothing follows the terminal event."""
    from tasks.streams.publish import EventFence

    publisher = EventPublisher(redis_client, service_settings)
    first = _tokens(2)
    publisher.publish([(job_id, e) for e in first], [EventFence(1, 1), EventFence(1, 2)])
    resent = publisher.publish([(job_id, first[1])], [EventFence(1, 2)])  # a retried send
    assert resent == [None]
    publisher.publish([(job_id, JobEvent(EventType.RESTART, attempt=2))])
    stale = publisher.publish([(job_id, _tokens(1, 2)[0])], [EventFence(1, 3)])
    assert stale == [None]
    publisher.publish([(job_id, _tokens(1, 7)[0]), (job_id, _done())],
                      [EventFence(2, 1), EventFence(2, 0)])
    late = publisher.publish([(job_id, _tokens(1, 8)[0])], [EventFence(2, 2)])
    assert late == [None]
    types = [e.type for _, e in EventSubscriber(redis_client, service_settings)
             .read_events(job_id)]
    assert types == [EventType.TOKEN, EventType.TOKEN, EventType.RESTART, EventType.TOKEN,
                     EventType.DONE]


def _result(job_id: str) -> Any:
    from tasks.models import JobStatus
    from workers.job_rows import JobResult

    return JobResult(job_id=job_id, status=JobStatus.SUCCEEDED, finish_reason="stop",
                     error=None, output=[], output_text="", prompt_tokens=3,
                     completion_tokens=0, cached_tokens=0, event=_done(), attempt=1)


def test_the_batcher_reads_its_replies_and_a_connection_lost_in_flight_loses_nothing(
        redis_client, service_settings):
    """StepPublisher as the batcher drives it: steps whose replies the batcher reads itself
    (before and after each step), a result handed on only once its step is stored, and a
    connection killed with steps in flight: the thread re-sends them, each event is
    stored once, in order, and each result handed on once."""
    from workers.step_publisher import StepPublisher

    jobs = [str(uuid.uuid4()) for _ in range(3)]
    handed: list[tuple[str, int]] = []  # (job id, events stored for it when handed on)
    subscriber = EventSubscriber(redis_client, service_settings)

    def on_published(result: Any) -> None:
        handed.append((result.job_id, len(list(subscriber.read_events(result.job_id)))))

    publisher = StepPublisher(EventPublisher(redis_client, service_settings).sender(),
                              on_published)
    publisher.start()
    attempts = {job: 1 for job in jobs}
    token = 0

    def step(results: list[str] = ()) -> None:
        nonlocal token
        publisher.before_step()
        events = [(job, _tokens(1, token)[0]) for job in jobs if job not in handed_ids()]
        token += 1
        publisher.submit(events + [(job, _done()) for job in results], attempts,
                         [_result(job) for job in results])

    def handed_ids() -> set[str]:
        return {job for job, _ in handed}

    for _ in range(3):
        step()
    step([jobs[0]])
    time.sleep(0.05)
    step()  # reads the reply: job 0's result goes on, after its events
    assert handed == [(jobs[0], 5)]
    assert publisher._in_flight and not publisher.recovering  # the batcher's, not queued

    # kill the publishing connection with a step in flight
    conn = publisher._in_flight[0].handle
    addr = "%s:%d" % conn._sock.getsockname()[:2]
    (client,) = [c for c in redis_client.client_list() if c["addr"] == addr]
    redis_client.client_kill_filter(_id=client["id"])
    time.sleep(0.05)
    step()
    step([jobs[1]])
    step()
    publisher.idle()
    deadline = time.monotonic() + 10
    while len(handed) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    step([jobs[2]])
    publisher.stop()

    assert [job for job, _ in handed] == jobs
    assert publisher.num_failed >= 1
    for job in jobs:
        stored = [e for _, e in subscriber.read_events(job)]
        tokens = [e.token_ids[0] for e in stored if e.type is EventType.TOKEN]
        assert tokens == list(range(len(tokens))), (job, tokens)  # once each, in order
        assert len(tokens) >= 4
        assert [e.type for e in stored][-1] is EventType.DONE
        assert sum(e.type is EventType.DONE for e in stored) == 1
    counts = dict(handed)
    for job in jobs:  # handed on after every event of its job was stored
        assert counts[job] == len(list(subscriber.read_events(job)))


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of the test's own (its memory limit and restarts reach no other
    test), and a client of it."""
    from tasks.redis_client import make_redis
    from tests.fault_helpers import RedisServer

    server = RedisServer(tmp_path, persistent=False)
    client = make_redis(server.url)
    yield server, client
    client.close()
    server.stop()


def test_a_send_redis_refuses_is_not_overtaken_by_the_next_one(private_redis, service_settings):
    """Redis refuses a step (out of memory: an error reply, the connection fine) and runs
    the next one, already on its way: the next is refused too rather than stored ahead of
    the refused one, whose re-send would then be dropped as old. Re-sent in order, every
    token is stored once, in order."""
    from tasks.streams.publish import EventFence

    _, client = private_redis
    sender = EventPublisher(client, service_settings).sender()
    job = str(uuid.uuid4())
    steps = [([(job, token)], [EventFence(1, i + 1)]) for i, token in enumerate(_tokens(4))]
    sender.receive(sender.send(*steps[0], order=1))
    client.config_set("maxmemory", 1)  # every write refused
    refused = sender.send(*steps[1], order=2)
    deadline = time.monotonic() + 5
    while not sender.ready(refused) and time.monotonic() < deadline:
        time.sleep(0.001)  # Redis has answered it (the reply is not read)
    client.config_set("maxmemory", 0)
    behind = sender.send(*steps[2], order=3)
    with pytest.raises(redis.ResponseError, match="OOM"):
        sender.receive(refused)
    with pytest.raises(redis.RedisError):  # refused, its reply never read
        sender.receive(behind)
    subscriber = EventSubscriber(client, service_settings)
    assert [e.token_ids for _, e in subscriber.read_events(job)] == [[0]]
    sender.reset()
    with pytest.raises(redis.ResponseError, match="OUTOFORDER"):  # a new connection
        sender.receive(sender.send(*steps[3], order=4))

    sender.reset()  # the owner re-sends from the first refused one, in order
    for order, step in enumerate(steps[1:], start=2):
        sender.receive(sender.send(*step, order=order))
    assert [e.token_ids for _, e in subscriber.read_events(job)] == [[0], [1], [2], [3]]
    sender.close()


def test_steps_published_while_redis_is_out_of_memory_lose_nothing(private_redis,
                                                                   service_settings):
    """StepPublisher as the batcher drives it, steps following each other while Redis
    refuses every write for a while (maxmemory): the refused steps and those behind them
    wait and are re-sent in order once Redis takes writes again; every token is stored
    once, in order, and each result is handed on once, after its job's events."""
    from workers.step_publisher import StepPublisher

    _, client = private_redis
    subscriber = EventSubscriber(client, service_settings)
    jobs = [str(uuid.uuid4()) for _ in range(2)]
    handed: list[tuple[str, int]] = []
    publisher = StepPublisher(
        EventPublisher(client, service_settings).sender(),
        lambda result: handed.append(
            (result.job_id, len(list(subscriber.read_events(result.job_id))))))
    publisher.start()
    attempts = {job: 1 for job in jobs}

    def step(token: int, ended: str | None = None) -> None:
        publisher.before_step()
        events = [(job, _tokens(1, token)[0]) for job in jobs
                  if job not in {done for done, _ in handed}]
        publisher.submit(events + ([(ended, _done())] if ended else []), attempts,
                         [_result(ended)] if ended else [])
        time.sleep(0.0005)  # a short step: replies are often still on their way

    for token in range(20):
        step(token)
    client.config_set("maxmemory", 1)
    for token in range(20, 40):
        step(token, jobs[0] if token == 39 else None)
    assert publisher.recovering and not handed
    client.config_set("maxmemory", 0)
    for token in range(40, 60):
        step(token)
    step(60, jobs[1])
    publisher.idle()
    publisher.stop()

    assert [job for job, _ in handed] == jobs
    assert publisher.num_failed >= 1
    for job, last in zip(jobs, (39, 60), strict=True):
        stored = [e for _, e in subscriber.read_events(job)]
        assert [e.token_ids[0] for e in stored if e.type is EventType.TOKEN] \
            == list(range(last + 1))
        assert [e.type for e in stored][-1] is EventType.DONE
    assert dict(handed) == {job: len(list(subscriber.read_events(job))) for job in jobs}


def test_steps_in_flight_while_redis_refuses_writes_now_and_then_lose_nothing(
        private_redis, service_settings):
    """Steps sent back to back, their replies read as the batcher reads them, while another
    client turns Redis's memory limit on and off: a step refused while the next is on its
    way must not leave a hole (the next stored ahead of it, its re-send then dropped)."""
    from tasks.redis_client import make_redis
    from workers.step_publisher import StepPublisher

    server, client = private_redis
    flipping = make_redis(server.url)
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            flipping.config_set("maxmemory", 1)
            flipping.config_set("maxmemory", 0)

    flipper = threading.Thread(target=flip, daemon=True)
    jobs = [str(uuid.uuid4()) for _ in range(3)]
    publisher = StepPublisher(EventPublisher(client, service_settings).sender(),
                              lambda result: None)
    publisher.start()
    flipper.start()
    try:
        for token in range(2000):
            publisher.before_step()
            publisher.submit([(job, _tokens(1, token)[0]) for job in jobs],
                             {job: 1 for job in jobs}, [])
    finally:
        stop.set()
        flipper.join(10)
        flipping.close()
    publisher.idle()
    publisher.stop()
    assert publisher.num_failed >= 1  # some steps were refused
    subscriber = EventSubscriber(client, service_settings)
    for job in jobs:
        assert [e.token_ids[0] for _, e in subscriber.read_events(job)] == list(range(2000))


def test_an_ordered_sender_goes_on_after_redis_restarts_empty(private_redis, service_settings):
    """Redis restarted without its data (its order key gone with the streams): the sender's
    next send on a new connection is stored, not refused as out of order."""
    from tasks.streams.publish import EventFence

    server, client = private_redis
    sender = EventPublisher(client, service_settings).sender()
    job = str(uuid.uuid4())
    tokens = _tokens(5)
    for order in (1, 2, 3):
        sender.receive(sender.send([(job, tokens[order - 1])], [EventFence(1, order)],
                                   order=order))
    server.restart()
    with pytest.raises((redis.ConnectionError, OSError)):
        sender.receive(sender.send([(job, tokens[3])], [EventFence(1, 4)], order=4))
    sender.reset()
    for order in (4, 5):
        sender.receive(sender.send([(job, tokens[order - 1])], [EventFence(1, order)],
                                   order=order))
    stored = [e.token_ids for _, e in EventSubscriber(client, service_settings)
              .read_events(job)]
    assert stored == [[3], [4]]  # what Redis had before is gone; nothing is refused
    sender.close()


def test_a_job_whose_keys_hold_something_else_does_not_stop_the_others(
        redis_client, service_settings):
    """A job's stream or fence key holding another type fails no step: it is replaced, and
    the other jobs of the same publish are stored."""
    from tasks.streams.publish import EventFence, fence_key

    publisher = EventPublisher(redis_client, service_settings)
    broken_stream, fine, broken_fence = (str(uuid.uuid4()) for _ in range(3))
    redis_client.set(events_key(service_settings, broken_stream), "not a stream")
    redis_client.set(fence_key(service_settings, broken_fence), "not a hash")
    jobs = [broken_stream, fine, broken_fence]
    token = _tokens(1)[0]
    ids = publisher.publish([(job, token) for job in jobs], [EventFence(1, 1)] * 3)
    assert all(ids)
    subscriber = EventSubscriber(redis_client, service_settings)
    for job in jobs:
        assert [e.token_ids for _, e in subscriber.read_events(job)] == [[0]]
    # the fence works on: a re-sent event is dropped, the next one stored
    assert publisher.publish([(broken_fence, token)], [EventFence(1, 1)]) == [None]
    assert publisher.publish([(broken_fence, _tokens(1, 1)[0])], [EventFence(1, 2)])[0]


def test_the_step_publisher_goes_on_after_redis_comes_back_from_an_older_snapshot(
        private_redis, service_settings):
    """Redis restarted from a snapshot older than its last acknowledged steps (its order
    key behind the publisher's): the publisher re-sends and goes on, rather than having
    every later step refused as out of order."""
    from workers.step_publisher import StepPublisher

    server, client = private_redis
    job = str(uuid.uuid4())
    publisher = StepPublisher(EventPublisher(client, service_settings).sender(),
                              lambda result: None)
    publisher.start()

    def step(token: int) -> None:
        publisher.before_step()
        publisher.submit([(job, _tokens(1, token)[0])], {job: 1}, [])
        publisher.idle()  # every reply read: each step is acknowledged

    for token in range(3):
        step(token)
    client.save()  # the snapshot the restart comes back from
    for token in range(3, 6):
        step(token)
    server.restart()  # steps 3-5 are lost with it
    for token in range(6, 9):
        step(token)
    deadline = time.monotonic() + 15
    while publisher.recovering and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not publisher.recovering
    step(9)
    publisher.stop()
    stored = [e.token_ids[0] for _, e in EventSubscriber(client, service_settings)
              .read_events(job)]
    assert stored == [0, 1, 2, 6, 7, 8, 9]
