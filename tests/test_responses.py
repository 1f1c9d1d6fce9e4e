"""OpenAI's Responses API on durable jobs (`/v1/responses`) with the official `openai`
client: the Flask app over HTTP, real Postgres and Redis, a real device-group worker.
Plus the event numbering on its own (`webapp/response_events.py`)."""

from __future__ import annotations

import uuid

import openai
import pytest
import requests
from sqlalchemy import select

from tasks.auth import create_api_key
from tasks.models import JobStatus, StoredResponse
from tasks.protocol import EventType, JobEvent, events_key
from tests.pipeline_helpers import read_job, running_worker, wait_for, wait_terminal
from webapp.response_events import ResponseEvents, text_so_far

PROMPT = "name three colours"
INSTRUCTIONS = "be brief"


# --- the event numbering (no services) ----------------------------------------------------


def _numbering() -> ResponseEvents:
    return ResponseEvents(item_id="msg_x", created_status="queued",
                          snapshot=lambda status: {"status": status})


def _final(text: str, status: str = "completed") -> dict:
    return {"status": status, "output": [{"id": "msg_x", "type": "message",
                                          "role": "assistant", "status": "completed",
                                          "content": [{"type": "output_text", "text": text,
                                                       "annotations": []}]}]}


def _token(text: str) -> JobEvent:
    return JobEvent(EventType.TOKEN, text=text, token_ids=[1])


def _run(job_events: list[JobEvent], final_text: str) -> list[dict]:
    numbering = _numbering()
    events = numbering.preamble()
    for event in job_events:
        events += numbering.feed(event)
    return events + numbering.finish(_final(final_text))


def test_events_are_numbered_in_order_with_a_fixed_preamble():
    events = _run([_token("ab"), _token("c"), _token("")], "abc")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[0]["response"]["status"] == "queued"
    assert [e["delta"] for e in events if "delta" in e] == ["ab", "c"]
    assert events[-4]["text"] == "abc"


def test_a_restart_never_sends_text_twice_and_numbering_is_a_function_of_the_stream():
    stream = [_token("The "), _token("quick "), JobEvent(EventType.RESTART, attempt=2),
              _token("The qu"), _token("ick br"), _token("own")]
    events = _run(stream, "The quick brown")
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == ["The ", "quick ", "br", "own"]
    assert "".join(deltas) == "The quick brown"
    assert _run(stream, "The quick brown") == events  # a replay numbers them the same


def test_polled_text_never_shrinks_across_a_restart():
    stream = [_token("The "), _token("quick "), JobEvent(EventType.RESTART, attempt=2),
              _token("The")]
    assert [text_so_far(stream[:i]) for i in range(1, 5)] == [
        "The ", "The quick ", "The quick ", "The quick "]


def test_a_rebuild_from_the_row_sends_the_whole_text_in_one_delta():
    events = _run([], "all of it")
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [e["delta"] for e in deltas] == ["all of it"]
    assert deltas[0]["sequence_number"] == 4


# --- the API over real services -----------------------------------------------------------


@pytest.fixture(scope="module")
def worker(service_settings, redis_client, tmp_path_factory):
    with running_worker(service_settings, redis_client, tmp_path_factory.mktemp("workers"),
                        "resp", args=["--max-num-seqs", "8", "--kv-cache-bytes",
                                      str(16 * 1024 * 1024)]) as process:
        yield process




def _poll(client, response_id: str, timeout: float = 90.0):
    return wait_for(lambda: (lambda r: r if r.status not in ("queued", "in_progress")
                             else None)(client.responses.retrieve(response_id)),
                    timeout, f"response {response_id} to end", interval=0.1)


def _chat_text(client, messages, max_tokens: int) -> str:
    chat = client.chat.completions.create(model="tiny", messages=messages, temperature=0.0,
                                          max_completion_tokens=max_tokens,
                                          extra_body={"ignore_eos": True})
    return chat.choices[0].message.content


@pytest.mark.integration
def test_background_then_poll_equals_the_chat_completion(client, worker, session_factory):
    created = client.responses.create(model="tiny", input=PROMPT, instructions=INSTRUCTIONS,
                                      background=True, temperature=0.0, max_output_tokens=12,
                                      metadata={"ticket": "42"},
                                      extra_body={"ignore_eos": True})
    assert created.object == "response" and created.id.startswith("resp_")
    assert created.status == "queued" and created.background is True
    assert created.output == [] and created.usage is None
    done = _poll(client, created.id)
    expected = _chat_text(client, [{"role": "system", "content": INSTRUCTIONS},
                                   {"role": "user", "content": PROMPT}], 12)
    assert done.output_text == expected
    # max_output_tokens reached: incomplete, with the reason
    assert done.status == "incomplete"
    assert done.incomplete_details.reason == "max_output_tokens"
    assert done.usage.output_tokens == 12
    assert done.usage.total_tokens == done.usage.input_tokens + 12
    assert done.usage.output_tokens_details.reasoning_tokens == 0
    assert done.metadata == {"ticket": "42"} and done.instructions == INSTRUCTIONS
    row = read_job(session_factory, done.job_id)  # a job like any other
    assert row.status == JobStatus.SUCCEEDED.value and row.output_text == expected


@pytest.mark.integration
def test_a_stop_token_ends_it_completed(client, worker, session_factory):
    first = client.responses.create(model="tiny", input="hi", temperature=0.0,
                                    max_output_tokens=4, extra_body={"ignore_eos": True})
    token_ids = read_job(session_factory, first.job_id).output[0]["token_ids"]
    # not background: the answer waits for the job
    stopped = client.responses.create(model="tiny", input="hi", temperature=0.0,
                                      max_output_tokens=4,
                                      extra_body={"stop_token_ids": [token_ids[2]]})
    assert stopped.status == "completed" and stopped.incomplete_details is None
    assert stopped.usage.output_tokens == token_ids.index(token_ids[2]) + 1
    assert stopped.output[0].status == "completed"


def _sse_events(url: str) -> list[dict]:
    import json

    events = []
    with requests.get(url, stream=True, timeout=120) as answer:
        assert answer.status_code == 200, answer.text
        kind = None
        for line in answer.iter_lines(decode_unicode=True):
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == kind
                events.append(event)
    return events


@pytest.mark.integration
def test_a_dropped_background_stream_resumes_exactly_after_k(client, base_url, worker,
                                                             session_factory):
    stream = client.responses.create(model="tiny", input=PROMPT, background=True, stream=True,
                                     temperature=0.0, max_output_tokens=1000,
                                     extra_body={"ignore_eos": True})
    seen = []
    for event in stream:
        seen.append(event)
        if len(seen) == 12:
            break
    stream.close()  # the client drops half way
    response_id = seen[0].response.id
    k = seen[-1].sequence_number
    assert [e.sequence_number for e in seen] == list(range(12))
    resumed = list(client.responses.retrieve(response_id, stream=True, starting_after=k))
    full = list(client.responses.retrieve(response_id, stream=True))
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in full
                                                 if e.sequence_number > k]
    assert [e.model_dump() for e in full[:12]] == [e.model_dump() for e in seen]
    assert [e.sequence_number for e in full] == list(range(len(full)))
    assert full[-1].type == "response.incomplete"
    text = "".join(e.delta for e in full if e.type == "response.output_text.delta")
    final = client.responses.retrieve(response_id)
    # the job ran on after the drop (background): to max_output_tokens, not cancelled
    assert text == final.output_text and final.usage.output_tokens == 1000
    # the same over plain HTTP: the exact bytes of each event's JSON
    url = f"{base_url}/v1/responses/{response_id}?stream=true"
    raw_full = _sse_events(url)
    assert _sse_events(f"{url}&starting_after={k}") == [
        e for e in raw_full if e["sequence_number"] > k]


@pytest.mark.integration
def test_a_dropped_foreground_stream_cancels_its_job(client, worker, session_factory):
    with client.responses.with_streaming_response.create(
            model="tiny", input=PROMPT, stream=True, temperature=0.0, max_output_tokens=2000,
            extra_body={"ignore_eos": True}) as answer:
        job_id = answer.headers["X-Llmq-Job-Id"]
        deltas = 0
        for line in answer.iter_lines():
            if line.startswith("event: response.output_text.delta"):
                deltas += 1
                if deltas == 3:
                    break
    row = wait_terminal(session_factory, job_id, timeout=60)
    assert row.status == JobStatus.CANCELLED.value


@pytest.mark.integration
def test_cancel_a_background_response_and_cancel_is_idempotent(client, worker):
    created = client.responses.create(model="tiny", input=PROMPT, background=True,
                                      max_output_tokens=1900, extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(created.id).status == "cancelled"
    again = client.responses.cancel(created.id)  # a finished one: answered as it is
    assert again.status == "cancelled"
    finished = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):  # only background responses
        client.responses.cancel(finished.id)


@pytest.mark.integration
def test_previous_response_id_continues_the_conversation(client, worker):
    first = client.responses.create(model="tiny", input="my name is Ada",
                                    instructions="answer in French", temperature=0.0,
                                    max_output_tokens=6, extra_body={"ignore_eos": True})
    second = client.responses.create(model="tiny", input="what is my name?",
                                     previous_response_id=first.id, temperature=0.0,
                                     max_output_tokens=6, extra_body={"ignore_eos": True})
    assert second.previous_response_id == first.id
    # the previous instructions are not carried over
    expected = _chat_text(client, [{"role": "user", "content": "my name is Ada"},
                                   {"role": "assistant", "content": first.output_text},
                                   {"role": "user", "content": "what is my name?"}], 6)
    assert second.output_text == expected
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert info.value.code == "previous_response_not_found"
    assert info.value.body["param"] == "previous_response_id"


@pytest.mark.integration
def test_input_items_are_the_requests_own_in_pages(client, base_url, worker):
    created = client.responses.create(model="tiny", input=[
        {"role": "developer", "content": "be terse"},
        {"role": "user", "content": [{"type": "input_text", "text": "one "},
                                     {"type": "input_text", "text": "two"}]},
        {"role": "assistant", "content": "three"},
        {"type": "message", "role": "user", "content": "four"}],
        instructions="not an input item", max_output_tokens=2)
    items = list(client.responses.input_items.list(created.id, order="asc"))
    assert [(i.role, i.content[0].text) for i in items] == [
        ("system", "be terse"), ("user", "one two"), ("assistant", "three"), ("user", "four")]
    first = client.responses.input_items.list(created.id, limit=3)  # newest first
    assert [i.content[0].text for i in first.data] == ["four", "three", "one two"]
    assert first.has_more is True and first.last_id == first.data[-1].id
    rest = client.responses.input_items.list(created.id, limit=3, after=first.last_id)
    assert [i.content[0].text for i in rest.data] == ["be terse"] and rest.has_more is False
    bad = requests.get(f"{base_url}/v1/responses/{created.id}/input_items?after=nope",
                       timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"


@pytest.mark.integration
def test_delete_then_every_read_is_a_404(client, worker):
    created = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    deleted = client.responses.delete(created.id)
    assert deleted is None  # the SDK returns nothing; the body is checked below
    for call in (lambda: client.responses.retrieve(created.id),
                 lambda: client.responses.delete(created.id)):
        with pytest.raises(openai.NotFoundError):
            call()


@pytest.mark.integration
def test_delete_answers_openais_deleted_object(base_url, worker):
    created = requests.post(f"{base_url}/v1/responses", json={
        "model": "tiny", "input": "hi", "max_output_tokens": 2}, timeout=60).json()
    answer = requests.delete(f"{base_url}/v1/responses/{created['id']}", timeout=30)
    assert answer.json() == {"id": created["id"], "object": "response.deleted", "deleted": True}


@pytest.mark.integration
@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                               "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": "hi", "background": True, "store": False}, "store"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "n": 2}, "n"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
])
def test_unsupported_input_is_a_400_naming_the_field(base_url, session_factory, body, param):
    answer = requests.post(f"{base_url}/v1/responses", json={"model": "tiny", **body},
                           timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert set(error) == {"type", "message", "param", "code"}
    assert error["param"] is not None and error["param"].startswith(param), error


@pytest.mark.integration
def test_a_response_belongs_to_its_key(start_web, service_settings, session_factory, worker):
    api = start_web(service_settings.with_overrides(auth_enabled=True))
    alice = openai.OpenAI(base_url=api + "/v1", api_key=create_api_key(session_factory,
                                                                      "alice")[1],
                          max_retries=0, timeout=120)
    bob = openai.OpenAI(base_url=api + "/v1", api_key=create_api_key(session_factory, "bob")[1],
                        max_retries=0, timeout=120)
    mine = alice.responses.create(model="tiny", input="hi", max_output_tokens=2)
    assert alice.responses.retrieve(mine.id).status in ("completed", "incomplete")
    for call in (lambda: bob.responses.retrieve(mine.id), lambda: bob.responses.cancel(mine.id),
                 lambda: bob.responses.delete(mine.id)):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as info:  # nor can bob continue it
        bob.responses.create(model="tiny", input="and?", previous_response_id=mine.id)
    assert info.value.code == "previous_response_not_found"
    assert alice.responses.retrieve(mine.id).id == mine.id  # still there for alice


@pytest.mark.integration
def test_starting_after_needs_stream(base_url):
    answer = requests.get(f"{base_url}/v1/responses/resp_x?starting_after=3", timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "starting_after"


@pytest.mark.integration
def test_an_expired_stream_is_rebuilt_from_the_row(client, worker, redis_client,
                                                   service_settings):
    done = client.responses.create(model="tiny", input=PROMPT, temperature=0.0,
                                   max_output_tokens=8, extra_body={"ignore_eos": True})
    redis_client.delete(events_key(service_settings, done.job_id))
    events = list(client.responses.retrieve(done.id, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas == [done.output_text]
    assert events[-1].type == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.integration
def test_an_idempotency_key_returns_the_first_response(base_url, worker, session_factory):
    body = {"model": "tiny", "input": PROMPT, "background": True, "max_output_tokens": 6}
    headers = {"Idempotency-Key": f"resp-{uuid.uuid4().hex}"}
    url = f"{base_url}/v1/responses"
    first = requests.post(url, json=body, headers=headers, timeout=60)
    assert first.status_code == 200, first.text
    again = requests.post(url, json=body, headers=headers, timeout=60)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    with session_factory() as session:
        rows = session.scalars(select(StoredResponse).where(
            StoredResponse.id == first.json()["id"])).all()
    assert len(rows) == 1
    other = requests.post(url, json={**body, "max_output_tokens": 7}, headers=headers,
                          timeout=60)
    assert other.status_code == 422 and other.json()["error"]["param"] == "Idempotency-Key"
    # the same key on a plain job: not a response
    job_key = {"Idempotency-Key": f"job-{uuid.uuid4().hex}"}
    job = requests.post(f"{base_url}/v1/jobs", json={
        "model": "tiny", "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 6}, headers=job_key, timeout=60)
    assert job.status_code == 202, job.text
    reused = requests.post(url, json=body, headers=job_key, timeout=60)
    assert reused.status_code == 422, reused.text
