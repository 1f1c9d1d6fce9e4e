"""Dashboard server time over a large jobs table: the API calls the page makes, timed.

    python benchmarks/bench_dashboard.py [--num-jobs 10000] [--repeats 30]

Fills a throwaway Postgres database with `--num-jobs` job rows (statuses, models, kinds,
API keys and creation times spread like a busy day; prompts and outputs of a few hundred
characters), then times each call the dashboard makes through the Flask app in-process
(the test client: server time only, no network): the page itself, the first jobs page, the
next page, a page deep in the listing, each filter, the summary (counts per status and
per-model queues, read every 2 s by every open page) and one job's view. Auth off (every
job listed) and auth on (one key's jobs, as a key holder sees them).

Uses the Postgres and Redis this machine runs (the database and key prefix are removed at
the end). Prints a Markdown table (median and p95 in ms) and, with --json, the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_services import add_service_args, create_scratch, drop_scratch  # noqa: E402
from sqlalchemy import insert, text  # noqa: E402

from tasks.auth import create_api_key  # noqa: E402
from tasks.db import create_db_engine, make_sessionmaker, utcnow  # noqa: E402
from tasks.models import Job  # noqa: E402
from tasks.settings import Settings  # noqa: E402
from webapp import create_app  # noqa: E402

BUDGET_MS = 300.0  # the page's server time budget per call
STATUSES = ["succeeded"] * 85 + ["failed"] * 5 + ["cancelled"] * 6 + ["queued"] * 2 + \
    ["running"] * 2
MODELS = ["qwen3-0.6b", "qwen3-4b", "llama-3.2-1b"]
WORDS = "the quick brown fox jumps over a lazy dog while seven owls watch the moon".split()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-jobs", type=int, default=10_000)
    p.add_argument("--num-keys", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30, help="timed calls per endpoint")
    add_service_args(p)
    return p.parse_args(argv)


def fill(session_factory: Any, num_jobs: int, key_ids: list[uuid.UUID]) -> None:
    """`num_jobs` rows created over the last 24 hours, inserted in batches."""
    rng = random.Random(0)
    now = utcnow()
    batch: list[dict[str, Any]] = []
    for i in range(num_jobs):
        created = now - timedelta(seconds=rng.uniform(0, 86_400))
        status = rng.choice(STATUSES)
        started = created + timedelta(seconds=rng.uniform(0.01, 2.0))
        first = started + timedelta(seconds=rng.uniform(0.02, 0.5))
        finished = first + timedelta(seconds=rng.uniform(0.5, 20.0))
        done = status not in ("queued", "running")
        prompt = " ".join(rng.choice(WORDS) for _ in range(40))
        output = " ".join(rng.choice(WORDS) for _ in range(120)) if done else None
        kind = "chat" if i % 3 == 0 else "completion"
        batch.append({
            "id": uuid.uuid4(), "api_key_id": key_ids[i % len(key_ids)],
            "model": MODELS[i % len(MODELS)], "kind": kind, "prompt": prompt,
            "messages": [{"role": "user", "content": prompt}] if kind == "chat" else None,
            "prompt_token_ids": list(range(48)), "params": {"max_tokens": 128},
            "priority": 0, "status": status, "attempts": 0 if status == "queued" else 1,
            "finish_reason": "length" if status == "succeeded" else None,
            "output": [{"index": 0, "text": output, "finish_reason": "length"}] if output
            else None, "output_text": output, "prompt_tokens": 48,
            "completion_tokens": 128 if done else None, "cached_tokens": 0,
            "worker": f"group-{i % 4}", "created_at": created,
            "started_at": None if status == "queued" else started,
            "first_token_at": first if done else None, "finished_at": finished if done else None,
        })
        if len(batch) == 2_000:
            with session_factory.begin() as session:
                session.execute(insert(Job), batch)
            batch = []
    if batch:
        with session_factory.begin() as session:
            session.execute(insert(Job), batch)


def timed(client: Any, url: str, headers: dict[str, str], repeats: int) -> list[float]:
    client.get(url, headers=headers)  # warm: first use of a connection, template compile
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        response = client.get(url, headers=headers)
        samples.append((time.perf_counter() - start) * 1000)
        assert response.status_code == 200, (url, response.status_code, response.data[:300])
    return samples


def calls(client: Any, headers: dict[str, str], key_name: str | None) -> list[tuple[str, str]]:
    """(label, url) of every call the page makes, with cursors read from the listing."""
    first = client.get("/v1/dashboard/jobs?limit=25", headers=headers).get_json()
    cursor = first["last_id"]
    deep = first
    for _ in range(40):  # ~1,000 rows down the listing
        deep = client.get(f"/v1/dashboard/jobs?limit=25&after={deep['last_id']}",
                          headers=headers).get_json()
    window_end = utcnow() - timedelta(hours=6)
    window = (f"created_after={(window_end - timedelta(hours=1)).isoformat()}"
              f"&created_before={window_end.isoformat()}").replace("+", "%2B")
    listed = [
        ("page `/`", "/"),
        ("jobs, first page", "/v1/dashboard/jobs?limit=25"),
        ("jobs, next page", f"/v1/dashboard/jobs?limit=25&after={cursor}"),
        ("jobs, page 41", f"/v1/dashboard/jobs?limit=25&after={deep['last_id']}"),
        ("jobs, status=failed", "/v1/dashboard/jobs?limit=25&status=failed"),
        ("jobs, status=queued,running", "/v1/dashboard/jobs?limit=25&status=queued,running"),
        ("jobs, model + kind", f"/v1/dashboard/jobs?limit=25&model={MODELS[1]}&kind=chat"),
        ("jobs, created in one hour", f"/v1/dashboard/jobs?limit=25&{window}"),
        ("summary (counts, queues, groups)", "/v1/dashboard/summary"),
        ("one job (job view)", f"/v1/dashboard/jobs/{first['data'][0]['id']}"),
    ]
    if key_name is not None:
        listed.insert(7, ("jobs, key=<name>", f"/v1/dashboard/jobs?limit=25&key={key_name}"))
    return listed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scratch = create_scratch(args.postgres_url, args.redis_url)
    rows: list[dict[str, Any]] = []
    try:
        engine = create_db_engine(scratch.database_url)
        session_factory = make_sessionmaker(engine)
        keys = [create_api_key(session_factory, f"key-{i}") for i in range(args.num_keys)]
        start = time.perf_counter()
        fill(session_factory, args.num_jobs, [key_id for key_id, _ in keys])
        # NOTE: a table at rest, as autovacuum leaves it: statistics and a visibility map
        # (index-only scans for the counts)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE jobs"))
        print(f"inserted {args.num_jobs} jobs in {time.perf_counter() - start:.1f} s",
              file=sys.stderr)
        base = Settings(database_url=scratch.database_url, redis_url=args.redis_url,
                        redis_prefix=scratch.redis_prefix, models={m: str(REPO) for m in MODELS})
        for auth in (False, True):
            app = create_app(base.with_overrides(auth_enabled=auth))
            client = app.test_client()
            headers = {"Authorization": f"Bearer {keys[0][1]}"} if auth else {}
            scope = f"auth on (1 key: {args.num_jobs // args.num_keys} jobs)" if auth \
                else f"auth off (all {args.num_jobs} jobs)"
            for label, url in calls(client, headers, None if auth else "key-2"):
                samples = sorted(timed(client, url, headers, args.repeats))
                rows.append({"scope": scope, "call": label, "url": url,
                             "median_ms": statistics.median(samples),
                             "p95_ms": samples[int(0.95 * (len(samples) - 1))],
                             "max_ms": samples[-1]})
            app.extensions["llmq"].close()
        engine.dispose()
    finally:
        drop_scratch(scratch)
    print(f"\n{args.num_jobs} jobs, {args.repeats} calls each, server time (Flask in-process)\n")
    print("| scope | call | median ms | p95 ms | max ms |")
    print("| --- | --- | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['scope']} | {row['call']} | {row['median_ms']:.1f} | "
              f"{row['p95_ms']:.1f} | {row['max_ms']:.1f} |")
    worst = max(row["p95_ms"] for row in rows)
    print(f"\nworst p95: {worst:.1f} ms (budget {BUDGET_MS:.0f} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps({"num_jobs": args.num_jobs, "rows": rows},
                                              indent=2))
    return 0 if worst < BUDGET_MS else 1


if __name__ == "__main__":
    sys.exit(main())
