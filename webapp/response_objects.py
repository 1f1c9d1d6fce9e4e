"""Responses API bodies -> a chat job's messages, and rows -> OpenAI response objects.

Pure functions over plain values and rows (no Flask, no Redis), so the views in
`webapp/responses.py` stay about flow.

Choices made here:
* A response is a chat job: `instructions` becomes a first system message, `developer`
  messages are system messages, text parts are joined into one string per message.
* `previous_response_id` continues a stored conversation: the previous job's messages
  without its instructions (OpenAI does not carry them over), its output as an assistant
  message, then the new input.
* Status: a job `succeeded` with finish reason `length` is `incomplete`
  (`max_output_tokens`); `running` is `in_progress`; the others keep their names.
"""

from __future__ import annotations

from typing import Any

from tasks.api.responses import ResponseCreateRequest
from tasks.models import Job, JobErrorKind, JobStatus, StoredResponse
from tasks.schema import SchemaError, validate_body

_TEXT_PARTS = {"user": ("input_text",), "system": ("input_text",),
               "developer": ("input_text",), "assistant": ("output_text", "input_text")}
_STATUSES = {JobStatus.QUEUED.value: "queued", JobStatus.RUNNING.value: "in_progress",
             JobStatus.SUCCEEDED.value: "completed", JobStatus.FAILED.value: "failed",
             JobStatus.CANCELLED.value: "cancelled"}


def response_id(job: Job) -> str:
    return "resp_" + job.id.hex


def message_id(job: Job) -> str:
    return "msg_" + job.id.hex


def parse_response_request(body: Any) -> ResponseCreateRequest:
    """Validate a `POST /v1/responses` body; raises SchemaError naming the field."""
    request = validate_body(ResponseCreateRequest, body)
    if request.tools:
        raise SchemaError("tools (function calling, built-in tools) are not supported; send "
                          "text input only", "tools")
    if request.n not in (None, 1):
        raise SchemaError("n is not supported by the Responses API: one response is one "
                          "sample (use /v1/chat/completions for several)", "n")
    if request.background and request.store is False:
        raise SchemaError("background responses must be stored: use store: true (or leave it "
                          "out) with background: true", "store")
    return request


def input_messages(request: ResponseCreateRequest) -> list[dict[str, str]]:
    """This request's own input as chat messages `[{"role", "content"}]`; a SchemaError
    naming the part for anything but text."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages = []
    for i, item in enumerate(request.input):
        content = item.content
        if not isinstance(content, str):
            texts = []
            for j, part in enumerate(content):
                where = f"input[{i}].content[{j}]"
                allowed = _TEXT_PARTS[item.role]
                if part.type not in allowed:
                    raise SchemaError(f"{where} is {part.type!r}: only text input is supported "
                                      f"here ({' or '.join(allowed)}); images, files and audio "
                                      "are not", f"{where}.type")
                extra = sorted(part.model_extra or {})
                if extra:
                    raise SchemaError(f"{where}.{extra[0]} is not a field of a text part",
                                      f"{where}.{extra[0]}")
                if part.text is None:
                    raise SchemaError(f"{where}.text is required", f"{where}.text")
                texts.append(part.text)
            content = "".join(texts)
        role = "system" if item.role == "developer" else item.role
        messages.append({"role": role, "content": content})
    return messages


def conversation(request: ResponseCreateRequest, own_input: list[dict[str, str]],
                 previous: tuple[StoredResponse, Job] | None) -> list[dict[str, str]]:
    """The job's messages: instructions, the previous conversation and its answer, input."""
    messages = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
    if previous is not None:
        stored, job = previous
        earlier = list(job.messages or [])
        if stored.instructions is not None:
            earlier = earlier[1:]  # its instructions message (not carried over)
        messages.extend(earlier)
        messages.append({"role": "assistant", "content": job.output_text or ""})
    messages.extend(own_input)
    return messages


def response_status(job: Job) -> str:
    status = _STATUSES[job.status]
    if status == "completed" and job.finish_reason == "length":
        return "incomplete"
    return status


def response_object(stored: StoredResponse, job: Job, *, status: str | None = None,
                    text: str | None = None) -> dict[str, Any]:
    """The OpenAI response of `stored` over its `job` (`tasks.api.responses.Response`).

    `status` and `text` override what the row says (stream preambles, live polling);
    without a text a queued or in-progress response has no output yet.
    """
    status = status or response_status(job)
    terminal = JobStatus(job.status).is_terminal and status == response_status(job)
    if text is None and terminal:
        text = job.output_text or ""
    output = []
    if text is not None:
        output.append(output_message(message_id(job), text, status))
    params = job.params or {}
    body: dict[str, Any] = {
        "id": stored.id, "object": "response", "created_at": int(stored.created_at.timestamp()),
        "status": status, "background": stored.background, "error": None,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                               else None),
        "instructions": stored.instructions, "max_output_tokens": stored.max_output_tokens,
        "model": job.model, "output": output, "parallel_tool_calls": False,
        "previous_response_id": stored.previous_response_id, "store": stored.store,
        "temperature": params.get("temperature"), "top_p": params.get("top_p"),
        "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [],
        "truncation": "disabled", "metadata": dict(stored.meta or {}), "usage": None,
        "job_id": str(job.id),
    }
    if status == "failed":
        code = ("invalid_prompt" if job.error_kind == JobErrorKind.INVALID_REQUEST.value
                else "server_error")
        body["error"] = {"code": code, "message": job.error or "the job failed"}
    if terminal:
        body["usage"] = usage(job)
    return body


def output_message(item_id: str, text: str, status: str) -> dict[str, Any]:
    item_status = {"queued": "in_progress", "in_progress": "in_progress",
                   "completed": "completed"}.get(status, "incomplete")
    return {"id": item_id, "type": "message", "role": "assistant",
            "status": item_status, "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def input_items_page(stored: StoredResponse, job: Job, *, limit: int, order: str,
                     after: str | None) -> dict[str, Any] | None:
    """A page of the response's own input items (`tasks.api.responses.InputItemList`);
    None when `after` is not one of its item ids."""
    items = [{"id": f"{message_id(job)}_{i}", "type": "message", "role": message["role"],
              "status": "completed",
              "content": [{"type": "output_text" if message["role"] == "assistant"
                           else "input_text", "text": message["content"]}]}
             for i, message in enumerate(stored.input or [])]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            return None
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def usage(job: Job) -> dict[str, Any]:
    prompt = job.prompt_tokens or 0
    completion = job.completion_tokens or 0
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": job.cached_tokens or 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}
