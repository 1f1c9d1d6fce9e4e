"""A tensor-parallel device group in the whole pipeline: `python -m workers.main
--devices 0,1 --tp 2` (rank 0 in the worker, rank 1 a spawned process, gloo on CPU)
serves jobs over HTTP exactly like one device, reports its topology, and a killed rank
trips the group: its jobs go back to the queue and it exits instead of hanging."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
import requests

from tasks.models import JobStatus
from tests.pipeline_helpers import (
    WorkerProcess,
    expected_batcher_nice,
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

TP_ARGS = ["--devices", "0,1", "--tp", "2", "--max-num-seqs", "8",
           "--kv-cache-bytes", str(8 * 1024 * 1024), "--concurrency", "2",
           "--tp-timeout", "30"]
TP_BATCHER_NICE = -20  # asked for: taken only where the two ranks' threads leave a core



@pytest.fixture
def tp_group(service_settings, redis_client, tmp_path_factory):
    with running_worker(service_settings, redis_client, tmp_path_factory.mktemp("workers"),
                        "tp", args=TP_ARGS,
                        extra_env={"LLMQ_BATCHER_NICE": str(TP_BATCHER_NICE)}) as worker:
        yield worker


def test_tp_group_serves_the_tp1_text_and_reports_its_topology(base_url, tp_group,
                                                               redis_client, session_factory,
                                                               service_settings):
    from tasks.params import SamplingParams
    from workers.engine.llm import LLM

    topology = tp_group.heartbeat(redis_client)["topology"]
    assert topology["device_kind"] == "cpu" and topology["tp_size"] == 2
    assert topology["devices"] == ["cpu", "cpu"] and len(set(topology["rank_pids"])) == 2
    assert topology["rank_pids"][0] == tp_group.process.pid
    assert topology["num_kv_tokens"] == topology["num_kv_blocks"] * 16 > 0
    # both ranks' threads count against the host's cores (one torch thread each here)
    assert thread_nice(tp_group.process.pid, BATCHER_THREAD) == expected_batcher_nice(
        TP_BATCHER_NICE, 2, tp_group.process.pid)
    models = requests.get(f"{base_url}/v1/models", timeout=10).json()["data"]
    shown = [g for m in models for g in m["groups"] if g["id"] == tp_group.group_id]
    assert shown and shown[0]["topology"] == topology
    ready = requests.get(f"{base_url}/ready", timeout=10).json()
    assert any(g["id"] == tp_group.group_id and g["tp_size"] == 2
               for g in ready["checks"]["topology"]["tiny"])

    prompts = ["the quick brown fox", "tensor parallel"]
    jobs = [submit(base_url, prompt=p, max_tokens=32, temperature=0.0, ignore_eos=True)
            for p in prompts]
    rows = [wait_terminal(session_factory, job["id"], timeout=120) for job in jobs]
    assert {row.status for row in rows} == {JobStatus.SUCCEEDED.value}
    assert {row.worker for row in rows} == {tp_group.group_id}
    streamed = [[t for e in iter_sse(base_url, job["id"]) if e.event == "token"
                 for t in e.data["token_ids"]] for job in jobs]
    with LLM(service_settings.models["tiny"], max_num_seqs=8) as offline:
        expected = offline.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0,
                                                            ignore_eos=True))
    assert streamed == [out.token_ids for out in expected]
    assert [row.output[0]["token_ids"] for row in rows] == streamed


def test_a_killed_rank_hands_the_jobs_back_and_stops_the_worker(service_settings, start_web,
                                                                redis_client, session_factory,
                                                                tmp_path_factory):
    """A lost rank is a device error: the group trips its breaker (no job is to blame), so
    its running jobs go back to the queue with their attempt given back, it says why it is
    unhealthy (`/ready`), exits non-zero, and the jobs finish on a healthy group with the
    text they have alone (their stream restarts once)."""
    from tasks.params import SamplingParams
    from workers.engine.llm import LLM

    # a queue of its own: only this test's groups take its jobs
    settings = service_settings.with_overrides(
        redis_prefix=f"{service_settings.redis_prefix}rank{uuid.uuid4().hex[:8]}",
        drain_grace_seconds=2.0)
    base_url = start_web(settings)
    log_dir = tmp_path_factory.mktemp("workers")
    victim = WorkerProcess(settings, f"tp-victim-{uuid.uuid4().hex[:4]}", log_dir,
                           args=TP_ARGS)
    prompts = [f"rank loss {i}" for i in range(3)]
    params = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0.0}
    try:
        beat = victim.wait_ready(redis_client)
        ids = [submit(base_url, prompt=p, **params)["id"] for p in prompts]
        wait_for(lambda: all(read_job(session_factory, i).first_token_at for i in ids),
                 90, "every job generating on the TP group")
        assert {read_job(session_factory, i).worker for i in ids} == {victim.group_id}
        rank1 = beat["topology"]["rank_pids"][1]
        os.kill(rank1, signal.SIGKILL)
        beat = wait_for(lambda: (lambda b: b if b and b.get("healthy") is False else None)(
            victim.heartbeat(redis_client)), 60, "the group to report itself unhealthy",
            interval=0.05)
        assert f"rank 1 (pid {rank1}) died" in beat["unhealthy_reason"]
        ready = requests.get(f"{base_url}/ready", timeout=10).json()
        assert victim.group_id in ready["checks"]["unhealthy"]["tiny"]
        # the worker does not hang: it stops consuming and exits non-zero
        code = wait_for(lambda: victim.process.poll(), 90, "the worker to exit",
                        interval=0.2)
        assert code == 1, victim.log_tail()
    finally:
        victim.terminate()
    rows = [read_job(session_factory, i) for i in ids]
    assert {row.status for row in rows} == {JobStatus.QUEUED.value}, [r.error for r in rows]
    assert {row.attempts for row in rows} == {0}
    with running_worker(settings, redis_client, log_dir, "healthy",
                        args=["--max-num-seqs", "8", "--kv-cache-bytes",
                              str(8 * 1024 * 1024), "--concurrency", "2"]) as good:
        rows = [wait_terminal(session_factory, i, timeout=120) for i in ids]
    assert {row.status for row in rows} == {JobStatus.SUCCEEDED.value}
    assert {(row.worker, row.attempts) for row in rows} == {(good.group_id, 1)}
    with LLM(settings.models["tiny"], max_num_seqs=8) as offline:
        expected = [out.token_ids for out in offline.generate(prompts, SamplingParams(**params))]
    assert [row.output[0]["token_ids"] for row in rows] == expected
    for row, tokens in zip(rows, expected):
        events = read_ended_stream(redis_client, settings, str(row.id))
        types = [e.type.value for e in events]
        # some tokens from the lost group, one restart, then the whole text again
        assert types.count("restart") == 1 and types[-1] == "done", types
        restart = types.index("restart")
        assert 0 < restart and "error" not in types
        assert [t for e in events[restart:] for t in e.token_ids] == tokens


def test_one_invocation_runs_a_worker_per_group_and_forwards_sigterm(
        service_settings, redis_client, tmp_path_factory, base_url, session_factory):
    """`--devices 0,1 --tp 1` on CPU: two groups, each its own child worker consuming the
    model's queue; SIGTERM to the supervisor drains both and it exits 0."""
    supervisor = WorkerProcess(service_settings, f"host-{uuid.uuid4().hex[:4]}",
                               tmp_path_factory.mktemp("workers"),
                               args=["--devices", "0,1", "--tp", "1", "--max-num-seqs", "4",
                                     "--kv-cache-bytes", str(4 * 1024 * 1024),
                                     "--concurrency", "1"])
    groups = [f"{supervisor.group_id}-g{i}" for i in range(2)]
    try:
        def every_heartbeat():
            beats = [_heartbeat(redis_client, service_settings, g) for g in groups]
            return beats if all(beats) else None

        beats = wait_for(every_heartbeat, 90, "a heartbeat from each group")
        pids = {beat["pid"] for beat in beats}
        assert len(pids) == 2 and supervisor.process.pid not in pids
        assert [beat["devices"] for beat in beats] == [["cpu"], ["cpu"]]
        jobs = [submit(base_url, prompt=f"group {i}", max_tokens=8) for i in range(6)]
        rows = [wait_terminal(session_factory, job["id"], timeout=60) for job in jobs]
        assert {row.status for row in rows} == {JobStatus.SUCCEEDED.value}
        assert {row.worker for row in rows} <= set(groups)
    finally:
        code = supervisor.terminate()
    assert code == 0, supervisor.log_tail()
    assert all(_heartbeat(redis_client, service_settings, g) is None for g in groups)
    for pid in pids:  # the children are gone too
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _heartbeat(redis_client, settings, group_id):
    import json

    from tasks.protocol import group_alive_key, groups_key

    if not redis_client.exists(group_alive_key(settings, "tiny", group_id)):
        return None
    raw = redis_client.hget(groups_key(settings, "tiny"), group_id)
    return json.loads(raw) if raw else None
