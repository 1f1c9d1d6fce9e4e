"""What the engine returns each step: per-sample deltas, plain data."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from workers.engine.step_io import TokenLogprobs


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(slots=True)
class CompletionDelta:
    """What one sample of one request produced in one step."""

    request_id: str
    index: int  # sample index, 0 <= index < params.n
    new_token_ids: list[int]
    text: str  # text delta; never half a multi-byte character, never a held-back stop prefix
    logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int  # total so far
    num_cached_tokens: int  # prompt tokens served from the prefix cache (device or tier)
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None  # why, when finish_reason is ERROR
    # the ERROR is the request's own doing (its grammar did not compile), not the service's
    caused_by_request: bool = False
    extra: dict[str, float] = field(default_factory=dict)
