"""Per-request sampling parameters (`SamplingParams`): the API validates with them, the
workers sample with them, and the offline API re-exports them.

Plain data, no torch: the same object travels from the job schema to the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0.0 means greedy
    top_p: float = 1.0  # (0, 1]; 1.0 disables
    top_k: int = 0  # 0 disables
    min_p: float = 0.0  # [0, 1]; 0.0 disables
    seed: int | None = None  # same seed -> same tokens, whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # excluded from the returned text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS / stop token ids are not honoured before this many tokens
    n: int = 1  # number of samples sharing the prompt
    presence_penalty: float = 0.0  # [-2, 2], OpenAI semantics
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI semantics
    repetition_penalty: float = 1.0  # > 0, HF/CTRL semantics over prompt and output tokens
    logprobs: int | None = None  # top-n logprobs per sampled token; None disables

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the field and its allowed range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
