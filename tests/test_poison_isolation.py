"""No request can fail another tenant's job: poison requests sent while a batch of
innocent greedy jobs runs are refused (400, nothing stored) and the innocents produce
exactly their solo text; rows that bypass the API are stopped by the engine's own guard;
valid-but-extreme parameters run to success inside a batch of innocents.

Real stack: the Flask app over HTTP, Postgres, Redis, a real device-group worker.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from tasks.celery_app import create_celery, send_generate
from tasks.models import Job, JobStatus
from tasks.params import MAX_STOP_TOKEN_IDS, SamplingParams, text_problem
from tests.pipeline_helpers import insert_job, read_job, running_worker, wait_for, wait_terminal
from tests.test_request_limits import ENDPOINTS, POISON_PARAMS, VOCAB, poison_requests

pytestmark = pytest.mark.integration

WORKER_MAX_MODEL_LEN = 256  # below the web's (2048): lets a job fail on input at the worker
INNOCENT_PROMPTS = ["the river runs past the old mill", "a good question deserves",
                    "numbers like one, two, three", "in winter the water freezes",
                    "the quick brown fox", "children walk along the bank"]


@pytest.fixture(scope="module")
def worker(service_settings, redis_client, tmp_path_factory):
    with running_worker(service_settings, redis_client, tmp_path_factory.mktemp("workers"),
                        "poison", args=["--max-num-seqs", "48", "--kv-cache-bytes",
                                        str(32 * 1024 * 1024), "--max-model-len",
                                        str(WORKER_MAX_MODEL_LEN)]) as process:
        yield process


@pytest.fixture(scope="module")
def solo_texts(service_settings):
    """Each innocent prompt's greedy text alone, by max_tokens (the offline engine)."""
    from workers.engine.llm import LLM

    llm = LLM(service_settings.models["tiny"], max_num_seqs=1, kv_cache_bytes=16 * 1024 * 1024)
    texts: dict[tuple[str, int], str] = {}
    for max_tokens in (24, 96):
        for prompt in INNOCENT_PROMPTS:
            out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                        ignore_eos=True))[0]
            texts[(prompt, max_tokens)] = out.text.replace("\x00", "\ufffd")
    llm.close()
    return texts



def _submit(base_url: str, body: dict[str, Any]) -> str:
    response = requests.post(f"{base_url}/v1/jobs", json={"model": "tiny", **body}, timeout=30)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _submit_innocents(base_url: str, max_tokens: int) -> dict[str, str]:
    return {_submit(base_url, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                               "ignore_eos": True}): prompt
            for prompt in INNOCENT_PROMPTS}


def _assert_innocents(session_factory, innocents: dict[str, str], max_tokens: int,
                      solo_texts) -> None:
    for job_id, prompt in innocents.items():
        job = wait_terminal(session_factory, job_id, timeout=120)
        assert job.status == JobStatus.SUCCEEDED.value, (prompt, job.status, job.error)
        assert job.completion_tokens == max_tokens
        assert job.output_text == solo_texts[(prompt, max_tokens)], prompt


def _count_jobs(session_factory) -> int:
    with session_factory() as session:
        return session.scalar(select(func.count()).select_from(Job))


def _storable(value: Any) -> bool:
    return not (isinstance(value, list) and any(isinstance(v, str) and text_problem(v)
                                                for v in value))


def test_poisons_are_refused_while_innocents_run_and_innocents_keep_their_text(
        worker, base_url, session_factory, service_settings, solo_texts):
    innocents = _submit_innocents(base_url, 96)
    wait_for(lambda: any(read_job(session_factory, j).status == JobStatus.RUNNING.value
                         for j in innocents), 60, "an innocent job to run")
    before = _count_jobs(session_factory)
    num_refused = 0
    for path, fields, _param in poison_requests():
        response = requests.post(f"{base_url}{path}", json={**ENDPOINTS[path], **fields},
                                 timeout=30)
        assert response.status_code == 400, (path, fields, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"
        num_refused += 1
    assert num_refused > 60
    assert _count_jobs(session_factory) == before  # nothing stored

    # the same poisons as rows that bypass the API reach the worker: its guards fail each
    # of them alone, before it joins a batch
    celery_app = create_celery(service_settings)
    poison_rows = {}
    for fields, param in POISON_PARAMS:
        if not all(_storable(v) for v in fields.values()):
            continue
        job_id = insert_job(session_factory, prompt_token_ids=[5, 6, 7],
                            params={"max_tokens": 8, **fields})
        send_generate(celery_app, service_settings, job_id, "tiny")
        poison_rows[job_id] = param
    job_id = insert_job(session_factory, prompt_token_ids=[5, VOCAB], params={"max_tokens": 8})
    send_generate(celery_app, service_settings, job_id, "tiny")
    poison_rows[job_id] = "prompt"
    for job_id, param in poison_rows.items():
        job = wait_terminal(session_factory, job_id, timeout=120)
        assert job.status == JobStatus.FAILED.value, (param, job.status)
        assert "engine step failed" not in (job.error or "")
        assert param in job.error or "max_model_len" in job.error, (param, job.error)
    _assert_innocents(session_factory, innocents, 96, solo_texts)


def test_a_request_longer_than_the_worker_serves_is_a_400(worker, base_url, session_factory):
    # the checkpoint allows 2048 tokens of context, this worker 256 (its heartbeat says
    # so): the API refuses the job before it is stored, streaming or not. (A job the worker
    # refuses after all, e.g. while a group restarts with other limits, ends as a 400 too:
    # tests/test_request_limits.py classifies the engine's own messages.)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="the river", max_tokens=300,
                                  temperature=0.0)
    assert info.value.code == "context_length_exceeded"
    assert info.value.body["param"] == "max_tokens"
    assert f"fits {WORKER_MAX_MODEL_LEN}" in info.value.message
    response = requests.post(f"{base_url}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 300, "stream": True})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


# --- valid but extreme -------------------------------------------------------------------


_STOP_TEXT = st.text(min_size=1, max_size=200).filter(lambda s: text_problem(s) is None)


@st.composite
def extreme_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Job bodies at the edges of every allowed range."""
    max_tokens = draw(st.integers(1, 16))
    body: dict[str, Any] = {
        "prompt": draw(st.sampled_from(["x", "the river", [0, VOCAB - 1, 7], [VOCAB - 1]])),
        "max_tokens": max_tokens,
        "min_tokens": draw(st.sampled_from([0, max_tokens])),
        "temperature": draw(st.sampled_from([0.0, 4e-6, 1e-5, 1.0, 100.0])),
        "top_p": draw(st.sampled_from([5e-324, 1e-45, 1.0])),
        "top_k": draw(st.sampled_from([0, 1, VOCAB])),
        "min_p": draw(st.sampled_from([0.0, 5e-324, 1.0])),
        "presence_penalty": draw(st.sampled_from([-2.0, 2.0])),
        "frequency_penalty": draw(st.sampled_from([-2.0, 2.0])),
        "repetition_penalty": draw(st.sampled_from([0.01, 2.0])),
        "ignore_eos": draw(st.booleans()),
        "n": draw(st.sampled_from([1, 8])),
        "priority": draw(st.sampled_from([-1_000_000, 0, 1_000_000])),
    }
    optional = {
        "seed": st.sampled_from([0, 2**63 - 1]),
        "logprobs": st.sampled_from([0, 20]),
        "stop": st.lists(_STOP_TEXT, max_size=16),
        "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=MAX_STOP_TOKEN_IDS),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            body[name] = draw(strategy)
    return body


@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(bodies=st.lists(extreme_bodies(), min_size=3, max_size=4))
def test_extreme_valid_params_succeed_inside_a_batch_of_innocents(
        worker, base_url, session_factory, solo_texts, bodies):
    innocents = _submit_innocents(base_url, 24)
    extremes = [_submit(base_url, body) for body in bodies]
    for job_id, body in zip(extremes, bodies):
        job = wait_terminal(session_factory, job_id, timeout=120)
        assert job.status == JobStatus.SUCCEEDED.value, (body, job.error)
        assert 1 <= len(job.output or []) == body["n"]
    _assert_innocents(session_factory, innocents, 24, solo_texts)


def test_the_worker_survived_every_poison(worker, redis_client):
    assert worker.process.poll() is None and worker.heartbeat(redis_client) is not None
    assert "engine step failed" not in worker.log_tail(10**7)


# hostile values for the surfaces added beside the completion fields: structured outputs,
# tools, request headers, the Responses API and vLLM's token endpoints
HOSTILE_REQUESTS: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "allOf": [{"type": "object"}]}}}}, {}),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {
            "a": {"$ref": "https://example.com/remote.json"}}}}}}, {}),
    ("/v1/completions", {"structured_outputs": {"regex": "(?<=a)b"}}, {}),
    ("/v1/completions", {"structured_outputs": {"regex": "(" * 10_000}}, {}),
    ("/v1/completions", {"structured_outputs": {"choice": ["x"] * 100_000}}, {}),
    ("/v1/completions", {"guided_json": {"type": "object"}, "guided_regex": "a+"}, {}),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= (" * 5_000}}, {}),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "not": {}}}}]}, {}),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function",
                                              "function": {"name": "missing"}}}, {}),
    ("/v1/chat/completions", {"tool_choice": "required"}, {}),
    ("/v1/completions", {}, {"X-Request-Id": "r" * 10_000}),
    ("/v1/completions", {}, {"X-Request-Id": "bad\tid"}),
    ("/v1/completions", {}, {"Idempotency-Key": "k" * 10_000}),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}, {}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10**30}, {}),
    ("/v1/responses", {"input": "hi", "store": False, "background": True}, {}),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_" + "0" * 32}, {}),
    ("/detokenize", {"tokens": [10**30]}, {}),
    ("/detokenize", {"tokens": [-1]}, {}),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, {}),
]
_BASE_BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/responses": {},
    "/detokenize": {},
    "/tokenize": {},
}


def test_hostile_input_to_the_newer_surfaces_leaves_the_batch_alone(
        worker, base_url, session_factory, solo_texts):
    """While innocents run: each hostile structured-output, tool, header, Responses or token
    request is a 400 that stores nothing; a grammar only the worker can refuse fails its
    job alone (a 400 kind); the innocents keep their solo text."""
    innocents = _submit_innocents(base_url, 96)
    wait_for(lambda: any(read_job(session_factory, j).status == JobStatus.RUNNING.value
                         for j in innocents), 60, "an innocent job to run")
    before = _count_jobs(session_factory)
    for path, fields, headers in HOSTILE_REQUESTS:
        body = {"model": "tiny", **_BASE_BODIES[path], **fields}
        response = requests.post(f"{base_url}{path}", json=body, headers=headers, timeout=60)
        assert response.status_code == 400, (path, fields, headers, response.text[:300])
        assert response.json()["error"]["type"] == "invalid_request_error", response.text
    assert _count_jobs(session_factory) == before  # nothing stored

    # passes the web's cheap check, refused by the worker's grammar compiler
    refused = _submit(base_url, {"prompt": "x", "max_tokens": 8,
                                 "structured_outputs": {"grammar": "root ::= undefined_rule"}})
    job = wait_terminal(session_factory, refused, timeout=120)
    assert job.status == JobStatus.FAILED.value and job.error_kind == "invalid_request"
    _assert_innocents(session_factory, innocents, 96, solo_texts)
