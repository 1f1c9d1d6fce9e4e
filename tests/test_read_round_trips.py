"""The web's reads run outside a transaction: a job poll, an event stream's open, an API
key's lookup, the readiness check, a listing, a batch's retrieval or the batch validator's
look for work cost one round trip to Postgres per statement, not a BEGIN before and a
ROLLBACK after; a running batch's retrieval is two statements, and one while another
read's figures are shared (real Postgres and Redis, the app in process)."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
from psycopg import pq
from sqlalchemy import event, select, update

from tasks.auth import create_api_key
from tasks.db import utcnow
from tasks.models import Batch, Job
from tasks.protocol import batch_progress_key, batch_progress_lock_key
from tests.batch_helpers import statements_sent, store_ended_batch
from webapp import batch_validation, create_app

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


@pytest.fixture
def app(service_settings):
    # auth on: every request also looks its key up
    settings = service_settings.with_overrides(
        redis_prefix=service_settings.redis_prefix + "r" + uuid.uuid4().hex[:6],
        auth_enabled=True)
    app = create_app(settings)
    yield app
    app.extensions["llmq"].close()


def _open_transactions(app) -> list[pq.TransactionStatus]:
    """At each end of a session's work on the web's engine, what its connection held:
    INTRANS where the driver had begun a transaction (a BEGIN went out before the statement
    and a ROLLBACK follows now), IDLE where the statement ran in autocommit."""
    seen: list[pq.TransactionStatus] = []

    def on_rollback(connection) -> None:
        seen.append(connection.connection.dbapi_connection.info.transaction_status)

    event.listen(app.extensions["llmq"].engine, "rollback", on_rollback)
    return seen


def test_reads_open_no_transaction(app, session_factory):
    key = create_api_key(session_factory, "reader")[1]
    headers = {"Authorization": f"Bearer {key}"}
    client = app.test_client()
    created = client.post("/v1/jobs", json=BODY, headers=headers)
    assert created.status_code == 202, created.json
    job_id = created.json["id"]
    seen = _open_transactions(app)

    got = client.get(f"/v1/jobs/{job_id}", headers=headers)
    assert got.status_code == 200 and got.json["id"] == job_id
    stream = client.get(f"/v1/jobs/{job_id}/events", headers=headers, buffered=False)
    assert stream.status_code == 200
    stream.close()
    assert client.get("/v1/jobs/" + str(uuid.uuid4()), headers=headers).status_code == 404
    assert client.get("/ready").status_code in (200, 503)
    for listing in ("/v1/jobs", "/v1/files", "/v1/batches", "/v1/dashboard/summary",
                    f"/v1/dashboard/jobs/{job_id}"):
        assert client.get(listing, headers=headers).status_code == 200, listing
    assert client.get("/v1/batches/batch_nothere", headers=headers).status_code == 404
    # the batch validator's look for work, which an idle web process repeats every 2 s
    assert app.extensions[batch_validation.EXTENSION_KEY].run_once() is False
    # key lookups (9), job reads (4), the readiness check, the listings and summary (5), a
    # batch read, the validator's look
    assert len(seen) >= 20, seen
    assert set(seen) == {pq.TransactionStatus.IDLE}, seen

    # the probe sees a transaction where one is open: a read through a plain session
    seen.clear()
    with app.extensions["llmq"].session_factory() as session:
        session.scalar(select(Job.status).where(Job.id == uuid.UUID(job_id)))
    assert seen == [pq.TransactionStatus.INTRANS]


def _app_sharing_figures(service_settings, seconds: float):
    """Settings with a key prefix of their own and running batches' figures shared for
    `seconds`, and the app serving them."""
    settings = service_settings.with_overrides(
        redis_prefix=service_settings.redis_prefix + "b" + uuid.uuid4().hex[:6],
        batch_progress_cache_seconds=seconds)
    return settings, create_app(settings)


def test_a_running_batch_reads_its_row_and_its_lines_once_and_a_done_one_is_finished(
        service_settings, session_factory):
    """Clients poll a running batch: its GET is two statements (the row, one pass over
    its lines, which also tells whether any line is left), not a finalizer's look besides,
    and the pass is shared for `batch_progress_cache_seconds` (then only the row is read);
    a batch whose lines all ended is still finished by the GET."""
    settings, app = _app_sharing_figures(service_settings, 0.5)
    try:
        client = app.test_client()
        running = store_ended_batch(session_factory, ("succeeded", "running", "queued"))

        def look(num_statements: int) -> dict:
            # this thread's statements (the app's validator thread looks for work)
            with statements_sent(app.extensions["llmq"].engine, this_thread=True) as statements:
                body = client.get(f"/v1/batches/{running}").json
            assert body["status"] == "in_progress", body
            assert body["output_file_id"] is None
            assert len(statements) == num_statements, statements
            return body["request_counts"]

        # a value this version did not write is computed anew
        app.extensions["llmq"].redis.set(batch_progress_key(settings, running), b"{oops")
        assert look(2) == {"total": 3, "completed": 1, "failed": 0}
        with session_factory.begin() as session:  # a line ends meanwhile
            session.execute(update(Job).where(Job.batch_id == running,
                                              Job.status == "running").values(status="failed"))
        assert look(1) == {"total": 3, "completed": 1, "failed": 0}  # the shared pass
        time.sleep(0.6)
        assert look(2) == {"total": 3, "completed": 1, "failed": 1}

        ended = store_ended_batch(session_factory, ("succeeded", "failed"))
        body = client.get(f"/v1/batches/{ended}").json
        assert body["status"] == "completed", body
        assert body["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
        assert body["output_file_id"] and body["error_file_id"]
    finally:
        app.extensions["llmq"].close()


def test_figures_past_their_age_are_computed_by_one_process_and_served_stale_meanwhile(
        service_settings, session_factory):
    """A running batch's figures older than `batch_progress_cache_seconds` are computed
    anew by the web process that takes the batch's lock; while another holds it, a GET
    answers the older figures with no pass of its own."""
    settings, app = _app_sharing_figures(service_settings, 0.3)
    try:
        client = app.test_client()
        redis_client = app.extensions["llmq"].redis
        running = store_ended_batch(session_factory, ("succeeded", "running", "queued"))

        def look(num_statements: int) -> dict:
            with statements_sent(app.extensions["llmq"].engine, this_thread=True) as statements:
                body = client.get(f"/v1/batches/{running}").json
            assert body["status"] == "in_progress", body
            assert len(statements) == num_statements, statements
            return body["request_counts"]

        assert look(2) == {"total": 3, "completed": 1, "failed": 0}
        with session_factory.begin() as session:  # a line ends meanwhile
            session.execute(update(Job).where(Job.batch_id == running,
                                              Job.status == "running").values(status="failed"))
        time.sleep(0.4)  # the figures are past their age
        lock = batch_progress_lock_key(settings, running)
        redis_client.set(lock, b"1", px=10_000)  # another process computes them
        assert look(1) == {"total": 3, "completed": 1, "failed": 0}  # served stale
        redis_client.delete(lock)
        assert look(2) == {"total": 3, "completed": 1, "failed": 1}  # this one computes
        assert redis_client.get(lock) is None  # and lets the next one in
        assert look(1) == {"total": 3, "completed": 1, "failed": 1}  # fresh: shared
    finally:
        app.extensions["llmq"].close()


def test_a_validating_batchs_figures_are_shared_for_its_status_only(service_settings,
                                                                    session_factory):
    """A batch being validated is polled as a running one is: one pass shared for
    `batch_progress_cache_seconds`; once it is in progress, its figures from validation
    are not served (they show no request counts)."""
    settings, app = _app_sharing_figures(service_settings, 30)
    try:
        client = app.test_client()
        batch_id = store_ended_batch(session_factory, ("succeeded", "queued"))
        with session_factory.begin() as session:  # validated by another process, alive
            session.execute(update(Batch).where(Batch.id == batch_id).values(
                status="validating", in_progress_at=None, validator="elsewhere",
                validation_lease_expires_at=utcnow() + timedelta(seconds=60)))

        def look(num_statements: int) -> dict:
            with statements_sent(app.extensions["llmq"].engine, this_thread=True) as statements:
                body = client.get(f"/v1/batches/{batch_id}").json
            assert len(statements) == num_statements, statements
            return body

        assert look(2)["status"] == "validating"
        assert look(1)["status"] == "validating"  # the shared pass
        with session_factory.begin() as session:
            session.execute(update(Batch).where(Batch.id == batch_id).values(
                status="in_progress", in_progress_at=utcnow(), validator=None,
                validation_lease_expires_at=None))
        body = look(2)  # another status: a pass of its own
        assert body["status"] == "in_progress"
        assert body["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
        client.post(f"/v1/batches/{batch_id}/cancel")  # leave nothing queued
    finally:
        app.extensions["llmq"].close()


def test_a_listing_shares_its_running_batches_figures(service_settings, session_factory):
    """`GET /v1/batches`: the page's rows in one statement; each running batch's figures
    from one pass over its lines, shared with every read for
    `batch_progress_cache_seconds` (a second listing within it reads the page alone); the
    extra row that says a page follows costs no pass."""
    settings, app = _app_sharing_figures(service_settings, 30)
    try:
        client = app.test_client()
        running = [store_ended_batch(session_factory, ("succeeded", "running"))
                   for _ in range(4)]  # the oldest is the extra row of a page of 3

        def listing(num_statements: int) -> dict:
            with statements_sent(app.extensions["llmq"].engine, this_thread=True) as sent:
                body = client.get("/v1/batches?limit=3").json
            assert len(sent) == num_statements, sent
            return body

        first = listing(1 + 3)  # the page, a pass for each listed batch
        assert [row["id"] for row in first["data"]] == running[:0:-1]
        assert first["has_more"] is True and first["last_id"] == running[1]
        assert all(row["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
                   for row in first["data"])
        with session_factory.begin() as session:  # a line ends meanwhile
            session.execute(update(Job).where(Job.batch_id == running[3],
                                              Job.status == "running").values(status="failed"))
        assert listing(1)["data"] == first["data"]  # the shared figures
        # a batch's own GET reads the figures the listing shared, and the other way round
        app.extensions["llmq"].redis.delete(batch_progress_key(settings, running[2]))
        assert client.get(f"/v1/batches/{running[2]}").json["status"] == "in_progress"
        assert listing(1)["data"] == first["data"]
        # hostile paging: a clear 400 naming the parameter, and the next listing unchanged
        for query, param, code in (("limit=101", "limit", "invalid_value"),
                                   ("limit=-1", "limit", "invalid_value"),
                                   ("after=batch_nope", "after", "invalid_cursor"),
                                   ("after=" + "x" * 10_000, "after", "invalid_cursor")):
            answer = client.get(f"/v1/batches?{query}")
            assert answer.status_code == 400, (query, answer.json)
            assert (answer.json["error"]["param"], answer.json["error"]["code"]) == (
                param, code), query
        assert listing(1)["data"] == first["data"]
    finally:
        app.extensions["llmq"].close()
