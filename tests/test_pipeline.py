"""The whole job pipeline: the Flask app over HTTP, real Postgres and Redis, and real
device-group worker processes (`python -m workers.main`) consuming the Celery queue."""

from __future__ import annotations

import time
import uuid

import pytest
import requests

from tasks.celery_app import create_celery
from tasks.maintenance import reclaim_expired_leases
from tasks.models import JobStatus
from tasks.settings import Settings
from tests.pipeline_helpers import (
    WorkerProcess,
    expected_batcher_nice,
    get_job,
    iter_sse,
    read_ended_stream,
    read_job,
    running_worker,
    submit,
    thread_nice,
    wait_for,
    wait_terminal,
)
from workers.batcher import THREAD_NAME as BATCHER_THREAD

pytestmark = pytest.mark.integration

# small engine limits so a handful of jobs fill a group and the queue spreads them
WORKER_ARGS = ["--max-num-seqs", "8", "--kv-cache-bytes", str(16 * 1024 * 1024),
               "--concurrency", "2"]
LONG = {"max_tokens": 600, "ignore_eos": True, "temperature": 0.0}



@pytest.fixture(scope="module")
def group_a(service_settings, redis_client, tmp_path_factory):
    with running_worker(service_settings, redis_client, tmp_path_factory.mktemp("workers"),
                        "group-a", args=WORKER_ARGS) as worker:
        yield worker


@pytest.fixture(scope="module")
def offline_llm(service_settings):
    from workers.engine.llm import LLM

    return LLM(service_settings.models["tiny"], max_num_seqs=8,
               kv_cache_bytes=16 * 1024 * 1024)


def test_the_batcher_runs_ahead_where_the_engine_leaves_cores(service_settings, redis_client,
                                                              tmp_path_factory):
    """One torch thread: on a host of two cores or more the batcher takes the raised
    priority (where this user may raise one)."""
    nice = Settings.model_fields["batcher_nice"].default  # what a deployment runs with
    with running_worker(service_settings, redis_client, tmp_path_factory.mktemp("workers"),
                        "nice", args=WORKER_ARGS,
                        extra_env={"LLMQ_BATCHER_NICE": str(nice)}) as worker:
        assert thread_nice(worker.process.pid, BATCHER_THREAD) == expected_batcher_nice(
            nice, 1, worker.process.pid)


def test_stream_equals_stored_output_equals_offline(base_url, group_a, session_factory,
                                                    offline_llm):
    from tasks.params import SamplingParams

    job = submit(base_url, prompt="the quick brown fox", max_tokens=24, temperature=0.0,
                 ignore_eos=True)
    assert job["status"] == "queued"
    events = list(iter_sse(base_url, job["id"]))
    assert [e.event for e in events].count("done") == 1 and events[-1].event == "done"
    streamed = "".join(e.data.get("text", "") for e in events if e.event == "token")
    streamed_ids = [t for e in events if e.event == "token" for t in e.data["token_ids"]]
    row = read_job(session_factory, job["id"])
    assert row.status == JobStatus.SUCCEEDED.value and row.worker == group_a.group_id
    assert streamed == row.output_text and streamed_ids == row.output[0]["token_ids"]
    assert get_job(base_url, job["id"])["text"] == streamed
    offline = offline_llm.generate(["the quick brown fox"],
                                   SamplingParams(max_tokens=24, temperature=0.0,
                                                  ignore_eos=True))[0]
    # (a NUL the random model emits is stored and streamed as U+FFFD)
    assert offline.token_ids == streamed_ids
    assert offline.text.replace("\x00", "\ufffd") == streamed
    assert events[-1].data["usage"]["completion_tokens"] == 24


def test_polling_shows_partial_output_and_late_readers_get_everything(base_url, group_a,
                                                                     session_factory):
    job = submit(base_url, prompt="hello world", **LONG)
    partial = wait_for(
        lambda: (lambda j: j if j["status"] == "running" and j["text"] else None)(
            get_job(base_url, job["id"])), 60, "partial output while running")
    assert 0 < len(partial["text"])
    wait_terminal(session_factory, job["id"], timeout=120)
    everything = list(iter_sse(base_url, job["id"]))  # a subscriber after the end
    tokens = [e for e in everything if e.event == "token"]
    assert everything[-1].event == "done" and len(tokens) >= 1
    assert sum(len(e.data["token_ids"]) for e in tokens) == 600
    assert "".join(e.data.get("text", "") for e in tokens).startswith(partial["text"])
    # a reconnect after the k-th event gets exactly the events after it
    k = len(everything) // 2
    rest = list(iter_sse(base_url, job["id"], last_event_id=everything[k].id))
    assert [e.id for e in rest] == [e.id for e in everything[k + 1:]]


def test_cancel_stops_a_running_job_and_frees_its_kv_blocks(base_url, group_a, redis_client,
                                                            session_factory):
    job = submit(base_url, prompt="cancel me", **{**LONG, "max_tokens": 2000})
    wait_for(lambda: get_job(base_url, job["id"])["text"], 60, "the first tokens")
    response = requests.post(f"{base_url}/v1/jobs/{job['id']}/cancel", timeout=10)
    assert response.status_code in (200, 202), response.text
    cancelled_at = time.time()
    row = wait_terminal(session_factory, job["id"], timeout=10)
    assert row.status == JobStatus.CANCELLED.value and row.finish_reason == "cancelled"
    assert row.finished_at.timestamp() - cancelled_at < 5.0
    assert 0 < row.completion_tokens < 1500
    events = read_ended_stream(redis_client, group_a.settings, job["id"])
    assert [e.type.value for e in events].count("cancelled") == 1
    assert events[-1].type.value == "cancelled"
    beat = wait_for(
        lambda: (lambda b: b if b and b["engine_stats_at"] > row.finished_at.timestamp()
                 and b["num_jobs"] == 0 else None)(group_a.heartbeat(redis_client)),
        10, "a heartbeat after the cancel")
    assert beat["kv_cache_usage"] == 0.0 and beat["num_running"] == 0


def test_two_groups_share_the_queue(base_url, group_a, service_settings, redis_client,
                                    session_factory, tmp_path_factory):
    group_b = WorkerProcess(service_settings, f"group-b-{uuid.uuid4().hex[:4]}",
                            tmp_path_factory.mktemp("workers"), args=WORKER_ARGS)
    try:
        group_b.wait_ready(redis_client)
        jobs = [submit(base_url, prompt=f"job number {i}", max_tokens=24, ignore_eos=True)
                for i in range(40)]
        rows = [wait_terminal(session_factory, job["id"], timeout=120) for job in jobs]
    finally:
        assert group_b.terminate() == 0, group_b.log_tail()
    assert {row.status for row in rows} == {JobStatus.SUCCEEDED.value}
    assert all(row.completion_tokens == 24 for row in rows)
    assert {group_a.group_id, group_b.group_id} <= {row.worker for row in rows}


def test_a_killed_group_loses_no_job(base_url, group_a, service_settings, redis_client,
                                     session_factory, tmp_path_factory):
    victim = WorkerProcess(service_settings, f"victim-{uuid.uuid4().hex[:4]}",
                           tmp_path_factory.mktemp("workers"), args=WORKER_ARGS)
    try:
        victim.wait_ready(redis_client)
        # long enough that a job seen generating is still running when the kill lands, on
        # a victim whose steps run ahead of the host's other threads
        jobs = [submit(base_url, prompt=f"survive {i}", **{**LONG, "max_tokens": 2000})
                for i in range(12)]
        ids = [job["id"] for job in jobs]

        def generating_on_victim() -> list[str] | None:
            rows = {i: read_job(session_factory, i) for i in ids}
            return [i for i, row in rows.items() if row.worker == victim.group_id
                    and row.status == JobStatus.RUNNING.value and row.first_token_at] or None

        on_victim = wait_for(generating_on_victim, 60, "a job generating on the victim")
        victim.kill()
    finally:
        victim.kill()
    assert on_victim
    celery_app = create_celery(service_settings)

    def all_terminal() -> bool:
        reclaim_expired_leases(service_settings, session_factory, redis_client, celery_app)
        return all(JobStatus(read_job(session_factory, i).status).is_terminal for i in ids)

    wait_for(all_terminal, 150, "every job to end after the kill", interval=0.5)
    rows = {i: read_job(session_factory, i) for i in ids}
    assert {row.status for row in rows.values()} == {JobStatus.SUCCEEDED.value}
    for job_id in on_victim:
        row = rows[job_id]
        assert row.worker != victim.group_id and row.attempts == 2
        events = read_ended_stream(redis_client, service_settings, job_id)
        types = [e.type.value for e in events]
        assert types.count("restart") == 1 and types.count("done") == 1
        after = events[types.index("restart") + 1:]
        assert "".join(e.text for e in after if e.type.value == "token") == row.output_text
        streamed = list(iter_sse(base_url, job_id))
        assert [e.event for e in streamed].count("restart") == 1
        assert streamed[-1].event == "done"


def test_sigterm_drains_and_requeues_what_did_not_finish(base_url, group_a, service_settings,
                                                         redis_client, session_factory,
                                                         tmp_path_factory):
    drainer = WorkerProcess(service_settings.with_overrides(drain_grace_seconds=0.0),
                            f"drainer-{uuid.uuid4().hex[:4]}",
                            tmp_path_factory.mktemp("workers"), args=WORKER_ARGS)
    try:
        drainer.wait_ready(redis_client)
        # long enough that the jobs are mid-generation when SIGTERM lands; twice what
        # group-a holds (8 running, claims ahead included), so some must go to the drainer
        ids = [submit(base_url, prompt=f"drain {i}", **{**LONG, "max_tokens": 2000})["id"]
               for i in range(16)]
        wait_for(lambda: any(read_job(session_factory, i).worker == drainer.group_id
                             and read_job(session_factory, i).first_token_at for i in ids),
                 60, "a job generating on the drainer")
    finally:
        assert drainer.terminate() == 0, drainer.log_tail()
    assert drainer.heartbeat(redis_client) is None  # it said goodbye
    rows = [wait_terminal(session_factory, i, timeout=120) for i in ids]
    assert {row.status for row in rows} == {JobStatus.SUCCEEDED.value}
    streams = {str(row.id): [e.type.value for e in read_ended_stream(
        redis_client, service_settings, str(row.id))] for row in rows}
    moved = [row for row in rows if "restart" in streams[str(row.id)]]
    assert moved, "no job was running on the drainer when it stopped"
    for row in moved:
        types = streams[str(row.id)]
        assert types.count("restart") == 1 and types[-1] == "done"
        assert row.worker != drainer.group_id
        assert row.attempts == 1  # a drain gives the attempt back: it spent nothing
