"""How Postgres runs the claims (workers/claims.py) while a big batch waits queued.

A claim takes a few rows; what it reads must not grow with the queue. With 2,000 queued
lines of the model, every scan of the claim's plan (EXPLAIN ANALYZE, rolled back) reads
about as many rows as it claims: the claimed-ahead interactive jobs through their
ordered index, the lines through theirs, then the rows updated by primary key.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, text

from tasks.db import utcnow
from tasks.models import Batch, Job
from tests.batch_helpers import store_queued_lines
from tests.pipeline_helpers import insert_job
from workers.claims import JobClaims

NUM_LINES = 2000
CLAIM = 15


def _scans(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = [node] if "Scan" in node["Node Type"] else []
    for child in node.get("Plans", []):
        found += _scans(child)
    return found


def _rows_read(scan: dict[str, Any]) -> int:
    return int(scan.get("Actual Rows", 0) + scan.get("Rows Removed by Filter", 0)
               + scan.get("Rows Removed by Index Recheck", 0))


def _explained(session_factory: Any, statement: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The plan Postgres ran `statement` with (its changes rolled back)."""
    engine = session_factory.kw["bind"]
    compiled = statement.compile(dialect=engine.dialect)
    with engine.connect() as conn:
        try:
            (plan,), = conn.exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) " + str(compiled),
                                            compiled.construct_params(params)).all()
        finally:
            conn.rollback()
    return plan[0]["Plan"]


def test_a_claim_reads_about_the_rows_it_claims_however_long_the_queue(
        service_settings, session_factory, redis_client):
    model = f"plans-{uuid.uuid4().hex[:6]}"
    lines = store_queued_lines(session_factory, model, list(range(NUM_LINES)),
                               created_at=utcnow() - timedelta(seconds=5))
    jobs = [insert_job(session_factory, model=model) for _ in range(CLAIM + 5)]
    try:
        with session_factory.begin() as session:  # the planner sees the queue as it is
            session.execute(text("ANALYZE jobs"))
        claims = JobClaims(service_settings, session_factory, redis_client, "plans-group",
                           own=lambda job_id, attempt: None)
        now = utcnow()
        times = {"claim_now": now, "claim_lease": now + timedelta(seconds=30)}
        plans = {
            "with_ahead": _explained(session_factory, claims._with_ahead, {
                **times, "claim_job_id": uuid.UUID(jobs[0]), "claim_model": model,
                "claim_limit": CLAIM}),
            "lines": _explained(session_factory, claims._lines, {
                **times, "claim_model": model, "claim_limit": CLAIM}),
        }
        for name, plan in plans.items():
            claimed = CLAIM + 1 if name == "with_ahead" else CLAIM
            assert plan["Actual Rows"] == claimed, (name, plan["Actual Rows"])
            for scan in _scans(plan):
                on = scan.get("Index Name") or scan.get("Relation Name")
                assert _rows_read(scan) <= claimed, (
                    f"{name}: {scan['Node Type']} on {on} read {_rows_read(scan)} rows to "
                    f"claim {claimed}")
        # and the statements claim as before: the job, the oldest others; the first lines
        assert {str(row.id) for row in claims.with_ahead(uuid.UUID(jobs[0]), model, 3)} \
            == set(jobs[:4])
        assert [str(row.id) for row in claims.lines(model, 3)] == [lines[i] for i in range(3)]
    finally:
        with session_factory.begin() as session:
            batch_id = session.get(Job, uuid.UUID(lines[0])).batch_id
            session.execute(delete(Job).where(Job.model == model))
            session.execute(delete(Batch).where(Batch.id == batch_id))
