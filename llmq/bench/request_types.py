"""What one benchmark request is sent with and what its timing came out as."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class RequestInput:
    """One request as a backend sends it."""

    prompt: str
    api_url: str  # the full endpoint URL (base URL + --endpoint)
    prompt_len: int  # tokens, as the dataset estimated them; usage.prompt_tokens overrides
    output_len: int  # max tokens to generate
    model: str
    ignore_eos: bool = False
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)  # sampling params, merged last


@dataclass(slots=True)
class RequestOutput:
    """One request's outcome; times in seconds of `time.perf_counter()`."""

    success: bool = False
    generated_text: str = ""
    latency: float = 0.0  # E2EL: send -> last content chunk
    output_tokens: int = 0  # usage.completion_tokens (0 when the server sent no usage)
    ttft: float = 0.0  # send -> first content chunk
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    prompt_len: int = 0  # usage.prompt_tokens when the server sent it
    error: str = ""
    start_time: float = 0.0  # perf_counter() when the request was sent
    num_chunks: int = 0  # content chunks: the output length when no usage came back


class RequestFunc(Protocol):
    """Sends one request, streams its answer and times it. Never raises: a failure is
    an output with `success=False` and `error` set."""

    def __call__(self, request: RequestInput) -> RequestOutput: ...
