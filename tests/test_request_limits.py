"""Request limits: every poison value (a request that used to pass the API and then fail
every job of the engine step it ran in) is rejected with a 400 naming the field, by the
contract check (`SamplingParams.check`), by the engine's `add_request` (offline) and by the
three create endpoints over real HTTP (real Postgres and Redis, nothing stored). Values at
the edges of the allowed ranges go through the real sampler without a non-finite number."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any

import pytest
import requests
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from tasks.models import Job
from tasks.params import (
    MAX_STOP_TOKEN_IDS,
    InvalidParamError,
    ModelLimits,
    SamplingParams,
)
from tasks.schema import SchemaError, parse_job_request
from webapp.errors import failed_job_error

VOCAB = 512  # the tiny checkpoint's config.json vocab_size (and its tokenizer's length)
LIMITS = ModelLimits(vocab_size=VOCAB, max_model_len=2048)

# (sampling fields, the field a 400 must name); each used to fail a whole engine step or
# store a value the sampler cannot use
POISON_PARAMS: list[tuple[dict[str, Any], str]] = [
    ({"stop_token_ids": [VOCAB], "min_tokens": 1}, "stop_token_ids"),
    ({"stop_token_ids": [100_000_000], "min_tokens": 1}, "stop_token_ids"),
    ({"stop_token_ids": [2**63], "min_tokens": 1}, "stop_token_ids"),
    ({"stop_token_ids": [10**30], "min_tokens": 1}, "stop_token_ids"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ({"temperature": 3.5e38, "min_tokens": 1}, "temperature"),
    ({"temperature": 3.5e38, "top_k": 5, "min_tokens": 1}, "temperature"),
    ({"temperature": 1e300}, "temperature"),
    ({"temperature": 101.0}, "temperature"),
    ({"temperature": 1.0, "repetition_penalty": 1e-40}, "repetition_penalty"),
    ({"temperature": 1.0, "repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 1e300}, "presence_penalty"),
    ({"frequency_penalty": -1e300}, "frequency_penalty"),
    ({"top_p": 1e300}, "top_p"),
    ({"min_p": 1e300}, "min_p"),
    ({"min_p": -1e-300}, "min_p"),
    ({"top_k": 10**30}, "top_k"),
    ({"top_k": VOCAB + 1}, "top_k"),
    ({"logprobs": 10**30}, "logprobs"),
    ({"seed": 2**64}, "seed"),
    ({"n": 10**30}, "n"),
    ({"min_tokens": 10**30}, "min_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": ["\ud800"]}, "stop"),
]


def _check(fields: dict[str, Any]) -> None:
    SamplingParams(**fields).check(LIMITS)


@pytest.mark.parametrize("fields,param", POISON_PARAMS, ids=lambda v: str(v)[:40])
def test_contract_check_names_the_field_the_value_and_the_range(fields, param):
    with pytest.raises(InvalidParamError) as info:
        _check(fields)
    error = info.value
    assert error.param.split("[")[0] == param
    assert str(error).startswith(f"{error.param} must be ")
    assert ", got " in str(error) and len(str(error)) < 300
    str(error).encode("utf-8")  # storable and loggable, even for a lone surrogate


def test_prompt_token_ids_are_checked_against_config_vocab_size_not_the_tokenizer():
    request = parse_job_request({"model": "tiny", "prompt": [1, VOCAB - 1]}, max_n=8)
    request.check(LIMITS, [1, VOCAB - 1])
    with pytest.raises(SchemaError) as info:
        request.check(ModelLimits(vocab_size=VOCAB - 1, max_model_len=2048), [1, VOCAB - 1])
    assert info.value.param == "prompt" and "prompt[1]" in info.value.message


def test_edge_values_are_allowed():
    _check({"temperature": 100.0, "repetition_penalty": 0.01, "presence_penalty": -2.0,
            "frequency_penalty": 2.0, "top_p": 5e-324, "min_p": 1.0, "top_k": VOCAB,
            "seed": 2**63 - 1, "logprobs": 20, "stop_token_ids": [0, VOCAB - 1],
            "min_tokens": 2048, "max_tokens": 2048})
    _check({"temperature": 0.0, "repetition_penalty": 2.0, "top_k": 0, "min_p": 0.0})


# --- the engine's guard, offline ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tiny_qwen3_dir):
    from workers.engine.builder import build_engine
    from workers.engine.config import EngineConfig

    engine = build_engine(str(tiny_qwen3_dir), kv_cache_bytes=8 * 1024 * 1024,
                          config=EngineConfig(block_size=16, max_num_seqs=8))
    yield engine
    engine.close()


def _params_bypassing_validation(fields: dict[str, Any]) -> SamplingParams:
    """Params holding a poison value as a row or a caller mutating them would."""
    params = SamplingParams()
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize("fields,param", POISON_PARAMS, ids=lambda v: str(v)[:40])
def test_engine_add_request_raises_the_same_typed_error(tiny_engine, fields, param):
    from workers.engine.config import PromptTooLongError

    assert tiny_engine.runner.vocab_size == VOCAB
    request_id = uuid.uuid4().hex
    params = _params_bypassing_validation(fields)
    if param == "max_tokens":  # the engine names the context length with the prompt's
        with pytest.raises(PromptTooLongError):
            tiny_engine.add_request(request_id, [5, 6, 7], params)
    else:
        with pytest.raises(InvalidParamError) as info:
            tiny_engine.add_request(request_id, [5, 6, 7], params)
        assert info.value.param.split("[")[0] == param
    assert not tiny_engine.has_unfinished_requests()


def test_engine_rejects_prompt_ids_outside_the_model_vocabulary(tiny_engine):
    with pytest.raises(InvalidParamError) as info:
        tiny_engine.add_request("big-id", [5, VOCAB], SamplingParams(max_tokens=2))
    assert info.value.param == "prompt[1]"
    assert not tiny_engine.has_unfinished_requests()


# --- the sampler at the edges --------------------------------------------------------------


EDGE_PARAMS = st.builds(
    SamplingParams,
    max_tokens=st.just(8),
    min_tokens=st.sampled_from([0, 8]),
    temperature=st.sampled_from([0.0, 4e-6, 1e-5, 1.0, 100.0]),
    top_p=st.sampled_from([5e-324, 1e-45, 1e-8, 1.0]),
    top_k=st.sampled_from([0, 1, VOCAB - 1, VOCAB]),
    min_p=st.sampled_from([0.0, 5e-324, 1e-45, 1.0]),
    presence_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
    frequency_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
    repetition_penalty=st.sampled_from([0.01, 1.0, 2.0]),
    seed=st.sampled_from([None, 0, 2**63 - 1]),
    logprobs=st.sampled_from([None, 0, 20]),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=MAX_STOP_TOKEN_IDS),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=st.lists(EDGE_PARAMS, min_size=1, max_size=4),
       scale=st.sampled_from([1.0, 1e3, 1e4]), seed=st.integers(0, 2**16))
def test_sampler_takes_every_edge_value_with_finite_results(params, scale, seed):
    from workers.engine.sampler import sample
    from workers.engine.step_io import ScheduledSequence

    for p in params:
        p.check(LIMITS)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), VOCAB, generator=g) * scale
    prompt = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    seqs = [ScheduledSequence(seq_id=i, token_ids=[prompt[-1]], start_pos=len(prompt) + 2,
                              block_table=[0], sample=True, params=p,
                              prompt_token_ids=prompt, output_token_ids=prompt[:3])
            for i, p in enumerate(params)]
    token_ids, logprobs = sample(logits, seqs, eos_token_ids=[1, 2])
    assert all(0 <= t < VOCAB for t in token_ids)
    for p, t, lp in zip(params, token_ids, logprobs):
        if p.min_tokens > 3:  # still short of min_tokens: no stop id, no EOS
            assert t not in set(p.stop_token_ids) | {1, 2}
        if lp is not None:
            assert lp.logprob == lp.logprob and len(lp.top) == p.logprobs


def test_sampler_fails_on_the_poisons_the_check_rejects():
    """Why the bounds exist: the values just outside them break a batched step."""
    from workers.engine.sampler import sample
    from workers.engine.step_io import ScheduledSequence

    def run(**fields: Any) -> list[int]:
        params = _params_bypassing_validation({"max_tokens": 8, **fields})
        seq = ScheduledSequence(seq_id=0, token_ids=[3], start_pos=2, block_table=[0],
                                sample=True, params=params, prompt_token_ids=[1, 2, 3],
                                output_token_ids=[])
        # NOTE: fixed logits and a seeded draw: the outcome must not depend on the RNG
        # state earlier tests left behind
        logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
        logits[0, [1, 2, 3]] = 5.0  # positive prompt-token logits: a tiny penalty divides
        return sample(logits, [seq], eos_token_ids=[2])[0]

    for fields in ({"stop_token_ids": [VOCAB], "min_tokens": 1},
                   {"stop_token_ids": [2**63], "min_tokens": 1}):
        with pytest.raises((IndexError, ValueError, RuntimeError)):
            run(**fields)
    # non-finite probabilities: an exception or a token id outside the vocabulary
    for fields in ({"temperature": 3.5e38, "min_tokens": 1, "seed": 7},
                   {"temperature": 1.0, "repetition_penalty": 1e-40, "seed": 7}):
        try:
            token_ids = run(**fields)
        except (IndexError, RuntimeError):
            continue
        assert not all(0 <= t < VOCAB for t in token_ids), fields


# --- failed jobs: whose fault -----------------------------------------------------------


def test_failed_job_errors_from_request_rejections_are_400s(tiny_engine):
    from workers.engine.config import PromptTooLongError

    rejections = [
        (_params_bypassing_validation({"stop_token_ids": [VOCAB]}), [5], "stop_token_ids"),
        (SamplingParams(max_tokens=2), [5, VOCAB], "prompt"),
        (SamplingParams(max_tokens=4000), [5], "max_tokens"),
    ]
    for params, prompt, param in rejections:
        with pytest.raises(ValueError) as info:
            tiny_engine.add_request(uuid.uuid4().hex, prompt, params)
        error = failed_job_error("j", str(info.value))
        assert (error.status, error.param) == (400, param), str(info.value)
        assert error.type == "invalid_request_error"
    too_long = failed_job_error("j", str(PromptTooLongError(2000, 100, 2048)))
    assert (too_long.status, too_long.code) == (400, "context_length_exceeded")
    admission = failed_job_error("j", "invalid job parameters: temperature must be a number "
                                      "in [0, 100], got 1e+300")
    assert (admission.status, admission.param) == (400, "temperature")
    for server_fault in ("engine step failed: IndexError: index 512 is out of bounds",
                         "internal error: the engine lost the request; resubmit the job",
                         "worker lost; gave up after 3 attempts", None):
        error = failed_job_error("j", server_fault)
        assert (error.status, error.code, error.type) == (500, "job_failed", "server_error")


# --- over HTTP: the three create endpoints ------------------------------------------------


@pytest.fixture
def api(start_web, service_settings) -> str:
    # own Redis prefix: nothing sent here reaches another test's worker
    return start_web(service_settings.with_overrides(
        redis_prefix=f"{service_settings.redis_prefix}l{uuid.uuid4().hex[:6]}"))


def _count_jobs(session_factory) -> int:
    with session_factory() as session:
        return session.scalar(select(func.count()).select_from(Job))


ENDPOINTS = {
    "/v1/jobs": {"model": "tiny", "prompt": "the river"},
    "/v1/completions": {"model": "tiny", "prompt": "the river"},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
}

# (body fields over an endpoint's base, the field named) beyond the sampling poisons
POISON_BODIES: list[tuple[dict[str, Any], str]] = [
    ({"prompt": [1, VOCAB]}, "prompt"),
    ({"prompt": [1, 10**30]}, "prompt"),
    ({"prompt": "lone \ud800 surrogate"}, "prompt"),
    ({"messages": [{"role": "user", "content": "lone \udfff surrogate"}]}, "messages[0].content"),
    ({"model": "tiny\ud800"}, "model"),
    ({"temperature": 10**400}, "temperature"),
]


def _post(api: str, path: str, body: Any) -> requests.Response:
    # NOTE: json.dumps writes a lone surrogate as the escape "\ud800", as a client would
    return requests.post(f"{api}{path}", data=json.dumps(body),
                         headers={"Content-Type": "application/json"}, timeout=30)


def poison_requests():
    """(path, fields, param) of every poison that applies to each create endpoint."""
    for path in ENDPOINTS:
        for fields, param in POISON_PARAMS + POISON_BODIES:
            if path == "/v1/chat/completions" and "prompt" in fields:
                continue
            if path != "/v1/chat/completions" and "messages" in fields:
                continue
            if path == "/v1/chat/completions" and "logprobs" in fields:
                fields = {"logprobs": True, "top_logprobs": fields["logprobs"]}
            yield path, fields, param


def test_every_poison_is_a_400_naming_the_field_on_all_three_endpoints(api, session_factory):
    before = _count_jobs(session_factory)
    for path, fields, param in poison_requests():
        body = {**ENDPOINTS[path], **fields}
        if path == "/v1/completions" and isinstance(body.get("prompt"), list):
            body["prompt"] = [body["prompt"]]  # OpenAI's one-prompt batch form
        response = _post(api, path, body)
        assert response.status_code == 400, (path, fields, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error", (path, fields, error)
        expected = {param}
        if path == "/v1/chat/completions":
            if param == "logprobs":
                expected = {"top_logprobs"}
            if param == "min_tokens":  # chat without max_tokens: the budget is the rest
                expected.add("max_tokens")
        assert error["param"] in expected, (path, fields, error)
        assert error["message"] and error["code"]
    assert _count_jobs(session_factory) == before


def test_deep_json_and_undecodable_bodies_are_400s(api, session_factory):
    before = _count_jobs(session_factory)
    for path in ENDPOINTS:
        for depth in (33, 1000, 100_000):
            deep = '{"model": "tiny", "prompt": ' + "[" * depth + "]" * depth + "}"
            response = requests.post(f"{api}{path}", data=deep, timeout=30,
                                     headers={"Content-Type": "application/json"})
            assert response.status_code == 400, (path, depth, response.text[:200])
            assert response.json()["error"]["code"] == "invalid_json"
        for raw in (b'{"model": "tiny", "prompt": "\xff\xfe"}', b"[" * 5000,
                    b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
                    b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"):
            response = requests.post(f"{api}{path}", data=raw, timeout=30,
                                     headers={"Content-Type": "application/json"})
            assert response.status_code == 400, (path, raw[:60], response.text[:200])
    assert _count_jobs(session_factory) == before


def test_json_nested_within_the_limit_is_read(api, session_factory):
    # an ignored OpenAI field holding depth 31: parsed, then the request is judged as usual
    nested: Any = 1
    for _ in range(30):
        nested = [nested]
    response = _post(api, "/v1/completions", {**ENDPOINTS["/v1/completions"],
                                              "metadata": {"x": nested}, "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_params_replace_keeps_validation():
    # `dataclasses.replace` (the engine's per-sample seeds) runs the same validation
    with pytest.raises(InvalidParamError):
        replace(SamplingParams(), temperature=float("nan"))
