"""A device group's circuit breaker and step watchdog, with real worker processes:
a group whose steps keep failing, or whose step hangs, stops claiming, hands its jobs back
without spending their attempts, says it is unhealthy (`/ready`), and exits non-zero; the
jobs finish on another group."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
import requests

from tasks.models import JobStatus
from tests.pipeline_helpers import (
    WorkerProcess,
    read_job,
    running_worker,
    submit,
    wait_for,
    wait_terminal,
)

pytestmark = pytest.mark.integration

WORKER_ARGS = ["--max-num-seqs", "8", "--kv-cache-bytes", str(16 * 1024 * 1024),
               "--concurrency", "2"]
LONG = {"max_tokens": 300, "ignore_eos": True, "temperature": 0.0, "model": "breaker"}
MODEL = LONG["model"]


@pytest.fixture
def settings(service_settings):
    # a queue of its own: only this test's groups take its jobs; and a model name of its
    # own: a claim also takes queued jobs of its model from the table ahead (the
    # database is shared), and a job another test left queued would change the step
    # count these tests rely on
    return service_settings.with_overrides(
        redis_prefix=f"{service_settings.redis_prefix}break{uuid.uuid4().hex[:8]}",
        drain_grace_seconds=2.0,
        models={MODEL: service_settings.models["tiny"]})


def _unhealthy_beat(worker: WorkerProcess, redis_client) -> dict:
    return wait_for(lambda: (lambda beat: beat if beat and beat.get("healthy") is False
                             else None)(worker.heartbeat(redis_client)),
                    30, f"{worker.group_id} to report itself unhealthy", interval=0.05)


def test_consecutive_failed_steps_trip_the_breaker(settings, redis_client, session_factory,
                                                   start_web, tmp_path):
    """LLMQ_FAULT_INJECT_STEP_FAILURES makes every step raise, as a failed device would
    (nothing real on a CPU-only machine fails a device on demand; the setting is read by
    the batcher alone and only tests set it)."""
    base_url = start_web(settings)
    faulty = WorkerProcess(settings, f"faulty-{uuid.uuid4().hex[:4]}", tmp_path,
                           model=MODEL, args=WORKER_ARGS,
                           extra_env={"LLMQ_FAULT_INJECT_STEP_FAILURES": "1000",
                                      "LLMQ_MAX_CONSECUTIVE_STEP_FAILURES": "3"})
    try:
        faulty.wait_ready(redis_client)
        # the first two failed steps fail their jobs (one job each: submitted one by one)
        for i in range(2):
            job_id = submit(base_url, prompt=f"broken {i}", **LONG)["id"]
            row = wait_terminal(session_factory, job_id, 30)
            assert row.status == JobStatus.FAILED.value and "engine step failed" in row.error
        # the third trips the breaker: its job is handed back, its attempt not spent
        handed_back = submit(base_url, prompt="handed back", **LONG)["id"]
        beat = _unhealthy_beat(faulty, redis_client)
        assert "consecutive" in beat["unhealthy_reason"]
        ready = requests.get(f"{base_url}/ready", timeout=10).json()
        assert faulty.group_id in ready["checks"]["unhealthy"][MODEL]
        assert faulty.process.wait(30) == 1, faulty.log_tail()
    finally:
        faulty.terminate()
    row = read_job(session_factory, handed_back)
    assert row.status == JobStatus.QUEUED.value and row.attempts == 0
    with running_worker(settings, redis_client, tmp_path, "healthy", model=MODEL,
                        args=WORKER_ARGS) as good:
        row = wait_terminal(session_factory, handed_back, 60)
    assert row.status == JobStatus.SUCCEEDED.value
    assert row.worker == good.group_id and row.attempts == 1


def test_a_hung_step_trips_the_watchdog(settings, redis_client, session_factory, start_web,
                                        tmp_path):
    """A real hang: a tensor-parallel group (rank 1 a process of its own) whose rank 1 is
    frozen with SIGSTOP. Rank 0's step waits in a collective; the watchdog
    (LLMQ_STEP_TIMEOUT_SECONDS=2) fires long before the TP timeout (60 s) would."""
    base_url = start_web(settings)
    hung = WorkerProcess(settings, f"hung-{uuid.uuid4().hex[:4]}", tmp_path, model=MODEL,
                         args=["--devices", "0,1", "--tp", "2", "--tp-timeout", "60",
                               *WORKER_ARGS],
                         extra_env={"LLMQ_STEP_TIMEOUT_SECONDS": "2"})
    rank_pids: list[int] = []
    try:
        beat = hung.wait_ready(redis_client, timeout=120)
        rank_pids = [pid for pid in beat["topology"]["rank_pids"] if pid != hung.process.pid]
        assert rank_pids
        ids = [submit(base_url, prompt=f"hang {i}", **{**LONG, "max_tokens": 2000})["id"]
               for i in range(3)]
        wait_for(lambda: all(read_job(session_factory, i).first_token_at for i in ids),
                 60, "every job generating")
        for pid in rank_pids:
            os.kill(pid, signal.SIGSTOP)
        beat = _unhealthy_beat(hung, redis_client)
        assert "longer than 2s" in beat["unhealthy_reason"]
        assert hung.process.wait(30) == 1, hung.log_tail()
    finally:
        for pid in rank_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        hung.terminate()
    rows = [read_job(session_factory, i) for i in ids]
    assert {row.status for row in rows} == {JobStatus.QUEUED.value}
    assert {row.attempts for row in rows} == {0}
    with running_worker(settings, redis_client, tmp_path, "healthy", model=MODEL,
                        args=WORKER_ARGS) as good:
        rows = [wait_terminal(session_factory, i, 60) for i in ids]
    assert {row.status for row in rows} == {JobStatus.SUCCEEDED.value}
    assert {(row.worker, row.attempts) for row in rows} == {(good.group_id, 1)}
