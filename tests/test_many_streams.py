"""One web process, started as `llmq web` starts it, holds 2,000 idle event streams while
`/health` stays fast, submissions and polls work, and closed clients are released at once.

Real gunicorn (the stream worker, 4 request threads), Postgres, Redis; no device group:
the jobs stay queued, so their streams stay open and idle.
"""

from __future__ import annotations

import re
import resource
import socket
import time

import pytest
import requests

from llmq.commands import web_command
from tests.fixtures_services import free_port
from tests.pipeline_helpers import serving_web, submit, worker_env

pytestmark = pytest.mark.integration

NUM_STREAMS = 2000
NUM_THREADS = 4  # far fewer request threads than streams: a stream must not hold one


@pytest.fixture(scope="module")
def web_url(service_settings, tmp_path_factory):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < NUM_STREAMS + 500:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, NUM_STREAMS + 1000), hard))
    port = free_port()
    command = web_command("127.0.0.1", port, workers=1, threads=NUM_THREADS,
                          graceful_timeout=2.0)
    command.remove("--access-logfile")
    command.remove("-")  # 2,000 access lines say nothing here
    with serving_web(command, worker_env(service_settings),
                     tmp_path_factory.mktemp("web") / "web.log") as url:
        yield url


def _open_streams(url: str, job_ids: list[str], count: int) -> list[socket.socket]:
    """`count` raw SSE connections, each past its headers and first bytes."""
    host, port = url.removeprefix("http://").split(":")
    socks: list[socket.socket] = []
    for start in range(0, count, 250):  # a batch at a time: stay inside the listen backlog
        batch = []
        for i in range(start, min(start + 250, count)):
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.sendall(f"GET /v1/jobs/{job_ids[i % len(job_ids)]}/events HTTP/1.1\r\n"
                         "Host: t\r\nAccept: text/event-stream\r\n\r\n".encode())
            batch.append(sock)
        for sock in batch:
            data = b""
            while b"retry:" not in data:
                chunk = sock.recv(4096)
                assert chunk, f"the server closed a stream early: {data!r}"
                data += chunk
            assert data.startswith(b"HTTP/1.1 200"), data
        socks.extend(batch)
    return socks


def _open_gauge(url: str) -> int:
    text = requests.get(url + "/metrics", timeout=10).text
    match = re.search(r"^llmq:sse_open_streams (\S+)$", text, re.MULTILINE)
    assert match, "no llmq:sse_open_streams gauge on /metrics"
    return int(float(match.group(1)))


@pytest.mark.alone
def test_two_thousand_idle_streams_leave_the_api_responsive(web_url, session_factory):
    jobs = [submit(web_url, prompt=f"idle {i}", max_tokens=4)["id"] for i in range(20)]
    socks = _open_streams(web_url, jobs, NUM_STREAMS)
    try:
        # NOTE: a client may read its first bytes a moment before the server counts its
        # stream as held: every one is counted within a second
        deadline = time.monotonic() + 2.0
        while (open_now := _open_gauge(web_url)) != NUM_STREAMS:
            assert time.monotonic() < deadline, f"{open_now} of {NUM_STREAMS} streams held"
            time.sleep(0.05)

        timings = []
        for _ in range(50):
            started = time.perf_counter()
            assert requests.get(web_url + "/health", timeout=5).ok
            timings.append(time.perf_counter() - started)
        timings.sort()
        p99 = timings[int(0.99 * (len(timings) - 1))]
        assert p99 < 0.100, f"/health p99 {p99 * 1000:.1f} ms with {NUM_STREAMS} streams"

        job = submit(web_url, prompt="one more", max_tokens=4)
        poll = requests.get(f"{web_url}/v1/jobs/{job['id']}", timeout=10)
        assert poll.status_code == 200 and poll.json()["status"] == "queued"

        # clients that go away are released at once, not at the next heartbeat
        for sock in socks[:100]:
            sock.close()
        del socks[:100]
        deadline = time.monotonic() + 2.0
        while (open_now := _open_gauge(web_url)) != NUM_STREAMS - 100:
            assert time.monotonic() < deadline, (
                f"{open_now} streams still open 2 s after 100 of {NUM_STREAMS} clients left")
            time.sleep(0.05)

        # the streams still live: a cancel reaches every client of that job
        assert requests.post(f"{web_url}/v1/jobs/{jobs[-1]}/cancel", timeout=10).ok
        listeners = [s for i, s in enumerate(socks, start=100)
                     if i % len(jobs) == len(jobs) - 1]
        for sock in listeners[:5]:
            data = b""
            while b"event: cancelled" not in data:
                chunk = sock.recv(4096)
                assert chunk, f"the stream ended without its terminal event: {data!r}"
                data += chunk
    finally:
        for sock in socks:
            sock.close()
