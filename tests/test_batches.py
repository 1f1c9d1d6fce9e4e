"""The OpenAI Batch API with the official `openai` client: `/v1/files` and `/v1/batches`
over HTTP, real Postgres and Redis, real device-group worker processes."""

from __future__ import annotations

import io
import json
import time
import uuid
from typing import Any

import openai
import pytest
import requests
from sqlalchemy import select

from tasks.batches import finalize_if_done, sweep_batches
from tasks.models import Batch, Job, JobStatus
from tests.batch_helpers import statements_sent, store_ended_batch
from tests.fault_helpers import Beat
from tests.pipeline_helpers import WorkerProcess, running_worker, wait_for

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "name three colours"}]
WORKER_ARGS = ["--max-num-seqs", "8", "--kv-cache-bytes", str(16 * 1024 * 1024)]


@pytest.fixture(scope="module")
def worker(service_settings, redis_client, tmp_path_factory):
    with running_worker(service_settings, redis_client, tmp_path_factory.mktemp("workers"),
                        "batch", args=WORKER_ARGS) as process:
        yield process




def _jsonl(lines: list[dict[str, Any] | str]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                   for line in lines).encode()


def _chat_line(custom_id: str, content: str, max_tokens: int = 6, **extra: Any) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": body}


def _upload(client: openai.OpenAI, lines: list[dict[str, Any] | str]):
    return client.files.create(file=("input.jsonl", io.BytesIO(_jsonl(lines))),
                               purpose="batch")


def _wait_status(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...],
                 timeout: float = 120.0):
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b,
                    timeout, f"batch {batch_id} {statuses}", interval=0.2)


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def _every_line_once(client, batch, custom_ids: list[str]) -> tuple[list, list]:
    output = _lines(client, batch.output_file_id)
    errors = _lines(client, batch.error_file_id)
    seen = [line["custom_id"] for line in output + errors]
    assert sorted(seen) == sorted(custom_ids), "every line once, in one of the files"
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (
        len(custom_ids), len(output), len(errors))
    return output, errors


# --- files --------------------------------------------------------------------------------


def test_files_upload_list_get_content_delete(client, base_url):
    data = _jsonl([_chat_line("a", "hi")])
    created = client.files.create(file=("mine.jsonl", io.BytesIO(data)), purpose="batch")
    assert created.id.startswith("file-") and created.object == "file"
    assert created.bytes == len(data) and created.filename == "mine.jsonl"
    assert created.purpose == "batch" and created.status == "processed"
    assert client.files.retrieve(created.id).bytes == len(data)
    assert client.files.content(created.id).content == data
    listed = [f.id for f in client.files.list(limit=100)]
    assert created.id in listed
    deleted = client.files.delete(created.id)
    assert deleted.deleted is True and deleted.id == created.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    # bad uploads are OpenAI-shaped 4xx errors naming the field
    bad = requests.post(base_url + "/v1/files", files={"file": ("x.jsonl", data)},
                        data={"purpose": "fine-tune"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "purpose"
    missing = requests.post(base_url + "/v1/files", data={"purpose": "batch"}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "file"


def test_files_and_batches_belong_to_their_key(start_web, service_settings, session_factory):
    from tasks.auth import create_api_key

    base_url = start_web(service_settings.with_overrides(auth_enabled=True))
    _, key_a = create_api_key(session_factory, "batch-alice")
    _, key_b = create_api_key(session_factory, "batch-bob")
    alice = openai.OpenAI(base_url=base_url + "/v1", api_key=key_a, max_retries=0)
    bob = openai.OpenAI(base_url=base_url + "/v1", api_key=key_b, max_retries=0)
    upload = _upload(alice, ["{"])
    batch = alice.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                 completion_window="24h")  # fails validation: cheap
    for call in (lambda: bob.files.retrieve(upload.id), lambda: bob.files.content(upload.id),
                 lambda: bob.files.delete(upload.id), lambda: bob.batches.retrieve(batch.id),
                 lambda: bob.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError):  # another key's file is not a batch input
        bob.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                           completion_window="24h")
    assert upload.id not in [f.id for f in bob.files.list()]
    assert batch.id not in [b.id for b in bob.batches.list()]
    assert alice.batches.retrieve(batch.id).id == batch.id
    no_key = requests.get(base_url + "/v1/batches", timeout=30)
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"


def test_a_file_over_the_size_limit_is_a_413(start_web, service_settings):
    base_url = start_web(service_settings.with_overrides(max_file_bytes=2048))
    answer = requests.post(base_url + "/v1/files", data={"purpose": "batch"},
                           files={"file": ("big.jsonl", b"x" * 4096)}, timeout=30)
    assert answer.status_code == 413
    assert "LLMQ_MAX_FILE_BYTES" in answer.json()["error"]["message"]


# --- batches ------------------------------------------------------------------------------


def test_finalization_is_won_by_exactly_one_process(session_factory):
    """Eight finalizers at once over a batch whose jobs all ended: one writes the files."""
    from concurrent.futures import ThreadPoolExecutor

    from tasks.models import File

    batch_id = store_ended_batch(session_factory, ("succeeded", "succeeded", "failed"))
    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(lambda _: finalize_if_done(session_factory, batch_id), range(8)))
    assert won.count(True) == 1
    with session_factory() as session:
        batch = session.get(Batch, batch_id)
        files = session.scalars(select(File.id).where(File.filename.like(f"{batch_id}%"))).all()
    assert batch.status == "completed" and (batch.num_completed, batch.num_failed) == (2, 1)
    assert sorted(files) == sorted([batch.output_file_id, batch.error_file_id])


def test_a_look_at_a_batch_with_lines_left_is_one_statement(session_factory):
    """A device group's writer looks at a batch after every write of its lines' results:
    while a line is left, the look is the one probe for it; once none is, it finishes."""
    from sqlalchemy import update

    batch_id = store_ended_batch(session_factory, ("succeeded", "running"))
    with statements_sent(session_factory.kw["bind"]) as statements:
        assert finalize_if_done(session_factory, batch_id) is False
    assert len(statements) == 1 and "FROM jobs" in statements[0], statements
    with session_factory.begin() as session:
        session.execute(update(Job).where(Job.batch_id == batch_id, Job.status == "running")
                        .values(status="succeeded"))
    assert finalize_if_done(session_factory, batch_id) is True
    with session_factory() as session:
        batch = session.get(Batch, batch_id)
    assert batch.status == "completed" and (batch.num_completed, batch.num_failed) == (2, 0)


def test_batch_outputs_equal_direct_requests_and_a_bad_body_fails_its_line(
        client, base_url, worker, session_factory):
    # the last asks for two samples: its body is built from the row's samples, not from
    # the row's first sample's text as the others' are
    prompts = ["name three colours", "count to five", "say hello", "name three colours"]
    samples = [1, 1, 1, 2]
    lines = [_chat_line(f"req-{i}", p, n=n) for i, (p, n) in enumerate(zip(prompts, samples))]
    lines.append(_chat_line("bad", "x", max_tokens=0))  # refused as the direct request is
    # the row keeps no tool plan to shape calls with: refused in a batch, not ignored
    lines.append(_chat_line("tools", "x", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}]))
    input_file = _upload(client, lines)
    batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "equal"})
    assert batch.object == "batch" and batch.id.startswith("batch_")
    assert batch.status == "validating" and batch.request_counts.total == 0  # answered at once
    batch = _wait_status(client, batch.id, ("in_progress", "completed"))
    assert batch.metadata == {"run": "equal"} and batch.request_counts.total == 6
    # each line is a job of the batch, listed like any job
    with session_factory() as session:
        jobs = session.scalars(select(Job).where(Job.batch_id == batch.id)
                               .order_by(Job.batch_index)).all()
    assert [job.custom_id for job in jobs] == ["req-0", "req-1", "req-2", "req-3", "bad",
                                               "tools"]
    assert jobs[4].status == jobs[5].status == JobStatus.FAILED.value
    listed = requests.get(f"{base_url}/v1/jobs", params={"batch_id": batch.id}, timeout=30)
    assert sorted(job["custom_id"] for job in listed.json()["data"]) == [
        "bad", "req-0", "req-1", "req-2", "req-3", "tools"]
    assert {job["batch_id"] for job in listed.json()["data"]} == {batch.id}

    done = _wait_status(client, batch.id, ("completed", "failed", "expired", "cancelled"))
    assert done.status == "completed" and done.completed_at and done.output_file_id
    output, errors = _every_line_once(client, done, [line["custom_id"] for line in lines])
    assert done.request_counts.completed == 4 and done.request_counts.failed == 2
    # its usage: the tokens of the requests that ran (the two refused ones never did)
    usages = [line["response"]["body"]["usage"] for line in output]
    assert done.model == "tiny" and done.usage is not None
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in usages) > 0
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in usages) == 30
    assert done.usage.input_tokens_details.cached_tokens == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    assert [line["custom_id"] for line in output] == ["req-0", "req-1", "req-2", "req-3"]
    for line, prompt, n in zip(output, prompts, samples):
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        direct = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=6,
            temperature=0.0, n=n, extra_body={"ignore_eos": True}).model_dump(mode="json")
        body = line["response"]["body"]
        assert set(body) == {k for k, v in direct.items() if v is not None} | {
            "system_fingerprint"}
        assert body["object"] == direct["object"] and body["model"] == direct["model"]
        assert body["choices"] == [{k: v for k, v in choice.items() if k in (
            "index", "message", "logprobs", "finish_reason")} | {"message": {
                "role": "assistant", "content": choice["message"]["content"]}}
            for choice in direct["choices"]]
        assert len(body["choices"]) == n and body["choices"][-1]["message"]["content"]
        for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert body["usage"][name] == direct["usage"][name]
        assert body["id"] == "chatcmpl-" + uuid.UUID(line["response"]["request_id"]).hex
    bad, tools = errors
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 400
    assert "max_tokens" in bad["response"]["body"]["error"]["message"]
    assert bad["response"]["body"]["error"]["param"] == "max_tokens"  # as the direct 400
    assert tools["custom_id"] == "tools" and tools["response"]["status_code"] == 400
    assert "tools is not supported in a batch" in tools["response"]["body"]["error"]["message"]
    # finished once: a second finalize (another web process, beat) changes nothing
    assert finalize_if_done(session_factory, batch.id) is False
    assert client.batches.retrieve(batch.id).output_file_id == done.output_file_id


def test_invalid_lines_fail_the_batch_with_their_line_numbers(client):
    good = _chat_line("a", "hi")
    lines: list[dict[str, Any] | str] = [
        good, "not json", {**good, "url": "/v1/completions", "custom_id": "b"},
        _chat_line("a", "again"), {"custom_id": "c", "method": "GET",
                                   "url": "/v1/chat/completions", "body": {}}]
    batch = client.batches.create(input_file_id=_upload(client, lines).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "validating"  # the lines are read off the request
    batch = _wait_status(client, batch.id, ("failed", "in_progress"), timeout=60)
    assert batch.status == "failed" and batch.failed_at is not None
    found = {(e.line, e.code) for e in batch.errors.data}
    assert found == {(2, "invalid_json_line"), (3, "mismatched_endpoint"),
                     (4, "duplicate_custom_id"), (5, "invalid_request")}
    assert batch.request_counts.total == 0
    # listing pages newest first
    later = client.batches.create(input_file_id=_upload(client, ["{"]).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    first = client.batches.list(limit=1)
    assert [b.id for b in first.data] == [later.id] and first.has_more
    second = client.batches.list(limit=1, after=later.id)
    assert second.data[0].id == batch.id


def test_create_batch_rejects_bad_bodies_with_4xx(base_url, client):
    url = base_url + "/v1/batches"
    file_id = _upload(client, [_chat_line("a", "hi")]).id
    for body, param in (({"input_file_id": file_id, "endpoint": "/v1/embeddings",
                          "completion_window": "24h"}, "endpoint"),
                        ({"input_file_id": file_id, "endpoint": "/v1/completions",
                          "completion_window": "1h"}, "completion_window"),
                        ({"input_file_id": "file-nope", "endpoint": "/v1/completions",
                          "completion_window": "24h"}, "input_file_id")):
        answer = requests.post(url, json=body, timeout=30)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param
    assert requests.get(url + "/batch_nope", timeout=30).status_code == 404
    assert requests.get(url + "?limit=0", timeout=30).json()["error"]["param"] == "limit"


def test_cancel_leaves_partial_results(client, worker, session_factory):
    # NOTE: two short lines, then long ones: lines of one length that run together end
    # together, and the cancel could come after the last of them
    lines = [_chat_line(f"c{i}", f"story {i}", max_tokens=4 if i < 2 else 256)
             for i in range(24)]
    batch = client.batches.create(input_file_id=_upload(client, lines).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")

    def lines_done() -> int:  # the rows themselves: a GET's counts may be a second old
        with session_factory() as session:
            return len(session.scalars(select(Job.id).where(
                Job.batch_id == batch.id, Job.status == JobStatus.SUCCEEDED.value)).all())

    wait_for(lambda: lines_done() >= 2, 120, "two lines done", interval=0.02)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = _wait_status(client, batch.id, ("cancelled",))
    assert done.cancelled_at is not None and done.cancelling_at is not None
    output, errors = _every_line_once(client, done, [line["custom_id"] for line in lines])
    assert len(output) >= 2 and errors
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: the same answer


def test_expiry_finishes_the_batch_with_what_was_done(start_web, service_settings, worker,
                                                      session_factory, redis_client):
    base_url = start_web(service_settings.with_overrides(batch_completion_window_seconds=1))
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    # more lines than the worker holds (its seats and the lines waiting for one): some are
    # still queued when the window passes
    lines = [_chat_line(f"e{i}", f"tale {i}", max_tokens=96) for i in range(256)]
    batch = client.batches.create(input_file_id=_upload(client, lines).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.expires_at - batch.created_at <= 2

    def swept() -> str | None:  # what beat does every few seconds
        sweep_batches(session_factory, redis_client, service_settings)
        with session_factory() as session:
            status = session.get(Batch, batch.id).status
        return status if status in ("expired", "completed") else None

    assert wait_for(swept, 120, "the batch ended", interval=0.5) == "expired"
    done = client.batches.retrieve(batch.id)
    assert done.status == "expired" and done.expired_at is not None
    output, errors = _every_line_once(client, done, [line["custom_id"] for line in lines])
    assert errors and {line["error"]["code"] for line in errors} == {"batch_expired"}
    assert all(line["response"]["status_code"] == 200 for line in output)


def test_batches_survive_a_web_restart(start_web, service_settings, client, worker):
    lines = [_chat_line(f"w{i}", f"note {i}") for i in range(4)]
    batch = client.batches.create(input_file_id=_upload(client, lines).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    # another web process (a restart) finishes it from the rows alone
    other = openai.OpenAI(base_url=start_web(service_settings) + "/v1", api_key="unused",
                          max_retries=0)
    deadline = time.monotonic() + 120
    while other.batches.retrieve(batch.id).status != "completed":
        assert time.monotonic() < deadline, "batch did not complete"
        time.sleep(0.2)
    _every_line_once(other, other.batches.retrieve(batch.id), [c["custom_id"] for c in lines])


def test_the_cli_submits_follows_and_fetches_a_batch(base_url, worker, tmp_path, capsys):
    from llmq.cli import main

    lines = [_chat_line(f"cli{i}", f"word {i}") for i in range(3)]
    path = tmp_path / "requests.jsonl"
    path.write_bytes(_jsonl(lines))
    assert main(["batch", "submit", str(path), "--url", base_url, "--wait"]) == 0
    out = capsys.readouterr().out
    batch_id = out.splitlines()[0]
    assert batch_id.startswith("batch_") and '"status": "completed"' in out
    assert main(["batch", "status", batch_id, "--url", base_url]) == 0
    assert json.loads(capsys.readouterr().out)["request_counts"]["completed"] == 3
    results = tmp_path / "results.jsonl"
    assert main(["batch", "results", batch_id, "--url", base_url, "-o", str(results)]) == 0
    found = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted(line["custom_id"] for line in found) == ["cli0", "cli1", "cli2"]
    # a file with an invalid line: the batch fails and the line is named
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert main(["batch", "submit", str(bad), "--url", base_url]) == 1
    assert "line 1:" in capsys.readouterr().err


def test_a_worker_killed_mid_batch_loses_no_line(start_web, service_settings, redis_client,
                                                 session_factory, tmp_path, worker):
    worker.terminate()  # the module's worker would take the requeued jobs: not this time
    base_url = start_web(service_settings)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    # the first line ends long before the others, so lines are mid-run at the kill: the
    # victim runs two at a time (with eight, a fast CPU ends all 20 before the first poll)
    lines = [_chat_line(f"k{i}", f"verse {i}", max_tokens=4 if i == 0 else 400)
             for i in range(20)]
    victim = WorkerProcess(service_settings, f"victim-{uuid.uuid4().hex[:4]}", tmp_path,
                           args=["--max-num-seqs", "2", *WORKER_ARGS[2:]])
    try:
        victim.wait_ready(redis_client)
        batch = client.batches.create(input_file_id=_upload(client, lines).id,
                                      endpoint="/v1/chat/completions",
                                      completion_window="24h")
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1,
                 120, "a first line done")
        victim.kill()
        at_kill = client.batches.retrieve(batch.id).request_counts
        assert at_kill.completed < len(lines), "every line ended before the kill"
    finally:
        victim.terminate()
    with Beat(service_settings, session_factory), running_worker(
            service_settings, redis_client, tmp_path, "rescue", args=WORKER_ARGS):
        done = _wait_status(client, batch.id, ("completed", "failed", "expired", "cancelled"),
                            timeout=180)
    assert done.status == "completed"
    output, errors = _every_line_once(client, done, [line["custom_id"] for line in lines])
    assert not errors and len(output) == len(lines)
    with session_factory() as session:
        attempts = session.scalars(select(Job.attempts).where(Job.batch_id == batch.id)).all()
    assert max(attempts) >= 2  # some line really ran again after the kill
