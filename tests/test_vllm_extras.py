"""vLLM's extra endpoints over HTTP (`/tokenize`, `/detokenize`, `/version`, `root` and
`max_model_len` in `/v1/models`) and `X-Request-Id`: echoed by every endpoint, made by
the server when missing, a 400 when malformed, and stored on the jobs the create
endpoints make. Real web server, Postgres and Redis; no worker (the jobs stay queued)."""

from __future__ import annotations

import importlib.metadata
import re
import uuid

import pytest
import requests
from sqlalchemy import select

from tasks.models import Job

pytestmark = pytest.mark.integration

SERVER_MADE = re.compile(r"^req_[0-9a-f]{32}$")
CHAT = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello "},
                                     {"type": "text", "text": "there"}]}]


@pytest.fixture
def settings(service_settings):
    # a queue of its own: no other test's worker takes the jobs made here
    # (under the session's prefix: its teardown deletes these keys too)
    prefix = f"{service_settings.redis_prefix}extra{uuid.uuid4().hex[:8]}"
    return service_settings.with_overrides(redis_prefix=prefix, request_timeout_seconds=0.5)


@pytest.fixture
def base_url(start_web, settings):
    return start_web(settings)


@pytest.fixture
def tokenizer(tiny_qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_qwen3_dir))


def _post(base_url, path, body, **headers):
    return requests.post(f"{base_url}{path}", json=body, headers=headers, timeout=30)


def _error(response, status, param):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


def test_tokenize_gives_the_tokens_a_job_of_the_same_request_has(base_url, tokenizer):
    prompt = "The quick brown fox"
    answer = _post(base_url, "/tokenize", {"model": "tiny", "prompt": prompt})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["tokens"] == list(tokenizer(prompt).input_ids)
    assert body["count"] == len(body["tokens"]) > 0
    models = requests.get(f"{base_url}/v1/models", timeout=10).json()["data"]
    tiny = next(m for m in models if m["id"] == "tiny")
    assert body["max_model_len"] == tiny["max_model_len"] > 0 and tiny["root"]
    job = _post(base_url, "/v1/jobs", {"model": "tiny", "prompt": prompt}).json()
    assert job["usage"]["prompt_tokens"] == body["count"]

    # content parts (OpenAI's) are joined, as the chat endpoint does
    chat = _post(base_url, "/tokenize", {"model": "tiny", "messages": CHAT}).json()
    flat = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello there"}]
    job = _post(base_url, "/v1/jobs", {"model": "tiny", "messages": flat}).json()
    assert job["usage"]["prompt_tokens"] == chat["count"]
    rendered = tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == list(tokenizer(rendered, add_special_tokens=False).input_ids)
    no_cue = _post(base_url, "/tokenize", {"model": "tiny", "messages": CHAT,
                                           "add_generation_prompt": False}).json()
    assert no_cue["count"] < chat["count"]
    assert chat["tokens"][:no_cue["count"]] == no_cue["tokens"]


def test_detokenize_inverts_tokenize_and_checks_ids_against_the_vocabulary(base_url,
                                                                           tiny_qwen3_dir):
    import json

    text = "a round trip, with punctuation!"
    tokens = _post(base_url, "/tokenize", {"model": "tiny", "prompt": text,
                                           "add_special_tokens": False}).json()["tokens"]
    answer = _post(base_url, "/detokenize", {"model": "tiny", "tokens": tokens})
    assert answer.status_code == 200 and answer.json() == {"prompt": text}
    assert _post(base_url, "/detokenize", {"model": "tiny", "tokens": []}).json() == {
        "prompt": ""}
    vocab_size = json.loads((tiny_qwen3_dir / "config.json").read_text())["vocab_size"]
    error = _error(_post(base_url, "/detokenize", {"model": "tiny",
                                                   "tokens": [5, vocab_size]}), 400, "tokens")
    assert f"below {vocab_size}" in error["message"] and "tokens[1]" in error["message"]
    for bad in ([-1], [1.5], [True], "5", None):
        _error(_post(base_url, "/detokenize", {"model": "tiny", "tokens": bad}), 400, "tokens")


def test_bad_tokenize_requests_are_400s_naming_the_field(base_url):
    cases = [
        ({"model": "tiny"}, 400, "messages"),
        ({"model": "tiny", "prompt": "x", "messages": CHAT}, 400, "prompt"),
        ({"model": "tiny", "prompt": "\ud800"}, 400, "prompt"),
        ({"model": "tiny", "prompt": 5}, 400, "prompt"),
        ({"prompt": "x"}, 400, "model"),
        ({"model": "tiny", "prompt": "x", "add_special_tokens": "yes"}, 400,
         "add_special_tokens"),
        ({"model": "tiny", "prompt": "x", "extra": 1}, 400, "extra"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400,
         "messages[0].role"),
        ({"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ]
    for body, status, param in cases:
        _error(_post(base_url, "/tokenize", body), status, param)
    _error(_post(base_url, "/detokenize", {"model": "no-such-model", "tokens": [1]}), 404,
           "model")
    assert _post(base_url, "/tokenize", [1, 2]).status_code == 400


def test_version_is_the_package_version(base_url):
    answer = requests.get(f"{base_url}/version", timeout=10)
    assert answer.status_code == 200
    assert answer.json() == {"version": importlib.metadata.version("llmq")}


def test_every_answer_carries_a_request_id_and_jobs_store_it(base_url, session_factory):
    made = [requests.get(f"{base_url}{path}", timeout=10) for path in
            ("/version", "/health", "/v1/models", "/no-such-route", "/openapi.json")]
    made.append(_post(base_url, "/tokenize", {"model": "tiny"}))  # a 400
    for answer in made:
        assert SERVER_MADE.match(answer.headers["X-Request-Id"]), answer.url
    assert len({answer.headers["X-Request-Id"] for answer in made}) == len(made)

    mine = f"client:{uuid.uuid4()}"
    answer = requests.get(f"{base_url}/version", headers={"X-Request-Id": mine}, timeout=10)
    assert answer.headers["X-Request-Id"] == mine
    created = _post(base_url, "/v1/jobs", {"model": "tiny", "prompt": "hi"},
                    **{"X-Request-Id": mine})
    assert created.status_code == 202 and created.headers["X-Request-Id"] == mine
    assert created.json()["request_id"] == mine
    job_id = created.json()["id"]
    shown = requests.get(f"{base_url}/v1/jobs/{job_id}", timeout=10)
    assert shown.json()["request_id"] == mine
    assert SERVER_MADE.match(shown.headers["X-Request-Id"])  # this request's own id
    made_id = _post(base_url, "/v1/jobs", {"model": "tiny", "prompt": "hi"})
    assert made_id.json()["request_id"] == made_id.headers["X-Request-Id"]

    # the OpenAI endpoints store it too (no worker: the answer is a 504 after 0.5 s)
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": CHAT,
                                                 "max_tokens": 2})):
        request_id = f"openai-{uuid.uuid4().hex}"
        answer = _post(base_url, path, body, **{"X-Request-Id": request_id})
        assert answer.headers["X-Request-Id"] == request_id, answer.text
        with session_factory() as session:
            stored = session.scalars(select(Job).where(Job.request_id == request_id)).all()
        assert len(stored) == 1 and stored[0].model == "tiny"


@pytest.mark.parametrize("bad", ["x" * 201, "caf\u00e9", "tab\there"])
def test_a_malformed_request_id_is_a_400(base_url, session_factory, bad):
    answer = requests.post(f"{base_url}/v1/jobs", json={"model": "tiny", "prompt": "hi"},
                           headers={"X-Request-Id": bad.encode("latin-1")}, timeout=10)
    error = _error(answer, 400, "X-Request-Id")
    assert error["code"] == "invalid_request_id"
    assert SERVER_MADE.match(answer.headers["X-Request-Id"])
    assert requests.get(f"{base_url}/health", headers={"X-Request-Id": "x" * 200},
                        timeout=10).status_code == 200
