"""Batches validated off the request: `POST /v1/batches` stores the batch `validating`
and answers at once; a `BatchValidator` thread reads its input file, checks every line and
inserts its jobs (webapp/batch_lines.py), then moves it to `in_progress`, or to `failed`
with the problems in `errors.data`.

Why a thread in the web process: tokenizing a line needs the served model's tokenizer,
which the web process holds (webapp/model_registry.py) and `tasks/` (beat) may not import.
Why not the next GET: a 50,000-line file takes tens of seconds, which would stall that
GET instead of the POST. So each web process runs one validator thread, started by its
first request (like the live hub: after any fork) and woken at once when the process
creates a batch or answers a GET of a validating one; between wakes it looks every
`POLL_SECONDS` for a batch nobody validates.

Durable, exactly once:
* a claim is a conditional UPDATE (still `validating`, never claimed or its validator's
  lease lapsed) that writes the claimer's token and a lease; so if the validating process
  dies, another process's validator takes the batch over once the lease lapsed;
* the lines become jobs in passes (64 lines first, then twice as many each pass, up to
  1,000), and each pass is ONE transaction whose first statement is an UPDATE matching
  only while the batch is still `validating` under the claim's token (it renews the
  lease): a validator that lost its claim (taken over, or cancelled) commits nothing and
  stops, so the jobs exist once. The workers run a pass's lines at once, while later
  passes are validated (2,000 lines: the first run about 0.1 s after the create instead
  of after the whole file). A validator that takes a lapsed claim over resumes after the
  lines already committed, which are always a prefix of the file. The move to
  `in_progress` (with the request count) is the last transaction; a cancel while
  validating cancels the lines committed so far;
* a line the server cannot validate for a reason of its own (a served model whose
  tokenizer does not load: a 5xx, where a bad line is a 4xx in the error file) makes no
  line fail: the claim is released and a later pass resumes there, and the last allowed
  claim fails the batch naming the reason and the line (and cancels the lines of earlier
  passes that have not ended);
* a batch whose validation keeps failing (`LLMQ_MAX_ATTEMPTS` claims) ends `failed`, and
  one whose window passes with no web process left is expired by beat (tasks/batches.py).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from datetime import timedelta
from typing import Any

from flask import Flask, current_app
from sqlalchemy import func, select, text, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from tasks.batches import cancel_batch_jobs, finalize_if_done, validation_unclaimed
from tasks.db import update_count, utcnow
from tasks.files import read_file_bytes
from tasks.models import Batch, BatchStatus, File, Job, JobStatus
from tasks.protocol import batch_lines_channel
from webapp.batch_lines import (
    KIND_OF_ENDPOINT,
    LineServerError,
    file_problem,
    line_jobs,
    parse_lines,
)
from webapp.errors import APIError
from webapp.services import Services

logger = logging.getLogger(__name__)

EXTENSION_KEY = "llmq.batch_validator"
POLL_SECONDS = 2.0  # how often an idle validator looks for a batch nobody validates
MAX_REPORTED_ERRORS = 1000  # validation errors kept in errors.data
# lines turned into jobs at a time (their prompts encoded in one call), each pass committed
# with a renewal of the claim's lease; the first passes are short, so the first lines run
# a moment after the create while later ones are still validated
FIRST_PASS_LINES = 64
LINES_PER_PASS = 1000
# a batch's lines committed since the jobs table's statistics were refreshed, at least,
# before the validator refreshes them (`refresh_statistics`)
REFRESH_STATISTICS_LINES = 1000


class LostClaim(Exception):
    """The batch is no longer validating under this claim (taken over, or cancelled)."""


class ValidationDeferred(Exception):
    """The server could not validate the batch now (a model that does not load): the
    claim is released and a later pass tries again, up to LLMQ_MAX_ATTEMPTS claims."""


def claim_batch(session_factory: sessionmaker[Session], token: str, lease_seconds: float,
                max_attempts: int, reads: sessionmaker[Session] | None = None) -> str | None:
    """Claim the oldest batch that is `validating` with no live validator; returns it, or
    None. One already claimed `max_attempts` times ends `failed` instead. `reads`: the
    sessions the candidates are looked up with (`Services.reads`: no transaction for the
    SELECT an idle validator repeats every POLL_SECONDS); default `session_factory`."""
    now = utcnow()
    with (reads or session_factory)() as session:
        candidates = session.execute(select(Batch.id, Batch.validation_attempts).where(
            validation_unclaimed(now)).order_by(Batch.created_at).limit(8)).all()
    for batch_id, attempts in candidates:
        values: dict[str, Any] = {"validator": token, "validation_lease_expires_at": now
                                  + timedelta(seconds=lease_seconds),
                                  "validation_attempts": attempts + 1}
        if attempts >= max_attempts:
            values = {"status": BatchStatus.FAILED.value, "failed_at": now,
                      "errors": [file_problem(
                          "validation_failed", f"validating the input file failed "
                          f"{attempts} times (LLMQ_MAX_ATTEMPTS); see the web logs, then "
                          "submit the batch again")]}
        with session_factory.begin() as session:
            won = update_count(session, update(Batch).where(
                Batch.id == batch_id, Batch.validation_attempts == attempts,
                validation_unclaimed(now)).values(**values))
        if won and attempts >= max_attempts:
            logger.error("batch %s: validation failed %d times; batch failed", batch_id,
                         attempts)
        elif won:
            return str(batch_id)
    return None


def release_claim(session_factory: sessionmaker[Session], batch_id: str, token: str) -> None:
    """Give the claim up at once (its lease ends now), so a later pass may claim again."""
    with session_factory.begin() as session:
        session.execute(update(Batch).where(*_held(batch_id, token)).values(
            validation_lease_expires_at=utcnow()))


def commit_validation(session_factory: sessionmaker[Session], batch_id: str, token: str,
                      values: dict[str, Any], jobs: list[Job]) -> bool:
    """A pass's result in one transaction: the batch's new `values` and `jobs`, only while
    the batch is still validating under `token`. The claim's lease ends unless `values`
    sets `validation_lease_expires_at` (a pass with more to come renews it). Returns
    whether it was written (False: the claim was lost; nothing was)."""
    with session_factory() as session, session.begin():
        # NOTE: the conditional UPDATE first: it locks the row, so a concurrent cancel or
        # a validator that took over waits, and a lost claim inserts no job.
        if not update_count(session, update(Batch).where(*_held(batch_id, token)).values(
                **{"validation_lease_expires_at": None, **values})):
            return False
        session.add_all(jobs)
    return True


def refresh_statistics(session_factory: sessionmaker[Session]) -> None:
    """ANALYZE the jobs table (Postgres), after a burst of a batch's lines.

    The planner reads the share of queued rows from the table's statistics, which
    autovacuum refreshes a minute or more after a burst: until then it took the lines
    just committed for one row, and the claims and the queue's looks chose their plans for
    that (a claim of 16 lines read 13,000 through the wrong index). Called at 1,000 lines,
    then each time the batch has doubled: a few times per batch (tens of ms each on a
    table of 100,000 jobs: ANALYZE reads a sample). Best effort: a role that may not
    analyze the table only gets Postgres' warning."""
    with session_factory() as session:
        if session.get_bind().dialect.name != "postgresql":
            return
        try:
            session.execute(text("ANALYZE jobs"))
            session.commit()
        except SQLAlchemyError as exc:
            session.rollback()
            logger.warning("could not refresh the jobs table's statistics: %s", exc)


def committed_lines(session_factory: sessionmaker[Session], batch_id: str) -> int:
    """How many of the batch's lines earlier passes (of this claim or a lapsed one) made
    jobs. NOTE: passes commit consecutive lines in order, each whole or not at all, so
    the jobs are always lines 0 .. n-1: validation resumes at line n."""
    with session_factory() as session:
        last = session.scalar(select(func.max(Job.batch_index)).where(
            Job.batch_id == batch_id))
    return 0 if last is None else last + 1


def _held(batch_id: str, token: str) -> tuple[Any, ...]:
    """The condition of `batch_id` still validating under the claim `token`."""
    return (Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING.value,
            Batch.validator == token)


def validate_batch(svc: Services, batch_id: str, token: str) -> bool:
    """Validate the claimed `batch_id` (inside an app context): its jobs and
    `in_progress`, or `failed` with the problems. Returns whether the result was written
    (False: the claim was lost on the way)."""
    lease = svc.settings.batch_validation_lease_seconds
    with svc.session_factory() as session:
        batch = session.get(Batch, batch_id)
        if batch is None:
            return False
        endpoint, api_key_id = batch.endpoint, batch.api_key_id
        attempts = batch.validation_attempts
        exists = session.get(File, batch.input_file_id) is not None
        data = read_file_bytes(session, batch.input_file_id) if exists else b""
    lines, errors = parse_lines(data, endpoint, svc.settings.max_batch_lines) if exists else (
        [], [file_problem("invalid_file", "the input file was deleted or expired before the "
                          "batch was validated")])
    now = utcnow()
    if errors:
        written = commit_validation(svc.session_factory, batch_id, token, {
            "status": BatchStatus.FAILED.value, "errors": errors[:MAX_REPORTED_ERRORS],
            "failed_at": now}, [])
        if written:
            logger.info("batch %s failed validation: %d problems", batch_id, len(errors))
        return written
    kind = KIND_OF_ENDPOINT[endpoint]
    first = committed_lines(svc.session_factory, batch_id)
    size = FIRST_PASS_LINES
    refreshed_at = first
    while first < len(lines):
        chunk = lines[first:first + size]
        try:
            jobs = line_jobs(svc, kind, first, chunk, api_key_id, batch_id, now)
        except LineServerError as exc:  # the server's problem, not the line's
            return _server_problem(svc, batch_id, token, attempts, exc.index, exc.error)
        lease_ends = utcnow() + timedelta(seconds=lease)
        if not commit_validation(svc.session_factory, batch_id, token,
                                 {"validation_lease_expires_at": lease_ends}, jobs):
            raise LostClaim(batch_id)
        # the feeders may run these lines now, while the next pass is validated
        _announce(svc, batch_id, {job.model for job in jobs
                                  if job.status == JobStatus.QUEUED.value})
        first += len(chunk)
        size = min(2 * size, LINES_PER_PASS)
        if first - refreshed_at >= max(REFRESH_STATISTICS_LINES, refreshed_at):
            refresh_statistics(svc.session_factory)
            refreshed_at = first
    written = commit_validation(svc.session_factory, batch_id, token, {
        "status": BatchStatus.IN_PROGRESS.value, "num_total": len(lines),
        "in_progress_at": utcnow()}, [])
    if written:
        logger.info("batch %s in progress: %d requests to %s", batch_id, len(lines), endpoint)
        finalize_if_done(svc.session_factory, batch_id)  # every line may have ended already
    return written


def _announce(svc: Services, batch_id: str, models: set[str]) -> None:
    """Wake the feeders of `models`: the lines are queued (best effort: a feeder that
    misses it finds them at its next look at the table)."""
    for model in models:
        try:
            svc.redis.publish(batch_lines_channel(svc.settings, model), batch_id)
        except Exception:
            logger.warning("could not announce batch %s to the workers of %s", batch_id,
                           model, exc_info=True)


def _server_problem(svc: Services, batch_id: str, token: str, attempts: int, index: int,
                    exc: APIError) -> bool:
    """Line `index` could not be validated for a reason of the server's: on the last
    allowed claim the batch fails naming it (and no line runs); before that the claim is
    released and ValidationDeferred raised (a later pass tries again)."""
    reason = f"line {index + 1}: {exc.message}"
    if attempts < svc.settings.max_attempts:
        release_claim(svc.session_factory, batch_id, token)
        raise ValidationDeferred(f"batch {batch_id}: validation deferred after claim "
                                 f"{attempts} of {svc.settings.max_attempts}: {reason}")
    problem = {"code": exc.code, "message": exc.message, "param": exc.param,
               "line": index + 1}
    written = commit_validation(svc.session_factory, batch_id, token, {
        "status": BatchStatus.FAILED.value, "errors": [problem], "failed_at": utcnow()}, [])
    if written:
        logger.error("batch %s failed: the server could not validate it (%s)", batch_id,
                     reason)
        # lines of earlier passes may be queued or running: a failed batch runs no more
        cancel_batch_jobs(svc.session_factory, svc.redis, svc.settings, batch_id)
    return written


class BatchValidator:
    """This web process's validator thread (see the module's docstring)."""

    def __init__(self, app: Flask, svc: Services) -> None:
        self._app = app
        self._svc = svc
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self.token = ""

    def ensure_started(self) -> None:
        """Start the thread in this process (a forked child starts its own)."""
        if self._pid == os.getpid() and self._thread is not None:
            return
        with self._lock:
            if self._pid == os.getpid() and self._thread is not None:
                return
            self._pid = os.getpid()
            # a claim token names its process, for the logs; the uuid makes it unique
            self.token = f"{socket.gethostname()[:32]}:{self._pid}:{uuid.uuid4().hex[:16]}"
            self._wake.set()  # a first look at once: a dead process's batches wait
            self._thread = threading.Thread(target=self._run, name="llmq-batch-validator",
                                            daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Look for work now (a batch was created, or a client waits on one)."""
        self.ensure_started()
        self._wake.set()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            # NOTE: briefly: a web worker that outlives its graceful timeout is killed,
            # and a long validation is left anyway (its claim lapses)
            thread.join(0.5)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait(POLL_SECONDS)
            self._wake.clear()
            try:
                while not self._stopped.is_set() and self.run_once():
                    pass
            except ValidationDeferred as exc:
                logger.error("%s", exc)
                self._stopped.wait(POLL_SECONDS * 5)
            except Exception:  # Postgres away, a bug: the claim lapses, a later pass retries
                logger.exception("batch validation pass failed")
                self._stopped.wait(POLL_SECONDS * 5)

    def run_once(self) -> bool:
        """Claim one batch and validate it; returns whether one was claimed."""
        settings = self._svc.settings
        batch_id = claim_batch(self._svc.session_factory, self.token,
                               settings.batch_validation_lease_seconds, settings.max_attempts,
                               reads=self._svc.reads)
        if batch_id is None:
            return False
        try:
            with self._app.app_context():
                validate_batch(self._svc, batch_id, self.token)
        except LostClaim:
            logger.warning("batch %s: validation claim lost (taken over or cancelled)",
                           batch_id)
        return True


def init_app(app: Flask, svc: Services) -> BatchValidator:
    """Give `app` a validator: started by its first request, stopped with its services."""
    validator = BatchValidator(app, svc)
    app.extensions[EXTENSION_KEY] = validator
    app.before_request(validator.ensure_started)
    svc.on_close.append(validator.stop)
    return validator


def batch_validator() -> BatchValidator:
    """The current app's validator."""
    validator: BatchValidator = current_app.extensions[EXTENSION_KEY]
    return validator
