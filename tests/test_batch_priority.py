"""Interactive traffic first: batch lines fill spare room and never hold an interactive
job back. Admission's band (unit), then a real worker with a batch in flight."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest
from sqlalchemy import func, select

from tasks.api.batches import BATCH_PRIORITY
from tasks.models import Job, JobStatus
from tasks.params import SamplingParams
from tests.pipeline_helpers import running_worker, wait_for
from workers.admitted import AdmittedJob
from workers.inbox import JobInbox


def _job(job_id: str, priority: int = 0) -> AdmittedJob:
    return AdmittedJob(job_id=job_id, prompt="x", params=SamplingParams(max_tokens=1),
                       priority=priority)


def test_batch_jobs_leave_a_quarter_of_the_capacity_to_interactive_ones():
    inbox = JobInbox(capacity=8)
    assert inbox.batch_capacity == 6
    for i in range(6):
        assert inbox.admit(_job(f"b{i}", BATCH_PRIORITY), timeout=0.1)
    assert not inbox.admit(_job("b6", BATCH_PRIORITY), timeout=0.1)  # no spare room
    assert inbox.admit(_job("i0"), timeout=0.1) and inbox.admit(_job("i1"), timeout=0.1)
    assert not inbox.admit(_job("i2"), timeout=0.1)  # the group is full
    taken = inbox.take().jobs
    inbox.release(taken[:1])  # one batch line ends: room for an interactive job first
    assert inbox.admit(_job("i2"), timeout=0.1)
    assert not inbox.admit(_job("b7", BATCH_PRIORITY), timeout=0.1)


@pytest.mark.integration
def test_an_interactive_request_behind_a_batch_does_not_wait_for_it(
        start_web, service_settings, redis_client, session_factory, tmp_path):
    """A group of 4 sequences busy with long batch lines (and more queued): an interactive
    request runs at once beside them, with no batch line ending first."""
    base_url = start_web(service_settings)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    lines = [{"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": f"line {i}", "max_tokens": 400,
                       "temperature": 0.0, "ignore_eos": True}} for i in range(10)]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    with running_worker(service_settings, redis_client, tmp_path, "prio",
                        args=["--max-num-seqs", "4", "--kv-cache-bytes",
                              str(16 * 1024 * 1024)]):
        idle = min(_timed(client) for _ in range(3))  # the same request, nothing else running
        upload = client.files.create(file=("p.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                      completion_window="24h")

        def batch_jobs(*statuses: str) -> int:
            with session_factory() as session:
                return session.scalar(select(func.count()).select_from(Job).where(
                    Job.batch_id == batch.id, Job.status.in_(statuses)))

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
    assert latency < 4 * idle, (latency, idle)


def _timed(client: openai.OpenAI) -> float:
    started = time.monotonic()
    answer = client.completions.create(model="tiny", prompt="interactive", max_tokens=8,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 8
    return time.monotonic() - started
