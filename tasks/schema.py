"""The job request schema: JSON body -> `JobRequest`, or a `SchemaError` naming the field.

Strict on types (a bool is not an integer, a string is not a number) so a client's mistake
is reported instead of silently coerced. Model-dependent checks (does the model exist, does
the prompt fit its context) happen where the tokenizer is, in the web layer, which then
runs `JobRequest.check` against the model's limits (vocabulary, sampling ranges).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from tasks.models import JobKind
from tasks.params import (
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    InvalidParamError,
    ModelLimits,
    SamplingParams,
    check_token_ids,
    text_problem,
)

MAX_MESSAGES = 1024
PRIORITY_RANGE = (-1_000_000, 1_000_000)  # lower runs first
MESSAGE_ROLES = ("system", "user", "assistant", "tool")

_INT_FIELDS = ("max_tokens", "top_k", "n", "min_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
ALLOWED_FIELDS = frozenset(_SAMPLING_FIELDS | {"model", "prompt", "messages", "priority"})


class SchemaError(ValueError):
    """A request field is missing, of the wrong type or out of range."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @classmethod
    def from_invalid_param(cls, exc: InvalidParamError) -> SchemaError:
        """The request field of a parameter error (`stop_token_ids[3]` is field
        `stop_token_ids`; the message keeps the element)."""
        return cls(str(exc), exc.param.split("[", 1)[0])


@dataclass(slots=True)
class JobRequest:
    model: str
    kind: JobKind
    prompt: str | None  # completion text (kind == COMPLETION and not token ids)
    prompt_token_ids: list[int] | None  # completion given as token ids
    messages: list[dict[str, str]] | None  # chat (kind == CHAT)
    params: SamplingParams
    priority: int  # lower runs first

    def params_dict(self) -> dict[str, Any]:
        """The `jobs.params` column: `SamplingParams(**params_dict())` rebuilds it."""
        return asdict(self.params)

    def check(self, limits: ModelLimits, prompt_token_ids: list[int]) -> None:
        """The job against the served model: its sampling parameters and its prompt token
        ids, given or tokenized (a tokenizer may know more tokens than the model's
        embedding has rows). Raises SchemaError naming the field."""
        try:
            check_token_ids(prompt_token_ids, "messages" if self.messages else "prompt",
                            limits.vocab_size)
            self.params.check(limits)
        except InvalidParamError as exc:
            raise SchemaError.from_invalid_param(exc) from None


def parse_job_request(body: Any, *, max_n: int) -> JobRequest:
    """Validate a decoded JSON body; raises SchemaError on the first problem found."""
    if not isinstance(body, dict):
        raise SchemaError("the request body must be a JSON object")
    unknown = sorted(set(body) - ALLOWED_FIELDS)
    if unknown:
        raise SchemaError(f"unknown field {unknown[0]!r}; allowed fields: "
                          f"{', '.join(sorted(ALLOWED_FIELDS))}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise SchemaError("model is required: the name of a served model (GET /v1/models)",
                          "model")
    _text(model, "model")
    prompt, prompt_token_ids, messages = _parse_prompt(body)
    sampling: dict[str, Any] = {}
    for name in _INT_FIELDS:
        if body.get(name) is not None:
            sampling[name] = _int(body, name)
    for name in _FLOAT_FIELDS:
        if body.get(name) is not None:
            sampling[name] = _float(body, name)
    if body.get("seed") is not None:
        sampling["seed"] = _int(body, "seed", low=0, high=MAX_SEED)
    if body.get("logprobs") is not None:
        sampling["logprobs"] = _int(body, "logprobs")
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise SchemaError("ignore_eos must be true or false", "ignore_eos")
        sampling["ignore_eos"] = body["ignore_eos"]
    if body.get("stop") is not None:
        sampling["stop"] = _stop(body["stop"])
    if body.get("stop_token_ids") is not None:
        sampling["stop_token_ids"] = _token_ids(body["stop_token_ids"], "stop_token_ids",
                                                allow_empty=True)
    if sampling.get("n", 1) > max_n:
        raise SchemaError(f"n must be between 1 and {max_n} on this server, got {sampling['n']}",
                          "n")
    try:
        params = SamplingParams(**sampling)
    except InvalidParamError as exc:
        raise SchemaError.from_invalid_param(exc) from None
    priority = 0
    if body.get("priority") is not None:
        priority = _int(body, "priority", *PRIORITY_RANGE)
    kind = JobKind.CHAT if messages is not None else JobKind.COMPLETION
    return JobRequest(model=model, kind=kind, prompt=prompt, prompt_token_ids=prompt_token_ids,
                      messages=messages, params=params, priority=priority)


def _parse_prompt(body: dict[str, Any]) -> tuple[str | None, list[int] | None,
                                                 list[dict[str, str]] | None]:
    has_prompt = body.get("prompt") is not None
    has_messages = body.get("messages") is not None
    if has_prompt == has_messages:
        raise SchemaError("give exactly one of prompt (completion) or messages (chat)",
                          "prompt" if has_prompt else "messages")
    if has_prompt:
        prompt = body["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise SchemaError("prompt must not be empty", "prompt")
            return _text(prompt, "prompt"), None, None
        if isinstance(prompt, list):
            return None, _token_ids(prompt, "prompt", allow_empty=False), None
        raise SchemaError("prompt must be a string or a list of token ids", "prompt")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise SchemaError("messages must be a non-empty list of {role, content} objects",
                          "messages")
    if len(messages) > MAX_MESSAGES:
        raise SchemaError(f"at most {MAX_MESSAGES} messages per job", "messages")
    parsed: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise SchemaError(f"{param} must be an object with role and content", param)
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise SchemaError(f"{param} has unknown field {min(extra)!r}", param)
        role, content = message.get("role"), message.get("content")
        if role not in MESSAGE_ROLES:
            raise SchemaError(f"{param}.role must be one of {', '.join(MESSAGE_ROLES)}",
                              f"{param}.role")
        if not isinstance(content, str):
            raise SchemaError(f"{param}.content must be a string", f"{param}.content")
        item = {"role": role, "content": _text(content, f"{param}.content")}
        if message.get("name") is not None:
            if not isinstance(message["name"], str):
                raise SchemaError(f"{param}.name must be a string", f"{param}.name")
            item["name"] = _text(message["name"], f"{param}.name")
        parsed.append(item)
    return None, None, parsed


def _int(body: dict[str, Any], name: str, low: int | None = None, high: int | None = None) -> int:
    value = body[name]
    # NOTE: bool is a subclass of int in Python; true is not a token count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(f"{name} must be an integer, got {_json_type(value)}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise SchemaError(f"{name} must be between {low} and {high}, got {value}", name)
    return value


def _float(body: dict[str, Any], name: str) -> float:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SchemaError(f"{name} must be a number, got {_json_type(value)}", name)
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float's range
        raise SchemaError(f"{name} is out of range", name) from None
    if not math.isfinite(number):
        raise SchemaError(f"{name} must be a finite number", name)
    return number


def _stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise SchemaError("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise SchemaError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise SchemaError(f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters",
                          "stop")
    return [_text(s, "stop") for s in stops]


def _text(value: str, name: str) -> str:
    problem = text_problem(value)
    if problem is not None:
        raise SchemaError(f"{name} must not contain {problem}", name)
    return value


def _token_ids(value: Any, name: str, *, allow_empty: bool) -> list[int]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise SchemaError(f"{name} must be a {'' if allow_empty else 'non-empty '}list of "
                          "token ids", name)
    for token_id in value:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise SchemaError(f"{name} must hold non-negative integer token ids, "
                              f"got {token_id!r}", name)
    return list(value)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, list):
        return "an array"
    return "an object"
