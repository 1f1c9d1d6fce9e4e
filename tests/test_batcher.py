"""The batcher, writer and admission with the real tiny engine, real Redis and Postgres,
and no Celery: a job row goes in, the stream and the row come out."""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import update

from tasks.batches import batch_progress
from tasks.db import utcnow
from tasks.models import Job, JobStatus
from tasks.params import SamplingParams
from tasks.protocol import EventType, JobEvent, cancel_flag_key
from tasks.streams.publish import EventPublisher
from tests.batch_helpers import statements_sent, store_queued_lines
from tests.pipeline_helpers import (
    insert_job,
    read_ended_stream,
    read_job,
    read_stream,
    wait_for,
    wait_terminal,
)
from workers.admission import GenerateOutcome, JobAdmission
from workers.admitted import AdmittedJob
from workers.batcher import Batcher
from workers.claims import JobClaims
from workers.db_writer import DbWriter
from workers.job_rows import JobResult
from workers.thread_priority import this_thread_nice

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def tiny_engine(tiny_qwen3_dir):
    from workers.engine.builder import build_engine
    from workers.engine.config import EngineConfig

    config = EngineConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=512)
    return build_engine(str(tiny_qwen3_dir), kv_cache_bytes=8 * 1024 * 1024,
                                  config=config)


class FlakyEngine:
    """The real engine, except that `step()` raises while `fail_steps` > 0 and waits while
    `running` is clear (so a test holds jobs in the engine as long as it needs)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.fail_steps = 0
        self.running = threading.Event()
        self.running.set()

    def step(self):
        self.running.wait(30)
        if self.fail_steps > 0:
            self.fail_steps -= 1
            raise RuntimeError("device lost")
        return self._engine.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _claims(settings, session_factory, redis_client, writer: DbWriter,
            group_id: str) -> JobClaims:
    """The group's claims, run in this process (a worker runs them in its database
    process, tests/test_db_process.py)."""
    return JobClaims(settings, session_factory, redis_client, group_id, own=writer.own)


@dataclass
class Group:
    settings: Any
    engine: FlakyEngine
    batcher: Batcher
    writer: DbWriter
    admission: JobAdmission
    sent: list[str]
    group_id: str


@pytest.fixture
def group(service_settings, session_factory, redis_client, tiny_engine):
    settings = service_settings.with_overrides(lease_renew_seconds=0.2, lease_seconds=5.0)
    group_id = f"test-group-{uuid.uuid4().hex[:6]}"
    publisher = EventPublisher(redis_client, settings)
    sent: list[str] = []
    engine = FlakyEngine(tiny_engine)
    writer = DbWriter(settings, session_factory, publisher.publish, sent.append, group_id)
    batcher = Batcher(engine, publisher, writer, capacity=4, progress_interval=0.1)
    admission = JobAdmission(settings, _claims(settings, session_factory, redis_client, writer,
                                               group_id), batcher, writer, group_id,
                             sent.append)
    writer.start()
    batcher.start()
    yield Group(settings, engine, batcher, writer, admission, sent, group_id)
    batcher.drain(0.0)
    writer.stop()
    assert not tiny_engine.has_unfinished_requests()


def _events(group: Group, redis_client, job_id: str):
    return read_ended_stream(redis_client, group.settings, job_id)


def test_job_runs_to_a_stored_result_and_one_terminal_event(group, session_factory,
                                                            redis_client, tiny_engine):
    job_id = insert_job(session_factory, prompt="hello world",
                        params={"max_tokens": 12, "ignore_eos": True, **GREEDY})
    assert group.admission.run(job_id) is GenerateOutcome.ADMITTED
    job = wait_terminal(session_factory, job_id)
    events = _events(group, redis_client, job_id)

    assert job.status == JobStatus.SUCCEEDED.value and job.finish_reason == "length"
    assert job.attempts == 1 and job.worker == group.group_id
    assert job.started_at <= job.first_token_at <= job.finished_at
    assert job.lease_expires_at is None
    tokens = [e for e in events if e.type is EventType.TOKEN]
    assert [e.type for e in events[len(tokens):]] == [EventType.DONE]
    assert "".join(e.text for e in tokens) == job.output_text == job.output[0]["text"]
    assert sum((e.token_ids for e in tokens), []) == job.output[0]["token_ids"]
    assert job.completion_tokens == 12 and events[-1].usage["completion_tokens"] == 12
    assert job.prompt_tokens == len(tiny_engine.tokenizer.encode("hello world"))
    # offline: the same request on the engine directly gives the same tokens
    tiny_engine.add_request("offline", "hello world",
                            SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))
    offline: list[int] = []
    while tiny_engine.has_unfinished_requests():
        offline += [t for d in tiny_engine.step() for t in d.new_token_ids]
    assert offline == job.output[0]["token_ids"]


def test_generate_only_claims_queued_jobs(group, session_factory):
    job_id = insert_job(session_factory, params={"max_tokens": 2})
    assert group.admission.run(job_id) is GenerateOutcome.ADMITTED
    # a duplicated message while running, and after the end: both skipped
    assert group.admission.run(job_id) is GenerateOutcome.SKIPPED
    wait_terminal(session_factory, job_id)
    assert group.admission.run(job_id) is GenerateOutcome.SKIPPED
    assert read_job(session_factory, job_id).attempts == 1
    cancelled = insert_job(session_factory)
    with session_factory.begin() as session:
        read = session.get(type(read_job(session_factory, cancelled)), uuid.UUID(cancelled))
        read.status = JobStatus.CANCELLED.value
    assert group.admission.run(cancelled) is GenerateOutcome.SKIPPED
    assert read_job(session_factory, cancelled).worker is None


def test_bad_parameters_fail_the_job_with_a_reason(group, session_factory, redis_client):
    job_id = insert_job(session_factory, params={"max_tokens": 0})
    assert group.admission.run(job_id) is GenerateOutcome.FAILED
    job = wait_terminal(session_factory, job_id)
    assert job.status == JobStatus.FAILED.value and "max_tokens" in job.error
    events = _events(group, redis_client, job_id)
    assert [e.type for e in events] == [EventType.ERROR] and "max_tokens" in events[0].error
    # a request the engine refuses (longer than the context) fails the same way
    too_long = insert_job(session_factory, params={"max_tokens": 100_000})
    assert group.admission.run(too_long) is GenerateOutcome.ADMITTED
    job = wait_terminal(session_factory, too_long)
    assert job.status == JobStatus.FAILED.value and "max_model_len" in job.error


def test_cancel_stops_a_running_job_and_frees_its_blocks(group, session_factory, redis_client,
                                                         tiny_engine):
    job_id = insert_job(session_factory, params={"max_tokens": 200, "ignore_eos": True})
    group.admission.run(job_id)
    wait_for(lambda: read_job(session_factory, job_id).output_text, 30, "partial output")
    group.batcher.cancel(job_id)
    job = wait_terminal(session_factory, job_id, timeout=10)
    events = _events(group, redis_client, job_id)
    assert job.status == JobStatus.CANCELLED.value and job.finish_reason == "cancelled"
    assert events[-1].type is EventType.CANCELLED
    assert [e.type for e in events].count(EventType.CANCELLED) == 1
    assert 0 < job.completion_tokens < 200
    assert job.output_text == "".join(e.text for e in events if e.type is EventType.TOKEN)
    assert tiny_engine.stats().kv_cache_usage == 0.0
    wait_for(lambda: group.batcher.load().engine["kv_cache_usage"] == 0.0, 5, "load figures")


def test_cancel_flag_set_before_admission_skips_the_engine(group, session_factory,
                                                          redis_client):
    job_id = insert_job(session_factory)
    redis_client.set(cancel_flag_key(group.settings, job_id), b"1", ex=60)
    assert group.admission.run(job_id) is GenerateOutcome.CANCELLED
    job = wait_terminal(session_factory, job_id)
    assert job.status == JobStatus.CANCELLED.value
    assert [e.type for e in _events(group, redis_client, job_id)] == [EventType.CANCELLED]
    # a cancel that reaches the batcher just before its job does still catches it
    early = insert_job(session_factory, params={"max_tokens": 200, "ignore_eos": True})
    group.batcher.cancel(early)
    time.sleep(0.1)
    group.admission.run(early)
    assert wait_terminal(session_factory, early).status == JobStatus.CANCELLED.value


def test_admission_blocks_while_the_group_is_full(group, session_factory):
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    group.engine.running.clear()  # hold the first job in the engine
    first = insert_job(session_factory, params={"max_tokens": 20, "ignore_eos": True, "n": 4})
    assert group.admission.run(first) is GenerateOutcome.ADMITTED  # 4 samples: full
    blocked = AdmittedJob(job_id=str(uuid.uuid4()), prompt="x", params=params)
    started = time.monotonic()
    assert group.batcher.admit(blocked, timeout=0.3) is False
    assert time.monotonic() - started >= 0.3
    second = insert_job(session_factory, params={"max_tokens": 4})
    result: list[GenerateOutcome] = []
    thread = threading.Thread(target=lambda: result.append(group.admission.run(second)))
    thread.start()
    thread.join(0.2)
    assert thread.is_alive(), "admission returned while the group was full"
    assert read_job(session_factory, first).status == JobStatus.RUNNING.value
    # a job cancelled while it waits for room is let through and ends without running
    waiting = insert_job(session_factory, params={"max_tokens": 4})
    outcome: list[GenerateOutcome] = []
    waiter = threading.Thread(target=lambda: outcome.append(group.admission.run(waiting)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    group.batcher.cancel(waiting)
    waiter.join(5)
    assert outcome == [GenerateOutcome.ADMITTED]
    group.engine.running.set()
    assert wait_terminal(session_factory, waiting).status == JobStatus.CANCELLED.value
    thread.join(60)
    assert result == [GenerateOutcome.ADMITTED]
    assert wait_terminal(session_factory, first).status == JobStatus.SUCCEEDED.value
    assert wait_terminal(session_factory, second).status == JobStatus.SUCCEEDED.value


def test_a_failing_step_fails_its_jobs_and_the_batcher_goes_on(group, session_factory,
                                                              redis_client):
    group.engine.fail_steps = 1
    job_id = insert_job(session_factory, params={"max_tokens": 4})
    group.admission.run(job_id)
    job = wait_terminal(session_factory, job_id)
    assert job.status == JobStatus.FAILED.value and "device lost" in job.error
    events = _events(group, redis_client, job_id)
    assert events[-1].type is EventType.ERROR and "device lost" in events[-1].error
    assert group.batcher.is_alive()
    after = insert_job(session_factory, params={"max_tokens": 4})
    group.admission.run(after)
    assert wait_terminal(session_factory, after).status == JobStatus.SUCCEEDED.value


def test_leases_are_renewed_while_running(group, session_factory):
    job_id = insert_job(session_factory, params={"max_tokens": 200, "ignore_eos": True})
    group.engine.running.clear()  # the job stays in the engine however fast the machine
    group.admission.run(job_id)
    first = read_job(session_factory, job_id).lease_expires_at
    later = wait_for(lambda: (lambda j: j if j.lease_expires_at > first else None)(
        read_job(session_factory, job_id)), 5, "a renewed lease")
    assert later.status == JobStatus.RUNNING.value
    group.engine.running.set()
    group.batcher.cancel(job_id)
    wait_terminal(session_factory, job_id)


def test_drain_requeues_unfinished_jobs(service_settings, session_factory, redis_client,
                                        tiny_engine):
    settings = service_settings
    publisher = EventPublisher(redis_client, settings)
    sent: list[str] = []
    writer = DbWriter(settings, session_factory, publisher.publish, sent.append, "drainer")
    batcher = Batcher(tiny_engine, publisher, writer, capacity=4)
    admission = JobAdmission(settings, _claims(settings, session_factory, redis_client, writer,
                                               "drainer"), batcher, writer,
                             "drainer", sent.append)
    writer.start()
    batcher.start()
    job_id = insert_job(session_factory, params={"max_tokens": 200, "ignore_eos": True})
    admission.run(job_id)
    wait_for(lambda: read_job(session_factory, job_id).first_token_at, 30, "a first token")
    admission.close()
    aborted = batcher.drain(0.0)
    assert [job.job_id for job in aborted] == [job_id]
    for job in aborted:
        writer.requeue(job.job_id, job.attempt)  # a drain gives the attempt back
    late = insert_job(session_factory)
    assert admission.run(late) is GenerateOutcome.REQUEUED  # handed back untouched
    writer.stop()
    job = read_job(session_factory, job_id)
    assert job.status == JobStatus.QUEUED.value and job.worker is None and job.attempts == 0
    assert sorted(sent) == sorted([job_id, late])
    events = [e for _, e in read_stream(redis_client, settings, job_id)]
    assert events[-1].type is EventType.RESTART and events[-1].attempt == 1
    assert read_job(session_factory, late).status == JobStatus.QUEUED.value
    assert not tiny_engine.has_unfinished_requests()


def test_a_result_postgres_rejects_fails_alone(group, session_factory, redis_client):
    """A poison row (NUL in text) must not block the writer or the other jobs' results."""
    bad, good = (insert_job(session_factory) for _ in range(2))
    group.engine.running.clear()  # keep both in the engine while we write by hand
    try:
        for job_id in (bad, good):
            assert group.admission.run(job_id) is GenerateOutcome.ADMITTED
        for job_id in (bad, good):
            group.batcher.cancel(job_id)  # nothing else may finish them
        for job_id, text in ((bad, "nul \x00 byte"), (good, "fine")):
            group.writer.finish(JobResult(
                job_id=job_id, status=JobStatus.SUCCEEDED, finish_reason="stop", error=None,
                output=[{"index": 0, "text": text}], output_text=text, prompt_tokens=1,
                completion_tokens=1, cached_tokens=0,
                event=JobEvent(EventType.DONE, finish_reason="stop")))
        assert group.writer.flush(10)
    finally:
        group.engine.running.set()
    bad_row, good_row = wait_terminal(session_factory, bad), wait_terminal(session_factory, good)
    assert good_row.status == JobStatus.SUCCEEDED.value and good_row.output_text == "fine"
    assert bad_row.status == JobStatus.FAILED.value and "could not store" in bad_row.error
    # (token events after it are the hand-written result's artefact: the engine went on)
    terminal = [e.type for e in _events(group, redis_client, bad) if e.type.is_terminal]
    assert terminal == [EventType.ERROR]


def test_a_request_that_fails_its_step_fails_alone(group, session_factory, redis_client,
                                                   tiny_engine):
    """The engine isolates a step that raises: only the job that makes it raise fails,
    with the reason in its row and its stream; its batch companions succeed with the
    tokens they produce alone."""
    from tests.test_step_isolation import POISON, FaultyRunner

    # innocents long enough to be running when the culprit reaches its first decode
    params = {"max_tokens": 150, "ignore_eos": True, **GREEDY}
    prompts = [[11 + i, 40, 41, 42, 43, 44 + i] for i in range(3)]
    runner = FaultyRunner(tiny_engine)
    try:
        innocents = [insert_job(session_factory, prompt=None, prompt_token_ids=p,
                                params=params) for p in prompts]
        culprit = insert_job(session_factory, prompt=None,
                             prompt_token_ids=[POISON, 40, 41, 42], params=params)
        for job_id in [innocents[0], culprit, *innocents[1:]]:
            assert group.admission.run(job_id) is GenerateOutcome.ADMITTED
        failed = wait_terminal(session_factory, culprit)
        done = [wait_terminal(session_factory, job_id) for job_id in innocents]
    finally:
        tiny_engine.runner = runner.inner
    assert failed.status == JobStatus.FAILED.value and failed.finish_reason == "error"
    assert "device-side assert triggered" in failed.error
    assert _events(group, redis_client, culprit)[-1].type is EventType.ERROR
    assert runner.num_failures >= 2  # the batch step, then the culprit alone
    for job, prompt in zip(done, prompts):
        assert job.status == JobStatus.SUCCEEDED.value, job.error
        tiny_engine.add_request("solo", prompt, SamplingParams(**params))
        solo: list[int] = []
        while tiny_engine.has_unfinished_requests():
            solo += [t for d in tiny_engine.step() for t in d.new_token_ids]
        assert job.output[0]["token_ids"] == solo


def test_a_batch_line_streams_every_token_in_merged_events(group, session_factory,
                                                            redis_client):
    from tasks.api.batches import BATCH_PRIORITY
    from workers.batcher import BATCH_LINE_EVENT_TOKENS

    num_tokens = BATCH_LINE_EVENT_TOKENS + 8
    params = {"max_tokens": num_tokens, "ignore_eos": True, **GREEDY}
    line = insert_job(session_factory, prompt="hello world", params=params,
                      priority=BATCH_PRIORITY)
    solo = insert_job(session_factory, prompt="hello world", params=params)
    for job_id in (line, solo):
        assert group.admission.run(job_id) is GenerateOutcome.ADMITTED
    jobs = {job_id: wait_terminal(session_factory, job_id) for job_id in (line, solo)}
    line_events, solo_events = (_events(group, redis_client, job_id) for job_id in (line, solo))

    assert [(e.type, len(e.token_ids)) for e in line_events] == [
        (EventType.TOKEN, BATCH_LINE_EVENT_TOKENS), (EventType.TOKEN, 8), (EventType.DONE, 0)]
    assert sum(e.type is EventType.TOKEN for e in solo_events) == num_tokens  # one a step
    for job_id, events in ((line, line_events), (solo, solo_events)):
        tokens = [e for e in events if e.type is EventType.TOKEN]
        assert "".join(e.text for e in tokens) == jobs[job_id].output_text
        assert sum((e.token_ids for e in tokens), []) == jobs[job_id].output[0]["token_ids"]
    assert jobs[line].output == jobs[solo].output
    assert jobs[line].first_token_at is not None


def test_batch_lines_are_claimed_oldest_batch_first_in_line_order(group, session_factory):
    model = f"tiny-{uuid.uuid4().hex[:6]}"  # no other test's lines
    now = utcnow()
    newer = store_queued_lines(session_factory, model, [0, 1], created_at=now)
    older = store_queued_lines(session_factory, model, [2, 0, 1],
                               created_at=now - timedelta(seconds=10))

    def claim(limit: int) -> set[str]:
        outcomes = group.admission.run_next_batch_jobs(model, limit)
        assert outcomes == [GenerateOutcome.ADMITTED] * limit
        return {job_id for job_id in [*newer.values(), *older.values()]
                if read_job(session_factory, job_id).attempts == 1}

    assert claim(2) == {older[0], older[1]}
    claimed = claim(2)
    assert claimed == {older[0], older[1], older[2], newer[0]}
    for job_id in claimed:
        wait_terminal(session_factory, job_id)
    assert read_job(session_factory, newer[1]).status == JobStatus.QUEUED.value


def test_the_writer_finishes_a_batch_once_its_last_line_is_stored(group, session_factory):
    """No GET and no beat here: the group's writer, having stored a line's result, finishes
    the batch when none of its lines is left, and not before."""
    from tasks.files import read_file_bytes
    from tasks.models import Batch

    model = f"tiny-{uuid.uuid4().hex[:6]}"  # no other test's lines
    ids = store_queued_lines(session_factory, model, [0, 1, 2], created_at=utcnow())
    batch_id = read_job(session_factory, ids[0]).batch_id

    def batch() -> Batch:
        with session_factory() as session:
            found = session.get(Batch, batch_id)
            assert found is not None
            return found

    assert group.admission.run_next_batch_jobs(model, 2) == [GenerateOutcome.ADMITTED] * 2
    for index in (0, 1):
        wait_terminal(session_factory, ids[index])
    time.sleep(0.5)  # the finisher looked, and found line 2 queued
    assert batch().status == "in_progress" and batch().output_file_id is None
    ran = [read_job(session_factory, ids[index]) for index in (0, 1)]
    with session_factory() as session:  # a look while it runs: counted from its lines
        counts, named, usage, unfinished = batch_progress(session, batch())
    assert counts == {"total": 3, "completed": 2, "failed": 0} and named == model
    assert unfinished == 1  # line 2, queued
    assert (usage["input_tokens"], usage["output_tokens"]) == (
        sum(job.prompt_tokens for job in ran), sum(job.completion_tokens for job in ran)) \
        and usage["output_tokens"] > 0

    assert group.admission.run_next_batch_jobs(model, 2) == [GenerateOutcome.ADMITTED]
    last = wait_terminal(session_factory, ids[2])
    done = wait_for(lambda: (found := batch()).status == "completed" and found, 30,
                    "the batch to complete")
    assert (done.num_completed, done.num_failed, done.error_file_id) == (3, 0, None)
    assert done.completed_at >= last.finished_at
    with session_factory() as session:
        lines = read_file_bytes(session, done.output_file_id).decode().splitlines()
    assert [json.loads(line)["custom_id"] for line in lines] == ["r0", "r1", "r2"]

    # the finished batch's figures were stored as it was finalized: a look reads them and
    # runs no statement; they equal what its lines sum to
    ran = [read_job(session_factory, job_id) for job_id in ids.values()]
    assert done.model == model and done.usage["output_tokens"] == sum(
        job.completion_tokens for job in ran)
    with session_factory() as session:
        found = session.get(Batch, batch_id)
        with statements_sent(session.get_bind()) as statements:
            stored = batch_progress(session, found)
        assert statements == []
        session.expunge(found)
        found.usage = None  # as a batch finished before its figures were stored
        counted = batch_progress(session, found)
        assert counted[:3] == stored[:3] == (
            {"total": 3, "completed": 3, "failed": 0}, model, done.usage)
        assert (counted.unfinished, stored.unfinished) == (0, None)  # None: not looked at


def test_a_message_claims_queued_jobs_of_the_model_ahead_up_to_the_room(
        group, session_factory, redis_client):
    """A claim takes the message's job and other queued interactive jobs of the group's
    model, as many as fit (capacity 4: three more); their messages are then skipped,
    without a statement while the job runs here and the group is full, with a claim that
    takes nothing after."""
    model = f"ahead-{uuid.uuid4().hex[:6]}"
    claims = _claims(group.settings, session_factory, redis_client, group.writer,
                     group.group_id)
    admission = JobAdmission(group.settings, claims, group.batcher, group.writer,
                             group.group_id, group.sent.append, model=model)
    group.engine.running.clear()  # hold every admitted job in the engine
    jobs = [insert_job(session_factory, model=model, params={"max_tokens": 2})
            for _ in range(5)]
    other = insert_job(session_factory, model=f"{model}-other", params={"max_tokens": 2})
    assert admission.run(jobs[0]) is GenerateOutcome.ADMITTED
    statuses = [read_job(session_factory, job_id).status for job_id in jobs]
    assert statuses.count(JobStatus.RUNNING.value) == 4, statuses
    assert read_job(session_factory, other).status == JobStatus.QUEUED.value
    claimed_ahead = [job_id for job_id in jobs[1:]
                     if read_job(session_factory, job_id).status == JobStatus.RUNNING.value]
    assert len(claimed_ahead) == 3
    with statements_sent(session_factory.kw["bind"]) as statements:
        assert admission.run(claimed_ahead[0]) is GenerateOutcome.SKIPPED
        assert admission.run(claimed_ahead[1]) is GenerateOutcome.SKIPPED
    assert statements == []  # the rows run here, no room for others: no claim to send
    group.engine.running.set()
    for job_id in jobs:  # the one left queued runs on its own message
        if read_job(session_factory, job_id).status == JobStatus.QUEUED.value:
            assert admission.run(job_id) is GenerateOutcome.ADMITTED
    assert all(wait_terminal(session_factory, job_id).status == JobStatus.SUCCEEDED.value
               and read_job(session_factory, job_id).attempts == 1 for job_id in jobs)
    wait_for(lambda: not group.batcher.holds(claimed_ahead[2]), 10, "the job released")
    # the last one's message comes after its job ended here: its claim runs, takes nothing
    with statements_sent(session_factory.kw["bind"]) as statements:
        assert admission.run(claimed_ahead[2]) is GenerateOutcome.SKIPPED
    assert any(statement.lstrip().upper().startswith(("UPDATE", "WITH"))
               for statement in statements), statements
    assert read_job(session_factory, claimed_ahead[2]).attempts == 1
    with session_factory.begin() as session:  # not this group's model: leave no row behind
        session.execute(update(Job).where(Job.id == uuid.UUID(other)).values(
            status=JobStatus.CANCELLED.value))


def _running_rows(session_factory, group_id: str, n: int) -> list[str]:
    """`n` rows claimed by `group_id` (attempt 1), as a claim leaves them."""
    job_ids = [insert_job(session_factory) for _ in range(n)]
    with session_factory.begin() as session:
        session.execute(update(Job).where(Job.id.in_([uuid.UUID(j) for j in job_ids]))
                        .values(status=JobStatus.RUNNING.value, worker=group_id, attempts=1,
                                started_at=utcnow(),
                                lease_expires_at=utcnow() + timedelta(seconds=60)))
    return job_ids


def _result(job_id: str, background: bool) -> JobResult:
    """A result; `background`: a batch line's (of a batch that is not stored)."""
    return JobResult(job_id=job_id, status=JobStatus.SUCCEEDED, finish_reason="length",
                     error=None, output=[{"index": 0, "text": "x", "finish_reason": "length",
                                          "token_ids": [1]}],
                     output_text="x", prompt_tokens=1, completion_tokens=1, cached_tokens=0,
                     event=JobEvent(EventType.DONE, finish_reason="length"), attempt=1,
                     batch_id="batch_unstored" if background else None)


@pytest.mark.alone
def test_batch_lines_results_wait_to_share_a_write_and_an_interactive_one_does_not(
        service_settings, session_factory, redis_client, monkeypatch):
    """Results of batch lines finishing one after another go out in one transaction; an
    interactive result is written at once, and ends a wait it arrives in."""
    from workers import db_writer

    monkeypatch.setattr(db_writer, "BACKGROUND_LINGER_SECONDS", 1.0)
    group_id = f"linger-{uuid.uuid4().hex[:6]}"
    writer = DbWriter(service_settings, session_factory,
                      EventPublisher(redis_client, service_settings).publish, lambda _: None,
                      group_id)
    writes: list[tuple[float, int]] = []  # (when, results in the write)
    real_write = writer.rows.write

    def observed_write(items):
        writes.append((time.monotonic(), len(items)))
        return real_write(items)

    writer.rows.write = observed_write
    writer.start()
    try:
        lines = _running_rows(session_factory, group_id, 5)
        for job_id in lines:  # finishing 20 ms apart, as lines do beside a running batch
            writer.own(job_id, 1)
            writer.finish(_result(job_id, background=True))
            time.sleep(0.02)
        assert writer.flush(10)
        assert [n for _, n in writes] == [5]
        assert all(read_job(session_factory, j).status == JobStatus.SUCCEEDED.value
                   for j in lines)

        writes.clear()
        line, interactive = _running_rows(session_factory, group_id, 2)
        writer.finish(_result(line, background=True))
        time.sleep(0.05)
        sent = time.monotonic()
        writer.finish(_result(interactive, background=False))
        wait_for(lambda: writes, 5, "the write")
        assert writes[0][1] == 2 and writes[0][0] - sent < 0.5  # not the 1 s linger

        writes.clear()
        (alone,) = _running_rows(session_factory, group_id, 1)
        sent = time.monotonic()
        writer.finish(_result(alone, background=False))
        wait_for(lambda: writes, 5, "the write")
        assert writes[0][1] == 1 and writes[0][0] - sent < 0.5
    finally:
        writer.stop()


def test_hostile_rows_claimed_with_good_ones_through_the_database_process_fail_alone(
        service_settings, session_factory, redis_client, tiny_engine):
    """The worker's own wiring (workers/runtime.py): claims and writes in the group's
    database process. One claim takes a good job, a row with parameters no worker can run
    (written past the API), a row whose prompt runs past the context, and one with a
    token id outside the vocabulary: each bad one fails alone with its reason, and the
    good one's tokens equal the engine's own."""
    from workers.db_process import DbProcess

    settings = service_settings.with_overrides(lease_renew_seconds=0.2, lease_seconds=5.0)
    model = f"hostile-{uuid.uuid4().hex[:6]}"
    db = DbProcess(settings, f"test-group-{uuid.uuid4().hex[:6]}", model)
    db.start()
    publisher = EventPublisher(redis_client, settings)
    batcher = Batcher(tiny_engine, publisher, db, capacity=8, progress_interval=0.1)
    admission = JobAdmission(settings, db.claims, batcher, db, db.group_id,
                             lambda job_id: None, model=model)
    batcher.start()
    try:
        good = insert_job(session_factory, model=model, prompt="hello world",
                          params={"max_tokens": 6, "ignore_eos": True, **GREEDY})
        bad_params = insert_job(session_factory, model=model,
                                params={"max_tokens": 4, "temperature": "hot"})
        too_long = insert_job(session_factory, model=model, prompt=None,
                              prompt_token_ids=[7] * 50_000, params={"max_tokens": 4})
        bad_token = insert_job(session_factory, model=model, prompt=None,
                               prompt_token_ids=[5, 10**9], params={"max_tokens": 4})
        assert admission.run(good) is GenerateOutcome.ADMITTED
        rows = {job_id: wait_terminal(session_factory, job_id)
                for job_id in (good, bad_params, too_long, bad_token)}
        assert all(row.attempts == 1 for row in rows.values())
        assert rows[good].status == JobStatus.SUCCEEDED.value
        for job_id in (bad_params, too_long, bad_token):
            assert rows[job_id].status == JobStatus.FAILED.value, rows[job_id].error
            assert rows[job_id].error_kind == "invalid_request", rows[job_id].error
        assert "temperature" in rows[bad_params].error
        tiny_engine.add_request("offline-hostile", "hello world",
                                SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
        offline: list[int] = []
        while tiny_engine.has_unfinished_requests():
            offline += [t for d in tiny_engine.step() for t in d.new_token_ids]
        assert rows[good].output[0]["token_ids"] == offline
    finally:
        batcher.drain(0.0)
        db.stop(10.0)


def test_an_interactive_job_stops_a_batch_only_step_and_no_token_changes(
        service_settings, session_factory, redis_client, tiny_qwen3_dir):
    """The service's wiring of `Engine.set_step_yield`: an interactive job admitted while
    a batch line's step runs stops that step between layers (the engine's counter moves),
    and neither the line's tokens nor the interactive jobs' change."""
    from tasks.api.batches import BATCH_PRIORITY
    from workers.engine.builder import build_engine
    from workers.engine.config import EngineConfig

    engine = build_engine(str(tiny_qwen3_dir), kv_cache_bytes=8 * 1024 * 1024,
                          config=EngineConfig(block_size=16, max_num_seqs=8,
                                              max_num_batched_tokens=512,
                                              background_priority=BATCH_PRIORITY))
    settings = service_settings.with_overrides(lease_renew_seconds=0.2, lease_seconds=5.0)
    model = f"stops-{uuid.uuid4().hex[:6]}"  # no other test's queued rows
    group_id = f"test-group-{uuid.uuid4().hex[:6]}"
    publisher = EventPublisher(redis_client, settings)
    writer = DbWriter(settings, session_factory, publisher.publish, lambda _: None, group_id)
    batcher = Batcher(engine, publisher, writer, capacity=8, progress_interval=0.1)
    admission = JobAdmission(settings, _claims(settings, session_factory, redis_client, writer,
                                               group_id), batcher, writer, group_id,
                             lambda _: None)
    assert batcher.interrupts_steps
    writer.start()
    batcher.start()
    line_params = {"max_tokens": 1500, "ignore_eos": True, **GREEDY}
    try:
        line = insert_job(session_factory, model=model, prompt="a long batch line",
                          params=line_params, priority=BATCH_PRIORITY)
        assert admission.run(line) is GenerateOutcome.ADMITTED
        questions: dict[str, str] = {}
        # NOTE: one token each: an interactive job's own steps are never stopped, so they
        # leave at once and the next one meets batch-only steps again; tried for as long
        # as the line runs (a loaded machine spends more of its time between steps)
        deadline = time.monotonic() + 60.0
        while (engine.num_interrupted_steps == 0 and time.monotonic() < deadline
               and not JobStatus(read_job(session_factory, line).status).is_terminal):
            prompt = f"question {len(questions)}"
            job_id = insert_job(session_factory, model=model, prompt=prompt,
                                params={"max_tokens": 1, **GREEDY})
            assert admission.run(job_id) is GenerateOutcome.ADMITTED
            questions[job_id] = prompt
            time.sleep(0.003)
        rows = {job_id: wait_terminal(session_factory, job_id)
                for job_id in [line, *questions]}
    finally:
        batcher.drain(0.0)
        writer.stop()
    assert engine.num_interrupted_steps >= 1
    assert all(row.status == JobStatus.SUCCEEDED.value for row in rows.values())

    def alone(prompt: str, params: dict[str, Any]) -> list[int]:
        engine.add_request(f"alone-{uuid.uuid4().hex}", prompt, SamplingParams(**params))
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            tokens += [t for d in engine.step() for t in d.new_token_ids]
        return tokens

    assert rows[line].output[0]["token_ids"] == alone("a long batch line", line_params)
    for job_id, prompt in list(questions.items())[-3:]:
        assert rows[job_id].output[0]["token_ids"] == alone(prompt,
                                                            {"max_tokens": 1, **GREEDY})


class SlowEngine(FlakyEngine):
    """The real engine with steps of at least `seconds` (a model slower than the tiny one)."""

    def __init__(self, engine: Any, seconds: float) -> None:
        super().__init__(engine)
        self.seconds = seconds

    def step(self):
        started = time.monotonic()
        deltas = super().step()
        time.sleep(max(0.0, self.seconds - (time.monotonic() - started)))
        return deltas


def test_a_streaming_job_gets_its_first_token_at_once_then_one_event_per_interval(
        service_settings, session_factory, redis_client, tiny_engine):
    """`stream_interval`: the first token alone, then events at least the interval apart
    (the stream's entry ids carry Redis's clock in ms), every token in order, and one event
    per step again with steps slower than the interval."""
    settings = service_settings.with_overrides(lease_renew_seconds=0.2, lease_seconds=5.0)
    group_id = f"test-group-{uuid.uuid4().hex[:6]}"
    publisher = EventPublisher(redis_client, settings)
    writer = DbWriter(settings, session_factory, publisher.publish, lambda _: None, group_id)
    engine = SlowEngine(tiny_engine, 0.01)
    interval = 0.06
    batcher = Batcher(engine, publisher, writer, capacity=4, progress_interval=0.1,
                      stream_interval=interval)
    admission = JobAdmission(settings, _claims(settings, session_factory, redis_client, writer,
                                               group_id), batcher, writer, group_id,
                             lambda _: None)
    writer.start()
    batcher.start()
    params = {"max_tokens": 40, "ignore_eos": True, **GREEDY}
    try:
        fast = insert_job(session_factory, prompt="hello world", params=params)
        assert admission.run(fast) is GenerateOutcome.ADMITTED
        row = wait_terminal(session_factory, fast)
        engine.seconds = interval * 1.5  # steps slower than the interval: nothing waits
        slow = insert_job(session_factory, prompt="hello there",
                          params={**params, "max_tokens": 4})
        assert admission.run(slow) is GenerateOutcome.ADMITTED
        slow_row = wait_terminal(session_factory, slow)
    finally:
        batcher.drain(0.0)
        writer.stop()
    entries = read_stream(redis_client, settings, fast)
    tokens = [(entry_id, event) for entry_id, event in entries
              if event.type is EventType.TOKEN]
    assert entries[-1][1].type is EventType.DONE
    assert len(tokens[0][1].token_ids) == 1  # the first token at once
    assert sum((e.token_ids for _, e in tokens), []) == row.output[0]["token_ids"]
    assert "".join(e.text for _, e in tokens) == row.output_text
    assert 2 <= len(tokens) < 40  # merged (10 ms steps, 60 ms apart: ~6 tokens an event)
    stamps = [int(entry_id.split("-")[0]) for entry_id, _ in tokens]
    # every event but the last (flushed with the result) waited out the interval
    assert all(b - a >= interval * 1000 - 10 for a, b in zip(stamps[:-2], stamps[1:-1]))
    slow_tokens = [e for _, e in read_stream(redis_client, settings, slow)
                   if e.type is EventType.TOKEN]
    assert [len(e.token_ids) for e in slow_tokens] == [1, 1, 1, 1]
    assert sum((e.token_ids for e in slow_tokens), []) == slow_row.output[0]["token_ids"]


class NiceRecordingEngine(FlakyEngine):
    """Records the nice value of the thread that runs each step."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.step_nices: set[int] = set()

    def step(self):
        self.step_nices.add(this_thread_nice())
        return super().step()


def test_the_batcher_runs_its_steps_at_its_nice_value(service_settings, session_factory,
                                                       redis_client, tiny_engine):
    settings = service_settings
    nice = this_thread_nice() + 2  # a lower priority: allowed without privileges
    publisher = EventPublisher(redis_client, settings)
    engine = NiceRecordingEngine(tiny_engine)
    writer = DbWriter(settings, session_factory, publisher.publish, lambda _: None, "nicer")
    batcher = Batcher(engine, publisher, writer, capacity=4, nice=nice)
    admission = JobAdmission(settings, _claims(settings, session_factory, redis_client, writer,
                                               "nicer"), batcher, writer, "nicer",
                             lambda _: None)
    writer.start()
    batcher.start()
    try:
        job_id = insert_job(session_factory, params={"max_tokens": 3, **GREEDY})
        assert admission.run(job_id) is GenerateOutcome.ADMITTED
        assert wait_terminal(session_factory, job_id).status == JobStatus.SUCCEEDED.value
    finally:
        batcher.drain(0.0)
        writer.stop()
    assert engine.step_nices == {nice}
    assert this_thread_nice() == nice - 2  # the test's own thread kept its value
