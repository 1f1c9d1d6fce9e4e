"""Interactive traffic first: batch lines fill spare room and never hold an interactive
job back. Admission's band (unit), then a real worker with a batch in flight."""

from __future__ import annotations

import io
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from sqlalchemy import func, select

from tasks.api.batches import BATCH_PRIORITY
from tasks.models import Job, JobStatus
from tasks.params import SamplingParams
from tasks.protocol import EventType, JobEvent, events_key
from tests.pipeline_helpers import running_worker, wait_for
from workers.admitted import AdmittedJob
from workers.inbox import JobInbox

# a group of 4 sequences: batch lines fill them (and one more waits in the engine)
FOUR_SEQS = ["--max-num-seqs", "4", "--kv-cache-bytes", str(16 * 1024 * 1024)]


def _job(job_id: str, priority: int = 0) -> AdmittedJob:
    return AdmittedJob(job_id=job_id, prompt="x", params=SamplingParams(max_tokens=1),
                       priority=priority)


def test_batch_lines_fill_the_capacity_and_a_quarter_more():
    inbox = JobInbox(capacity=8)
    assert inbox.batch_capacity == 10  # two wait in the engine for a freed seat
    for i in range(10):
        assert inbox.admit(_job(f"b{i}", BATCH_PRIORITY), timeout=0.1)
    assert not inbox.admit(_job("b10", BATCH_PRIORITY), timeout=0.1)  # no room left
    assert inbox.wait_batch_room(0.05) == 0
    inbox.release(inbox.take().jobs[:3])
    assert inbox.wait_batch_room(0.05) == 3


def test_interactive_jobs_never_wait_for_batch_lines():
    inbox = JobInbox(capacity=4)
    for i in range(5):
        assert inbox.admit(_job(f"b{i}", BATCH_PRIORITY), timeout=0.1)
    # the engine gives them batch lines' seats: only other interactive jobs count
    for i in range(4):
        assert inbox.admit(_job(f"i{i}"), timeout=0.1)
    assert not inbox.admit(_job("i4"), timeout=0.1)  # interactive jobs fill the capacity


def test_a_waiting_interactive_job_holds_batch_lines_back():
    inbox = JobInbox(capacity=4)
    for i in range(4):
        assert inbox.admit(_job(f"i{i}"), timeout=0.1)
    assert inbox.wait_batch_room(0.05) == 1
    admitted: list[bool] = []
    waiter = threading.Thread(target=lambda: admitted.append(inbox.admit(_job("i4"))))
    waiter.start()
    wait_for(lambda: inbox.wait_batch_room(0.01) == 0, 5, "the interactive job to wait")
    inbox.release(inbox.take().jobs[:1])  # an interactive job ends: the waiter goes first
    waiter.join(5)
    assert admitted == [True]
    assert inbox.wait_batch_room(0.05) == 1


@pytest.mark.integration
@pytest.mark.alone
def test_an_interactive_request_behind_a_batch_does_not_wait_for_it(
        start_web, service_settings, redis_client, session_factory, tmp_path):
    """A group of 4 sequences busy with long batch lines (and more queued): an interactive
    request runs at once beside them, with no batch line ending first."""
    base_url = start_web(service_settings)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    with running_worker(service_settings, redis_client, tmp_path, "prio", args=FOUR_SEQS):
        idle = min(_timed(client) for _ in range(3))  # the same request, nothing else running
        batch = _create_batch(client, "p", 10, max_tokens=400)

        def batch_jobs(*statuses: str) -> int:
            return _count_lines(session_factory, batch.id, *statuses)

        wait_for(lambda: batch_jobs(JobStatus.RUNNING.value) >= 3, 60, "batch lines running")
        ended_before = batch_jobs(JobStatus.SUCCEEDED.value)
        latency = _timed(client)
        ended_after = batch_jobs(JobStatus.SUCCEEDED.value)
        wait_for(lambda: client.batches.retrieve(batch.id).status == "completed", 300,
                 "the batch completed")
    with session_factory() as session:
        runs = [(job.finished_at - job.started_at).total_seconds() for job in session.scalars(
            select(Job).where(Job.batch_id == batch.id))]
    # it ran beside the batch lines, not after one of them: none ended meanwhile, and it
    # took less than a line's time
    assert ended_after == ended_before, (ended_before, ended_after, latency, idle)
    assert latency < min(runs), (latency, idle, min(runs))


def _create_batch(client: openai.OpenAI, prefix: str, num_lines: int, *, max_tokens: int):
    """A batch of `num_lines` greedy completions (custom ids `<prefix><i>`)."""
    lines = [{"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": f"line {i}", "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True}} for i in range(num_lines)]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = client.files.create(file=(f"{prefix}.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                 completion_window="24h")


def _count_lines(session_factory, batch_id: str, *statuses: str) -> int:
    with session_factory() as session:
        return session.scalar(select(func.count()).select_from(Job).where(
            Job.batch_id == batch_id, Job.status.in_(statuses)))


def _timed(client: openai.OpenAI) -> float:
    started = time.monotonic()
    answer = client.completions.create(model="tiny", prompt="interactive", max_tokens=8,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 8
    return time.monotonic() - started


@pytest.mark.integration
def test_interactive_requests_take_seats_from_running_batch_lines(
        start_web, service_settings, redis_client, session_factory, tmp_path):
    """A group of 4 sequences, every seat busy with a long batch line and one more line
    waiting in the engine: 3 interactive requests at once take seats from batch lines
    (preempted in the engine, not handed back), end before any line, and the batch still
    completes with every line exactly once and no attempt spent."""
    base_url = start_web(service_settings)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    with running_worker(service_settings, redis_client, tmp_path, "seats", args=FOUR_SEQS):
        batch = _create_batch(client, "h", 6, max_tokens=800)

        def lines_in(*statuses: str) -> int:
            return _count_lines(session_factory, batch.id, *statuses)

        # 4 seats and 1 line ahead: every seat holds a batch line
        wait_for(lambda: lines_in(JobStatus.RUNNING.value) >= 5, 60, "batch lines running")
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda i: client.completions.create(
                model="tiny", prompt=f"interactive {i}", max_tokens=64, temperature=0.0,
                extra_body={"ignore_eos": True}), range(3)))
        ended = lines_in(JobStatus.SUCCEEDED.value)
        done = wait_for(lambda: (lambda b: b if b.status == "completed" else None)(
            client.batches.retrieve(batch.id)), 300, "the batch completed")
        output = client.files.content(done.output_file_id).text.splitlines()
    assert ended == 0, ended  # every interactive request ended first
    with session_factory() as session:
        interactive = [session.get(Job, uuid.UUID(answer.id.removeprefix("cmpl-")))
                       for answer in answers]
    # they ran side by side (each had its first token before any of them ended)
    assert max(job.first_token_at for job in interactive) < min(
        job.finished_at for job in interactive), [
        (round((job.first_token_at - job.created_at).total_seconds() * 1e3),
         round((job.finished_at - job.created_at).total_seconds() * 1e3),
         round((job.created_at - interactive[0].created_at).total_seconds() * 1e3))
        for job in interactive]
    bodies = {json.loads(line)["custom_id"]: json.loads(line)["response"]["body"]
              for line in output}
    assert sorted(bodies) == [f"h{i}" for i in range(6)]
    assert {body["usage"]["completion_tokens"] for body in bodies.values()} == {800}
    with session_factory() as session:
        rows = session.scalars(select(Job).where(Job.batch_id == batch.id)).all()
    restarted = [row for row in rows if any(
        JobEvent.from_fields(fields).type is EventType.RESTART
        for _, fields in redis_client.xrange(events_key(service_settings, str(row.id))))]
    assert not restarted, "a batch line was handed back"
    assert all(row.attempts == 1 for row in rows)


@pytest.mark.integration
def test_the_listener_wakes_the_feeder_when_a_batch_of_its_model_is_announced(
        service_settings, redis_client):
    from tasks.protocol import batch_lines_channel, cancel_channel
    from workers.cancel_listener import CancelListener

    cancels: list[str] = []
    wakes: list[int] = []
    listener = CancelListener(redis_client, service_settings, cancels.append, model="tiny",
                              on_batch_lines=lambda: wakes.append(1))
    listener.start()
    try:
        redis_client.publish(batch_lines_channel(service_settings, "other"), "batch_x")
        redis_client.publish(batch_lines_channel(service_settings, "tiny"), "batch_1")
        redis_client.publish(cancel_channel(service_settings), "job-1")
        wait_for(lambda: cancels == ["job-1"], 5, "the cancel")
        assert wakes == [1]  # its own model's announcement only, and no cancel from it
    finally:
        listener.stop()
