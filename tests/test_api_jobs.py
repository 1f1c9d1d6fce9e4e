"""The jobs API over real HTTP, on real Postgres and Redis (no worker: rows and streams
are driven the way a worker drives them, through the same publisher)."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import requests
from sqlalchemy import func, select, update
from transformers import AutoTokenizer

from tasks.auth import create_api_key
from tasks.models import Job, JobStatus
from tasks.protocol import (
    GENERATE_TASK,
    EventType,
    JobEvent,
    cancel_channel,
    cancel_flag_key,
    group_alive_key,
    groups_key,
)
from tasks.streams.publish import EventPublisher
from webapp.model_registry import read_max_model_len


@pytest.fixture
def api_settings(service_settings):
    # own prefix: the generate messages sent here never reach another test's worker
    return service_settings.with_overrides(
        redis_prefix=f"{service_settings.redis_prefix}a{uuid.uuid4().hex[:6]}")


@pytest.fixture
def api(start_web, api_settings) -> str:
    return start_web(api_settings)


def _count_jobs(session_factory) -> int:
    with session_factory() as session:
        return session.scalar(select(func.count()).select_from(Job))


def _queued_generate_ids(redis_client, settings) -> list[str]:
    key = f"{settings.redis_prefix}:celery:{settings.queue_for('tiny')}"
    messages = [json.loads(raw) for raw in redis_client.lrange(key, 0, -1)]
    assert all(m["headers"]["task"] == GENERATE_TASK for m in messages)
    return [json.loads(m["headers"]["argsrepr"].replace("'", '"'))[0] for m in messages]


def _assert_error(response, status: int, code: str | None = None, param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"type", "message", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


BAD_BODIES = [
    ({"model": "tiny", "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "hi", "top_k": 1.5}, 400, "top_k"),
    ({"model": "tiny", "prompt": "hi", "n": 99}, 400, "n"),
    ({"model": "tiny", "prompt": "hi", "seed": -1}, 400, "seed"),
    ({"model": "tiny", "prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"model": "tiny", "prompt": "hi", "stop": ["ok", 3]}, 400, "stop"),
    ({"model": "tiny", "prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"model": "tiny", "prompt": "hi", "ignore_eos": 1}, 400, "ignore_eos"),
    ({"model": "tiny", "prompt": "hi", "priority": "high"}, 400, "priority"),
    ({"model": "tiny", "prompt": "hi", "min_tokens": 20, "max_tokens": 4}, 400, "min_tokens"),
    ({"model": "tiny", "prompt": "hi", "best_of": 2}, 400, "best_of"),
    ({"model": "tiny"}, 400, "messages"),
    ({"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "x"}]}, 400,
     "prompt"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "prompt": "nul \u0000 byte"}, 400, "prompt"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "a\u0000"}]}, 400,
     "messages[0].content"),
    ({"model": "tiny", "prompt": "hi", "stop": ["\u0000"]}, 400, "stop"),
    ({"model": "tiny", "prompt": [1, "2"]}, 400, "prompt"),
    ({"model": "tiny", "prompt": [10**9]}, 400, "prompt"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny", "prompt": "hi", "stop_token_ids": [512], "min_tokens": 1}, 400,
     "stop_token_ids"),
    ({"model": "tiny", "prompt": "hi", "temperature": 3.5e38}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "repetition_penalty": 1e-40}, 400, "repetition_penalty"),
    ({"model": "tiny", "prompt": "lone \ud800"}, 400, "prompt"),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    (["not", "an", "object"], 400, None),
]


def test_every_bad_input_is_a_json_4xx_and_writes_nothing(api, session_factory):
    before = _count_jobs(session_factory)
    for body, status, param in BAD_BODIES:
        response = requests.post(f"{api}/v1/jobs", json=body, timeout=30)
        error = _assert_error(response, status, param=param)
        assert error["type"] in ("invalid_request_error", "not_found_error"), (body, error)
    _assert_error(requests.post(f"{api}/v1/jobs", data="{not json", timeout=30), 400,
                  "invalid_json")
    _assert_error(requests.post(f"{api}/v1/jobs", json={"model": "tiny", "prompt": "hi"},
                                headers={"Idempotency-Key": "x" * 300}, timeout=30),
                  400, "invalid_idempotency_key")
    assert _count_jobs(session_factory) == before


def test_prompt_too_long_names_both_numbers(api, session_factory, api_settings):
    max_len = read_max_model_len(api_settings.models["tiny"])
    before = _count_jobs(session_factory)
    response = requests.post(f"{api}/v1/jobs", json={
        "model": "tiny", "prompt": "hello world", "max_tokens": max_len}, timeout=30)
    error = _assert_error(response, 400, "context_length_exceeded", "max_tokens")
    assert f"max_tokens is {max_len}" in error["message"]
    assert f"fits {max_len}" in error["message"]
    prompt_tokens = int(error["message"].split("prompt has ")[1].split(" ")[0])
    assert 0 < prompt_tokens < 10
    response = requests.post(f"{api}/v1/jobs", json={
        "model": "tiny", "prompt": "hello world " * max_len, "max_tokens": 1}, timeout=30)
    error = _assert_error(response, 400, "context_length_exceeded", "prompt")
    assert int(error["message"].split("prompt has ")[1].split(" ")[0]) > max_len
    assert _count_jobs(session_factory) == before


def test_oversize_body_is_413(start_web, api_settings, session_factory):
    small = start_web(api_settings.with_overrides(max_body_bytes=2000))
    before = _count_jobs(session_factory)
    response = requests.post(f"{small}/v1/jobs", json={"model": "tiny", "prompt": "x" * 5000},
                             timeout=30)
    _assert_error(response, 413, "request_too_large")
    assert _count_jobs(session_factory) == before


def test_unknown_routes_jobs_and_methods_are_json(api):
    _assert_error(requests.get(f"{api}/nope", timeout=30), 404, "not_found")
    _assert_error(requests.get(f"{api}/v1/jobs/{uuid.uuid4()}", timeout=30), 404,
                  "job_not_found")
    _assert_error(requests.get(f"{api}/v1/jobs/not-a-uuid", timeout=30), 404, "job_not_found")
    error = _assert_error(requests.delete(f"{api}/v1/jobs", timeout=30), 405,
                          "method_not_allowed")
    assert "POST" in error["message"]
    _assert_error(requests.get(f"{api}/v1/jobs/{uuid.uuid4()}/cancel", timeout=30), 405)
    assert requests.get(f"{api}/health", timeout=30).json()["status"] == "ok"


def test_create_get_and_idempotency(api, api_settings, session_factory, redis_client):
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 5, "temperature": 0,
            "stop": "\n", "seed": 7, "priority": -3}
    before = _count_jobs(session_factory)
    created = requests.post(f"{api}/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"},
                            timeout=30)
    assert created.status_code == 202, created.text
    job = created.json()
    assert job["status"] == "queued" and job["model"] == "tiny"
    assert job["links"]["events"] == f"/v1/jobs/{job['id']}/events"
    assert created.headers["Location"] == f"/v1/jobs/{job['id']}"

    again = requests.post(f"{api}/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"},
                          timeout=30)
    assert again.status_code == 200 and again.json()["id"] == job["id"]
    assert _count_jobs(session_factory) == before + 1
    assert _queued_generate_ids(redis_client, api_settings) == [job["id"]]

    fetched = requests.get(f"{api}/v1/jobs/{job['id']}", timeout=30).json()
    assert fetched["status"] == "queued" and fetched["attempts"] == 0
    assert fetched["params"]["stop"] == ["\n"] and fetched["params"]["seed"] == 7
    assert fetched["priority"] == -3
    with session_factory() as session:
        row = session.get(Job, uuid.UUID(job["id"]))
    assert row.prompt == "hello world" and row.kind == "completion"
    assert row.prompt_token_ids and all(isinstance(t, int) for t in row.prompt_token_ids)
    assert row.params["max_tokens"] == 5 and row.params["temperature"] == 0.0
    assert row.prompt_tokens == len(row.prompt_token_ids)


def test_chat_messages_use_the_chat_template(api, api_settings, session_factory):
    response = requests.post(f"{api}/v1/jobs", json={
        "model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "hello"}]}, timeout=30)
    assert response.status_code == 202, response.text
    with session_factory() as session:
        row = session.get(Job, uuid.UUID(response.json()["id"]))
    assert row.kind == "chat" and row.messages[1] == {"role": "user", "content": "hello"}
    tokenizer = AutoTokenizer.from_pretrained(api_settings.models["tiny"],
                                              local_files_only=True)
    expected = tokenizer.apply_chat_template(row.messages, tokenize=False,
                                             add_generation_prompt=True)
    assert row.prompt == expected and "be brief" in expected and "hello" in expected
    assert row.prompt_token_ids == tokenizer(expected, add_special_tokens=False).input_ids


def _create(api, headers=None, **extra) -> str:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **extra}
    response = requests.post(f"{api}/v1/jobs", json=body, headers=headers or {}, timeout=30)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _set_status(session_factory, job_id: str, status: JobStatus) -> None:
    with session_factory.begin() as session:
        session.execute(update(Job).where(Job.id == uuid.UUID(job_id)).values(
            status=status.value, attempts=1))


def test_running_job_output_comes_from_the_current_attempt(api, api_settings,
                                                           session_factory, redis_client):
    job_id = _create(api, n=2)
    _set_status(session_factory, job_id, JobStatus.RUNNING)
    publisher = EventPublisher(redis_client, api_settings)
    publisher.publish([(job_id, JobEvent(EventType.TOKEN, text="old")),
                       (job_id, JobEvent(EventType.RESTART, attempt=2)),
                       (job_id, JobEvent(EventType.TOKEN, text="new ", index=0)),
                       (job_id, JobEvent(EventType.TOKEN, text="B", index=1)),
                       (job_id, JobEvent(EventType.TOKEN, text="text", index=0))])
    job = requests.get(f"{api}/v1/jobs/{job_id}", timeout=30).json()
    assert job["status"] == "running"
    assert job["text"] == "new text"
    assert [c["text"] for c in job["choices"]] == ["new text", "B"]


def test_cancel_queued_and_running(api, api_settings, session_factory, redis_client):
    queued = _create(api)
    response = requests.post(f"{api}/v1/jobs/{queued}/cancel", timeout=30)
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    assert requests.post(f"{api}/v1/jobs/{queued}/cancel", timeout=30).status_code == 200
    events = _read_sse(f"{api}/v1/jobs/{queued}/events")
    assert [e["event"] for e in events] == ["cancelled"]
    assert "id" in events[0]

    running = _create(api)
    _set_status(session_factory, running, JobStatus.RUNNING)
    pubsub = redis_client.pubsub()
    pubsub.subscribe(cancel_channel(api_settings))
    pubsub.get_message(timeout=2)  # subscribe confirmation
    response = requests.post(f"{api}/v1/jobs/{running}/cancel", timeout=30)
    assert response.status_code == 202 and response.json()["cancel_requested"] is True
    assert response.json()["status"] == "running"  # the worker writes the terminal state
    assert redis_client.get(cancel_flag_key(api_settings, running)) == b"1"
    assert redis_client.ttl(cancel_flag_key(api_settings, running)) > 0
    message = pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
    pubsub.close()
    assert message is not None and message["data"] == running.encode()

    _set_status(session_factory, running, JobStatus.SUCCEEDED)
    _assert_error(requests.post(f"{api}/v1/jobs/{running}/cancel", timeout=30), 409,
                  "job_finished")


def _read_sse(url: str, headers=None, timeout: float = 30) -> list[dict]:
    """Parse an SSE response into [{"id", "event", "data"} | {"comment"}] until it ends."""
    items: list[dict] = []
    with requests.get(url, headers=headers or {}, stream=True, timeout=timeout) as response:
        assert response.status_code == 200, response.text
        assert response.headers["Content-Type"].startswith("text/event-stream")
        current: dict = {}
        for line in response.iter_lines(decode_unicode=True):
            if line == "":
                if current:
                    items.append(current)
                current = {}
            elif line.startswith(":"):
                items.append({"comment": line[1:].strip()})
            else:
                name, _, value = line.partition(": ")
                current[name] = json.loads(value) if name == "data" else value
    return [i for i in items if "retry" not in i]


def test_sse_streams_live_with_heartbeats_and_resumes_from_last_event_id(
    api, api_settings, session_factory, redis_client
):
    job_id = _create(api)
    _set_status(session_factory, job_id, JobStatus.RUNNING)
    publisher = EventPublisher(redis_client, api_settings)
    publisher.publish([(job_id, JobEvent(EventType.TOKEN, text="a", token_ids=[1]))])

    def worker() -> None:
        time.sleep(1.5)  # longer than the 1 s heartbeat: the client sees a ping
        for i in range(2, 5):
            publisher.publish([(job_id, JobEvent(EventType.TOKEN, text="x", token_ids=[i]))])
        publisher.publish([(job_id, JobEvent(EventType.DONE, finish_reason="length",
                                             usage={"completion_tokens": 4}))])

    thread = threading.Thread(target=worker)
    thread.start()
    items = _read_sse(f"{api}/v1/jobs/{job_id}/events")
    thread.join()
    events = [i for i in items if "event" in i]
    assert {"comment": "ping"} in items
    assert [e["event"] for e in events] == ["token"] * 4 + ["done"]
    assert [e["data"]["token_ids"] for e in events[:4]] == [[1], [2], [3], [4]]
    assert events[-1]["data"]["finish_reason"] == "length"

    # reconnect after the second event: exactly the rest, by header and by query
    rest = [i for i in _read_sse(f"{api}/v1/jobs/{job_id}/events",
                                 headers={"Last-Event-ID": events[1]["id"]}) if "event" in i]
    assert [e["id"] for e in rest] == [e["id"] for e in events[2:]]
    rest = [i for i in _read_sse(f"{api}/v1/jobs/{job_id}/events?last_event_id="
                                 + events[3]["id"]) if "event" in i]
    assert [e["id"] for e in rest] == [events[4]["id"]]
    _assert_error(requests.get(f"{api}/v1/jobs/{job_id}/events",
                               headers={"Last-Event-ID": "bogus"}, timeout=30), 400)


def test_auth_keys_scope_jobs(start_web, api_settings, session_factory):
    api = start_web(api_settings.with_overrides(auth_enabled=True))
    _, key_a = create_api_key(session_factory, "alice")
    _, key_b = create_api_key(session_factory, "bob")
    a = {"Authorization": f"Bearer {key_a}"}
    b = {"Authorization": f"Bearer {key_b}"}
    body = {"model": "tiny", "prompt": "hi"}
    before = _count_jobs(session_factory)
    _assert_error(requests.post(f"{api}/v1/jobs", json=body, timeout=30), 401,
                  "missing_api_key")
    error = _assert_error(requests.post(f"{api}/v1/jobs", json=body, timeout=30,
                                        headers={"Authorization": "Bearer wrong"}), 401,
                          "invalid_api_key")
    assert error["type"] == "authentication_error"
    assert _count_jobs(session_factory) == before

    job_id = _create(api, headers=a)
    assert requests.get(f"{api}/v1/jobs/{job_id}", headers=a, timeout=30).status_code == 200
    _assert_error(requests.get(f"{api}/v1/jobs/{job_id}", headers=b, timeout=30), 404)
    _assert_error(requests.post(f"{api}/v1/jobs/{job_id}/cancel", headers=b, timeout=30), 404)
    _assert_error(requests.get(f"{api}/v1/jobs/{job_id}/events", headers=b, timeout=30), 404)
    assert requests.get(f"{api}/v1/jobs", headers=b, timeout=30).json()["data"] == []
    listed = requests.get(f"{api}/v1/jobs", headers=a, timeout=30).json()["data"]
    assert [j["id"] for j in listed] == [job_id]
    # the same Idempotency-Key under two keys makes two jobs
    ids = {requests.post(f"{api}/v1/jobs", json=body, headers={**h, "Idempotency-Key": "same"},
                         timeout=30).json()["id"] for h in (a, b)}
    assert len(ids) == 2


def test_listing_filters_by_status_and_pages_with_a_cursor(start_web, api_settings,
                                                          session_factory):
    api = start_web(api_settings.with_overrides(auth_enabled=True))
    _, key = create_api_key(session_factory, "lister")
    headers = {"Authorization": f"Bearer {key}"}
    ids = [_create(api, headers=headers) for _ in range(5)]  # oldest first
    _set_status(session_factory, ids[1], JobStatus.SUCCEEDED)
    _set_status(session_factory, ids[3], JobStatus.SUCCEEDED)

    pages, after = [], None
    while True:
        url = f"{api}/v1/jobs?limit=2" + (f"&after={after}" if after else "")
        page = requests.get(url, headers=headers, timeout=30).json()
        pages.append([j["id"] for j in page["data"]])
        after = page["last_id"]
        if not page["has_more"]:
            break
    assert pages == [ids[4:2:-1], ids[2:0:-1], ids[0:1]]

    done = requests.get(f"{api}/v1/jobs?status=succeeded", headers=headers, timeout=30).json()
    assert [j["id"] for j in done["data"]] == [ids[3], ids[1]]
    both = requests.get(f"{api}/v1/jobs?status=queued,succeeded&limit=100", headers=headers,
                        timeout=30).json()
    assert len(both["data"]) == 5 and both["has_more"] is False
    _assert_error(requests.get(f"{api}/v1/jobs?status=bogus", headers=headers, timeout=30),
                  400, param="status")
    _assert_error(requests.get(f"{api}/v1/jobs?limit=0", headers=headers, timeout=30), 400,
                  param="limit")
    _assert_error(requests.get(f"{api}/v1/jobs?after={uuid.uuid4()}", headers=headers,
                               timeout=30), 400, "invalid_cursor")


def test_models_lists_live_groups_from_heartbeats(api, api_settings, redis_client):
    redis_client.hset(groups_key(api_settings, "tiny"), mapping={
        "g0": json.dumps({"num_running": 2, "max_num_seqs": 8}), "g1": json.dumps({})})
    redis_client.set(group_alive_key(api_settings, "tiny", "g0"), 1, ex=30)
    models = requests.get(f"{api}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["tiny"]
    assert models[0]["max_model_len"] == read_max_model_len(api_settings.models["tiny"])
    assert models[0]["num_live_groups"] == 1
    assert models[0]["groups"] == [{"id": "g0", "num_running": 2, "max_num_seqs": 8}]


def _closed_port_url(scheme: str) -> str:
    from tests.fixtures_services import free_port

    return f"{scheme}://127.0.0.1:{free_port()}"


def test_503_when_redis_or_postgres_is_down(start_web, api, api_settings, session_factory):
    job_id = _create(api)
    before = _count_jobs(session_factory)
    no_redis = start_web(api_settings.with_overrides(redis_url=_closed_port_url("redis") + "/0"))
    body = {"model": "tiny", "prompt": "hi"}
    started = time.monotonic()
    _assert_error(requests.post(f"{no_redis}/v1/jobs", json=body, timeout=60), 503,
                  "redis_unavailable")
    assert time.monotonic() - started < 20
    assert _count_jobs(session_factory) == before  # the row was taken back
    _assert_error(requests.get(f"{no_redis}/v1/models", timeout=30), 503, "redis_unavailable")
    _assert_error(requests.get(f"{no_redis}/v1/jobs/{job_id}/events", timeout=30), 503,
                  "redis_unavailable")
    _set_status(session_factory, job_id, JobStatus.RUNNING)
    _assert_error(requests.post(f"{no_redis}/v1/jobs/{job_id}/cancel", timeout=30), 503,
                  "redis_unavailable")
    _assert_error(requests.get(f"{no_redis}/health/ready", timeout=30), 503)
    assert requests.get(f"{no_redis}/health", timeout=30).status_code == 200

    no_db = start_web(api_settings.with_overrides(
        database_url=_closed_port_url("postgresql") + "/nodb"))
    error = _assert_error(requests.post(f"{no_db}/v1/jobs", json=body, timeout=60), 503,
                          "database_unavailable")
    assert "database" in error["message"]
    _assert_error(requests.get(f"{no_db}/v1/jobs/{uuid.uuid4()}", timeout=30), 503,
                  "database_unavailable")
    assert requests.get(f"{no_db}/health", timeout=30).status_code == 200


def test_cli_keys_create_prints_a_working_key_once(start_web, api_settings, session_factory):
    import os
    import subprocess
    import sys

    env = {**os.environ, "LLMQ_DATABASE_URL": api_settings.database_url}
    result = subprocess.run([sys.executable, "-m", "llmq.cli", "keys", "create", "ci-bot"],
                            env=env, capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip()
    assert key.startswith("llmq-") and len(key.splitlines()) == 1
    assert "shown only this once" in result.stderr
    listed = subprocess.run([sys.executable, "-m", "llmq.cli", "keys", "list"], env=env,
                            capture_output=True, text=True, check=False, timeout=120)
    assert "ci-bot" in listed.stdout and key not in listed.stdout

    api = start_web(api_settings.with_overrides(auth_enabled=True))
    assert requests.get(f"{api}/v1/jobs", headers={"Authorization": f"Bearer {key}"},
                        timeout=30).status_code == 200


def test_sse_ends_from_the_row_when_the_terminal_event_is_missing(api, session_factory):
    # finished, stream gone (expired): one terminal event built from the row
    finished = _create(api)
    _set_status(session_factory, finished, JobStatus.SUCCEEDED)
    events = [i for i in _read_sse(f"{api}/v1/jobs/{finished}/events") if "event" in i]
    assert [e["event"] for e in events] == ["done"] and "id" not in events[0]

    # running, then failed by someone whose event never arrived: the stream still ends
    running = _create(api)
    _set_status(session_factory, running, JobStatus.RUNNING)
    threading.Timer(0.5, _set_status, (session_factory, running, JobStatus.FAILED)).start()
    started = time.monotonic()
    events = [i for i in _read_sse(f"{api}/v1/jobs/{running}/events") if "event" in i]
    assert [e["event"] for e in events] == ["error"]
    assert time.monotonic() - started < 10


def test_cli_submit_prints_the_streamed_text(api, api_settings, session_factory, redis_client):
    import subprocess
    import sys

    before = {j["id"] for j in requests.get(f"{api}/v1/jobs?limit=100", timeout=30).json()["data"]}
    process = subprocess.Popen(
        [sys.executable, "-m", "llmq.cli", "submit", "hello", "--max-tokens", "3", "--url", api],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        new: set[str] = set()
        while not new and time.monotonic() < deadline:
            time.sleep(0.2)
            listed = requests.get(f"{api}/v1/jobs?limit=100", timeout=30).json()["data"]
            new = {j["id"] for j in listed} - before
        (job_id,) = new
        _set_status(session_factory, job_id, JobStatus.RUNNING)
        EventPublisher(redis_client, api_settings).publish(
            [(job_id, JobEvent(EventType.TOKEN, text=t)) for t in ("Hel", "lo ", "there")]
            + [(job_id, JobEvent(EventType.DONE, finish_reason="length",
                                 usage={"completion_tokens": 3}))])
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert stdout == "Hello there\n"
    assert job_id in stderr and "length" in stderr
