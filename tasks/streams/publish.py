"""Writing job event streams: every event of a batcher step in one round trip.

Each event is appended to the job's Redis Stream (`events_key`) and published on its live
channel (`live_channel`) with the entry id the server assigned; tasks/streams/reader.py reads
them back.
"""

from __future__ import annotations

import threading
from typing import Any

import redis
from redis import Redis

from tasks.protocol import JobEvent, events_key, live_channel
from tasks.redis_client import as_text, dedicated_connection
from tasks.settings import Settings

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
        return [as_text(entry_id) for entry_id in entry_ids]

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
                conn = dedicated_connection(self._publisher._redis)
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
        return [as_text(entry_id) for entry_id in reply]

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._drop(self._conn)

    def _drop(self, conn: Any) -> None:
        """Caller holds _lock. Replies still owed on `conn` are lost: it is closed."""
        if self._conn is conn:
            self._conn = None
        conn.disconnect()
