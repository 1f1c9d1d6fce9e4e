"""The OpenAI-compatible endpoints with the official `openai` client: the Flask app over
HTTP, real Postgres and Redis, and a real device-group worker process."""

from __future__ import annotations

import json
import uuid

import openai
import pytest
import requests
from sqlalchemy import func, select

from tasks.models import Job, JobStatus
from tasks.params import SamplingParams
from tests.pipeline_helpers import running_worker, wait_terminal

pytestmark = pytest.mark.integration

PROMPT = "the quick brown fox"
MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "name three colours"}]


@pytest.fixture(scope="module")
def worker(service_settings, redis_client, tmp_path_factory):
    with running_worker(service_settings, redis_client, tmp_path_factory.mktemp("workers"),
                        "oai", args=["--max-num-seqs", "8", "--kv-cache-bytes",
                                     str(16 * 1024 * 1024)]) as process:
        yield process


@pytest.fixture(scope="module")
def offline(service_settings):
    from workers.engine.llm import LLM

    return LLM(service_settings.models["tiny"], max_num_seqs=8, kv_cache_bytes=16 * 1024 * 1024)




def _chat_prompt_ids(offline, messages) -> list[int]:
    tokenizer = offline.tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _offline(offline, prompt, **params):
    return offline.generate([prompt], SamplingParams(**params))[0]


def _count_jobs(session_factory) -> int:
    with session_factory() as session:
        return session.scalar(select(func.count()).select_from(Job))


def test_completion_non_stream_equals_offline(client, worker, offline, session_factory):
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    expected = _offline(offline, PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert response.model == "tiny" and len(response.choices) == 1
    choice = response.choices[0]
    assert choice.text == expected.text.replace("\x00", "\ufffd")
    assert choice.finish_reason == "length" and choice.index == 0
    usage = response.usage
    assert usage.prompt_tokens == len(expected.prompt_token_ids)
    assert usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + 12
    assert usage.prompt_tokens_details.cached_tokens >= 0
    # the answer is a job like any other
    row = wait_terminal(session_factory, str(uuid.UUID(response.id.removeprefix("cmpl-"))))
    assert row.status == JobStatus.SUCCEEDED.value and row.output_text == choice.text


def test_completion_stream_with_usage_echo_and_logprobs(client, worker, offline):
    expected = _offline(offline, PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True,
                        logprobs=2)
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.0, stream=True, echo=True,
        logprobs=2, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    usage = chunks[-1].usage
    assert usage.completion_tokens == 10
    # a second identical prompt finds its prefix cached (full blocks of the first one)
    assert usage.prompt_tokens_details.cached_tokens >= 0
    text_chunks = [c for c in chunks if c.choices]
    assert text_chunks[0].choices[0].text == PROMPT  # echo first
    text = "".join(c.choices[0].text for c in text_chunks)
    assert text == PROMPT + expected.text.replace("\x00", "\ufffd")
    assert text_chunks[-1].choices[0].finish_reason == "length"
    tokens = [t for c in text_chunks if c.choices[0].logprobs
              for t in c.choices[0].logprobs.token_logprobs]
    assert len(tokens) == 10
    assert tokens == pytest.approx([lp.logprob for lp in expected.outputs[0].logprobs], abs=1e-4)
    offsets = [o for c in text_chunks if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets[0] == len(PROMPT) and offsets == sorted(offsets)
    assert all(len(c.choices[0].logprobs.top_logprobs[0]) <= 2
               for c in text_chunks if c.choices[0].logprobs)


def test_chat_non_stream_and_stream_equal_offline(client, worker, offline):
    prompt_ids = _chat_prompt_ids(offline, MESSAGES)
    expected = _offline(offline, prompt_ids, max_tokens=8, temperature=0.0, ignore_eos=True)
    expected_text = expected.text.replace("\x00", "\ufffd")
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_completion_tokens=8, temperature=0.0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    message = response.choices[0].message
    assert message.role == "assistant" and message.content == expected_text
    assert response.usage.prompt_tokens == len(prompt_ids)
    content = response.choices[0].logprobs.content
    assert len(content) == 8 and all(len(item.top_logprobs) == 3 for item in content)
    assert content[0].bytes == list(content[0].token.encode())

    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == expected_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 8
    # the same prompt again: its full blocks come from the prefix cache
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_n2_with_seed_equals_offline(client, worker, offline):
    params = {"max_tokens": 8, "temperature": 1.0, "seed": 1234, "n": 2, "ignore_eos": True}
    expected = _offline(offline, PROMPT, **params)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                         temperature=1.0, seed=1234, n=2,
                                         extra_body={"ignore_eos": True})
    texts = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    assert texts == [o.text.replace("\x00", "\ufffd") for o in expected.outputs]
    assert response.usage.completion_tokens == 16
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                      temperature=1.0, seed=1234, n=2,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts


def test_bad_input_is_a_4xx_in_openai_shape_and_writes_nothing(client, base_url,
                                                               session_factory):
    before = _count_jobs(session_factory)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, temperature=-1.0)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=["one", "two"])
    assert "one request per prompt" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10**6)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard",
                                                                "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=PROMPT, suffix="the end")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT)
    response = requests.post(f"{base_url}/v1/chat/completions", data="{not json",
                             headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400 and set(response.json()["error"]) == {
        "type", "message", "param", "code"}
    assert _count_jobs(session_factory) == before


def test_stream_disconnect_cancels_the_job(client, worker, session_factory):
    with client.completions.with_streaming_response.create(
            model="tiny", prompt=PROMPT, max_tokens=2000, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True}) as response:
        job_id = response.headers["X-Llmq-Job-Id"]
        lines = response.iter_lines()
        received = 0
        for line in lines:
            if line.startswith("data: {"):
                received += 1
                if received == 3:
                    break
        assert received == 3
    # the connection is closed now; the server notices at its next write
    row = wait_terminal(session_factory, job_id, timeout=60)
    assert row.status == JobStatus.CANCELLED.value
    assert row.completion_tokens is None or row.completion_tokens < 2000


def test_an_idempotency_key_answers_from_the_first_job(base_url, worker, session_factory):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "count to three"}],
            "max_tokens": 8, "temperature": 0.0}
    headers = {"Idempotency-Key": f"chat-{uuid.uuid4().hex}"}
    url = f"{base_url}/v1/chat/completions"
    first = requests.post(url, json=body, headers=headers, timeout=120)
    assert first.status_code == 200, first.text
    jobs = _count_jobs(session_factory)
    again = requests.post(url, json=body, headers=headers, timeout=120)
    assert again.status_code == 200, again.text
    assert again.headers["X-Llmq-Job-Id"] == first.headers["X-Llmq-Job-Id"]
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["choices"] == first.json()["choices"]
    # a streamed retry (how the answer is delivered is not part of the job) replays the
    # same job from its first event
    streamed = requests.post(url, json={**body, "stream": True}, headers=headers, timeout=120)
    assert streamed.status_code == 200, streamed.text
    chunks = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert {chunk["id"] for chunk in chunks} == {first.json()["id"]}
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks
                   if chunk["choices"]) == first.json()["choices"][0]["message"]["content"]
    assert _count_jobs(session_factory) == jobs  # no new job for either retry
    other = requests.post(url, json={**body, "max_tokens": 9}, headers=headers, timeout=120)
    assert other.status_code == 422
    assert other.json()["error"]["param"] == "Idempotency-Key"
    assert "params differ" in other.json()["error"]["message"]
