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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tasks.models import JobKind
from tasks.schema import JobRequest, SchemaError, parse_job_request

# passed through to the job schema as they are (OpenAI names and the extra fields serving
# benchmarks send)
PASSTHROUGH_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                      "stop_token_ids", "ignore_eos", "min_tokens", "n", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "priority")
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                            "skip_special_tokens", "spaces_between_special_tokens"})
OWN_FIELDS = {
    JobKind.COMPLETION: frozenset({"prompt", "max_tokens", "logprobs", "echo", "stream",
                                   "stream_options", "suffix", "best_of", "logit_bias"}),
    JobKind.CHAT: frozenset({"messages", "max_tokens", "max_completion_tokens", "logprobs",
                             "top_logprobs", "stream", "stream_options", "logit_bias", "tools",
                             "tool_choice", "functions", "function_call", "response_format"}),
}
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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
    allowed = set(PASSTHROUGH_FIELDS) | OWN_FIELDS[kind] | IGNORED_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise SchemaError(f"unknown field {unknown[0]!r} for this endpoint; supported fields: "
                          f"{', '.join(sorted(allowed - IGNORED_FIELDS))}", unknown[0])
    _reject_unsupported(body, kind)
    job_body = {name: body[name] for name in PASSTHROUGH_FIELDS if body.get(name) is not None}
    stream = _bool(body, "stream")
    include_usage = False
    if body.get("stream_options") is not None:
        options = body["stream_options"]
        if not isinstance(options, dict) or set(options) - {"include_usage",
                                                             "continuous_usage_stats"}:
            raise SchemaError("stream_options must be an object like {\"include_usage\": true}",
                              "stream_options")
        if not stream:
            raise SchemaError("stream_options is only allowed with stream: true",
                              "stream_options")
        include_usage = _bool(options, "include_usage", "stream_options.include_usage")
    num_logprobs: int | None = None
    fill_max_tokens = False
    echo = False
    if kind is JobKind.COMPLETION:
        job_body["prompt"] = _single_prompt(body.get("prompt"))
        job_body["max_tokens"] = body.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
        if job_body["max_tokens"] is None:
            job_body["max_tokens"] = DEFAULT_COMPLETION_MAX_TOKENS
        if body.get("logprobs") is not None:
            job_body["logprobs"] = num_logprobs = body["logprobs"]
        echo = _bool(body, "echo")
    else:
        job_body["messages"] = _messages(body.get("messages"))
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is None:
            fill_max_tokens = True
            # a placeholder that passes validation; the real budget needs the prompt length
            min_tokens = body.get("min_tokens")
            max_tokens = min_tokens if isinstance(min_tokens, int) and min_tokens > 1 else 1
        job_body["max_tokens"] = max_tokens
        if _bool(body, "logprobs"):
            top = body.get("top_logprobs")
            job_body["logprobs"] = num_logprobs = 0 if top is None else top
        elif body.get("top_logprobs") is not None:
            raise SchemaError("top_logprobs needs logprobs: true", "top_logprobs")
    try:
        job = parse_job_request(job_body, max_n=max_n)
    except SchemaError as exc:
        if kind is JobKind.CHAT and exc.param == "logprobs":
            # chat names the count top_logprobs (logprobs is its on/off switch)
            raise SchemaError(exc.message.replace("logprobs", "top_logprobs", 1),
                              "top_logprobs") from None
        raise
    return OpenAIRequest(job=job, stream=stream, include_usage=include_usage, echo=echo,
                         num_logprobs=num_logprobs, fill_max_tokens=fill_max_tokens)


def _reject_unsupported(body: dict[str, Any], kind: JobKind) -> None:
    if body.get("suffix"):
        raise SchemaError("suffix (insertion) is not supported; put all text in the prompt",
                          "suffix")
    if body.get("best_of") is not None and body["best_of"] != body.get("n", 1):
        raise SchemaError("best_of is not supported (only best_of == n); use n for several "
                          "samples and choose among them yourself", "best_of")
    if body.get("logit_bias"):
        raise SchemaError("logit_bias is not supported", "logit_bias")
    for name in ("tools", "functions"):
        if body.get(name):
            raise SchemaError(f"{name} (tool calling) is not supported", name)
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict)
                                        or response_format.get("type") != "text"):
        raise SchemaError("only response_format {\"type\": \"text\"} is supported",
                          "response_format")


def _bool(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise SchemaError(f"{param or name} must be true or false", param or name)
    return value


def _single_prompt(prompt: Any) -> Any:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise SchemaError(f"a batch of {len(prompt)} prompts is not supported: send one "
                              "request per prompt (each becomes its own job)", "prompt")
        return prompt[0]
    return prompt


def _messages(messages: Any) -> Any:
    """OpenAI content parts ([{type: text, text}]) flattened to a string."""
    if not isinstance(messages, list):
        return messages
    flat = []
    for i, message in enumerate(messages):
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            texts = []
            for part in message["content"]:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise SchemaError(f"messages[{i}].content: only text parts are supported",
                                      f"messages[{i}].content")
                texts.append(part["text"])
            message = {**message, "content": "".join(texts)}
        flat.append(message)
    return flat


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


def usage_dict(usage: dict[str, int] | None) -> dict[str, Any]:
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens", 0))
    completion = int(usage.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(usage.get("cached_tokens", 0))}}


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
