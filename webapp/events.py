"""Server-sent events of a job (`GET /v1/jobs/<id>/events`).

Each event is `id: <stream entry id>`, `event: <type>`, `data: <json>`; a reconnecting
client sends `Last-Event-ID` (or `?last_event_id=`) and gets exactly the events after it.
`: ping` comments keep idle connections open. The stream ends after the terminal event.
A `restart` event means the output so far is void: the job starts over on another worker.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, request

from tasks.models import Job, JobStatus
from tasks.protocol import EventType, JobEvent
from tasks.streams.live_hub import Sink
from tasks.streams.reader import EventSubscriber, Park, StreamEntry, parse_stream_id
from webapp.errors import APIError
from webapp.jobs import load_job
from webapp.serialize import is_terminal
from webapp.services import services
from webapp.streaming import event_stream_response

logger = logging.getLogger(__name__)

bp = Blueprint("events", __name__, url_prefix="/v1/jobs")

RETRY_MILLISECONDS = 2000  # how soon an EventSource reconnects after a drop
# A row that is terminal with no terminal event on the stream for this long (the event
# was lost, or the stream expired) is ended from the row instead.
MISSING_TERMINAL_GRACE_SECONDS = 2.0


@bp.get("/<job_id>/events")
def job_events(job_id: str) -> Response:
    """Stream the job's events; everything the generator needs is read here, up front."""
    svc = services()
    job = load_job(job_id)
    last_id = request.headers.get("Last-Event-ID") or request.args.get("last_event_id")
    if last_id:
        try:
            parse_stream_id(last_id)
        except ValueError:
            raise APIError(400, "invalid_last_event_id", f"Last-Event-ID {last_id!r} is not an "
                           "event id of this stream (expected <ms>-<seq>)",
                           "Last-Event-ID") from None
    svc.redis.ping()  # Redis down -> 503 now, not a broken stream later
    heartbeat_seconds = svc.settings.sse_heartbeat_seconds
    return event_stream_response(
        lambda sink, cooperative: _sse(job_id, job, last_id or None, svc.subscriber,
                                       svc.reads, heartbeat_seconds, sink,
                                       cooperative))


def _sse(job_id: str, job: Job, last_id: str | None, subscriber: EventSubscriber,
         session_factory: Any, heartbeat_seconds: float, sink: Sink | None,
         cooperative: bool) -> Iterator[str | Park]:
    yield f"retry: {RETRY_MILLISECONDS}\n\n"
    if is_terminal(job):
        # Finished: the stored log is complete (or gone); no need to listen.
        for entry in subscriber.read_entries(job_id, last_id):
            yield format_entry(entry)
            if entry.type.is_terminal:
                return
        if last_id is None or not _stream_has_terminal(subscriber, job_id):
            yield format_event(None, terminal_event_from_row(job))
        return
    terminal_seen_at: float | None = None
    # NOTE: with a sink, the hub thread writes live events to the client itself while
    # this generator sleeps (or is parked); everything before and after goes through the
    # server.
    for item in subscriber.iter_entries(job_id, last_id, heartbeat_seconds=heartbeat_seconds,
                                        sink=sink, cooperative=cooperative):
        if isinstance(item, Park):
            yield item
            continue
        if item is not None:
            yield format_entry(item)
            continue
        yield ": ping\n\n"
        # NOTE: the worker writes the row before the event; a terminal row whose event
        # never comes (lost publish, expired stream) ends the stream from the row.
        row = _reload(session_factory, job_id)
        if row is None or not is_terminal(row):
            terminal_seen_at = None
        elif terminal_seen_at is None:
            terminal_seen_at = time.monotonic()
        elif time.monotonic() - terminal_seen_at >= MISSING_TERMINAL_GRACE_SECONDS:
            logger.warning("job %s is %s but its stream has no terminal event; ending the "
                           "event stream from the row", job_id, row.status)
            yield format_event(None, terminal_event_from_row(row))
            return


def format_event(entry_id: str | None, event: JobEvent) -> str:
    data = event.to_fields()["data"]
    if event.type is EventType.RESTART:
        payload = json.loads(data)
        payload["message"] = ("the job restarts from the beginning; discard the output "
                              "received so far")
        data = json.dumps(payload, separators=(",", ":"))
    head = "" if entry_id is None else f"id: {entry_id}\n"
    return f"{head}event: {event.type.value}\ndata: {data}\n\n"


def format_entry(entry: StreamEntry) -> str:
    """An SSE event of a stored entry: its JSON passes through as stored (no re-encode)."""
    if entry.type is EventType.RESTART:
        return format_event(entry.entry_id, entry.event())
    return f"id: {entry.entry_id}\nevent: {entry.type.value}\ndata: {entry.data}\n\n"


def terminal_event_from_row(job: Job) -> JobEvent:
    usage = {"prompt_tokens": job.prompt_tokens or 0,
             "completion_tokens": job.completion_tokens or 0,
             "total_tokens": (job.prompt_tokens or 0) + (job.completion_tokens or 0),
             "cached_tokens": job.cached_tokens or 0}
    event_type = {JobStatus.SUCCEEDED.value: EventType.DONE,
                  JobStatus.CANCELLED.value: EventType.CANCELLED}.get(job.status, EventType.ERROR)
    return JobEvent(event_type, finish_reason=job.finish_reason, error=job.error, usage=usage)


def _stream_has_terminal(subscriber: EventSubscriber, job_id: str) -> bool:
    return any(entry.type.is_terminal for entry in subscriber.read_entries(job_id))


def _reload(session_factory: Any, job_id: str) -> Job | None:
    try:
        with session_factory() as session:
            return session.get(Job, uuid.UUID(job_id))
    except Exception:  # noqa: BLE001 - a database blip must not break a live stream
        logger.warning("job %s: could not re-read the row during streaming", job_id)
        return None
