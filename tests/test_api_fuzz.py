"""Fuzz of the three create endpoints over real HTTP (real Postgres and Redis, no worker):
random JSON from a seeded generator — wrong types, deep nesting, unicode with lone
surrogates and NUL, huge and non-finite numbers, unknown fields, undecodable bytes — and
not one answer may be a 5xx; every 4xx is the OpenAI error shape.

Valid bodies do get through (a 202 job, or a 200 stream that the test closes at once,
which cancels its job): OpenAI requests always stream, so no request waits on a worker.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections import Counter
from typing import Any

import pytest
import requests

pytestmark = pytest.mark.integration

NUM_REQUESTS = 700  # per endpoint: 2,100 in all
DEEP = "__deep__"  # a placeholder serialised as nested arrays (json.dumps would recurse)

BASES: dict[str, dict[str, Any]] = {
    "/v1/jobs": {"model": "tiny", "prompt": "the river", "max_tokens": 4},
    "/v1/completions": {"model": "tiny", "prompt": "the river", "max_tokens": 4,
                        "stream": True, "echo": True},
    "/v1/chat/completions": {"model": "tiny", "max_tokens": 4, "stream": True,
                             "messages": [{"role": "user", "content": "hi"}]},
}
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
          "min_tokens", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "logprobs", "top_logprobs", "priority", "echo", "stream_options", "best_of",
          "logit_bias", "suffix", "user", "metadata", "response_format", "tools",
          "tool_choice", "parallel_tool_calls", "structured_outputs", "guided_json",
          "guided_regex", "guided_choice", "guided_grammar", "json", "regex", "choice",
          "grammar", "json_object", "json_schema", "schema", "strict", "function",
          "parameters", "name", "tool_calls", "tool_call_id", "unknown_field", "\ud800", ""]
INTS = [0, -1, 1, 2, 16, 511, 512, 1024, 2047, 2048, 2**31, 2**63 - 1, 2**63, 2**64,
        -(2**63) - 1, 10**30, 10**300, 10**4000]
FLOATS = [0.0, -0.0, 5e-324, 1e-320, 1e-45, 1e-40, 1e-5, 0.5, 1.0, 2.0, 2.0000001, 100.0,
          100.5, 3.5e38, 1e300, 1.7e308, -1.0, -2.0, float("nan"), float("inf"),
          float("-inf")]
STRINGS = ["", "x", "tiny", "hello world", "\ud800", "lone \udfff low", "a\x00b", "é",
           "\U0001f600", "\u202e\u200b", "\ufeff", "\\", "\"", "x" * 5000, "\ud83d\ude00",
           "<|im_start|>", "{{ raise_exception('x') }}"]
RAW_BODIES = [b"", b"{", b"[" * 3000, b"{\"model\": \"tiny\", \"prompt\": \"\xff\xfe\"}",
              b"\xef\xbb\xbf{}", b"null", b"true", b"1e999", b"\"\\ud800\"",
              b"{\"model\": \"tiny\", \"prompt\": \"x\", \"max_tokens\": 1" + b"0" * 5000 + b"}",
              b"{\"model\": \"tiny\", \"prompt\": \"x\", \"temperature\": -Infinity}",
              b"{\"a\": 1, \"a\": 2}", b"\x00\x01\x02",
              "{\"prompt\": \"\u00e9\"}".encode("latin-1")]


def _scalar(rng: random.Random) -> Any:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.choice(INTS)
    if kind == 1:
        return rng.choice(FLOATS)
    if kind == 2:
        return rng.choice(STRINGS)
    if kind == 3:
        return "".join(chr(rng.choice([rng.randrange(0x20, 0x7f), rng.randrange(0xd800, 0xe000),
                                       rng.randrange(0x80, 0x10ffff)]))
                       for _ in range(rng.randrange(1, 8)))
    if kind == 4:
        return rng.choice([True, False, None])
    return rng.randint(-10**6, 10**6)


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(10)
    if kind < 5 or depth > 4:
        return _scalar(rng)
    if kind < 7:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if kind < 9:
        return {rng.choice(FIELDS + ["role", "content", "type", "text"]): _value(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    return DEEP


def _plausible(rng: random.Random, name: str) -> Any:
    """A value of about the right shape for `name`, often just outside its range."""
    if name in ("messages",):
        role = rng.choice(["user", "system", "assistant", "tool", "wizard", None, 3])
        content = rng.choice([_scalar(rng), [{"type": "text", "text": _scalar(rng)}],
                              [{"type": "image_url"}], DEEP])
        return [{"role": role, "content": content}]
    if name in ("prompt",):
        return rng.choice([_scalar(rng), [rng.choice(INTS) for _ in range(rng.randrange(4))],
                           [[1, 2]], [_scalar(rng)], []])
    if name in ("stop", "stop_token_ids"):
        return [rng.choice([_scalar(rng), rng.randrange(600)])
                for _ in range(rng.choice([0, 1, 3, 17, 129, 300]))]
    return rng.choice([_scalar(rng), rng.choice(INTS), rng.choice(FLOATS), _value(rng)])


def _body(rng: random.Random, path: str) -> bytes:
    roll = rng.random()
    if roll < 0.05:
        return rng.choice(RAW_BODIES)
    if roll < 0.15:
        body: Any = _value(rng)
    else:
        body = json.loads(json.dumps(BASES[path]))
        for _ in range(rng.randrange(1, 4)):
            name = rng.choice(FIELDS)
            if rng.random() < 0.15:
                body.pop(name, None)
            else:
                body[name] = _plausible(rng, name)
        # NOTE: a valid non-streaming OpenAI request would wait for a worker; never send one
        if path != "/v1/jobs" and (body.get("stream") is None or body.get("stream") is False):
            body["stream"] = True
        # a completions stream's first bytes (its headers too) come with its first token
        # or a 1 s ping; the echoed prompt comes at once (no worker runs here)
        if path == "/v1/completions" and (body.get("echo") is None or body.get("echo") is False):
            body["echo"] = True
    text = json.dumps(body, allow_nan=True)
    depth = rng.choice([5, 31, 32, 33, 100, 1000, 50_000])
    return text.replace(json.dumps(DEEP), "[" * depth + "]" * depth).encode("utf-8",
                                                                            "surrogatepass")


@pytest.fixture
def api(start_web, service_settings) -> str:
    # own Redis prefix: the jobs that get through are never run by another test's worker
    return start_web(service_settings.with_overrides(
        redis_prefix=f"{service_settings.redis_prefix}f{uuid.uuid4().hex[:6]}"))


@pytest.mark.parametrize("path", list(BASES))
def test_random_json_never_gets_a_5xx(api, path):
    rng = random.Random(f"llmq-fuzz-{path}")
    statuses: Counter[int] = Counter()
    started = time.monotonic()
    with requests.Session() as session:
        for i in range(NUM_REQUESTS):
            data = _body(rng, path)
            with session.post(f"{api}{path}", data=data, timeout=60, stream=True,
                              headers={"Content-Type": "application/json"}) as response:
                status = response.status_code
                statuses[status] += 1
                assert status < 500, (i, data[:300], response.content[:500])
                if status >= 400:
                    error = response.json()["error"]
                    assert set(error) == {"type", "message", "param", "code"}, error
                    assert error["message"] and error["type"], error
                # a 200 stream is closed here, unread: the server cancels its job
    elapsed = time.monotonic() - started
    print(f"{path}: {NUM_REQUESTS} requests in {elapsed:.1f}s, statuses {dict(statuses)}")
    assert statuses[400] > NUM_REQUESTS // 2  # the fuzz mostly probes validation
    assert sum(n for s, n in statuses.items() if s in (200, 202)) > 0  # and some pass it
    assert elapsed < 60
