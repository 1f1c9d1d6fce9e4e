"""Reading job event streams: replay + live without loss.

Every event goes to the job's Redis Stream (`events_key`, the durable log whose entry ids
are the SSE event ids) and to its live pub/sub channel (`live_channel`); see
tasks/streams/publish.py for the writing side. A subscriber SUBSCRIBEs first, then replays
the stream after its last id, then takes live messages, skipping ids it has already
yielded: an event published during the replay arrives on both paths and is yielded once;
none is lost in between.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis
from redis import Redis

from tasks.protocol import EventType, JobEvent, events_key, live_channel
from tasks.redis_client import as_text
from tasks.settings import Settings
from tasks.streams.live_hub import (
    GAP,
    SINK_ENDED,
    SINK_FELL_SHORT,
    SINK_FELL_SHORT_AT_END,
    Listener,
    LiveHub,
    Sink,
)

StreamId = tuple[int, int]  # (milliseconds, sequence) of a stream entry id
_START: StreamId = (0, 0)  # before every entry


# Without a heartbeat the subscriber still re-reads the stream when idle this long: it
# closes any gap a dropped pub/sub connection may have left.
_IDLE_CATCH_UP_SECONDS = 5.0
_SUBSCRIBE_TIMEOUT_SECONDS = 5.0


def parse_stream_id(entry_id: str | bytes) -> StreamId:
    """`"1700000000000-3"` -> `(1700000000000, 3)`; raises ValueError on anything else."""
    text = as_text(entry_id)
    ms, sep, seq = text.partition("-")
    if not ms.isdigit() or (sep and not seq.isdigit()):
        raise ValueError(f"not a stream entry id: {text!r} (expected <ms>-<seq>)")
    return int(ms), int(seq or 0)


@dataclass(slots=True, frozen=True)
class StreamEntry:
    """One event as stored: its stream entry id, type and JSON payload (unparsed)."""

    entry_id: str
    type: EventType
    data: str  # JobEvent.to_fields()["data"]

    def event(self) -> JobEvent:
        return JobEvent.from_fields({"type": self.type.value, "data": self.data})


@dataclass(slots=True, frozen=True)
class Park:
    """Yielded by a cooperative reader instead of blocking: nothing to do until the
    listener's queue gets an item (its `wake` is called) or `deadline` passes (a
    `time.monotonic()` instant). Resume the generator then; resuming early is harmless."""

    listener: Listener
    deadline: float


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

    def num_listening(self) -> int:
        """Readers of live events in this process: one per open event stream."""
        return self._hub.num_listeners()

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
        cooperative: bool = False,
    ) -> Iterator[tuple[str, JobEvent] | Park | None]:
        """`iter_entries`, parsed: `(entry_id, event)`, `None` (heartbeat tick) or `Park`."""
        for entry in self.iter_entries(job_id, last_id, heartbeat_seconds,
                                       cooperative=cooperative):
            if entry is None or isinstance(entry, Park):
                yield entry
            else:
                yield entry.entry_id, entry.event()

    def iter_entries(
        self,
        job_id: str,
        last_id: str | None = None,
        heartbeat_seconds: float | None = None,
        sink: Sink | None = None,
        cooperative: bool = False,
    ) -> Iterator[StreamEntry | Park | None]:
        """Yield the entries after `last_id` until (and including) a terminal one.

        Yields `None` as a heartbeat tick whenever nothing arrived for `heartbeat_seconds`
        (the SSE view turns it into a comment that keeps proxies from closing the stream).
        With a `sink`, live events after the replay are written to it by the hub instead
        of being yielded, whenever nothing else is pending (see tasks/streams/live_hub.py); the
        generator then ends when the sink got the terminal event. Close the generator to
        stop listening early.

        `cooperative`: never wait for live events in the generator; yield a `Park` instead
        and expect to be resumed (one thread can then drive thousands of streams).
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
                        if cooperative:
                            item = listener.queue.get_nowait()
                        else:
                            item = listener.queue.get(timeout=remaining)
                    except queue.Empty:
                        if cooperative:
                            yield Park(listener, time.monotonic() + remaining)
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
    decoded = {as_text(k): as_text(v) for k, v in fields.items()}
    return StreamEntry(as_text(entry_id), EventType(decoded["type"]), decoded.get("data") or "{}")


def _format_id(entry: StreamId) -> str | None:
    return None if entry == _START else f"{entry[0]}-{entry[1]}"


def _parse_live(data: bytes | str) -> StreamEntry:
    entry_id, event_type, payload = as_text(data).split(" ", 2)
    return StreamEntry(entry_id, EventType(event_type), payload)

