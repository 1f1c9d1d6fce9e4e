"""The device-group service survives infrastructure faults (real Redis, Postgres and
worker processes): a Redis restart, Redis down mid-stream, Postgres unreachable for longer
than the lease. Every job ends once, with its own attempt's text, and every stream is
complete: its tokens once each, one terminal event, nothing after it."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import requests

from tasks.models import JobStatus
from tasks.protocol import EventType, JobEvent
from tasks.redis_client import make_redis
from tests.fault_helpers import Beat, RedisServer, TcpProxy
from tests.pipeline_helpers import (
    WorkerProcess,
    iter_sse,
    read_job,
    read_stream,
    submit,
    wait_for,
)

pytestmark = pytest.mark.integration

WORKER_ARGS = ["--max-num-seqs", "8", "--kv-cache-bytes", str(16 * 1024 * 1024),
               "--concurrency", "2"]


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def settings(service_settings, redis_server):
    return service_settings.with_overrides(
        redis_url=redis_server.url, redis_prefix=f"llmqfault{uuid.uuid4().hex[:8]}",
        queued_resend_seconds=2.0, lease_seconds=4.0, lease_renew_seconds=0.5)


@pytest.fixture
def redis(settings):
    client = make_redis(settings.redis_url)
    yield client
    client.close()


def _start_worker(settings, redis, tmp_path, name: str, **env: str) -> WorkerProcess:
    worker = WorkerProcess(settings, f"{name}-{uuid.uuid4().hex[:4]}", tmp_path,
                           args=WORKER_ARGS, extra_env=env)
    worker.wait_ready(redis)
    return worker


def _wait_all_terminal(session_factory, ids: list[str], timeout: float) -> dict[str, Any]:
    wait_for(lambda: all(JobStatus(read_job(session_factory, i).status).is_terminal
                         for i in ids), timeout, "every job to end", interval=0.2)
    return {i: read_job(session_factory, i) for i in ids}


def _check_stream(redis, settings, row) -> list[JobEvent]:
    """One terminal event, last; the tokens since the last restart are the stored text."""
    events = [event for _, event in read_stream(redis, settings, str(row.id))]
    types = [event.type for event in events]
    terminal = [t for t in types if t.is_terminal]
    assert terminal == [EventType.DONE], (row.id, types[-5:])
    assert types[-1] is EventType.DONE, "an event after the terminal one"
    start = max((i + 1 for i, t in enumerate(types) if t is EventType.RESTART), default=0)
    tokens = [e for e in events[start:] if e.type is EventType.TOKEN]
    assert "".join(e.text for e in tokens) == row.output_text
    assert sum(len(e.token_ids) for e in tokens) == row.completion_tokens
    return events


def test_a_redis_restart_loses_no_job_and_no_token(settings, redis, redis_server,
                                                    session_factory, start_web, tmp_path):
    base_url = start_web(settings)
    worker = _start_worker(settings, redis, tmp_path, "redis-restart")
    try:
        ids = [submit(base_url, prompt=f"restart {i}", max_tokens=300, ignore_eos=True,
                      temperature=0.0)["id"] for i in range(12)]  # 8 run, 4 wait queued
        wait_for(lambda: sum(bool(read_job(session_factory, i).first_token_at)
                             for i in ids) >= 4, 60, "jobs generating")
        redis_server.restart(down_seconds=1.0)
        with Beat(settings, session_factory):
            rows = _wait_all_terminal(session_factory, ids, 60)
        assert worker.process.poll() is None, worker.log_tail()  # survived the restart
    finally:
        code = worker.terminate()
    assert code == 0, worker.log_tail()
    assert {row.status for row in rows.values()} == {JobStatus.SUCCEEDED.value}
    assert {row.attempts for row in rows.values()} == {1}  # nothing was run twice
    for row in rows.values():
        _check_stream(redis, settings, row)


def test_postgres_gone_for_twice_the_lease_stores_each_job_once(
        settings, redis, session_factory, start_web, tmp_path):
    parts = urlsplit(settings.database_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    proxied = urlunsplit(parts._replace(netloc=parts.netloc.replace(
        f"{parts.hostname}:{parts.port or 5432}", f"127.0.0.1:{proxy.port}")))
    worker_settings = settings.with_overrides(database_url=proxied)
    base_url = start_web(settings)
    worker = _start_worker(worker_settings, redis, tmp_path, "pg-cut")
    try:
        # sampled, unseeded: two attempts of a job write different texts
        ids = [submit(base_url, prompt=f"fence {i}", max_tokens=500, ignore_eos=True,
                      temperature=1.0)["id"] for i in range(4)]
        wait_for(lambda: all(read_job(session_factory, i).first_token_at for i in ids),
                 60, "every job generating")
        with Beat(settings, session_factory, interval=0.5) as beat:
            proxy.cut()
            time.sleep(2 * settings.lease_seconds)
            assert beat.num_reclaimed >= 1
            proxy.restore()
            rows = _wait_all_terminal(session_factory, ids, 60)
        assert worker.process.poll() is None, worker.log_tail()
    finally:
        code = worker.terminate()
        proxy.close()
    assert code == 0, worker.log_tail()
    assert {row.status for row in rows.values()} == {JobStatus.SUCCEEDED.value}
    reclaimed = [row for row in rows.values() if row.attempts == 2]
    assert reclaimed, "no job was reclaimed during the outage"
    for row in rows.values():
        events = _check_stream(redis, settings, row)
        restarts = [e for e in events if e.type is EventType.RESTART]
        assert len(restarts) == row.attempts - 1


def _follow(base_url: str, job_id: str, seen: dict[str, list[tuple[str, str]]],
            errors: list[str]) -> None:
    """A client that reconnects with Last-Event-ID until the terminal event."""
    last_id: str | None = None
    events = seen.setdefault(job_id, [])
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            for event in iter_sse(base_url, job_id, last_event_id=last_id, timeout=10):
                if event.id:
                    last_id = event.id
                events.append((event.event, event.data.get("text", "")))
                if event.event in ("done", "error", "cancelled"):
                    return
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.3)
    errors.append(f"{job_id}: no terminal event")


def _stream_through(fault: Callable[[], None], settings, redis, session_factory,
                    base_url: str, worker: WorkerProcess, num_jobs: int) -> None:
    """Submit `num_jobs` jobs, follow each with a client that reconnects with
    Last-Event-ID, run `fault()` once tokens flow; then every job succeeded on its first
    attempt, its stream holds its stored text, and its client got every token once and
    one terminal event."""
    seen: dict[str, list[tuple[str, str]]] = {}
    errors: list[str] = []
    try:
        ids = [submit(base_url, prompt=f"tokens {i}", max_tokens=400, ignore_eos=True,
                      temperature=0.0)["id"] for i in range(num_jobs)]
        clients = [threading.Thread(target=_follow, args=(base_url, i, seen, errors),
                                    daemon=True) for i in ids]
        for client in clients:
            client.start()
        wait_for(lambda: all(len(seen.get(i, [])) >= 5 for i in ids), 60, "tokens flowing")
        fault()
        with Beat(settings, session_factory):
            rows = _wait_all_terminal(session_factory, ids, 60)
            for client in clients:
                client.join(60)
        assert worker.process.poll() is None, worker.log_tail()
    finally:
        code = worker.terminate()
    assert code == 0, worker.log_tail()
    assert not errors
    for job_id in ids:
        row = rows[job_id]
        assert row.status == JobStatus.SUCCEEDED.value and row.attempts == 1
        _check_stream(redis, settings, row)
        events = seen[job_id]
        assert [t for t, _ in events if t in ("done", "error", "cancelled")] == ["done"]
        assert "".join(text for t, text in events if t == "token") == row.output_text


def test_redis_down_ten_seconds_mid_stream_every_client_gets_every_token_once(
        settings, redis, redis_server, session_factory, start_web, tmp_path):
    base_url = start_web(settings)
    worker = _start_worker(settings, redis, tmp_path, "redis-down")
    _stream_through(lambda: redis_server.restart(down_seconds=10.0), settings, redis,
                    session_factory, base_url, worker, num_jobs=4)


def test_redis_at_its_memory_limit_now_and_then_every_client_gets_every_token_once(
        settings, redis, redis_server, session_factory, start_web, tmp_path):
    """Redis refuses writes now and then (its memory limit switched on and off by another
    client) while jobs stream: a refused publish is re-sent in order, and no step behind it
    is stored ahead of it."""
    base_url = start_web(settings)
    # every step's tokens published at once: steps follow each other with publishes
    # still on their way, where one refused must not be overtaken
    worker = _start_worker(settings, redis, tmp_path, "redis-oom",
                           LLMQ_STREAM_INTERVAL_SECONDS="0")
    flipping = make_redis(settings.redis_url)

    def refuse_writes_now_and_then() -> None:
        until = time.monotonic() + 2.0
        try:
            while time.monotonic() < until:
                flipping.config_set("maxmemory", 1)
                flipping.config_set("maxmemory", 0)
        finally:
            flipping.config_set("maxmemory", 0)

    try:
        _stream_through(refuse_writes_now_and_then, settings, redis, session_factory,
                        base_url, worker, num_jobs=8)
    finally:
        flipping.close()
    assert "OOM" in worker.log_path.read_text(errors="replace")  # publishes were refused


def test_a_worker_started_before_redis_waits_for_it(settings, redis, redis_server,
                                                    session_factory, start_web, tmp_path):
    redis_server.stop()
    worker = WorkerProcess(settings, f"early-{uuid.uuid4().hex[:4]}", tmp_path,
                           args=WORKER_ARGS)
    try:
        wait_for(lambda: "is waiting for Redis" in worker.log_tail(), 60,
                 "the worker to say it waits for Redis", interval=0.2)
        time.sleep(11)  # longer than the ~10 s after which it used to give up
        assert worker.process.poll() is None, worker.log_tail()
        redis_server.start()
        worker.wait_ready(redis)
        base_url = start_web(settings)
        job_id = submit(base_url, prompt="late redis", max_tokens=20)["id"]
        rows = _wait_all_terminal(session_factory, [job_id], 60)
    finally:
        code = worker.terminate()
    assert code == 0, worker.log_tail()
    assert rows[job_id].status == JobStatus.SUCCEEDED.value
