"""The final OpenAI object of a finished job: `text_completion` or `chat.completion`.

Pure over plain values, so the direct (non-streaming) answer of `webapp/openai_api.py`
and the output file of a batch (`tasks/batches.py`, which may run in beat, away from any
tokenizer) build their bodies with the same function: a batch line's body is exactly
what the direct request answers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tasks.models import JobKind

# a chat sample's text and finish reason -> its message and finish reason (e.g. tool calls
# read from the text)
ChatMessage = Callable[[str, str | None], tuple[dict[str, Any], str | None]]


def response_id(kind: JobKind, job_hex: str) -> str:
    """`cmpl-<job hex>` / `chatcmpl-<job hex>`: the job is findable from the answer."""
    return ("cmpl-" if kind is JobKind.COMPLETION else "chatcmpl-") + job_hex


def usage_dict(usage: dict[str, int] | None) -> dict[str, Any]:
    """OpenAI's usage from a job's counts (`prompt_tokens`, `completion_tokens`,
    `cached_tokens`)."""
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens", 0))
    completion = int(usage.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(usage.get("cached_tokens", 0))}}


def completion_object(*, kind: JobKind, id: str, created: int, model: str, n: int,
                      output: list[dict[str, Any]] | None, finish_reason: str | None,
                      usage: dict[str, int] | None, echo_text: str | None = None,
                      choice_logprobs: list[dict[str, Any] | None] | None = None,
                      chat_message: ChatMessage | None = None) -> dict[str, Any]:
    """The answer of a finished job: `output` is the row's per-sample list
    (`{"index", "text", "finish_reason"}`), `finish_reason` the row's, `echo_text` the
    prompt put before a completion's text, `choice_logprobs` each choice's rendered
    logprobs (None: not asked for), `chat_message` how a chat sample's text becomes its
    message (default: the text as the assistant's content)."""
    outputs = {int(o.get("index", 0)): o for o in (output or [])}
    choices = []
    for i in range(n):
        sample = outputs.get(i, {})
        text = sample.get("text", "")
        reason = sample.get("finish_reason") or finish_reason
        choice: dict[str, Any] = {"index": i}
        if kind is JobKind.COMPLETION:
            choice["text"] = (echo_text or "") + text
        elif chat_message is not None:
            choice["message"], reason = chat_message(text, reason)
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = choice_logprobs[i] if choice_logprobs else None
        choice["finish_reason"] = reason
        choices.append(choice)
    return {"id": id, "object": "text_completion" if kind is JobKind.COMPLETION
            else "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage_dict(usage), "system_fingerprint": None}
