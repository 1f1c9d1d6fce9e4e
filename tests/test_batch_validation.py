"""A batch validated off the request (webapp/batch_validation.py): `POST /v1/batches`
answers `validating`; a web process's validator claims the batch under a lease and
commits its jobs and status in one transaction, once. Real Postgres and Redis, the Flask
app over HTTP, the official `openai` client."""

from __future__ import annotations

import io
import json
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import openai
import pytest
from sqlalchemy import func, select, text

from tasks.batches import cancel_batch_jobs, sweep_batches
from tasks.db import utcnow
from tasks.models import Batch, Job, JobStatus
from tests.pipeline_helpers import wait_for
from webapp.batch_validation import claim_batch, commit_validation

pytestmark = pytest.mark.integration

FINISHED = ("completed", "failed", "expired", "cancelled")


def _line(custom_id: str, model: str = "tiny") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": f"say {custom_id}", "max_tokens": 4}}


def _upload(client: openai.OpenAI, count: int, model: str = "tiny") -> str:
    data = "".join(json.dumps(_line(f"v{i}", model)) + "\n" for i in range(count)).encode()
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def _stored_batch(session_factory, file_id: str, *, validator: str | None,
                  lease_seconds: float, attempts: int, window_seconds: float = 3600) -> str:
    """A `validating` batch as a web process left it: claimed by `validator` with a lease
    ending `lease_seconds` from now (negative: lapsed)."""
    batch_id = f"batch_{uuid.uuid4().hex}"
    now = utcnow()
    with session_factory.begin() as session:
        session.add(Batch(
            id=batch_id, endpoint="/v1/completions", input_file_id=file_id,
            completion_window="24h", status="validating", num_total=0, num_completed=0,
            num_failed=0, created_at=now, expires_at=now + timedelta(seconds=window_seconds),
            validator=validator, validation_attempts=attempts,
            validation_lease_expires_at=(now + timedelta(seconds=lease_seconds)
                                         if validator else None)))
    return batch_id


def _num_jobs(session_factory, batch_id: str) -> int:
    with session_factory() as session:
        return session.scalar(select(func.count()).select_from(Job).where(
            Job.batch_id == batch_id)) or 0


def _commit(session_factory, batch_id: str, token: str, tag: str) -> bool:
    """What a validator holding `token` commits: two jobs and `in_progress`."""
    jobs = [Job(model="tiny", kind="completion", prompt="p", params={}, batch_id=batch_id,
                custom_id=f"{tag}{i}", batch_index=i, created_at=utcnow()) for i in range(2)]
    return commit_validation(session_factory, batch_id, token,
                             {"status": "in_progress", "num_total": 2}, jobs)


def test_create_answers_validating_and_the_validator_queues_every_line(client,
                                                                        session_factory):
    batch = client.batches.create(input_file_id=_upload(client, 40),
                                  endpoint="/v1/completions", completion_window="24h")
    assert batch.status == "validating" and batch.in_progress_at is None
    assert batch.expires_at - batch.created_at == 24 * 3600  # the window counts from creation
    running = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status != "validating"
                       and b, 60, "validation ended")
    assert running.status == "in_progress" and running.in_progress_at is not None
    assert running.request_counts.total == 40 == _num_jobs(session_factory, batch.id)
    with session_factory() as session:
        indexes = session.scalars(select(Job.batch_index).where(
            Job.batch_id == batch.id, Job.status == JobStatus.QUEUED.value)).all()
    assert sorted(indexes) == list(range(40))
    client.batches.cancel(batch.id)  # no worker here: leave nothing queued


def _manual_analyses(session_factory) -> int:
    """ANALYZEs of the jobs table run by a statement (not by autovacuum) so far."""
    with session_factory() as session:
        return session.scalar(text("SELECT analyze_count FROM pg_stat_user_tables "
                                   "WHERE relname = 'jobs'")) or 0


def test_the_first_lines_are_queued_while_later_ones_are_validated(client, session_factory):
    """Passes commit as they go: a big file's first lines are jobs (the workers may run
    them) while the batch is still `validating`; in the end every line is a job, once,
    in order. The validator refreshed the jobs table's statistics after the burst (the
    claims' plans read the queued share from them)."""
    num_lines = 3000
    analyses = _manual_analyses(session_factory)
    batch = client.batches.create(input_file_id=_upload(client, num_lines),
                                  endpoint="/v1/completions", completion_window="24h")

    def early_lines() -> int:
        with session_factory() as session:
            validating = session.get(Batch, batch.id).status == "validating"
            count = _num_jobs(session_factory, batch.id)
        return count if validating and 0 < count < num_lines else 0

    seen = wait_for(early_lines, 60, "lines queued while validating", interval=0.005)
    assert client.batches.retrieve(batch.id).request_counts.total in (0, num_lines)
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status != "validating"
                    and b, 60, "validation ended")
    assert done.status == "in_progress" and done.request_counts.total == num_lines
    with session_factory() as session:
        indexes = session.scalars(select(Job.batch_index).where(Job.batch_id == batch.id))
        assert sorted(indexes) == list(range(num_lines))
    assert seen < num_lines
    wait_for(lambda: _manual_analyses(session_factory) > analyses, 10,
             "the jobs table analyzed after the lines")
    client.batches.cancel(batch.id)  # no worker here: leave nothing queued


def test_a_lapsed_lease_is_taken_over_and_the_jobs_exist_once(client, session_factory):
    file_id = _upload(client, 5)
    # a process claimed this one and died; another still validates that one
    orphan = _stored_batch(session_factory, file_id, validator="dead:1:x", lease_seconds=-1,
                           attempts=1)
    alive = _stored_batch(session_factory, file_id, validator="alive:2:y", lease_seconds=600,
                          attempts=1)
    client.batches.retrieve(orphan)  # a GET wakes this process's validator
    done = wait_for(lambda: (b := client.batches.retrieve(orphan)).status != "validating"
                    and b, 60, "the orphan validated")
    assert done.status == "in_progress" and done.request_counts.total == 5
    with session_factory() as session:
        row = session.get(Batch, orphan)
        assert row.validator != "dead:1:x" and row.validation_attempts == 2
    # the dead validator wakes up late: its commit matches nothing, no job is added
    assert not _commit(session_factory, orphan, "dead:1:x", "late")
    assert _num_jobs(session_factory, orphan) == 5
    # a live lease is left alone
    assert client.batches.retrieve(alive).status == "validating"
    with session_factory() as session:
        assert session.get(Batch, alive).validator == "alive:2:y"
    for batch_id in (orphan, alive):
        assert client.batches.cancel(batch_id).status == "cancelled"


def test_concurrent_claims_give_a_batch_to_one_validator_which_commits_once(
        session_factory, redis_client, service_settings):
    # no web process runs in this test: the eight racers alone claim
    batch_id = _stored_batch(session_factory, "file-unread", validator="gone:3:z",
                             lease_seconds=-5, attempts=0)
    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(lambda i: claim_batch(session_factory, f"racer-{i}", 600, 3),
                            range(8)))
    winners = [i for i, claimed in enumerate(won) if claimed == batch_id]
    assert len(winners) == 1, won
    with session_factory() as session:
        assert session.get(Batch, batch_id).validator == f"racer-{winners[0]}"
    loser = next(i for i in range(8) if i != winners[0])
    assert not _commit(session_factory, batch_id, "gone:3:z", "a")
    assert not _commit(session_factory, batch_id, f"racer-{loser}", "b")
    assert _commit(session_factory, batch_id, f"racer-{winners[0]}", "c")
    assert not _commit(session_factory, batch_id, f"racer-{winners[0]}", "d")  # twice
    with session_factory() as session:
        assert sorted(session.scalars(select(Job.custom_id).where(
            Job.batch_id == batch_id))) == ["c0", "c1"]
    cancel_batch_jobs(session_factory, redis_client, service_settings, batch_id)


def test_cancel_while_validating_leaves_no_line_to_run(client, session_factory):
    held = _stored_batch(session_factory, _upload(client, 3), validator="busy:4:w",
                         lease_seconds=600, attempts=1)
    cancelled = client.batches.cancel(held)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    assert cancelled.output_file_id is None and cancelled.error_file_id is None
    # the validator that held it finishes afterwards: nothing is committed
    assert not _commit(session_factory, held, "busy:4:w", "v")
    assert _num_jobs(session_factory, held) == 0
    assert client.batches.retrieve(held).status == "cancelled"
    # through the API, at once after the create: cancelled, and no line left to run
    batch = client.batches.create(input_file_id=_upload(client, 300),
                                  endpoint="/v1/completions", completion_window="24h")
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status in FINISHED
                    and b, 60, "the cancel ended")
    assert done.status == "cancelled"
    with session_factory() as session:
        statuses = set(session.scalars(select(Job.status).where(Job.batch_id == batch.id)))
    assert statuses <= {JobStatus.CANCELLED.value}  # none, or every line cancelled


def test_a_batch_whose_validation_keeps_failing_fails(client, session_factory):
    batch_id = _stored_batch(session_factory, _upload(client, 2), validator="crashed:5:v",
                             lease_seconds=-1, attempts=3)  # LLMQ_MAX_ATTEMPTS claims
    failed = wait_for(lambda: (b := client.batches.retrieve(batch_id)).status != "validating"
                      and b, 60, "the batch failed")
    assert failed.status == "failed" and failed.errors.data[0].code == "validation_failed"
    assert _num_jobs(session_factory, batch_id) == 0


def test_beat_expires_a_validating_batch_nobody_validates(session_factory, redis_client,
                                                          service_settings):
    # no web process runs in this test: nothing validates it, its window passes
    batch_id = _stored_batch(session_factory, "file-none", validator="dead:6:u",
                             lease_seconds=-1, attempts=1, window_seconds=-1)
    sweep_batches(session_factory, redis_client, service_settings)
    with session_factory() as session:
        row = session.get(Batch, batch_id)
        assert row.status == "expired" and row.expired_at is not None
        assert row.output_file_id is None and row.error_file_id is None
    assert _num_jobs(session_factory, batch_id) == 0


def test_a_missing_input_file_fails_the_batch_with_a_file_error(client, session_factory):
    batch_id = _stored_batch(session_factory, "file-deleted-meanwhile", validator=None,
                             lease_seconds=0, attempts=0)
    failed = wait_for(lambda: (b := client.batches.retrieve(batch_id)).status != "validating"
                      and b, 60, "the batch failed")
    assert failed.status == "failed"
    assert [(e.code, e.line) for e in failed.errors.data] == [("invalid_file", None)]


def test_a_web_process_killed_while_validating_loses_nothing(service_settings, start_web,
                                                             session_factory, tmp_path):
    """The `llmq web` (gunicorn) worker validating a big file is killed with SIGKILL after
    its first passes committed; once its lease lapsed, another web process resumes where
    they ended: every line is a job, once, and the jobs made before the kill are kept."""
    import os
    import signal

    from llmq.commands import web_command
    from tests.fixtures_services import free_port
    from tests.pipeline_helpers import serving_web, worker_env

    num_lines = 20_000  # seconds of tokenizing: the kill lands mid-validation
    port = free_port()
    command = web_command("127.0.0.1", port, workers=1, threads=4, graceful_timeout=1.0)
    env = worker_env(service_settings, LLMQ_BATCH_VALIDATION_LEASE_SECONDS="2")
    with serving_web(command, env, tmp_path / "victim.log") as url:
        victim = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        batch = victim.batches.create(input_file_id=_upload(victim, num_lines),
                                      endpoint="/v1/completions", completion_window="24h")

        def claimed() -> str | None:
            with session_factory() as session:
                return session.get(Batch, batch.id).validator

        token = wait_for(claimed, 30, "the victim claimed the batch")
        wait_for(lambda: _num_jobs(session_factory, batch.id) > 0, 30,
                 "the victim committed a first pass", interval=0.01)
        os.kill(int(token.split(":")[1]), signal.SIGKILL)  # the token names its process
    with session_factory() as session:
        assert session.get(Batch, batch.id).status == "validating"
        before = dict(session.execute(select(Job.batch_index, Job.id).where(
            Job.batch_id == batch.id)).all())
    assert 0 < len(before) < num_lines  # killed mid-way, lines 0..n-1 committed
    assert sorted(before) == list(range(len(before)))
    rescuer = openai.OpenAI(base_url=start_web(service_settings) + "/v1", api_key="unused",
                            max_retries=0)
    done = wait_for(lambda: (b := rescuer.batches.retrieve(batch.id)).status != "validating"
                    and b, 120, "another process validated the batch", interval=0.2)
    assert done.status == "in_progress" and done.request_counts.total == num_lines
    with session_factory() as session:
        after = dict(session.execute(select(Job.batch_index, Job.id).where(
            Job.batch_id == batch.id)).all())
        row = session.get(Batch, batch.id)
        assert row.validator != token and row.validation_attempts == 2
    assert _num_jobs(session_factory, batch.id) == num_lines == len(after)
    assert sorted(after) == list(range(num_lines))
    assert all(after[index] == job_id for index, job_id in before.items())
    rescuer.batches.cancel(batch.id)


def test_a_model_that_cannot_load_defers_then_fails_the_batch_not_its_lines(
        service_settings, start_web, session_factory, tiny_qwen3_dir, tmp_path):
    """A 5xx of the server (the model's tokenizer does not load) is not the lines' fault:
    no line goes to the error file as a bad request; the batch is validated again and,
    on its last allowed claim, fails naming the reason."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3_dir, broken)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (broken / name).exists():
            (broken / name).write_text("{ not json")
    settings = service_settings.with_overrides(
        models={**service_settings.models, "broken": str(broken)}, max_attempts=2)
    client = openai.OpenAI(base_url=start_web(settings) + "/v1", api_key="unused",
                           max_retries=0, timeout=60)
    batch = client.batches.create(input_file_id=_upload(client, 3, model="broken"),
                                  endpoint="/v1/completions", completion_window="24h")
    # the first claim defers: the batch stays validating with its claim released
    wait_for(lambda: _attempts(session_factory, batch.id) >= 1, 60, "a first claim")
    assert client.batches.retrieve(batch.id).status == "validating"
    failed = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status != "validating"
                      and b, 90, "the batch failed")
    assert failed.status == "failed"
    assert [(e.code, e.line) for e in failed.errors.data] == [("model_unavailable", 1)]
    assert "cannot load the tokenizer of model 'broken'" in failed.errors.data[0].message
    assert _attempts(session_factory, batch.id) == 2
    assert _num_jobs(session_factory, batch.id) == 0  # no line became a failed job


def _attempts(session_factory, batch_id: str) -> int:
    with session_factory() as session:
        return session.get(Batch, batch_id).validation_attempts


def test_prompts_encoded_together_equal_each_encoded_alone(tiny_qwen3_dir):
    """A batch's prompts go through the tokenizer in one call (webapp/batch_lines.py):
    the same token ids as one call per prompt, with and without special tokens."""
    from tasks.settings import Settings
    from webapp.model_registry import ModelRegistry

    model = ModelRegistry(Settings(models={"tiny": str(tiny_qwen3_dir)})).get("tiny")
    texts = ["", "hello", "hello world " * 40, "üñí ☃ 你好", "<|im_start|>user\nhi"]
    assert model.encode_many(texts, chat=False) == [model.encode(t) for t in texts]
    assert model.encode_many(texts, chat=True) == [model.encode_chat(t) for t in texts]
    assert model.encode_many([], chat=False) == []


def test_hostile_lines_fail_alone_and_their_neighbours_are_queued_as_sent_directly(
        client, session_factory, tiny_qwen3_dir):
    """Lines whose bodies are malformed, huge or out of range, beside good ones, in one
    pass of the validator (their prompts encoded together): each bad line is a failed job
    naming its problem; every good line is queued with the prompt ids a direct request
    gets."""
    from tasks.settings import Settings
    from webapp.model_registry import ModelRegistry

    unknown = f"unknown-{uuid.uuid4().hex[:8]}"
    good = {"g0": "say one", "g1": "say two " * 20, "g2": "üñí ☃"}
    hostile = {
        "empty_prompt": {"prompt": ""},
        "too_long": {"prompt": "word " * 50_000},
        "huge_max_tokens": {"prompt": "hi", "max_tokens": 10**8},
        "string_max_tokens": {"prompt": "hi", "max_tokens": "x"},
        "negative_temperature": {"prompt": "hi", "temperature": -1},
        "out_of_vocab": {"prompt": [10**9]},
        # a name of its own: the session's other tests look for jobs of theirs by model
        "unknown_model": {"prompt": "hi", "model": unknown},
        "huge_n": {"prompt": "hi", "n": 10**6},
    }
    lines = []
    for custom_id, prompt in good.items():
        lines.append(_line(custom_id) | {"body": {"model": "tiny", "prompt": prompt,
                                                 "max_tokens": 4}})
    for custom_id, body in hostile.items():
        lines.append(_line(custom_id) | {"body": {"model": "tiny", "max_tokens": 4, **body}})
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = client.files.create(file=("mixed.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).status != "validating", 60,
             "validation ended")
    with session_factory() as session:
        jobs = {job.custom_id: job for job in session.scalars(
            select(Job).where(Job.batch_id == batch.id))}
    client.batches.cancel(batch.id)  # no worker here: leave nothing queued
    assert set(jobs) == set(good) | set(hostile)
    model = ModelRegistry(Settings(models={"tiny": str(tiny_qwen3_dir)})).get("tiny")
    for custom_id, prompt in good.items():
        job = jobs[custom_id]
        assert job.status == JobStatus.QUEUED.value and job.error is None, job.error
        assert job.prompt_token_ids == model.encode(prompt)
    for custom_id in hostile:
        job = jobs[custom_id]
        assert job.status == JobStatus.FAILED.value, custom_id
        assert job.error_kind == "invalid_request" and job.error, custom_id
    assert "max_tokens" in jobs["huge_max_tokens"].error
    assert unknown in jobs["unknown_model"].error
