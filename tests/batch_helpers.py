"""Batch rows the Batch API tests store directly: a batch whose jobs all ended, as the
workers leave it before anyone finalizes it."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event

from tasks.api.batches import BATCH_PRIORITY
from tasks.db import utcnow
from tasks.models import Batch, Job


def store_ended_batch(session_factory: Any, statuses: tuple[str, ...], *,
                      input_file_id: str = "file-x", **batch_fields: Any) -> str:
    """An `in_progress` batch with one ended job per status (`succeeded` ones with an
    output, `failed` ones with an error), not finalized yet; returns its id."""
    batch_id = f"batch_{uuid.uuid4().hex}"
    now = utcnow()
    with session_factory.begin() as session:
        session.add(Batch(id=batch_id, endpoint="/v1/completions", input_file_id=input_file_id,
                          completion_window="24h", status="in_progress",
                          num_total=len(statuses), num_completed=0, num_failed=0,
                          created_at=now, in_progress_at=now, **batch_fields))
        session.flush()  # the batch before its jobs (their foreign key)
        for i, status in enumerate(statuses):
            session.add(Job(model="tiny", kind="completion", prompt="p", params={"n": 1},
                            status=status, batch_id=batch_id, custom_id=f"r{i}",
                            batch_index=i, output=[{"index": 0, "text": "t",
                                                    "finish_reason": "length"}],
                            error="boom" if status == "failed" else None, prompt_tokens=1,
                            completion_tokens=1, created_at=now, finished_at=now))
    return batch_id


def store_queued_lines(session_factory: Any, model: str, indexes: list[int], *,
                       created_at: Any) -> dict[int, str]:
    """An `in_progress` batch whose lines wait queued, inserted in the order of `indexes`
    (their batch_index); returns each index's job id."""
    batch_id = f"batch_{uuid.uuid4().hex}"
    ids: dict[int, str] = {}
    with session_factory.begin() as session:
        session.add(Batch(id=batch_id, endpoint="/v1/completions", input_file_id="file-x",
                          completion_window="24h", status="in_progress",
                          num_total=len(indexes), num_completed=0, num_failed=0,
                          created_at=created_at, in_progress_at=created_at))
        session.flush()  # the batch before its jobs (their foreign key)
        for index in indexes:
            job = Job(id=uuid.uuid4(), model=model, kind="completion", prompt="p",
                      params={"max_tokens": 1}, priority=BATCH_PRIORITY, status="queued",
                      batch_id=batch_id, custom_id=f"r{index}", batch_index=index, attempts=0,
                      created_at=created_at)
            session.add(job)
            ids[index] = str(job.id)
    return ids


@contextmanager
def statements_sent(engine: Any, this_thread: bool = False,
                    parameters: list[Any] | None = None) -> Iterator[list[str]]:
    """The SQL statements `engine` sends while the block runs, in order (with
    `this_thread`, only those of the thread that entered: an app's background threads
    read too); `parameters`, when given, receives each one's parameters in the same order."""
    statements: list[str] = []
    me = threading.get_ident()

    def record(conn: Any, cursor: Any, statement: str, sent_parameters: Any,
               *rest: Any) -> None:
        if not this_thread or threading.get_ident() == me:
            statements.append(statement)
            if parameters is not None:
                parameters.append(sent_parameters)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", record)
