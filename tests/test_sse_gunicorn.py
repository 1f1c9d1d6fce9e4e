"""Event streams served by gunicorn: `llmq web`'s worker (the stream server holds them)
and stock gthread; either way the live-event hub writes token events straight to the
client sockets: HTTP/1.1 (chunked) and HTTP/1.0, replay,
reconnect, a client that leaves early. Real gunicorn, worker process, Postgres, Redis."""

from __future__ import annotations

import json
import socket
import sys

import pytest
import requests

from tests.fixtures_services import free_port
from tests.pipeline_helpers import (
    iter_sse,
    read_job,
    running_worker,
    serving_web,
    submit,
    wait_terminal,
    worker_env,
)

pytestmark = pytest.mark.integration

LONG = {"max_tokens": 300, "ignore_eos": True, "temperature": 0.0}


# `llmq web`'s worker (streams held by the stream server) and stock gthread (a thread per
# stream, the hub writing through webapp/sse_sink.py)
@pytest.fixture(scope="module", params=["webapp.stream_worker.StreamWorker", "gthread"])
def gunicorn_url(request, service_settings, tmp_path_factory):
    port = free_port()
    env = worker_env(service_settings, LLMQ_SSE_HEARTBEAT_SECONDS="1")
    command = [sys.executable, "-m", "gunicorn", "-k", request.param, "-w", "1", "--threads",
               "16", "-b", f"127.0.0.1:{port}", "webapp.wsgi:app"]
    with serving_web(command, env, tmp_path_factory.mktemp("gunicorn") / "web.log") as url:
        yield url


@pytest.fixture(scope="module")
def group(service_settings, redis_client, tmp_path_factory):
    # NOTE: one token event per step (no stream interval): these tests want many events
    # in flight, a client leaving while the hub writes to it
    with running_worker(service_settings, redis_client, tmp_path_factory.mktemp("workers"),
                        "sse", extra_env={"LLMQ_STREAM_INTERVAL_SECONDS": "0"}) as worker:
        yield worker


def _http10_events(url: str, job_id: str) -> list[tuple[str | None, str, dict]]:
    """Read a stream over HTTP/1.0 (no chunking: the server closes at the end)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"GET /v1/jobs/{job_id}/events HTTP/1.0\r\nHost: t\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")), head
    assert b"chunked" not in head.lower()
    events = []
    for block in body.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n")
                      if ": " in line and not line.startswith(":"))
        if "event" in fields:
            events.append((fields.get("id"), fields["event"], json.loads(fields["data"])))
    return events


def _check_stream(events_text: str, token_ids: list[int], job_id: str, session_factory):
    row = read_job(session_factory, job_id)
    assert row.status == "succeeded"
    assert events_text == row.output_text and token_ids == row.output[0]["token_ids"]


def test_http11_stream_equals_stored_output(gunicorn_url, group, session_factory):
    job = submit(gunicorn_url, prompt="the quick brown fox", **LONG)
    events = list(iter_sse(gunicorn_url, job["id"]))
    assert [e.event for e in events].count("done") == 1 and events[-1].event == "done"
    ids = [e.id for e in events]
    assert len(set(ids)) == len(ids) and ids == sorted(ids, key=lambda i: tuple(
        int(p) for p in i.split("-")))
    tokens = [e for e in events if e.event == "token"]
    _check_stream("".join(e.data["text"] for e in tokens),
                  [t for e in tokens for t in e.data["token_ids"]], job["id"],
                  session_factory)
    assert len(tokens) == 300


def test_http10_stream_equals_stored_output(gunicorn_url, group, session_factory):
    job = submit(gunicorn_url, prompt="hello there", **LONG)
    events = _http10_events(gunicorn_url, job["id"])
    assert events[-1][1] == "done"
    tokens = [data for _, kind, data in events if kind == "token"]
    _check_stream("".join(d["text"] for d in tokens),
                  [t for d in tokens for t in d["token_ids"]], job["id"], session_factory)


def test_reconnect_mid_stream_and_a_client_that_leaves(gunicorn_url, group, session_factory):
    job = submit(gunicorn_url, prompt="reconnect me", **LONG)
    seen = []
    for event in iter_sse(gunicorn_url, job["id"]):
        seen.append(event)
        if len(seen) == 20:
            break  # the client leaves while the hub is writing to it
    rest = list(iter_sse(gunicorn_url, job["id"], last_event_id=seen[-1].id))
    assert rest[-1].event == "done"
    everything = seen + rest
    ids = [e.id for e in everything]
    assert len(set(ids)) == len(ids)
    tokens = [e for e in everything if e.event == "token"]
    _check_stream("".join(e.data["text"] for e in tokens),
                  [t for e in tokens for t in e.data["token_ids"]], job["id"],
                  session_factory)
    # the server is fine after the early leave: another stream works end to end
    other = submit(gunicorn_url, prompt="after", max_tokens=8, temperature=0.0)
    assert list(iter_sse(gunicorn_url, other["id"]))[-1].event == "done"
    wait_terminal(session_factory, job["id"])


def _openai_chunks(url: str, **body) -> tuple[str, list[dict], requests.Response]:
    response = requests.post(url + "/v1/completions", json={"model": "tiny", "stream": True,
                                                            **body}, stream=True, timeout=60)
    assert response.status_code == 200, response.text
    chunks = []
    for line in response.iter_lines(decode_unicode=True):
        if line == "data: [DONE]":
            break
        if line.startswith("data: "):
            chunks.append(json.loads(line[6:]))
    return response.headers["X-Llmq-Job-Id"], chunks, response


def test_openai_stream_equals_stored_output(gunicorn_url, group, session_factory):
    job_id, chunks, _ = _openai_chunks(gunicorn_url, prompt="stream it", max_tokens=40,
                                       temperature=0.0, ignore_eos=True)
    row = read_job(session_factory, job_id)
    assert row.status == "succeeded"
    assert "".join(c["choices"][0]["text"] for c in chunks) == row.output_text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_openai_stream_closed_by_the_client_cancels_its_job(gunicorn_url, group,
                                                           session_factory):
    response = requests.post(gunicorn_url + "/v1/completions", stream=True, timeout=60,
                             json={"model": "tiny", "prompt": "leave early", "stream": True,
                                   "max_tokens": 2000, "ignore_eos": True})
    job_id = response.headers["X-Llmq-Job-Id"]
    lines = response.iter_lines()
    while not next(lines).startswith(b"data: {"):
        pass
    response.close()  # the client goes away mid-stream
    row = wait_terminal(session_factory, job_id, timeout=30)
    assert row.status == "cancelled"
    assert row.completion_tokens is None or row.completion_tokens < 2000
