"""Job event streams: append + publish in one round trip, replay + live without loss.

Every event goes to the job's Redis Stream (`events_key`, the durable log whose entry ids
are the SSE event ids) and to its live pub/sub channel (`live_channel`). A subscriber
SUBSCRIBEs first, then replays the stream after its last id, then takes live messages,
skipping ids it has already yielded: an event published during the replay arrives on
both paths and is yielded once; none is lost in between.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis
from redis import Redis

from tasks.live_hub import (
    GAP,
    SINK_ENDED,
    SINK_FELL_SHORT,
    SINK_FELL_SHORT_AT_END,
    LiveHub,
    Sink,
)
from tasks.protocol import EventType, JobEvent, events_key, live_channel
from tasks.settings import Settings

logger = logging.getLogger(__name__)

StreamId = tuple[int, int]  # (milliseconds, sequence) of a stream entry id
_START: StreamId = (0, 0)  # before every entry

# For each event: XADD it, PUBLISH "<entry id> <type> <json data>" on the live channel,
# and on a terminal event start the stream's expiry. One script call for ALL the events
# of a publish, so the published message carries the id the server assigned and a whole
# batcher step is one round trip.
# KEYS[i]: the i-th event's stream. ARGV[1]: the events as records separated by \x1e, each
# "channel \x1f type \x1f data \x1f ttl seconds" (0: leave the stream as is).
# NOTE: packed into one argument because packing hundreds of arguments costs the worker
# more Python time than the script costs Redis. The separators cannot occur in a record:
# `data` is json.dumps output (control characters escaped), the rest are names we make.
_RECORD_SEP, _UNIT_SEP = "\x1e", "\x1f"
_PUBLISH_LUA = """
local packed = ARGV[1]
local ids = {}
local pos, i = 1, 0
while pos <= #packed do
  local stop = string.find(packed, '\\30', pos, true) or (#packed + 1)
  local rec = string.sub(packed, pos, stop - 1)
  pos = stop + 1
  i = i + 1
  local a = string.find(rec, '\\31', 1, true)
  local b = string.find(rec, '\\31', a + 1, true)
  local c = string.find(rec, '\\31', b + 1, true)
  local channel = string.sub(rec, 1, a - 1)
  local typ = string.sub(rec, a + 1, b - 1)
  local data = string.sub(rec, b + 1, c - 1)
  local ttl = tonumber(string.sub(rec, c + 1))
  local id = redis.call('XADD', KEYS[i], '*', 'type', typ, 'data', data)
  redis.call('PUBLISH', channel, id .. ' ' .. typ .. ' ' .. data)
  if ttl > 0 then redis.call('EXPIRE', KEYS[i], ttl) end
  ids[i] = id
end
return ids
"""

# Without a heartbeat the subscriber still re-reads the stream when idle this long: it
# closes any gap a dropped pub/sub connection may have left.
_IDLE_CATCH_UP_SECONDS = 5.0
_SUBSCRIBE_TIMEOUT_SECONDS = 5.0


def parse_stream_id(entry_id: str | bytes) -> StreamId:
    """`"1700000000000-3"` -> `(1700000000000, 3)`; raises ValueError on anything else."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, sep, seq = text.partition("-")
    if not ms.isdigit() or (sep and not seq.isdigit()):
        raise ValueError(f"not a stream entry id: {text!r} (expected <ms>-<seq>)")
    return int(ms), int(seq or 0)


class EventPublisher:
    """Appends job events to their streams and pushes them live."""

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self._redis = redis
        self._settings = settings
        self._script = redis.register_script(_PUBLISH_LUA)

    def publish(self, events: list[tuple[str, JobEvent]]) -> list[str]:
        """Publish `(job_id, event)` pairs in one round trip; returns their stream entry ids.

        Events of one job keep their order. A terminal event sets the stream's TTL to
        `settings.stream_ttl_seconds`.
        """
        if not events:
            return []
        keys, packed = self._encode(events)
        entry_ids = self._script(keys=keys, args=[packed])
        return [_text(entry_id) for entry_id in entry_ids]

    def sender(self) -> PipelinedSender:
        """A sender on its own connection, for a thread that must not wait for replies."""
        return PipelinedSender(self)

    def _encode(self, events: list[tuple[str, JobEvent]]) -> tuple[list[str], str]:
        keys: list[str] = []
        records: list[str] = []
        for job_id, event in events:
            fields = event.to_fields()
            ttl = self._settings.stream_ttl_seconds if event.type.is_terminal else 0
            keys.append(events_key(self._settings, job_id))
            records.append(_UNIT_SEP.join(
                (live_channel(self._settings, job_id), fields["type"], fields["data"], str(ttl))
            ))
        return keys, _RECORD_SEP.join(records)


class PipelinedSender:
    """`send` publishes from the calling thread without waiting; `receive` (another
    thread, in send order) reads each reply.

    The batcher sends a step's events the moment the step ends, so they leave without
    waiting for a publisher thread to get the GIL; the thread that reads the replies
    then hands the step's results on. One connection, pipelined: replies come in order.
    """

    def __init__(self, publisher: EventPublisher) -> None:
        pool = publisher._redis.connection_pool
        # NOTE: no client-side health check: it would read a PING reply in the sending
        # thread, out of turn with the replies the receiving thread reads.
        self._connection_kwargs = {**pool.connection_kwargs, "health_check_interval": 0}
        self._connection_class = pool.connection_class
        self._publisher = publisher
        self._lock = threading.Lock()
        self._conn: Any = None

    def send(self, events: list[tuple[str, JobEvent]]) -> Any:
        """Send one EVAL for `events`; returns the handle `receive` takes. Raises on a
        broken connection (the next send opens a new one)."""
        keys, packed = self._publisher._encode(events)
        with self._lock:
            conn = self._conn
            if conn is None:
                conn = self._connection_class(**self._connection_kwargs)
                self._conn = conn
            try:
                # NOTE: EVAL, not EVALSHA: no NOSCRIPT retry is possible once the reply is
                # another thread's to read, and Redis caches the compiled script anyway.
                conn.send_command("EVAL", _PUBLISH_LUA, len(keys), *keys, packed)
            except BaseException:
                self._drop(conn)
                raise
        return conn

    def receive(self, handle: Any) -> list[str]:
        """The entry ids of the send that returned `handle`; raises if it failed."""
        try:
            reply = handle.read_response()
        except redis.ResponseError:
            raise  # the script failed; the connection is fine
        except BaseException:
            with self._lock:
                self._drop(handle)
            raise
        return [_text(entry_id) for entry_id in reply]

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._drop(self._conn)

    def _drop(self, conn: Any) -> None:
        """Caller holds _lock. Replies still owed on `conn` are lost: it is closed."""
        if self._conn is conn:
            self._conn = None
        conn.disconnect()


@dataclass(slots=True, frozen=True)
class StreamEntry:
    """One event as stored: its stream entry id, type and JSON payload (unparsed)."""

    entry_id: str
    type: EventType
    data: str  # JobEvent.to_fields()["data"]

    def event(self) -> JobEvent:
        return JobEvent.from_fields({"type": self.type.value, "data": self.data})


class EventSubscriber:
    """Reads a job's events: the stored log, or the log followed by live events.

    Live events come through one `LiveHub` per process (one pub/sub connection for every
    stream the process serves); `close()` stops it.
    """

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self._redis = redis
        self._settings = settings
        self._hub = LiveHub(redis)

    def close(self) -> None:
        self._hub.close()

    def read_entries(self, job_id: str, after_id: str | None = None) -> list[StreamEntry]:
        """The job's stored events after `after_id` (all when None), oldest first."""
        start = "-" if after_id is None else "(" + after_id
        entries: list[Any] = self._redis.xrange(  # type: ignore[assignment]
            events_key(self._settings, job_id), min=start, max="+")
        return [_stored_entry(entry_id, fields) for entry_id, fields in entries]

    def read_events(self, job_id: str, after_id: str | None = None) -> list[tuple[str, JobEvent]]:
        """`read_entries`, parsed."""
        return [(entry.entry_id, entry.event()) for entry in self.read_entries(job_id, after_id)]

    def iter_events(
        self,
        job_id: str,
        last_id: str | None = None,
        heartbeat_seconds: float | None = None,
    ) -> Iterator[tuple[str, JobEvent] | None]:
        """`iter_entries`, parsed: `(entry_id, event)` or `None` (heartbeat tick)."""
        for entry in self.iter_entries(job_id, last_id, heartbeat_seconds):
            yield None if entry is None else (entry.entry_id, entry.event())

    def iter_entries(
        self,
        job_id: str,
        last_id: str | None = None,
        heartbeat_seconds: float | None = None,
        sink: Sink | None = None,
    ) -> Iterator[StreamEntry | None]:
        """Yield the entries after `last_id` until (and including) a terminal one.

        Yields `None` as a heartbeat tick whenever nothing arrived for `heartbeat_seconds`
        (the SSE view turns it into a comment that keeps proxies from closing the stream).
        With a `sink`, live events after the replay are written to it by the hub instead
        of being yielded, whenever nothing else is pending (see tasks/live_hub.py); the
        generator then ends when the sink got the terminal event. Close the generator to
        stop listening early.
        """
        last = parse_stream_id(last_id) if last_id else _START
        idle_limit = heartbeat_seconds if heartbeat_seconds else _IDLE_CATCH_UP_SECONDS
        listener = self._hub.listen(live_channel(self._settings, job_id))
        try:
            while True:
                # NOTE: subscribed first, so nothing published from now on is missed by
                # the replay below (which runs on another connection).
                if not listener.subscribed.wait(_SUBSCRIBE_TIMEOUT_SECONDS):
                    raise redis.TimeoutError(
                        f"Redis did not confirm the live subscription of job {job_id} in "
                        f"{_SUBSCRIBE_TIMEOUT_SECONDS:.0f}s")
                # replay (first pass) or catch up (after idling or a gap): the stream is
                # the truth
                for entry in self.read_entries(job_id, _format_id(last)):
                    last = parse_stream_id(entry.entry_id)
                    yield entry
                    if entry.type.is_terminal:
                        return
                idle_since, delivered = time.monotonic(), last
                while True:
                    if sink is not None and listener.sink is None:
                        listener.start_direct(sink, last)
                    remaining = idle_limit - (time.monotonic() - idle_since)
                    if remaining <= 0:
                        if listener.last > delivered:  # the hub delivered meanwhile
                            idle_since, delivered = time.monotonic(), listener.last
                            continue
                        last = max(last, listener.stop_direct())
                        if heartbeat_seconds:
                            yield None
                        break
                    try:
                        item = listener.queue.get(timeout=remaining)
                    except queue.Empty:
                        continue
                    if item is SINK_ENDED:
                        return
                    if item is SINK_FELL_SHORT or item is SINK_FELL_SHORT_AT_END:
                        last = max(last, listener.stop_direct())
                        assert sink is not None  # only a sink falls short
                        if not sink.flush() or item is SINK_FELL_SHORT_AT_END:
                            return  # the client is gone, or it has the terminal event
                        idle_since = time.monotonic()
                        continue
                    if item is GAP:
                        last = max(last, listener.stop_direct())
                        listener.take_gap()
                        break
                    entry = _parse_live(item)
                    entry_key = parse_stream_id(entry.entry_id)
                    if entry_key <= last:
                        continue  # already yielded by the replay
                    last, idle_since = entry_key, time.monotonic()
                    yield entry
                    if entry.type.is_terminal:
                        return
        finally:
            listener.stop_direct()  # no write may follow the end of the response
            self._hub.leave(listener)


def current_output(events: list[tuple[str, JobEvent]]) -> dict[int, str]:
    """Text so far per sample index: token deltas after the last `restart` event."""
    texts: dict[int, list[str]] = {}
    for _entry_id, event in events:
        if event.type is EventType.RESTART:
            texts.clear()
        elif event.type is EventType.TOKEN:
            texts.setdefault(event.index, []).append(event.text)
    return {index: "".join(parts) for index, parts in sorted(texts.items())}


def _stored_entry(entry_id: str | bytes, fields: dict[Any, Any]) -> StreamEntry:
    decoded = {_text(k): _text(v) for k, v in fields.items()}
    return StreamEntry(_text(entry_id), EventType(decoded["type"]), decoded.get("data") or "{}")


def _format_id(entry: StreamId) -> str | None:
    return None if entry == _START else f"{entry[0]}-{entry[1]}"


def _parse_live(data: bytes | str) -> StreamEntry:
    entry_id, event_type, payload = _text(data).split(" ", 2)
    return StreamEntry(entry_id, EventType(event_type), payload)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
