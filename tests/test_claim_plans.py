"""How Postgres runs the claims (workers/claims.py) while a big batch waits queued.

A claim takes a few rows; what it reads must not grow with the queue. With 2,000 queued
lines of the model, every scan of the claim's plan (EXPLAIN ANALYZE, rolled back) reads
about as many rows as it claims: the claimed-ahead interactive jobs through their
ordered index, the lines through theirs, then the rows updated by primary key; on the
plan made for the values sent (custom) and on a prepared statement's generic plan, with
the table's statistics from before the lines came (as when a batch's burst outruns them)
and refreshed (as the batch validator does).
"""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from typing import Any

from psycopg import sql
from sqlalchemy import delete, text

from tasks.db import make_sessionmaker, utcnow
from tasks.models import Batch, Job
from tests.batch_helpers import statements_sent, store_queued_lines
from tests.pipeline_helpers import insert_job
from webapp.batch_validation import refresh_statistics
from workers.claims import JobClaims, create_claims_engine

NUM_LINES = 2000
CLAIM = 15
# rows a scan of a claim may read: the claimed ones and the versions the rolled-back runs
# before it left (an index holds those until vacuum), far fewer than the queue
READ_AT_MOST = NUM_LINES // 5


def _scans(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = [node] if "Scan" in node["Node Type"] else []
    for child in node.get("Plans", []):
        found += _scans(child)
    return found


def _rows_read(scan: dict[str, Any]) -> int:
    return int(scan.get("Actual Rows", 0) + scan.get("Rows Removed by Filter", 0)
               + scan.get("Rows Removed by Index Recheck", 0))


def _sent(engine: Any, statement: Any, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The SQL and parameters `statement` goes to Postgres as (run, then rolled back)."""
    parameters: list[Any] = []
    with statements_sent(engine, parameters=parameters) as sent, engine.connect() as conn:
        conn.execute(statement, params)
        conn.rollback()
    return sent[-1], dict(parameters[-1])


def _explained(session_factory: Any, statement: Any, params: dict[str, Any],
               generic: bool) -> dict[str, Any]:
    """The plan Postgres ran `statement` with (its changes rolled back). `generic`: as a
    prepared statement on its generic plan, as a connection runs a statement it ran five
    times (psycopg prepares it), where nothing sent as a parameter is known."""
    engine = session_factory.kw["bind"]
    sql_text, values = _sent(engine, statement, params)
    with engine.connect() as conn:
        raw = conn.connection.driver_connection
        try:
            if not generic:
                (plan,), = raw.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql_text,
                                       values).fetchall()
                return plan[0]["Plan"]
            names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", sql_text)))
            numbered = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m.group(1)) + 1}",
                              sql_text)
            raw.execute("PREPARE claim AS " + numbered)
            raw.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            arguments = sql.SQL(", ").join(sql.Literal(values[name]) for name in names)
            (plan,), = raw.execute(sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE claim({})")
                                   .format(arguments)).fetchall()
            return plan[0]["Plan"]
        finally:
            raw.rollback()
            if generic:
                raw.execute("DEALLOCATE claim")
                raw.commit()


def test_a_claim_reads_about_the_rows_it_claims_however_long_the_queue(
        service_settings, session_factory, redis_client):
    model = f"plans-{uuid.uuid4().hex[:6]}"
    with session_factory.begin() as session:  # statistics from before the lines
        session.execute(text("ANALYZE jobs"))
    lines = store_queued_lines(session_factory, model, list(range(NUM_LINES)),
                               created_at=utcnow() - timedelta(seconds=5))
    jobs = [insert_job(session_factory, model=model) for _ in range(CLAIM + 5)]
    claims_engine = create_claims_engine(service_settings.database_url, 1)
    claims_sessions = make_sessionmaker(claims_engine)
    try:
        claims = JobClaims(service_settings, claims_sessions, redis_client, "plans-group",
                           own=lambda job_id, attempt: None)
        now = utcnow()
        times = {"claim_now": now, "claim_lease": now + timedelta(seconds=30)}
        asked = {
            "with_ahead": (claims._with_ahead, {**times, "claim_job_id": uuid.UUID(jobs[0]),
                                                "claim_model": model, "claim_limit": CLAIM}),
            "lines": (claims._lines, {**times, "claim_model": model, "claim_limit": CLAIM}),
            "one": (claims._one, {**times, "claim_job_id": uuid.UUID(jobs[1])}),
        }
        for statistics in ("from before the lines", "refreshed"):
            if statistics == "refreshed":
                refresh_statistics(session_factory)  # as the validator does after a burst
            for name, (statement, params) in asked.items():
                claimed = {"with_ahead": CLAIM + 1, "lines": CLAIM, "one": 1}[name]
                for generic in (False, True):
                    plan = _explained(claims_sessions, statement, params, generic)
                    which = (f"{name} ({'generic' if generic else 'custom'} plan, statistics "
                             f"{statistics})")
                    assert plan["Actual Rows"] == claimed, (which, plan["Actual Rows"])
                    for scan in _scans(plan):
                        on = scan.get("Index Name") or scan.get("Relation Name")
                        assert _rows_read(scan) <= READ_AT_MOST, (
                            f"{which}: {scan['Node Type']} on {on} read {_rows_read(scan)} "
                            f"rows to claim {claimed}")
        # and the statements claim as before: the job, the oldest others; the first lines
        assert {str(row.id) for row in claims.with_ahead(uuid.UUID(jobs[0]), model, 3)} \
            == set(jobs[:4])
        assert [str(row.id) for row in claims.lines(model, 3)] == [lines[i] for i in range(3)]
    finally:
        claims_engine.dispose()
        with session_factory.begin() as session:
            batch_id = session.get(Job, uuid.UUID(lines[0])).batch_id
            session.execute(delete(Job).where(Job.model == model))
            session.execute(delete(Batch).where(Batch.id == batch_id))
