"""Bounded queues, the queue timeout, pinned seeds, idempotency conflicts and the
listing's query contract, against real Postgres and Redis (the app in-process)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from sqlalchemy import update

from tasks.db import utcnow
from tasks.maintenance import fail_overdue_queued_jobs
from tasks.models import Job, JobStatus
from tasks.settings import Settings
from tasks.streams.reader import EventSubscriber
from webapp import create_app

pytestmark = pytest.mark.integration

BODY = {"model": "q", "prompt": "the river", "max_tokens": 4}


@pytest.fixture
def settings(service_settings, tiny_qwen3_dir):
    # a model name and a prefix of this test's own: its queue holds only its own jobs
    name = "q" + uuid.uuid4().hex[:8]
    BODY["model"] = name
    return service_settings.with_overrides(
        redis_prefix=service_settings.redis_prefix + "q" + uuid.uuid4().hex[:6],
        models={name: str(tiny_qwen3_dir)}, max_queued_jobs=2)


@pytest.fixture
def client(settings):
    app = create_app(settings)
    yield app.test_client()
    app.extensions["llmq"].close()


def test_a_full_model_queue_answers_429_with_retry_after(client, session_factory):
    first = client.post("/v1/jobs", json=BODY)
    second = client.post("/v1/jobs", json=BODY)
    assert first.status_code == second.status_code == 202
    full = client.post("/v1/jobs", json=BODY)
    assert full.status_code == 429 and int(full.headers["Retry-After"]) > 0
    error = full.json["error"]
    assert error["code"] == "queue_full" and "LLMQ_MAX_QUEUED_JOBS" in error["message"]
    assert error["type"] == "rate_limit_error"
    # a job that left the queue frees its place
    assert client.post(f"/v1/jobs/{first.json['id']}/cancel").status_code == 200
    assert client.post("/v1/jobs", json=BODY).status_code == 202


def test_unlimited_queue_with_zero(settings, session_factory):
    app = create_app(settings.with_overrides(max_queued_jobs=0))
    try:
        client = app.test_client()
        assert all(client.post("/v1/jobs", json=BODY).status_code == 202 for _ in range(4))
    finally:
        app.extensions["llmq"].close()


def test_an_unseeded_job_gets_a_seed_pinned_and_a_seeded_one_keeps_its_own(client,
                                                                         session_factory):
    unseeded = client.post("/v1/jobs", json=BODY).json
    seeded = client.post("/v1/jobs", json={**BODY, "seed": 7}).json
    with session_factory() as session:
        pinned = session.get(Job, uuid.UUID(unseeded["id"])).params["seed"]
        kept = session.get(Job, uuid.UUID(seeded["id"])).params["seed"]
    assert isinstance(pinned, int) and 0 <= pinned < 2**63 and kept == 7


def test_idempotency_key_reused_with_another_body_is_a_422(client):
    headers = {"Idempotency-Key": "k-" + uuid.uuid4().hex}
    first = client.post("/v1/jobs", json=BODY, headers=headers)
    again = client.post("/v1/jobs", json=BODY, headers=headers)
    assert first.status_code == 202 and again.status_code == 200
    assert again.json["id"] == first.json["id"]  # the pinned seed is not a difference
    other = client.post("/v1/jobs", json={**BODY, "max_tokens": 5}, headers=headers)
    assert other.status_code == 422
    error = other.json["error"]
    assert error["param"] == "Idempotency-Key" and error["code"] == "idempotency_key_reused"
    assert "params" in error["message"] and first.json["id"] in error["message"]


def test_listing_filters_and_refuses_unknown_parameters(client):
    job_id = client.post("/v1/jobs", json=BODY).json["id"]
    listed = client.get(f"/v1/jobs?model={BODY['model']}&status=queued").json
    assert [job["id"] for job in listed["data"]] == [job_id]
    assert client.get("/v1/jobs?model=nobody").json["data"] == []
    future = (utcnow() + timedelta(hours=1)).isoformat().replace("+00:00", "Z")
    assert client.get(f"/v1/jobs?created_after={future}").json["data"] == []
    assert client.get(f"/v1/jobs?created_before={future}&model={BODY['model']}"
                      ).json["data"][0]["id"] == job_id
    unknown = client.get("/v1/jobs?stauts=queued")
    assert unknown.status_code == 400 and unknown.json["error"]["param"] == "stauts"
    bad = client.get("/v1/jobs?limit=0")
    assert bad.status_code == 400 and bad.json["error"]["param"] == "limit"


def test_cancelling_a_finished_job_is_a_409(client, session_factory):
    job_id = client.post("/v1/jobs", json=BODY).json["id"]
    with session_factory.begin() as session:
        session.execute(update(Job).where(Job.id == uuid.UUID(job_id)).values(
            status=JobStatus.SUCCEEDED.value, finished_at=utcnow()))
    answer = client.post(f"/v1/jobs/{job_id}/cancel")
    assert answer.status_code == 409 and answer.json["error"]["code"] == "job_finished"


def test_queue_timeout_fails_old_queued_jobs_with_a_terminal_event(settings, session_factory,
                                                                  redis_client):
    now = utcnow()
    ids = {}
    # NOTE: ages far beyond any other test's rows: the pass fails every overdue row
    for label, age in (("old", 40 * 86400), ("fresh", 1)):
        job = Job(model=BODY["model"], kind="completion", prompt="hi", prompt_token_ids=[1],
                  params={"max_tokens": 4}, status=JobStatus.QUEUED.value, attempts=0,
                  prompt_tokens=1, created_at=now - timedelta(seconds=age))
        with session_factory.begin() as session:
            session.add(job)
        ids[label] = str(job.id)
    assert fail_overdue_queued_jobs(settings, session_factory, redis_client) == []  # off
    timed = settings.with_overrides(queue_timeout_seconds=30 * 86400)
    failed = fail_overdue_queued_jobs(timed, session_factory, redis_client)
    assert ids["old"] in failed and ids["fresh"] not in failed
    with session_factory() as session:
        old = session.get(Job, uuid.UUID(ids["old"]))
        fresh = session.get(Job, uuid.UUID(ids["fresh"]))
    assert old.status == "failed" and "LLMQ_QUEUE_TIMEOUT_SECONDS" in old.error
    assert fresh.status == "queued"
    events = EventSubscriber(redis_client, timed).read_events(ids["old"])
    assert [event.type.value for _, event in events] == ["error"]
    assert fail_overdue_queued_jobs(timed, session_factory, redis_client) == []  # once only


def test_settings_ranges_name_the_variable():
    with pytest.raises(ValueError, match="LLMQ_MAX_QUEUED_JOBS='-1'"):
        Settings.from_env({"LLMQ_MAX_QUEUED_JOBS": "-1"})
    with pytest.raises(ValueError, match="LLMQ_QUEUE_TIMEOUT_SECONDS='0'"):
        Settings.from_env({"LLMQ_QUEUE_TIMEOUT_SECONDS": "0"})
    with pytest.raises(ValueError, match="LLMQ_LEASE_SECONDS"):
        Settings.from_env({"LLMQ_LEASE_SECONDS": "-5"})
    assert Settings.from_env({"LLMQ_QUEUE_TIMEOUT_SECONDS": "off"}).queue_timeout_seconds is None
    shown = Settings(database_url="postgresql://me:s3cret@db/llmq").effective()
    assert shown["LLMQ_DATABASE_URL"] == "postgresql://me:****@db/llmq"
    assert shown["LLMQ_MAX_QUEUED_JOBS"] == 10_000
