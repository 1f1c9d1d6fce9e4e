"""The contract between API and workers: task names, Redis key names, stream events.

Events are appended to the job's Redis Stream (`<prefix>:job:<id>:events`) and published
on its live channel (`<prefix>:job:<id>:live`) in one pipeline; the stream entry id is
the SSE event id. Every job's stream ends with exactly one terminal event.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from enum import Enum
from json.encoder import encode_basestring_ascii
from typing import Any

from tasks.settings import Settings

GENERATE_TASK = "llmq.generate"  # body in workers/, sent by name from the web
RECLAIM_TASK = "llmq.reclaim_expired_leases"
EXPIRE_STREAMS_TASK = "llmq.expire_streams"
RESEND_QUEUED_TASK = "llmq.resend_stranded_jobs"
BATCH_SWEEP_TASK = "llmq.sweep_batches"


class EventType(str, Enum):
    TOKEN = "token"
    RESTART = "restart"  # the job went back to the queue (lease reclaim, drain); output resets
    DONE = "done"  # terminal: finished with stop or length
    ERROR = "error"  # terminal: failed
    CANCELLED = "cancelled"  # terminal

    @property
    def is_terminal(self) -> bool:
        return self in (EventType.DONE, EventType.ERROR, EventType.CANCELLED)


@dataclass(slots=True)
class JobEvent:
    type: EventType
    # token: text delta, token ids, optional logprobs; index = sample index (n > 1)
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    # terminal events
    finish_reason: str | None = None
    error: str | None = None
    usage: dict[str, int] | None = None
    attempt: int | None = None  # restart: the attempt number that follows
    ts: float | None = None  # token: when the worker published it (unix seconds), for latency

    def to_fields(self) -> dict[str, str]:
        """Stream entry fields: the event type plus one JSON payload."""
        # NOTE: a shallow read of the fields, not asdict(): asdict deep-copies recursively
        # and was half the cost of publishing a step's events; the JSON is the same.
        # NOTE: this JSON is also the SSE `data:` line, passed through as stored: a token
        # event keeps its (possibly empty) text and its index; other events leave out
        # empty defaults, which would only confuse clients.
        if self.type is EventType.TOKEN:
            data = self._plain_token_json()
            if data is not None:
                return {"type": "token", "data": data}
        return {"type": self.type.value, "data": _JSON.encode(self._payload())}

    def _payload(self) -> dict[str, Any]:
        """The JSON payload as a dict (every event type)."""
        if self.type is EventType.TOKEN:
            payload: dict[str, Any] = {"index": self.index, "text": self.text,
                                       "token_ids": self.token_ids}
            for name in _RARE_TOKEN_FIELDS:
                value = getattr(self, name)
                if value is not None:
                    payload[name] = value
            return payload
        payload = {name: getattr(self, name) for name in _PAYLOAD_FIELDS}
        payload = {k: v for k, v in payload.items() if v not in (None, "", [])}
        if payload.get("index") == 0:
            del payload["index"]
        return payload

    def _plain_token_json(self) -> str | None:
        """The hot path (every token of every job): a token event with nothing but its
        text, ids and publish time, written out. The same JSON `_JSON.encode(_payload())`
        gives (the same string escaping, int and float reprs) in half the time; None for
        anything else (logprobs, a non-int, a non-finite time), which goes the long way."""
        ts = self.ts
        if (self.logprobs is not None or self.finish_reason is not None
                or self.error is not None or self.usage is not None
                or self.attempt is not None or type(self.index) is not int
                or type(self.text) is not str
                or not (ts is None or (type(ts) is float and math.isfinite(ts)))):
            return None
        ids = self.token_ids
        if type(ids) is not list or not all(type(t) is int for t in ids):
            return None
        return '{"index":%d,"text":%s,"token_ids":[%s]%s}' % (
            self.index, encode_basestring_ascii(self.text), ",".join(map(str, ids)),
            "" if ts is None else ',"ts":' + repr(ts))

    @classmethod
    def from_fields(cls, fields: dict[str, str] | dict[bytes, bytes]) -> JobEvent:
        decoded = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in fields.items()
        }
        payload = json.loads(decoded.get("data") or "{}")
        return cls(type=EventType(decoded["type"]), **payload)


_PAYLOAD_FIELDS = tuple(f.name for f in fields(JobEvent) if f.name != "type")
_RARE_TOKEN_FIELDS = tuple(name for name in _PAYLOAD_FIELDS
                           if name not in ("index", "text", "token_ids"))
_JSON = json.JSONEncoder(separators=(",", ":"))  # one encoder: dumps() builds one per call


def events_key(settings: Settings, job_id: str) -> str:
    return settings.key("job", job_id, "events")


def live_channel(settings: Settings, job_id: str) -> str:
    return settings.key("job", job_id, "live")


def cancel_channel(settings: Settings) -> str:
    return settings.key("cancel")


def batch_lines_channel(settings: Settings, model: str) -> str:
    """Where a web process announces that a batch's lines of `model` are queued (the
    message is the batch id): the model's batch feeders claim at once instead of at
    their next look at the table."""
    return settings.key("model", model, "batch-lines")


def batch_progress_key(settings: Settings, batch_id: str) -> str:
    """A running batch's counts, model, usage and unfinished lines as JSON, with when they
    were computed (fresh for `batch_progress_cache_seconds`, kept a little longer: served
    stale while one web process computes them anew), shared by the web processes its
    clients poll."""
    return settings.key("batch", batch_id, "progress")


def batch_progress_lock_key(settings: Settings, batch_id: str) -> str:
    """Held (SET NX, with a TTL) by the web process computing a running batch's figures
    anew: the others serve the stale ones meanwhile, so a pass a batch runs at once."""
    return settings.key("batch", batch_id, "progress", "computing")


def cancel_flag_key(settings: Settings, job_id: str) -> str:
    """Set (with a TTL) when a running job's cancel was requested; the batcher checks it."""
    return settings.key("job", job_id, "cancel")


def groups_key(settings: Settings, model: str) -> str:
    """Hash: device group id -> JSON heartbeat (load, limits) of each group serving `model`."""
    return settings.key("groups", model)


def group_alive_key(settings: Settings, model: str, group_id: str) -> str:
    """Exists (with a TTL the group keeps renewing) while the device group is alive."""
    return settings.key("groups", model, group_id, "alive")


def kv_key(settings: Settings, fingerprint: str, block_hash_hex: str) -> str:
    return settings.key("kv", fingerprint, block_hash_hex)
