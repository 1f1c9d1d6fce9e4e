"""OpenAI-compatible endpoints: `POST /v1/completions` and `POST /v1/chat/completions`.

A second face of the same jobs: each request is validated, tokenized and stored as a job
through `webapp.jobs.submit_job` (a row in the database, a `generate` message), and its
answer comes from the job's event stream and row. So every OpenAI request is also visible
at `/v1/jobs/<id>` (the response id is `cmpl-<job id hex>`, and the `X-Llmq-Job-Id`
header carries the job id).

Streaming answers are OpenAI's server-sent chunks ending with `data: [DONE]`. A client
that disconnects from a stream cancels its job (the generator is closed by the server).
A non-streaming request waits for the job to end, up to `settings.request_timeout_seconds`
(then the job is cancelled and the answer is a 504).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
import sqlalchemy.exc
from flask import Blueprint, Response

from tasks.models import Job, JobKind, JobStatus
from tasks.openai_body import ChatMessage, completion_object, response_id, usage_dict
from tasks.protocol import EventType, JobEvent
from tasks.schema import SchemaError
from tasks.streams.reader import Park
from webapp.auth import current_api_key_id
from webapp.errors import APIError, failed_job_error
from webapp.events import terminal_event_from_row
from webapp.groups import context_len
from webapp.jobs import (
    cancel,
    idempotency_key_header,
    json_body,
    served_model,
    submit_job,
    tokenize,
)
from webapp.openai_format import (
    ChoiceLogprobs,
    OpenAIRequest,
    chat_logprobs,
    completion_logprobs,
    parse_openai_request,
)
from webapp.services import Services, services
from webapp.streaming import event_stream_response
from webapp.tool_calls import ToolCallStream, ToolPlan, parse_output
from webapp.tool_calls import finish_reason as tool_finish_reason

logger = logging.getLogger(__name__)

bp = Blueprint("openai", __name__, url_prefix="/v1")

STREAM_PING_SECONDS = 1.0  # idle tick: keep-alive comment, deadline and row checks
# a row that is terminal with no terminal event on the stream this long ends the wait
MISSING_TERMINAL_GRACE_SECONDS = 2.0


@dataclass(slots=True)
class Answer:
    """What every chunk and the final object of one request share."""

    kind: JobKind
    id: str  # cmpl-<hex> / chatcmpl-<hex>
    created: int  # unix seconds
    model: str
    n: int
    echo_text: str | None  # completions with echo: the prompt text
    num_logprobs: int | None
    include_usage: bool
    decode: Callable[[int], str]  # one token id -> its text
    tools: ToolPlan | None = None  # chat with tools: calls are read from the text

    @property
    def object(self) -> str:
        return "text_completion" if self.kind is JobKind.COMPLETION else "chat.completion"

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              with_usage_field: bool = True) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion" if self.kind is JobKind.COMPLETION
            else "chat.completion.chunk",
            "created": self.created, "model": self.model, "choices": choices,
        }
        if self.include_usage and with_usage_field:
            body["usage"] = usage
        return "data: " + json.dumps(body, separators=(",", ":")) + "\n\n"

    def logprobs(self, lp: ChoiceLogprobs, text_offset: int) -> dict[str, Any] | None:
        if self.num_logprobs is None:
            return None
        if self.kind is JobKind.COMPLETION:
            return completion_logprobs(lp, self.decode, text_offset)
        return chat_logprobs(lp, self.decode)


@bp.post("/completions")
def completions() -> Response:
    """OpenAI completions (`prompt`), stream or not."""
    return _serve(JobKind.COMPLETION)


@bp.post("/chat/completions")
def chat_completions() -> Response:
    """OpenAI chat completions (`messages`), stream or not."""
    return _serve(JobKind.CHAT)


def _serve(kind: JobKind) -> Response:
    svc = services()
    api_key_id = current_api_key_id()
    body = json_body()
    try:
        req = parse_openai_request(body, kind, max_n=svc.settings.max_n)
    except SchemaError as exc:
        raise APIError(400, "invalid_value", exc.message, exc.param) from None
    model = served_model(req.job.model)
    prompt_text, prompt_token_ids = tokenize(model, req.job,
                                             req.tools.tools if req.tools else None)
    if req.fill_max_tokens:
        req.job.params.max_tokens = max(req.job.params.min_tokens, 1,
                                        context_len(model) - len(prompt_token_ids))
    # a repeated Idempotency-Key with the same request answers from the first job (streamed
    # from its first event); with a different request it is a 422
    job, _ = submit_job(req.job, prompt_text, prompt_token_ids, api_key_id=api_key_id,
                        idempotency_key=idempotency_key_header())
    tokenizer = model.tokenizer
    echo_text = None
    if req.echo:
        echo_text = prompt_text if prompt_text is not None else tokenizer.decode(prompt_token_ids)
    answer = Answer(
        kind=kind, id=response_id(kind, job.id.hex),
        created=int(job.created_at.timestamp()), model=job.model, n=req.job.params.n,
        echo_text=echo_text, num_logprobs=req.num_logprobs, include_usage=req.include_usage,
        decode=lambda token_id: tokenizer.decode([token_id]), tools=req.tools,
    )
    headers = {"X-Llmq-Job-Id": str(job.id)}
    if req.stream:
        return event_stream_response(
            lambda _sink, cooperative: _stream(svc, job, answer, cooperative), headers)
    body = _wait_and_answer(svc, job, answer, req)
    return Response(json.dumps(body, separators=(",", ":")), mimetype="application/json",
                    headers=headers)


# --- events ------------------------------------------------------------------------------


def job_events(svc: Services, job_id: str,
                cooperative: bool = False) -> Iterator[JobEvent | Park | None]:
    """The job's events up to the terminal one; `None` every idle STREAM_PING_SECONDS;
    `Park` where a cooperative reader waits (see webapp/stream_server.py).

    Ends from the row when the row is terminal but the stream never gets a terminal
    event (a lost publish), as the jobs SSE view does.
    """
    terminal_seen_at: float | None = None
    for item in svc.subscriber.iter_events(job_id, heartbeat_seconds=STREAM_PING_SECONDS,
                                           cooperative=cooperative):
        if isinstance(item, Park):
            yield item
            continue
        if item is not None:
            yield item[1]
            continue
        yield None
        row = reload_job(svc, job_id)
        if row is None or not JobStatus(row.status).is_terminal:
            terminal_seen_at = None
        elif terminal_seen_at is None:
            terminal_seen_at = time.monotonic()
        elif time.monotonic() - terminal_seen_at >= MISSING_TERMINAL_GRACE_SECONDS:
            logger.warning("job %s is %s without a terminal event; answering from the row",
                           job_id, row.status)
            yield terminal_event_from_row(row)
            return


def reload_job(svc: Services, job_id: str) -> Job | None:
    with svc.reads() as session:
        return session.get(Job, uuid.UUID(job_id))


def _error_body(error: APIError) -> dict[str, Any]:
    return {"error": {"type": error.type, "message": error.message, "param": error.param,
                      "code": error.code}}


# --- non-streaming -------------------------------------------------------------------------


def _wait_and_answer(svc: Services, job: Job, answer: Answer,
                     req: OpenAIRequest) -> dict[str, Any]:
    job_id = str(job.id)
    deadline = time.monotonic() + svc.settings.request_timeout_seconds
    logprobs = [ChoiceLogprobs() for _ in range(answer.n)]
    terminal: JobEvent | None = None
    for event in job_events(svc, job_id):
        if time.monotonic() > deadline:
            cancel_quietly(svc, job_id)
            raise APIError(504, "timeout", f"job {job_id} did not finish within "
                           f"{svc.settings.request_timeout_seconds:g} s and was cancelled; "
                           "lower max_tokens, or use stream: true or the jobs API "
                           "(/v1/jobs) for long generations")
        if event is None or isinstance(event, Park):  # not cooperative: never a Park
            continue
        if event.type is EventType.RESTART:
            logprobs = [ChoiceLogprobs() for _ in range(answer.n)]
        elif event.type is EventType.TOKEN and event.logprobs and event.index < answer.n:
            logprobs[event.index].extend(event.logprobs)
        elif event.type.is_terminal:
            terminal = event
            break
    row = reload_job(svc, job_id) or job
    if row.status == JobStatus.FAILED.value:
        raise failed_job_error(job_id, row.error, row.error_kind)
    usage = terminal.usage if terminal is not None and terminal.usage else {
        "prompt_tokens": row.prompt_tokens or 0, "completion_tokens": row.completion_tokens or 0,
        "cached_tokens": row.cached_tokens or 0}
    prefix = answer.echo_text or ""
    return completion_object(
        kind=answer.kind, id=answer.id, created=answer.created, model=answer.model, n=answer.n,
        output=row.output, finish_reason=row.finish_reason, usage=usage,
        echo_text=answer.echo_text,
        choice_logprobs=[answer.logprobs(logprobs[i], len(prefix)) for i in range(answer.n)],
        chat_message=None if answer.tools is None else _tool_message(answer.tools))


def _tool_message(plan: ToolPlan) -> ChatMessage:
    """How a chat sample's text becomes its message when the request had tools: the calls
    read from the text (`tool_calls`, finish_reason `tool_calls`) and what text is left."""
    def message(text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        content, calls = parse_output(text, plan)
        shaped: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            shaped["tool_calls"] = [call.to_openai() for call in calls]
        return shaped, tool_finish_reason(finish_reason, len(calls))
    return message


# --- streaming -----------------------------------------------------------------------------


def _stream(svc: Services, job: Job, answer: Answer,
            cooperative: bool) -> Iterator[str | Park]:
    """OpenAI chunks of the job; closing this generator early cancels the job."""
    job_id = str(job.id)
    finished = False
    n = answer.n
    try:
        if answer.kind is JobKind.CHAT:
            yield answer.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None} for i in range(n)])
        offsets = [0] * n
        if answer.echo_text:
            yield answer.chunk([{"index": i, "text": answer.echo_text, "logprobs": None,
                                 "finish_reason": None} for i in range(n)])
            offsets = [len(answer.echo_text)] * n
        sent = [0] * n  # characters sent per choice
        tool_streams = [ToolCallStream(answer.tools) for _ in range(n)] if answer.tools \
            else None
        produced = [0] * n  # characters of the current attempt per choice
        for event in job_events(svc, job_id, cooperative):
            if isinstance(event, Park):
                yield event
                continue
            if event is None:
                yield ": ping\n\n"  # also how a closed connection is noticed
                continue
            if event.type is EventType.RESTART:
                # NOTE: the job starts over elsewhere. What was sent cannot be taken back,
                # so the new attempt's text is sent only past what the client already has
                # (exact for greedy or seeded sampling, which repeats itself).
                logger.info("job %s restarted while streaming to an OpenAI client", job_id)
                produced = [0] * n
                continue
            if event.type is EventType.TOKEN:
                i = event.index
                if i >= n:
                    continue
                start = produced[i]
                produced[i] += len(event.text)
                text = event.text[max(0, sent[i] - start):]
                if not text and sent[i] > start:
                    continue  # a replay of what the client has
                sent[i] = max(sent[i], produced[i])
                lp = ChoiceLogprobs()
                lp.extend(event.logprobs)
                choice: dict[str, Any] = {"index": i}
                deltas = [{"content": text}]
                if tool_streams is not None:
                    deltas = tool_streams[i].feed(text) or [{}]
                if answer.kind is JobKind.COMPLETION:
                    choice["text"] = text
                else:
                    choice["delta"] = deltas[0]
                choice["logprobs"] = answer.logprobs(lp, offsets[i])
                choice["finish_reason"] = None
                offsets[i] += sum(len(answer.decode(t)) for t in lp.token_ids)
                if choice.get("delta") != {} or choice["logprobs"] is not None:
                    yield answer.chunk([choice])
                for delta in deltas[1:]:
                    yield answer.chunk([{"index": i, "delta": delta, "logprobs": None,
                                         "finish_reason": None}])
                continue
            # the terminal event
            finished = True
            if event.type is EventType.ERROR:
                row = reload_job(svc, job_id)  # committed before its error event: the kind
                kind = row.error_kind if row is not None else None
                body = _error_body(failed_job_error(job_id, event.error, kind))
                yield "data: " + json.dumps(body) + "\n\n"
                yield "data: [DONE]\n\n"
                return
            row = reload_job(svc, job_id)
            reasons = {int(o.get("index", 0)): o.get("finish_reason")
                       for o in ((row.output if row is not None else None) or [])}
            for i in range(n):
                reason = reasons.get(i) or event.finish_reason
                if tool_streams is not None:
                    for delta in tool_streams[i].finish():
                        yield answer.chunk([{"index": i, "delta": delta, "logprobs": None,
                                             "finish_reason": None}])
                    reason = tool_finish_reason(reason, tool_streams[i].num_calls)
                empty: dict[str, Any] = ({"text": ""} if answer.kind is JobKind.COMPLETION
                                         else {"delta": {}})
                yield answer.chunk([{"index": i, **empty, "logprobs": None,
                                     "finish_reason": reason}])
            if answer.include_usage:
                yield answer.chunk([], usage_dict(event.usage))
            yield "data: [DONE]\n\n"
            return
    finally:
        if not finished:
            # the client went away (or the server is stopping): nobody reads this job
            logger.info("job %s: stream closed before the end; cancelling the job", job_id)
            cancel_quietly(svc, job_id)


def cancel_quietly(svc: Services, job_id: str) -> None:
    try:
        row = reload_job(svc, job_id)
        if row is not None and not JobStatus(row.status).is_terminal:
            cancel(svc, row)
    except (sqlalchemy.exc.OperationalError, redis.ConnectionError) as exc:
        # the database or Redis is down: a line, not a traceback per stream
        logger.warning("job %s: could not cancel after the client left (%s)", job_id,
                       str(exc).strip().splitlines()[0])
    except Exception:
        logger.warning("job %s: could not cancel after the client left", job_id, exc_info=True)
