"""A background response survives its web process restarting and its worker killed with
SIGKILL: the real `llmq web` server (gunicorn + the stream server), real worker processes,
Postgres and Redis. Polling and a resumed stream both end in one terminal state with the
stored text; the resumed events continue the numbering exactly, each character once."""

from __future__ import annotations

import threading
import uuid

import openai
import pytest

from llmq.commands import web_command
from tasks.models import JobStatus
from tasks.protocol import EventType
from tests.fault_helpers import Beat
from tests.fixtures_services import free_port
from tests.pipeline_helpers import (
    WorkerProcess,
    read_job,
    read_stream,
    serving_web,
    wait_for,
    worker_env,
)

pytestmark = pytest.mark.integration

WORKER_ARGS = ["--max-num-seqs", "8", "--kv-cache-bytes", str(16 * 1024 * 1024)]
MAX_OUTPUT_TOKENS = 1900  # long enough to be mid-generation at the kill
TERMINAL = {"response.completed", "response.incomplete", "response.failed",
            "response.cancelled"}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_web_restart_and_worker_kill9_during_a_background_response(
        service_settings, redis_client, session_factory, tmp_path):
    settings = service_settings.with_overrides(lease_seconds=3.0, lease_renew_seconds=0.5)
    env = worker_env(settings)
    port = free_port()
    command = web_command("127.0.0.1", port, workers=1, threads=4, graceful_timeout=1.0)
    victim = WorkerProcess(settings, f"victim-{uuid.uuid4().hex[:4]}", tmp_path,
                           args=WORKER_ARGS)
    rescuer: WorkerProcess | None = None
    try:
        victim.wait_ready(redis_client)
        with serving_web(command, env, tmp_path / "web-1.log") as url:
            client = _client(url)
            # sampled, unseeded: the seed pinned at submission makes the re-run repeat
            stream = client.responses.create(
                model="tiny", input="tell me a long story", background=True, stream=True,
                temperature=1.0, max_output_tokens=MAX_OUTPUT_TOKENS,
                extra_body={"ignore_eos": True})
            before = []
            for event in stream:
                before.append(event)
                if len(before) == 10:
                    break
            stream.close()  # the client drops; the background job runs on
            victim.kill()  # SIGKILL mid-generation
            response_id = before[0].response.id
            job_id = before[0].response.job_id
            assert read_job(session_factory, job_id).worker == victim.group_id
        k = before[-1].sequence_number
        status = read_job(session_factory, job_id).status
        assert status == JobStatus.RUNNING.value, status

        rescuer = WorkerProcess(settings, f"rescuer-{uuid.uuid4().hex[:4]}", tmp_path,
                                args=WORKER_ARGS)
        with serving_web(command, env, tmp_path / "web-2.log") as url, \
                Beat(settings, session_factory):
            client = _client(url)
            resumed: list = []
            follower = threading.Thread(target=lambda: resumed.extend(
                client.responses.retrieve(response_id, stream=True, starting_after=k)),
                daemon=True)
            follower.start()
            rescuer.wait_ready(redis_client)
            texts: list[str] = []

            def poll():
                response = client.responses.retrieve(response_id)
                texts.append(response.output_text)
                return response if response.status not in ("queued", "in_progress") else None

            polled = wait_for(poll, 120, "the response to end", interval=0.2)
            follower.join(60)
            assert not follower.is_alive(), "the resumed stream did not end"
            replay = list(client.responses.retrieve(response_id, stream=True))

        row = read_job(session_factory, job_id)
        assert row.attempts == 2 and row.worker == rescuer.group_id
        types = [event.type for _, event in read_stream(redis_client, settings, job_id)]
        assert types.count(EventType.RESTART) == 1
        # one terminal state, the stored text, everywhere
        assert polled.status == "incomplete" and polled.output_text == row.output_text
        assert polled.usage.output_tokens == MAX_OUTPUT_TOKENS
        assert [e.type for e in resumed if e.type in TERMINAL] == ["response.incomplete"]
        assert resumed[-1].response.output_text == row.output_text
        # the resumed events continue the numbering: none missing, none twice
        assert [e.sequence_number for e in resumed] == list(range(k + 1, k + 1 + len(resumed)))
        seen = before + resumed
        assert [e.model_dump() for e in replay] == [e.model_dump() for e in seen]
        text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        assert text == row.output_text
        # each poll's text was a prefix of the next: nothing taken back by the restart
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts
    finally:
        victim.kill()
        if rescuer is not None:
            rescuer.terminate()
