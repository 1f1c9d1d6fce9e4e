"""OpenAI request bodies -> job requests, and job output -> OpenAI response objects.

Pure functions over plain values (no Flask, no Redis), so the views in `openai_api.py`
stay about flow. Shapes follow OpenAI's `/v1/completions` and `/v1/chat/completions`.

Choices made here:
* `prompt` is one prompt: a string, a list of token ids, or a one-element list of either.
  A batch of several prompts is rejected (400): send one request per prompt (each is a
  job of its own; `n` gives several samples of one prompt).
* One constraint per request: `response_format` (`json_object`, `json_schema`),
  `structured_outputs`, a `guided_*` field, or `tool_choice` `required` / a named function
  (which decode under the tools' schema, `webapp/tool_calls.py`); two are a 400 naming
  both. The constraint is checked here (`tasks.structured`), before the job exists.
* Fields that would change the meaning of a request but are not implemented (`suffix`,
  `best_of` != `n`, `logit_bias`, legacy `functions`) are a 400, never ignored.
  Bookkeeping fields clients commonly send (`user`, `metadata`...) are ignored.
* Shapes and types are the models' of `tasks.api.openai`; this module adds what spans
  fields and maps OpenAI's names onto the job's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, cast

from tasks.api.openai import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
)
from tasks.models import JobKind
from tasks.schema import JobRequest, SchemaError, build_job_request, validate_body
from tasks.structured import InvalidStructuredOutputsError, StructuredOutputs
from webapp.tool_calls import ToolMode, ToolPlan

REQUEST_MODELS: dict[JobKind, type[CompletionRequest] | type[ChatCompletionRequest]] = {
    JobKind.COMPLETION: CompletionRequest, JobKind.CHAT: ChatCompletionRequest}


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
    tools: ToolPlan | None = None  # chat with tools: how to render, decode and answer


def parse_openai_request(body: Any, kind: JobKind, *, max_n: int) -> OpenAIRequest:
    """Validate an OpenAI body; raises SchemaError naming the field."""
    request = validate_body(REQUEST_MODELS[kind], body)
    _reject_unsupported(request)
    if request.stream_options is not None and not request.stream:
        raise SchemaError("stream_options is only allowed with stream: true", "stream_options")
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    tools = _tool_plan(request) if isinstance(request, ChatCompletionRequest) else None
    if isinstance(request, CompletionRequest):
        parsed = _completion(request, include_usage, max_n)
    else:
        parsed = _chat(request, include_usage, max_n)
    parsed.tools = tools
    parsed.job.params.structured_outputs = constraint_of(request, tools)
    return parsed


def constraint_of(request: CompletionRequest | ChatCompletionRequest,
                  tools: ToolPlan | None = None) -> StructuredOutputs | None:
    """The request's one constraint, checked; SchemaError naming the field (both fields
    when two are given)."""
    given: list[tuple[str, dict[str, Any]]] = []
    if request.structured_outputs is not None:
        given.append(("structured_outputs", request.structured_outputs.as_dict()))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(request, name) is not None:
            given.append((name, {key: getattr(request, name)}))
    response_format = request.response_format
    if isinstance(response_format, ResponseFormatJsonObject):
        given.append(("response_format", {"json_object": True}))
    elif isinstance(response_format, ResponseFormatJsonSchema):
        schema = response_format.json_schema.schema_
        given.append(("response_format", {"json_object": True} if schema is None
                      else {"json": schema}))
    if tools is not None and tools.schema() is not None:
        given.append(("tool_choice", {"json": tools.schema()}))
    if len(given) > 1:
        raise SchemaError(f"give one constraint per request, got {given[0][0]} and "
                          f"{given[1][0]}", given[1][0])
    if not given:
        return None
    name, spec = given[0]
    return structured_outputs(spec, name)


# how each source names the field a constraint's message speaks of
_SPEC_NAMES = {"response_format": "response_format.json_schema.schema",
               "guided_json": "guided_json", "guided_regex": "guided_regex",
               "guided_choice": "guided_choice", "guided_grammar": "guided_grammar"}


def structured_outputs(spec: dict[str, Any], param: str) -> StructuredOutputs:
    """`StructuredOutputs(**spec)`, or a SchemaError naming `param` (its message names the
    field as the client sent it)."""
    try:
        return StructuredOutputs(**spec)
    except InvalidStructuredOutputsError as exc:
        message = str(exc)
        if param in _SPEC_NAMES:
            message = re.sub(r"^structured_outputs\.[a-z_]+", _SPEC_NAMES[param], message)
        raise SchemaError(message, param) from None


def _tool_plan(request: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tools and tool_choice checked: names unique, each parameters schema
    usable, a named choice among the tools. None without tools."""
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice not in ("none", "auto"):
            raise SchemaError("tool_choice requires tools", "tool_choice")
        return None
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
    seen: set[str] = set()
    for i, tool in enumerate(request.tools):
        function = tool.function
        if function.name in seen:
            raise SchemaError(f"tools[{i}].function.name {function.name!r} is given twice",
                              f"tools[{i}].function.name")
        seen.add(function.name)
        if function.parameters is not None:
            where = f"tools[{i}].function.parameters"
            try:
                StructuredOutputs(json=function.parameters)
            except InvalidStructuredOutputsError as exc:
                raise SchemaError(re.sub(r"^structured_outputs\.json", where, str(exc)),
                                  where) from None
    parallel = request.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        return ToolPlan(ToolMode.AUTO, tools, parallel=parallel)
    if choice == "none":
        return ToolPlan(ToolMode.NONE, tools)
    if choice == "required":
        return ToolPlan(ToolMode.REQUIRED, tools, parallel=parallel)
    name = choice.function.name
    if name not in seen:
        raise SchemaError(f"tool_choice names function {name!r}, which is not among the "
                          f"tools ({', '.join(sorted(seen))})", "tool_choice")
    return ToolPlan(ToolMode.NAMED, tools, named=name)


def _completion(request: CompletionRequest, include_usage: bool, max_n: int) -> OpenAIRequest:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise SchemaError(f"a batch of {len(prompt)} prompts is not supported: send one "
                              "request per prompt (each becomes its own job)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str) and not prompt:
        raise SchemaError("prompt must not be empty", "prompt")
    # NOTE: a list left here is token ids (a list of prompts was unwrapped above)
    text, token_ids = ((prompt, None) if isinstance(prompt, str)
                       else (None, cast(list[int], list(prompt))))
    max_tokens = request.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    job = build_job_request(request, prompt=text, prompt_token_ids=token_ids, messages=None,
                            max_tokens=max_tokens, logprobs=request.logprobs, max_n=max_n)
    return OpenAIRequest(job=job, stream=bool(request.stream), include_usage=include_usage,
                         echo=bool(request.echo), num_logprobs=request.logprobs)


def _chat(request: ChatCompletionRequest, include_usage: bool, max_n: int) -> OpenAIRequest:
    messages = []
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, list):  # OpenAI content parts, flattened to a string
            content = "".join(part.text for part in content)
        if message.tool_calls is not None and message.role != "assistant":
            raise SchemaError("only assistant messages carry tool_calls",
                              f"messages[{i}].tool_calls")
        if content is None and not message.tool_calls:
            raise SchemaError(f"messages[{i}].content is required (it may be null only on "
                              "an assistant message with tool_calls)", f"messages[{i}].content")
        if message.role == "tool" and message.tool_call_id is None:
            raise SchemaError(f"messages[{i}].tool_call_id is required on a tool message",
                              f"messages[{i}].tool_call_id")
        item: dict[str, Any] = {"role": message.role, "content": content}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
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
    if isinstance(request, ChatCompletionRequest) and request.functions:
        raise SchemaError("functions (the legacy form of tool calling) is not supported; "
                          "send tools", "functions")


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
