"""One request per backend, timed as vLLM's `bench serve` times it.

TTFT is send -> the first chunk carrying text; ITL the gaps between such chunks; E2EL
send -> the last one. Output tokens come from the server's `usage` (asked for with
`stream_options.include_usage`; llmq's `done` event carries it), so several tokens in
one chunk are still counted.

NOTE: a chunk counts when it carries a token: text, or (a token that decodes to nothing)
an empty text with no finish_reason. vLLM counts every chunk with a `choices` entry, which
also takes in a chat server's opening role-only delta and llmq's closing `finish_reason`
chunk (both without a token): they would shorten TTFT and add a near-zero ITL.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import requests

from llmq.bench.request_types import RequestFunc, RequestInput, RequestOutput
from llmq.bench.sse import iter_sse

CONNECT_TIMEOUT = 30.0  # seconds
READ_TIMEOUT = 6 * 60 * 60.0  # seconds between bytes: a long queue is not a failure

_local = threading.local()


def _session() -> requests.Session:
    """One keep-alive session per dispatch thread (a Session is not thread-safe)."""
    session = getattr(_local, "session", None)
    if session is None:
        session = _local.session = requests.Session()
    return session


def _headers(request: RequestInput) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if request.api_key:
        headers["Authorization"] = f"Bearer {request.api_key}"
    return headers


def _http_error(response: requests.Response) -> str:
    body = response.text[:500]
    return f"HTTP {response.status_code} {response.reason}: {body}"


class _Timer:
    """Stamps content chunks: TTFT on the first, ITL between the next ones."""

    def __init__(self, output: RequestOutput) -> None:
        self.output = output
        self.last = output.start_time

    def chunk(self, text: str) -> None:
        now = time.perf_counter()
        if self.output.num_chunks == 0:
            self.output.ttft = now - self.output.start_time
        else:
            self.output.itl.append(now - self.last)
        self.output.num_chunks += 1
        self.output.generated_text += text
        self.last = now

    def finish(self) -> None:
        out = self.output
        out.latency = self.last - out.start_time
        if out.num_chunks == 0 and not out.error:
            out.error = "the stream ended without any token, so TTFT is undefined"
        out.success = out.num_chunks > 0 and not out.error


def _take_usage(output: RequestOutput, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    if usage.get("completion_tokens") is not None:
        output.output_tokens = int(usage["completion_tokens"])
    if usage.get("prompt_tokens") is not None:
        output.prompt_len = int(usage["prompt_tokens"])


def _guarded(body: Callable[[RequestInput, RequestOutput], None]) -> RequestFunc:
    """Wraps a backend body: sets start_time, turns any exception into a failed output."""

    def run(request: RequestInput) -> RequestOutput:
        output = RequestOutput(prompt_len=request.prompt_len)
        output.start_time = time.perf_counter()
        try:
            body(request, output)
        except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
            output.success = False
            output.error = "".join(traceback.format_exception_only(exc)).strip()
        return output

    run.__name__ = body.__name__
    return run


def _openai_stream(request: RequestInput, output: RequestOutput, payload: dict[str, Any],
                   text_of: Callable[[dict[str, Any]], str | None]) -> None:
    payload.update({"stream": True, "stream_options": {"include_usage": True}})
    if request.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(request.extra_body)
    timer = _Timer(output)
    with _session().post(request.api_url, json=payload, headers=_headers(request),
                         stream=True, timeout=(CONNECT_TIMEOUT, READ_TIMEOUT)) as response:
        if response.status_code != 200:
            output.error = _http_error(response)
            return
        for message in iter_sse(response):
            if message.data.strip() == "[DONE]":
                break
            data = json.loads(message.data)
            if "error" in data:
                output.error = json.dumps(data["error"])
                break
            if choices := data.get("choices"):
                text = text_of(choices[0])
                if text or (text is not None and choices[0].get("finish_reason") is None):
                    timer.chunk(text or "")
            _take_usage(output, data.get("usage"))
    timer.finish()


def openai_completions(request: RequestInput, output: RequestOutput) -> None:
    """`POST /v1/completions`, streamed."""
    payload = {"model": request.model, "prompt": request.prompt,
               "max_tokens": request.output_len}
    _openai_stream(request, output, payload, lambda choice: choice.get("text"))


def _chat_token_text(choice: dict[str, Any]) -> str | None:
    """The delta's content; None for a role-only opening delta (no token yet)."""
    delta = choice.get("delta") or {}
    content = delta.get("content")
    if "role" in delta and not content:
        return None
    return content


def openai_chat(request: RequestInput, output: RequestOutput) -> None:
    """`POST /v1/chat/completions`, streamed; the prompt is one user message."""
    payload = {"model": request.model,
               "messages": [{"role": "user", "content": request.prompt}],
               "max_completion_tokens": request.output_len}
    _openai_stream(request, output, payload, _chat_token_text)


def llmq_jobs(request: RequestInput, output: RequestOutput) -> None:
    """`POST /v1/jobs`, then `GET /v1/jobs/{id}/events`: the durable path, timed from
    the submit (TTFT includes queueing in Postgres and the broker)."""
    payload: dict[str, Any] = {"model": request.model, "prompt": request.prompt,
                               "max_tokens": request.output_len}
    if request.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(request.extra_body)
    session = _session()
    submitted = session.post(request.api_url, json=payload, headers=_headers(request),
                             timeout=(CONNECT_TIMEOUT, READ_TIMEOUT))
    if submitted.status_code not in (200, 202):
        output.error = _http_error(submitted)
        return
    job_id = submitted.json()["id"]
    events_url = f"{request.api_url.rstrip('/')}/{job_id}/events"
    timer = _Timer(output)
    ended = False
    with session.get(events_url, headers=_headers(request), stream=True,
                     timeout=(CONNECT_TIMEOUT, READ_TIMEOUT)) as response:
        if response.status_code != 200:
            output.error = _http_error(response)
            return
        for message in iter_sse(response):
            data = json.loads(message.data)
            if message.event == "token":
                if data.get("index", 0) == 0:
                    timer.chunk(data.get("text") or "")
            elif message.event == "restart":
                # NOTE: the job starts over on another worker; its text so far is void.
                # The timings stay: they are what a client of this job lived through.
                output.generated_text = ""
            elif message.event == "done":
                _take_usage(output, data.get("usage"))
                ended = True
                break
            elif message.event in ("error", "cancelled"):
                output.error = f"job {job_id} {message.event}: {data.get('error') or ''}"
                break
    if not ended and not output.error:
        output.error = f"job {job_id}: the event stream ended before the job's terminal event"
    timer.finish()


REQUEST_FUNCS: dict[str, RequestFunc] = {
    "openai": _guarded(openai_completions),
    "openai-chat": _guarded(openai_chat),
    "llmq-jobs": _guarded(llmq_jobs),
}
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions",
                     "llmq-jobs": "/v1/jobs"}
