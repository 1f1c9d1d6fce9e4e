"""Serving a response's job: wait for it to end, or stream its response events.

`stream_events` reads the job's events once, from the start of its Redis Stream (replay,
then live), numbers them (`webapp/response_events.py`) and sends those after
`starting_after`; the caller decides whether a client leaving cancels the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from tasks.models import Job, JobStatus, StoredResponse
from tasks.protocol import events_key
from tasks.streams.reader import Park
from webapp.errors import APIError
from webapp.openai_api import cancel_quietly, job_events, reload_job
from webapp.response_events import ResponseEvents, sse_lines
from webapp.response_objects import message_id, response_object
from webapp.services import Services

logger = logging.getLogger(__name__)

FINAL_ROW_WAIT_SECONDS = 5.0  # a terminal event whose row is not terminal yet (a db blip)
_POLL_SECONDS = 0.05


def wait_for_job(svc: Services, job_id: str) -> None:
    """Until the job ends; a 504 (and the job cancelled) after the request timeout."""
    deadline = time.monotonic() + svc.settings.request_timeout_seconds
    for event in job_events(svc, job_id):
        if time.monotonic() > deadline:
            cancel_quietly(svc, job_id)
            raise APIError(504, "timeout", f"response of job {job_id} did not finish within "
                           f"{svc.settings.request_timeout_seconds:g} s and was cancelled; "
                           "use background: true for long generations")
        if event is not None and not isinstance(event, Park) and event.type.is_terminal:
            return


def stream_events(svc: Services, stored: StoredResponse, job: Job, starting_after: int,
                  cancel_on_close: bool, cooperative: bool) -> Iterator[str | Park]:
    """The response's events numbered after `starting_after`; closing this generator
    before the end cancels the job when `cancel_on_close` (a non-background create)."""
    job_id = str(job.id)
    events = ResponseEvents(
        item_id=message_id(job), created_status="queued" if stored.background else "in_progress",
        snapshot=lambda status: response_object(stored, job, status=status))
    finished = False
    try:
        yield from sse_lines(events.preamble(), starting_after)
        row = reload_job(svc, job_id) or job
        if JobStatus(row.status).is_terminal and not svc.redis.exists(events_key(svc.settings,
                                                                                 job_id)):
            logger.info("response %s: the job's stream expired; events rebuilt from the row",
                        stored.id)
            finished = True
            yield from sse_lines(events.finish(response_object(stored, row)), starting_after)
            return
        for item in job_events(svc, job_id, cooperative):
            if isinstance(item, Park):
                yield item
            elif item is None:
                yield ": ping\n\n"  # also how a closed connection is noticed
            elif item.type.is_terminal:
                finished = True
                row = _final_row(svc, job_id, row)
                yield from sse_lines(events.finish(response_object(stored, row)),
                                     starting_after)
                return
            else:
                yield from sse_lines(events.feed(item), starting_after)
    finally:
        if not finished and cancel_on_close:
            logger.info("response %s: stream closed before the end; cancelling job %s",
                        stored.id, job_id)
            cancel_quietly(svc, job_id)


def _final_row(svc: Services, job_id: str, row: Job) -> Job:
    """The job's row once terminal. NOTE: the row is written before the terminal event is
    published, so this is at once but for a database blip; it waits a little then."""
    deadline = time.monotonic() + FINAL_ROW_WAIT_SECONDS
    while True:
        row = reload_job(svc, job_id) or row
        if JobStatus(row.status).is_terminal or time.monotonic() > deadline:
            return row
        time.sleep(_POLL_SECONDS)
