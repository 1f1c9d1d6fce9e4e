"""Writing job event streams: every event of a batcher step in one round trip.

Each event is appended to the job's Redis Stream (`events_key`) and published on its live
channel (`live_channel`) with the entry id the server assigned; tasks/streams/reader.py reads
them back.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from redis import Redis

from tasks.protocol import EventType, JobEvent, events_key, live_channel
from tasks.redis_client import as_text, dedicated_connection
from tasks.settings import Settings

# For each event: XADD it, PUBLISH "<entry id> <type> <json data>" on the live channel,
# and on a terminal event start the stream's expiry. One script call for ALL the events
# of a publish, so the published message carries the id the server assigned and a whole
# batcher step is one round trip.
#
# FENCING. Each job has a fence hash next to its stream: `a` the newest attempt seen, `s`
# the last sequence number stored for it, `t` set once a terminal event is stored. An
# event is dropped (its reply is nil) when
#   * the job already has its terminal event (nothing ever follows `done`),
#   * it belongs to an older attempt than one already seen (a restart event announces the
#     new attempt: a worker that lost its lease during a Postgres outage cannot append
#     its stale tokens after beat's `restart`),
#   * its sequence number is not above the last one stored (a send retried after an
#     outage, whose first try may have been stored, is stored once).
# Attempt 0 and sequence 0 mean "not fenced" (maintenance, hand-written events).
#
# ORDER. A pipelined sender has several sends on its way, and Redis may refuse one (out
# of memory, a failed disk write: a ResponseError, the connection fine) and run the next:
# its events would be stored ahead of the refused ones, whose re-send the sequence
# numbers then drop as old: tokens lost. So each send of a pipelined sender names the
# sender's order key and its place in the sender's order; a send is refused
# ("OUTOFORDER") while the one before it is not stored, and stores nothing. An order key
# that is gone (expired, Redis restarted empty) refuses nothing. A send made once every
# earlier one is known to be stored (a re-send, one at a time) is never refused: a key
# behind it means Redis lost what it had acknowledged (restored from an older snapshot),
# and the order goes on from that send.
#
# KEYS HOLDING SOMETHING ELSE. A job's stream or fence key that holds another type
# (written by hand, or by something else sharing the prefix) would fail every step that
# carries one of that job's events, and with it every other job of the step, on every
# re-send: one job's key would stop its whole device group, then the groups its jobs
# move to. Such a key is not ours: it is deleted and written anew.
#
# KEYS[i]: the i-th event's stream, KEYS[n + i] its fence. ARGV[1]: the events as
# records separated by \x1e, each "channel \x1f type \x1f data \x1f ttl \x1f attempt
# \x1f seq" (ttl 0: leave the stream as is). ARGV[2]: the fence's TTL in seconds.
# ARGV[3]: the sender's order key ('': not ordered), ARGV[4]: this send's place in it
# (1, 2, ...), ARGV[5]: the order key's TTL in seconds, ARGV[6]: '1' when every earlier
# send is stored (never refused).
# NOTE: packed into one argument because packing hundreds of arguments costs the worker
# more Python time than the script costs Redis. The separators cannot occur in a record:
# `data` is json.dumps output (control characters escaped), the rest are names we make.
_RECORD_SEP, _UNIT_SEP = "\x1e", "\x1f"
# jobs whose key names an EventPublisher keeps (a step names a few hundred at most)
_MAX_CACHED_JOBS = 4096
# an order key outlives a sender that publishes at least this often (each send renews it)
ORDER_TTL_SECONDS = 86_400
_PUBLISH_LUA = """
local packed = ARGV[1]
local fence_ttl = tonumber(ARGV[2])
local order_key = ARGV[3] or ''
local place = tonumber(ARGV[4]) or 0
local last_placed = nil
if order_key ~= '' then
  last_placed = tonumber(redis.call('GET', order_key) or '')
  if last_placed and place > last_placed + 1 and ARGV[6] ~= '1' then
    return redis.error_reply('OUTOFORDER send ' .. place .. ' follows send ' ..
                             last_placed .. ': one between them is not stored')
  end
end
local n = #KEYS / 2
local fences = {}
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
  local d = string.find(rec, '\\31', c + 1, true)
  local e = string.find(rec, '\\31', d + 1, true)
  local channel = string.sub(rec, 1, a - 1)
  local typ = string.sub(rec, a + 1, b - 1)
  local data = string.sub(rec, b + 1, c - 1)
  local ttl = tonumber(string.sub(rec, c + 1, d - 1))
  local attempt = tonumber(string.sub(rec, d + 1, e - 1))
  local seq = tonumber(string.sub(rec, e + 1))
  local fkey = KEYS[n + i]
  local f = fences[fkey]
  if not f then
    local v = redis.pcall('HMGET', fkey, 'a', 's', 't')
    if v.err then  -- not a hash: not ours (see KEYS HOLDING SOMETHING ELSE)
      redis.call('DEL', fkey)
      v = {}
    end
    f = {a = tonumber(v[1]) or 0, s = tonumber(v[2]) or 0, t = tonumber(v[3]) or 0,
         new = not v[1], dirty = false}
    fences[fkey] = f
  end
  local ok = f.t == 0
  if ok and attempt > 0 then
    if attempt < f.a then ok = false
    elseif attempt > f.a then f.a = attempt; f.s = 0; f.dirty = true end
  end
  if ok and seq > 0 then
    if seq <= f.s then ok = false else f.s = seq; f.dirty = true end
  end
  if ok then
    if typ == 'restart' then f.s = 0; f.dirty = true end
    local id = redis.pcall('XADD', KEYS[i], '*', 'type', typ, 'data', data)
    if type(id) == 'table' and id.err then
      if not string.find(id.err, 'WRONGTYPE', 1, true) then
        return redis.error_reply(id.err)  -- out of memory, a failed disk write: refused
      end
      redis.call('DEL', KEYS[i])  -- not a stream: not ours
      id = redis.call('XADD', KEYS[i], '*', 'type', typ, 'data', data)
    end
    redis.call('PUBLISH', channel, id .. ' ' .. typ .. ' ' .. data)
    if ttl > 0 then
      redis.call('EXPIRE', KEYS[i], ttl)
      f.t = 1; f.dirty = true; f.ttl = ttl
    end
    ids[i] = id
  else
    ids[i] = false
  end
end
for fkey, f in pairs(fences) do
  if f.dirty then
    redis.call('HSET', fkey, 'a', f.a, 's', f.s, 't', f.t)
    if f.new or f.ttl then redis.call('EXPIRE', fkey, f.ttl or fence_ttl) end
  end
end
if order_key ~= '' and place > (last_placed or 0) then
  redis.call('SET', order_key, place, 'EX', tonumber(ARGV[5]))
end
return ids
"""


def fence_key(settings: Settings, job_id: str) -> str:
    """The hash fencing a job's stream (see above); it expires with the stream."""
    return settings.key("job", job_id, "fence")


@dataclass(slots=True)
class EventFence:
    """Which attempt of a job an event belongs to and its place in that attempt."""

    attempt: int  # jobs.attempts of the claim that produced it; 0: not fenced
    seq: int  # 1, 2, ... per job and attempt, in publish order; 0: not deduplicated


class EventPublisher:
    """Appends job events to their streams and pushes them live."""

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self._redis = redis
        self._settings = settings
        self._script = redis.register_script(_PUBLISH_LUA)
        # job id -> (events key, fence key, live channel): a step names the same jobs as
        # the last one. A cache only: cleared when it grows past _MAX_CACHED_JOBS.
        self._job_keys: dict[str, tuple[str, str, str]] = {}

    def publish(self, events: list[tuple[str, JobEvent]],
                fences: list[EventFence] | None = None) -> list[str | None]:
        """Publish `(job_id, event)` pairs in one round trip; returns their stream entry ids
        (None for an event the job's fence dropped).

        Events of one job keep their order. A terminal event sets the stream's TTL to
        `settings.stream_ttl_seconds`. `fences[i]` fences `events[i]` (see above).
        """
        if not events:
            return []
        keys, packed = self._encode(events, fences)
        entry_ids = self._script(keys=keys, args=[packed, self._settings.stream_ttl_seconds,
                                                  "", 0, 0, 0])
        return _entry_ids(entry_ids)

    def sender(self) -> PipelinedSender:
        """A sender on its own connection, for a thread that must not wait for replies."""
        return PipelinedSender(self)

    def _encode(self, events: list[tuple[str, JobEvent]],
                fences: list[EventFence] | None = None) -> tuple[list[str], str]:
        settings = self._settings
        job_keys = self._job_keys
        if len(job_keys) > _MAX_CACHED_JOBS:
            job_keys.clear()
        keys: list[str] = []
        fence_keys: list[str] = []
        records: list[str] = []
        for i, (job_id, event) in enumerate(events):
            named = job_keys.get(job_id)
            if named is None:
                named = job_keys[job_id] = (events_key(settings, job_id),
                                            fence_key(settings, job_id),
                                            live_channel(settings, job_id))
            fields = event.to_fields()
            ttl = settings.stream_ttl_seconds if event.type.is_terminal else 0
            attempt, seq = (fences[i].attempt, fences[i].seq) if fences is not None else (0, 0)
            if event.type is EventType.RESTART and event.attempt:
                attempt = event.attempt  # announces the attempt that follows
            keys.append(named[0])
            fence_keys.append(named[1])
            records.append(_UNIT_SEP.join(
                (named[2], fields["type"], fields["data"], str(ttl), str(attempt), str(seq))
            ))
        return keys + fence_keys, _RECORD_SEP.join(records)


class PipelinedSender:
    """`send` publishes from the calling thread without waiting; `receive` (later, in
    send order, from the same or another thread) reads each reply; `ready` says whether
    it is there.

    The batcher sends a step's events the moment the step ends, so they leave without
    waiting for a publisher thread to get the GIL; whoever reads a step's reply (the
    batcher between steps, or the step publisher's thread: workers/step_publisher.py)
    then hands the step's results on. One connection, pipelined: replies come in order.

    NOTE (order across a failure): once a send or a reply fails, the sender is BROKEN and
    every `send` raises `SenderBroken` until `reset()`. Sends already on the dead
    connection fail on `receive`; without the latch a send made between the failure and
    the owner noticing it would go out on a new connection ahead of the ones the owner
    must re-send. The owner re-sends in order, then resets. A reply that is an error (the
    script refused: out of memory, a failed disk write) fails the connection too: the
    replies after it belong to sends the owner re-sends, and a re-send on the same
    connection would read one of theirs. Sends given an `order` are refused by Redis while
    an earlier one is not stored (the script's ORDER note), so none is stored ahead of a
    refused one.
    """

    def __init__(self, publisher: EventPublisher) -> None:
        self._publisher = publisher
        self._lock = threading.Lock()
        self._conn: Any = None
        self._broken = False
        self._order_key = publisher._settings.key("publisher", uuid.uuid4().hex, "order")

    def reset(self) -> None:
        """Allow sends again (the owner re-sends what failed, in order, from here)."""
        with self._lock:
            self._broken = False

    def send(self, events: list[tuple[str, JobEvent]],
             fences: list[EventFence] | None = None, order: int = 0,
             earlier_stored: bool = False) -> Any:
        """Send one EVAL for `events`; returns the handle `receive` takes. `order`: this
        send's place in the owner's order (1, 2, ...; a re-send keeps its place), which
        Redis keeps (0: none); `earlier_stored`: the owner read every earlier send's reply
        (a re-send one at a time), so Redis does not refuse it whatever order it has kept.
        Raises on a broken connection (the next send opens a new one)."""
        keys, packed = self._publisher._encode(events, fences)
        fence_ttl = self._publisher._settings.stream_ttl_seconds
        order_key = self._order_key if order > 0 else ""
        with self._lock:
            if self._broken:
                raise SenderBroken("an earlier publish failed; the owner re-sends first")
            conn = self._conn
            try:
                if conn is None:
                    conn = dedicated_connection(self._publisher._redis)
                    self._conn = conn
                    if order > 0:
                        # the order key is there before a send can be refused (a key
                        # that is gone refuses nothing); where Redis lost it (restarted
                        # empty), the order goes on from this send
                        conn.send_command("SET", self._order_key, order - 1, "NX", "EX",
                                          ORDER_TTL_SECONDS)
                        conn.read_response()
                # NOTE: EVAL, not EVALSHA: no NOSCRIPT retry is possible once the reply is
                # another thread's to read, and Redis caches the compiled script anyway.
                conn.send_command("EVAL", _PUBLISH_LUA, len(keys), *keys, packed, fence_ttl,
                                  order_key, order, ORDER_TTL_SECONDS, int(earlier_stored))
            except BaseException:
                if conn is not None:
                    self._drop(conn)
                raise
        return conn

    def ready(self, handle: Any, timeout: float = 0.0) -> bool:
        """Whether the reply of the send that returned `handle` can be read without
        waiting, now or within `timeout` seconds; raises if its connection is gone."""
        # NOTE: a closed redis-py connection reconnects in `can_read`, and a reply owed
        # on the old one would then never come: a dropped handle is a failed one.
        if getattr(handle, "_sock", None) is None:
            raise redis.ConnectionError("the publishing connection was closed")
        try:
            return bool(handle.can_read(timeout=timeout))
        except BaseException:
            with self._lock:
                self._drop(handle)
            raise

    def receive(self, handle: Any) -> list[str | None]:
        """The entry ids of the send that returned `handle` (None: fenced off); raises if
        it failed."""
        try:
            reply = handle.read_response()
        except BaseException:
            # NOTE: an error reply too (the connection is fine): see the class's note
            with self._lock:
                self._drop(handle)
            raise
        return _entry_ids(reply)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._drop(self._conn)

    def _drop(self, conn: Any) -> None:
        """Caller holds _lock. Replies still owed on `conn` are lost: it is closed."""
        self._broken = True
        if self._conn is conn:
            self._conn = None
        conn.disconnect()


class SenderBroken(redis.ConnectionError):
    """A `PipelinedSender` refuses sends until its owner resets it after a failure."""


def _entry_ids(reply: list[Any]) -> list[str | None]:
    return [None if entry_id is None else as_text(entry_id) for entry_id in reply]
