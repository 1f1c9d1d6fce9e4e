"""Whose fault a failed job is (`jobs.error_kind`): the request's (`invalid_request`, a 400
from the OpenAI endpoints) or the service's (`server_error`, a 500), stored by whatever
fails the job (admission, the engine's guards, a failed step, beat's reclaim and queue
timeout) and shown in the job JSON; rows without a kind fall back to the wording."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import requests

from tasks.db import utcnow
from tasks.models import Job, JobErrorKind, JobStatus
from tests.pipeline_helpers import insert_job, read_job, wait_for, wait_terminal
from tests.test_batcher import group, tiny_engine  # noqa: F401 (fixtures)
from webapp.errors import failed_job_error
from workers.admission import GenerateOutcome
from workers.engine.errors import DeviceGroupError

INVALID = JobErrorKind.INVALID_REQUEST.value
SERVER = JobErrorKind.SERVER_ERROR.value
VOCAB = 512  # the tiny checkpoint's vocab_size


def test_the_kind_decides_400_or_500_and_the_wording_only_names_the_param():
    param_text = "invalid job parameters: temperature must be a number in [0, 100], got 1e+300"
    invalid = failed_job_error("j", param_text, INVALID)
    assert (invalid.status, invalid.code, invalid.param) == (400, "invalid_value", "temperature")
    assert invalid.type == "invalid_request_error"
    # a server fault whose text happens to read like a rejection is still the server's
    server = failed_job_error("j", param_text, SERVER)
    assert (server.status, server.code, server.type) == (500, "job_failed", "server_error")
    # a rejection worded in no known way is still the request's: a 400 without a param
    odd = failed_job_error("j", "the grammar is recursive", INVALID)
    assert (odd.status, odd.code, odd.param) == (400, "invalid_value", None)
    context = failed_job_error("j", "prompt 2000 + max_tokens 100 > max_model_len 2048; "
                               "shorten the prompt or lower max_tokens", INVALID)
    assert (context.status, context.code, context.param) == (
        400, "context_length_exceeded", "max_tokens")
    # rows from before the kind: the wording decides, as it always did
    assert failed_job_error("j", param_text).status == 400
    assert failed_job_error("j", "engine step failed: IndexError: boom").status == 500


def test_the_worker_stores_whose_fault_a_failure_is(group, session_factory,  # noqa: F811
                                                    service_settings, start_web):
    # admission: parameters no worker can run (written past the API)
    bad_params = insert_job(session_factory, params={"max_tokens": 4, "temperature": "hot"})
    assert group.admission.run(bad_params) is GenerateOutcome.FAILED
    # the engine's own guard: a token id outside the model's vocabulary
    bad_token = insert_job(session_factory, prompt=None, prompt_token_ids=[5, VOCAB + 3])
    assert group.admission.run(bad_token) is GenerateOutcome.ADMITTED
    for job_id, param in ((bad_params, "temperature"), (bad_token, "prompt")):
        row = wait_terminal(session_factory, job_id)
        assert (row.status, row.error_kind) == (JobStatus.FAILED.value, INVALID), row.error
        assert failed_job_error(job_id, row.error, row.error_kind).param == param
    # a step that raises: the service's fault
    group.engine.fail_steps = 1
    broken = insert_job(session_factory, params={"max_tokens": 4})
    assert group.admission.run(broken) is GenerateOutcome.ADMITTED
    row = wait_terminal(session_factory, broken)
    assert (row.status, row.error_kind) == (JobStatus.FAILED.value, SERVER)
    assert "engine step failed" in row.error
    # a job that succeeds has no kind
    fine = insert_job(session_factory, params={"max_tokens": 4})
    assert group.admission.run(fine) is GenerateOutcome.ADMITTED
    assert wait_terminal(session_factory, fine).error_kind is None

    base_url = start_web(service_settings)
    shown = {job_id: requests.get(f"{base_url}/v1/jobs/{job_id}", timeout=10).json()
             for job_id in (bad_params, broken, fine)}
    assert [shown[j]["error_kind"] for j in (bad_params, broken, fine)] == [
        INVALID, SERVER, None]


def test_a_device_error_hands_the_jobs_back_instead_of_failing_them(
        group, session_factory, redis_client):  # noqa: F811
    """The batcher's side of a lost rank: no job is failed; they are aborted for the
    runtime to give back, and the breaker says why."""
    tripped: list[str] = []
    group.batcher.on_unhealthy = tripped.append
    running = insert_job(session_factory, params={"max_tokens": 200, "ignore_eos": True})
    assert group.admission.run(running) is GenerateOutcome.ADMITTED
    wait_for(lambda: read_job(session_factory, running).first_token_at, 30, "a first token")

    def lost_rank():
        raise DeviceGroupError("tensor-parallel rank 1 (pid 1) died")

    group.engine.step = lost_rank  # the instance's step, over FlakyEngine's
    assert group.batcher.join(10), "the batcher did not stop"
    assert tripped and "device error: tensor-parallel rank 1" in tripped[0]
    assert [job.job_id for job in group.batcher.aborted] == [running]
    row = read_job(session_factory, running)
    assert row.status == JobStatus.RUNNING.value and row.error is None


@pytest.mark.parametrize("path", ["reclaim", "queue_timeout"])
def test_beat_fails_jobs_as_the_servers_fault(path, service_settings, session_factory,
                                              redis_client):
    from tasks.celery_app import create_celery
    from tasks.maintenance import fail_overdue_queued_jobs, reclaim_expired_leases

    settings = service_settings.with_overrides(
        redis_prefix=f"{service_settings.redis_prefix}kind{uuid.uuid4().hex[:8]}", max_attempts=1,
        queue_timeout_seconds=60.0)
    job_id = insert_job(session_factory)
    with session_factory.begin() as session:
        job = session.get(Job, uuid.UUID(job_id))
        job.created_at = utcnow() - timedelta(hours=1)
        if path == "reclaim":
            job.status, job.attempts, job.worker = JobStatus.RUNNING.value, 1, "lost-group"
            job.lease_expires_at = utcnow() - timedelta(seconds=5)
    if path == "reclaim":
        reclaim_expired_leases(settings, session_factory, redis_client, create_celery(settings))
    else:
        assert job_id in fail_overdue_queued_jobs(settings, session_factory, redis_client)
    row = read_job(session_factory, job_id)
    assert (row.status, row.error_kind) == (JobStatus.FAILED.value, SERVER), row.error


def test_an_openai_stream_answers_a_failed_job_by_its_kind(group, session_factory,  # noqa: F811
                                                           service_settings, start_web):
    """The stream's last data line before [DONE] is the error: a 400 naming the field for
    a request the worker rejected, a 500 job_failed for a failed step."""
    import json
    import threading

    from sqlalchemy import select

    base_url = start_web(service_settings)

    def stream_error(request_id: str, prepare) -> dict:
        lines: list[str] = []

        def consume() -> None:
            with requests.post(f"{base_url}/v1/chat/completions", stream=True, timeout=60,
                               headers={"X-Request-Id": request_id},
                               json={"model": "tiny", "max_tokens": 4, "stream": True,
                                     "messages": [{"role": "user", "content": "hi"}]}) as r:
                lines.extend(line for line in r.iter_lines(decode_unicode=True) if line)

        reader = threading.Thread(target=consume)
        reader.start()

        def created() -> str | None:
            with session_factory() as session:
                ids = session.scalars(select(Job.id).where(Job.request_id == request_id)).all()
            return str(ids[0]) if ids else None

        job_id = wait_for(created, 30, "the stream's job")
        prepare(job_id)
        group.admission.run(job_id)  # this test's group takes it, not a Celery worker
        reader.join(60)
        assert lines[-1] == "data: [DONE]", lines
        return json.loads(lines[-2].removeprefix("data: "))["error"]

    def bad_params(job_id: str) -> None:
        with session_factory.begin() as session:
            job = session.get(Job, uuid.UUID(job_id))
            job.params = {**job.params, "temperature": "hot"}

    error = stream_error(f"kind-{uuid.uuid4().hex}", bad_params)
    assert (error["code"], error["param"], error["type"]) == (
        "invalid_value", "temperature", "invalid_request_error")

    def failing_step(job_id: str) -> None:
        group.engine.fail_steps = 1

    error = stream_error(f"kind-{uuid.uuid4().hex}", failing_step)
    assert (error["code"], error["type"]) == ("job_failed", "server_error")
