"""OpenAI request bodies -> job requests, and job output -> OpenAI response objects.

Pure functions over plain values (no Flask, no Redis), so the views in `openai_api.py`
stay about flow. Shapes follow OpenAI's `/v1/completions` and `/v1/chat/completions`.

Choices made here:
* `prompt` is one prompt: a string, a list of token ids, or a one-element list of either.
  A batch of several prompts is rejected (400): send one request per prompt (each is a
  job of its own; `n` gives several samples of one prompt).
* Fields that would change the meaning of a request but are not implemented (`suffix`,
  `best_of` != `n`, `logit_bias`, tools, non-text `response_format`) are a 400, never
  ignored. Bookkeeping fields clients commonly send (`user`, `metadata`...) are ignored.
* Shapes and types are the models' of `tasks.api.openai`; this module adds what spans
  fields and maps OpenAI's names onto the job's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tasks.api.openai import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
)
from tasks.models import JobKind
from tasks.schema import JobRequest, SchemaError, build_job_request

REQUEST_MODELS = {JobKind.COMPLETION: CompletionRequest, JobKind.CHAT: ChatCompletionRequest}


@dataclass(slots=True)
class OpenAIRequest:
    """A validated OpenAI request: the job to run and how to answer."""

    job: JobRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    echo: bool  # completions: the prompt goes before the text
    # completions: top-n per token (OpenAI `logprobs: int`); chat: `top_logprobs` when
    # `logprobs: true`. None: no logprobs in the answer.
    num_logprobs: int | None
    # chat without max_tokens: the job may use the rest of the context (set once the
    # prompt is tokenized)
    fill_max_tokens: bool = False


def parse_openai_request(body: Any, kind: JobKind, *, max_n: int) -> OpenAIRequest:
    """Validate an OpenAI body; raises SchemaError naming the field."""
    if not isinstance(body, dict):
        raise SchemaError("the request body must be a JSON object")
    model = REQUEST_MODELS[kind]
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise SchemaError.from_validation(exc, model) from None
    _reject_unsupported(request)
    if request.stream_options is not None and not request.stream:
        raise SchemaError("stream_options is only allowed with stream: true", "stream_options")
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    if isinstance(request, CompletionRequest):
        return _completion(request, include_usage, max_n)
    return _chat(request, include_usage, max_n)


def _completion(request: CompletionRequest, include_usage: bool, max_n: int) -> OpenAIRequest:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise SchemaError(f"a batch of {len(prompt)} prompts is not supported: send one "
                              "request per prompt (each becomes its own job)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str) and not prompt:
        raise SchemaError("prompt must not be empty", "prompt")
    text, token_ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
    max_tokens = request.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    job = build_job_request(request, prompt=text, prompt_token_ids=token_ids, messages=None,
                            max_tokens=max_tokens, logprobs=request.logprobs, max_n=max_n)
    return OpenAIRequest(job=job, stream=bool(request.stream), include_usage=include_usage,
                         echo=bool(request.echo), num_logprobs=request.logprobs)


def _chat(request: ChatCompletionRequest, include_usage: bool, max_n: int) -> OpenAIRequest:
    messages = []
    for message in request.messages:
        content = message.content
        if isinstance(content, list):  # OpenAI content parts, flattened to a string
            content = "".join(part.text for part in content)
        item = {"role": message.role, "content": content}
        if message.name is not None:
            item["name"] = message.name
        messages.append(item)
    max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = request.max_tokens
    fill_max_tokens = max_tokens is None
    if max_tokens is None:
        # a placeholder that passes validation; the real budget needs the prompt length
        max_tokens = max(request.min_tokens or 1, 1)
    num_logprobs: int | None = None
    if request.logprobs:
        num_logprobs = request.top_logprobs or 0
    elif request.top_logprobs is not None:
        raise SchemaError("top_logprobs needs logprobs: true", "top_logprobs")
    try:
        job = build_job_request(request, prompt=None, prompt_token_ids=None, messages=messages,
                                max_tokens=max_tokens, logprobs=num_logprobs, max_n=max_n)
    except SchemaError as exc:
        if exc.param == "logprobs":
            # chat names the count top_logprobs (logprobs is its on/off switch)
            raise SchemaError(exc.message.replace("logprobs", "top_logprobs", 1),
                              "top_logprobs") from None
        raise
    return OpenAIRequest(job=job, stream=bool(request.stream), include_usage=include_usage,
                         echo=False, num_logprobs=num_logprobs, fill_max_tokens=fill_max_tokens)


def _reject_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    if isinstance(request, CompletionRequest):
        if request.suffix:
            raise SchemaError("suffix (insertion) is not supported; put all text in the "
                              "prompt", "suffix")
        if request.best_of is not None and request.best_of != (request.n or 1):
            raise SchemaError("best_of is not supported (only best_of == n); use n for "
                              "several samples and choose among them yourself", "best_of")
    if request.logit_bias:
        raise SchemaError("logit_bias is not supported", "logit_bias")
    if isinstance(request, ChatCompletionRequest):
        for name in ("tools", "functions"):
            if getattr(request, name):
                raise SchemaError(f"{name} (tool calling) is not supported", name)


# --- responses -------------------------------------------------------------------------


@dataclass(slots=True)
class ChoiceLogprobs:
    """Logprobs of one choice, accumulated over token events (token ids and floats)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # best first

    def extend(self, payload: list[dict[str, Any]] | None) -> None:
        for item in payload or []:
            self.token_ids.append(int(item["token_id"]))
            self.logprobs.append(float(item["logprob"]))
            self.top.append([(int(t), float(lp)) for t, lp in item.get("top", [])])


def completion_logprobs(lp: ChoiceLogprobs, decode: Any, text_offset: int) -> dict[str, Any]:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset.

    `decode(token_id) -> str`; `text_offset` is where the first token starts in the text.
    """
    tokens = [decode(t) for t in lp.token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    top = [{decode(t): value for t, value in entries} for entries in lp.top]
    return {"tokens": tokens, "token_logprobs": list(lp.logprobs), "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(lp: ChoiceLogprobs, decode: Any) -> dict[str, Any]:
    """OpenAI chat logprobs: {content: [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for token_id, value, top in zip(lp.token_ids, lp.logprobs, lp.top):
        token = decode(token_id)
        content.append({
            "token": token, "logprob": value, "bytes": list(token.encode("utf-8")),
            "top_logprobs": [{"token": decode(t), "logprob": v,
                              "bytes": list(decode(t).encode("utf-8"))} for t, v in top],
        })
    return {"content": content}
