"""Chaos benchmark: a loaded stack under one infrastructure fault at a time.

    python benchmarks/bench_chaos.py [--num-jobs 200] [--groups 2] [--max-tokens 64]
        [--faults none,redis-restart,redis-down,postgres-cut,worker-kill]

The stack: a throwaway Postgres database, a private redis-server (append-only file on, as
a production Redis), `--groups` device-group worker processes reaching Postgres through a
TCP proxy the benchmark can cut, and a beat stand-in (lease reclaim and stranded-job resend
every 0.5 s). For each fault, `--num-jobs` jobs are queued at once (rows plus `generate`
messages, as the web does), the fault is applied once a few jobs generate, and every job is
awaited. Faults:

* `redis-restart`: Redis stopped and started again after 1 s,
* `redis-down`: Redis stopped for 10 s mid-stream,
* `postgres-cut`: the workers' Postgres connections cut for twice the lease,
* `worker-kill`: one worker SIGKILLed, a new one started.

Per fault it prints submitted / succeeded / failed (with reason) / lost (not ended in
time) / duplicated (more than one terminal event, or more tokens in the stream than the
stored output) / truncated (fewer, or no terminal event last) / run twice (attempts > 1:
reclaimed, not lost) and the recovery time: from the service's return to the first job
ending after it. A Markdown table at the end; `--json` for the raw figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tasks.celery_app import create_celery, send_generate  # noqa: E402
from tasks.db import create_db_engine, make_sessionmaker, upgrade_database  # noqa: E402
from tasks.models import JobStatus  # noqa: E402
from tasks.protocol import EventType  # noqa: E402
from tasks.redis_client import make_redis  # noqa: E402
from tasks.settings import Settings  # noqa: E402
from tests.fault_helpers import Beat, RedisServer, TcpProxy  # noqa: E402
from tests.pipeline_helpers import (  # noqa: E402
    WorkerProcess,
    insert_job,
    read_job,
    read_stream,
)

FAULTS = ("none", "redis-restart", "redis-down", "postgres-cut", "worker-kill")
WORKER_ARGS = ["--max-num-seqs", "16", "--kv-cache-bytes", str(32 * 1024 * 1024),
               "--concurrency", "2", "--loglevel", "WARNING"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-jobs", type=int, default=200)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--preset", default="tiny", help="workers.engine.make_model preset")
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per fault")
    p.add_argument("--lease-seconds", type=float, default=4.0)
    p.add_argument("--postgres-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


class Stack:
    """Database, Redis, proxy, workers and beat of one benchmark run."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        import psycopg

        self.args = args
        self.workdir = workdir
        self.db_name = f"llmq_chaos_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(args.postgres_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.db_name}"')
        database_url = args.postgres_url.rsplit("/", 1)[0] + "/" + self.db_name
        upgrade_database(database_url)
        from workers.engine.make_model import make_model

        model_dir = str(make_model(workdir / "model", "qwen3", args.preset))
        self.redis_server = RedisServer(workdir)
        self.settings = Settings(
            database_url=database_url, redis_url=self.redis_server.url,
            redis_prefix=f"llmqchaos{uuid.uuid4().hex[:8]}", models={"bench": model_dir},
            lease_seconds=args.lease_seconds, lease_renew_seconds=0.5,
            queued_resend_seconds=3.0, drain_grace_seconds=5.0)
        parts = urlsplit(database_url)
        self.proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
        self.worker_settings = self.settings.with_overrides(database_url=urlunsplit(
            parts._replace(netloc=parts.netloc.replace(
                f"{parts.hostname}:{parts.port or 5432}", f"127.0.0.1:{self.proxy.port}"))))
        self.db = create_db_engine(database_url)
        self.session_factory = make_sessionmaker(self.db)
        self.redis = make_redis(self.settings.redis_url)
        self.app = create_celery(self.settings)
        self.workers = [self.start_worker() for _ in range(args.groups)]
        self.beat = Beat(self.settings, self.session_factory).__enter__()

    def start_worker(self) -> WorkerProcess:
        worker = WorkerProcess(self.worker_settings, f"chaos-{uuid.uuid4().hex[:4]}",
                               self.workdir, model="bench", args=WORKER_ARGS)
        worker.wait_ready(self.redis, timeout=120)
        return worker

    def close(self) -> None:
        import psycopg

        self.beat.__exit__(None, None, None)
        for worker in self.workers:
            worker.terminate()
        self.proxy.close()
        self.redis.close()
        self.redis_server.stop()
        self.db.dispose()
        with psycopg.connect(self.args.postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')


def submit_all(stack: Stack, args: argparse.Namespace, fault: str) -> list[str]:
    ids = []
    for i in range(args.num_jobs):
        job_id = insert_job(stack.session_factory, model="bench", prompt=f"{fault} job {i}",
                            params={"max_tokens": args.max_tokens, "ignore_eos": True,
                                    "temperature": 1.0})
        send_generate(stack.app, stack.settings, job_id, "bench")
        ids.append(job_id)
    return ids


def apply_fault(stack: Stack, fault: str) -> float:
    """Apply `fault`; returns time.monotonic() when the service is back."""
    if fault == "redis-restart":
        stack.redis_server.restart(down_seconds=1.0)
    elif fault == "redis-down":
        stack.redis_server.restart(down_seconds=10.0)
    elif fault == "postgres-cut":
        stack.proxy.cut()
        time.sleep(2 * stack.settings.lease_seconds)
        stack.proxy.restore()
    elif fault == "worker-kill":
        victim = stack.workers.pop(0)
        victim.kill()
        stack.workers.append(stack.start_worker())
    return time.monotonic()


def classify(stack: Stack, job_id: str) -> tuple[str, str | None]:
    row = read_job(stack.session_factory, job_id)
    if not JobStatus(row.status).is_terminal:
        return "lost", None
    if row.status != JobStatus.SUCCEEDED.value:
        return "failed", row.error
    events = [event for _, event in read_stream(stack.redis, stack.settings, job_id)]
    types = [event.type for event in events]
    num_terminal = sum(t.is_terminal for t in types)
    if num_terminal != 1 or not types[-1].is_terminal:
        outcome = "duplicated" if num_terminal > 1 else "truncated"
        print(f"job {job_id} {outcome}: attempts {row.attempts}, events "
              f"{_runs([t.value for t in types])}", file=sys.stderr)
        return outcome, None
    start = max((i + 1 for i, t in enumerate(types) if t is EventType.RESTART), default=0)
    text = "".join(e.text for e in events[start:] if e.type is EventType.TOKEN)
    if text == row.output_text:
        return "succeeded", None
    outcome = "duplicated" if len(text) > len(row.output_text) else "truncated"
    print(f"job {job_id} {outcome}: attempts {row.attempts}, events "
          f"{_runs([t.value for t in types])}, stream text {len(text)} chars, stored "
          f"{len(row.output_text)}", file=sys.stderr)
    return outcome, None


def _runs(types: list[str]) -> str:
    """token x12, restart, token x40, done"""
    runs: list[list[Any]] = []
    for t in types:
        if runs and runs[-1][0] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    return ", ".join(t if n == 1 else f"{t} x{n}" for t, n in runs)


def run_fault(stack: Stack, args: argparse.Namespace, fault: str) -> dict[str, Any]:
    started = time.monotonic()
    ids = submit_all(stack, args, fault)
    deadline = started + args.timeout
    while time.monotonic() < deadline:  # a few jobs generating: the stack is loaded
        done = sum(1 for i in ids[:32] if read_job(stack.session_factory, i).first_token_at)
        if done >= 4:
            break
        time.sleep(0.2)
    back_at = apply_fault(stack, fault) if fault != "none" else time.monotonic()
    first_end_after: float | None = None
    pending = set(ids)
    while pending and time.monotonic() < deadline:
        ended = {i for i in pending
                 if JobStatus(read_job(stack.session_factory, i).status).is_terminal}
        if ended and first_end_after is None:
            first_end_after = time.monotonic()
        pending -= ended
        time.sleep(0.5)
    counts: collections.Counter[str] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    rerun = sum(1 for i in ids if (read_job(stack.session_factory, i).attempts or 0) > 1)
    for job_id in ids:
        outcome, reason = classify(stack, job_id)
        counts[outcome] += 1
        if reason:
            reasons[reason[:80]] += 1
    return {"fault": fault, "submitted": len(ids), "succeeded": counts["succeeded"],
            "failed": counts["failed"], "failed_reasons": dict(reasons),
            "lost": counts["lost"], "duplicated": counts["duplicated"],
            "truncated": counts["truncated"], "rerun": rerun,
            "recovery_seconds": None if first_end_after is None
            else max(0.0, first_end_after - back_at),
            "total_seconds": time.monotonic() - started}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        print(f"error: unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}",
              file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="llmq-bench-chaos-"))
    stack = Stack(args, workdir)
    results = []
    try:
        for fault in faults:
            result = run_fault(stack, args, fault)
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        stack.close()
    print(f"\n{args.num_jobs} jobs x {args.max_tokens} tokens per fault, {args.groups} groups, "
          f"`{args.preset}` qwen3, lease {args.lease_seconds:g} s\n")
    print("| fault | submitted | succeeded | failed (reason) | lost | duplicated | truncated "
          "| run twice | recovery s | total s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        reasons = "; ".join(f"{n} {why}" for why, n in r["failed_reasons"].items())
        recovery = "-" if r["recovery_seconds"] is None else f"{r['recovery_seconds']:.1f}"
        print(f"| {r['fault']} | {r['submitted']} | {r['succeeded']} | {r['failed']}"
              f"{f' ({reasons})' if reasons else ''} | {r['lost']} | {r['duplicated']} | "
              f"{r['truncated']} | {r['rerun']} | {recovery} | {r['total_seconds']:.1f} |")
    if args.json:
        print(json.dumps(results))
    bad = sum(r["lost"] + r["duplicated"] + r["truncated"] + r["failed"] for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
