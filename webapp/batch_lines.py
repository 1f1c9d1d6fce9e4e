"""The lines of a batch's input file: parsed and checked against the batch's endpoint,
then each one turned into its job.

A line that is not a request of the batch's endpoint (not JSON, no unique `custom_id`,
not `POST`, another `url`) fails the whole batch, its problems in `errors.data` with their
line numbers (as OpenAI does). Every other line becomes a job (`jobs.batch_id`,
`custom_id`, `batch_index`) in the batch band (`tasks.api.batches.BATCH_PRIORITY`): a body
the served model refuses is a failed job from the start, so it reaches the error file as a
failed request (status 400) like at OpenAI. Tokenizing needs the served model, so this
runs in a web process (webapp/batch_validation.py).
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from tasks.api.batches import BATCH_PRIORITY, BatchInputLine
from tasks.api.errors import SchemaError
from tasks.models import Job, JobErrorKind, JobKind, JobStatus
from tasks.schema import pin_seed
from webapp.errors import APIError
from webapp.groups import context_len
from webapp.jobs import prompt_text, served_model, tokenize
from webapp.model_registry import ServedModel
from webapp.openai_format import OpenAIRequest, parse_openai_request
from webapp.services import Services

KIND_OF_ENDPOINT = {"/v1/completions": JobKind.COMPLETION,
                    "/v1/chat/completions": JobKind.CHAT}


def parse_lines(data: bytes, endpoint: str,
                max_lines: int) -> tuple[list[BatchInputLine], list[dict[str, Any]]]:
    """The requests of an input file, or its problems (`{code, message, param, line}`,
    1-based lines). Blank lines are skipped."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [file_problem("invalid_file", f"the file is not UTF-8 text "
                                 f"(byte {exc.start})")]
    lines: list[BatchInputLine] = []
    errors: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    numbered = [(n, raw) for n, raw in enumerate(text.split("\n"), start=1) if raw.strip()]
    if not numbered:
        return [], [file_problem("empty_file", "the input file holds no requests")]
    if len(numbered) > max_lines:
        return [], [file_problem("too_many_requests", f"the input file holds "
                                 f"{len(numbered)} requests; a batch takes at most "
                                 f"{max_lines} (LLMQ_MAX_BATCH_LINES): split it")]
    for number, raw in numbered:
        def problem(code: str, message: str, param: str | None = None,
                    line_number: int = number) -> None:
            errors.append({"code": code, "message": message, "param": param,
                           "line": line_number})
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            problem("invalid_json_line", "the line is not a JSON object")
            continue
        try:
            line = BatchInputLine.model_validate(value)
        except ValidationError as exc:
            error = SchemaError.from_validation(exc, BatchInputLine)
            problem("invalid_request", error.message, error.param)
            continue
        if line.url != endpoint:
            problem("mismatched_endpoint", f"url {line.url!r} is not the batch's endpoint "
                    f"{endpoint!r}", "url")
            continue
        if line.custom_id in seen:
            problem("duplicate_custom_id", f"custom_id {line.custom_id!r} is also on line "
                    f"{seen[line.custom_id]}; every request needs its own", "custom_id")
            continue
        seen[line.custom_id] = number
        lines.append(line)
    return lines, errors


def file_problem(code: str, message: str) -> dict[str, Any]:
    """A problem of the whole input file (no line), as `errors.data` holds it."""
    return {"code": code, "message": message, "param": None, "line": None}


class LineServerError(Exception):
    """Line `index` could not be validated for a reason of the server's (a 5xx APIError:
    the served model cannot load its tokenizer): not the line's fault."""

    def __init__(self, index: int, error: APIError) -> None:
        super().__init__(error.message)
        self.index = index
        self.error = error


def line_jobs(svc: Services, kind: JobKind, first_index: int, lines: list[BatchInputLine],
              api_key_id: uuid.UUID | None, batch_id: str, now: datetime) -> list[Job]:
    """The jobs of valid lines (`first_index` is the first one's index in the batch):
    queued, or failed when the served model refuses a body (the error file then answers
    it with a 400, as the direct request would). The prompts of each model are encoded in
    one tokenizer call.

    Raises LineServerError for a problem of the server's, not a line's: the batch is
    validated again later."""
    jobs: list[Job] = []
    # (job, index, line, request, model, prompt text) of the lines parsed so far
    parsed: list[tuple[Job, int, BatchInputLine, OpenAIRequest, ServedModel, str | None]] = []
    for index, line in enumerate(lines, start=first_index):
        job = Job(id=uuid.uuid4(), api_key_id=api_key_id, batch_id=batch_id,
                  custom_id=line.custom_id, batch_index=index, kind=kind.value,
                  priority=BATCH_PRIORITY, attempts=0, created_at=now)
        jobs.append(job)
        try:
            req = _line_request(svc, kind, line.body)
            model = served_model(req.job.model)
            parsed.append((job, index, line, req, model, prompt_text(model, req.job)))
        except APIError as exc:
            _refused(job, index, line, exc, now)
    token_ids = _encode_all([(model, text, req.job.messages is not None)
                             for _, _, _, req, model, text in parsed])
    for (job, index, line, req, model, text), ids in zip(parsed, token_ids):
        try:
            # NOTE: no text: the line gave token ids, which tokenize takes as they are
            _fill_job(model, req, job, None if text is None or ids is None else (text, ids))
        except APIError as exc:
            _refused(job, index, line, exc, now)
    return jobs


def _refused(job: Job, index: int, line: BatchInputLine, exc: APIError,
             now: datetime) -> None:
    """`job` (line `index`) fails from the start with the refusal `exc` (a 4xx); a 5xx is
    the server's problem and raises LineServerError."""
    if exc.status >= 500:
        raise LineServerError(index, exc)
    model = line.body.get("model")
    job.model = model[:200] if isinstance(model, str) else ""
    job.params = job.params or {}
    job.status = JobStatus.FAILED.value
    job.finish_reason = "error"
    job.error = exc.message
    job.error_kind = JobErrorKind.INVALID_REQUEST.value
    job.finished_at = now


def _encode_all(prompts: list[tuple[ServedModel, str | None, bool]]
                ) -> list[list[int] | None]:
    """Token ids of every (model, text, is a chat): one tokenizer call per model and kind
    of prompt; None where there is no text (token ids given)."""
    out: list[list[int] | None] = [None] * len(prompts)
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, (model, text, chat) in enumerate(prompts):
        if text is not None:
            groups.setdefault((id(model), chat), []).append(i)
    for (_, chat), members in groups.items():
        model = prompts[members[0]][0]
        encoded = model.encode_many([prompts[i][1] or "" for i in members], chat=chat)
        for i, ids in zip(members, encoded):
            out[i] = ids
    return out


def _line_request(svc: Services, kind: JobKind, body: dict[str, Any]) -> OpenAIRequest:
    """The request of a line's body, as `webapp.openai_api` reads a direct one; raises
    APIError (4xx) for what it refuses."""
    try:
        req = parse_openai_request(body, kind, max_n=svc.settings.max_n)
    except SchemaError as exc:
        raise APIError(400, "invalid_value", exc.message, exc.param) from None
    # NOTE: a batch's bodies are built from the job row (tasks/batches.py), which keeps
    # neither the token logprobs, how the prompt was echoed, nor the request's tool plan:
    # refused, not ignored.
    for name, asked in (("stream", req.stream), ("echo", req.echo),
                        ("logprobs", req.num_logprobs is not None),
                        ("tools", req.tools is not None)):
        if asked:
            raise APIError(400, "invalid_value", f"{name} is not supported in a batch "
                           "request; send it as a direct request", name)
    return req


def _fill_job(model: ServedModel, req: OpenAIRequest, job: Job,
              encoded: tuple[str, list[int]] | None) -> None:
    """`job` queued with the request's prompt (`encoded`: its text and token ids, None
    for a prompt of token ids), checked against the served model; raises APIError (4xx)
    for what it refuses."""
    prompt, prompt_token_ids = tokenize(model, req.job, encoded=encoded)
    if req.fill_max_tokens:
        req.job.params.max_tokens = max(req.job.params.min_tokens, 1,
                                        context_len(model) - len(prompt_token_ids))
    pin_seed(req.job.params)
    job.model = req.job.model
    job.prompt = prompt
    job.messages = req.job.messages
    job.prompt_token_ids = prompt_token_ids
    job.params = req.job.params_dict()
    job.prompt_tokens = len(prompt_token_ids)
    job.status = JobStatus.QUEUED.value
