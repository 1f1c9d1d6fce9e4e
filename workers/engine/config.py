"""Engine knobs, engine figures, and the error for a request that can never fit."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # sequences (samples) running at once
    max_num_batched_tokens: int = 2048  # tokens computed per step, prompt chunks + decodes
    max_model_len: int | None = None  # None: the checkpoint's context length
    long_prefill_token_threshold: int = 0  # cap on one sequence's chunk per step; 0: no cap
    enable_prefix_caching: bool = True
    # priority values >= this (they run after the others) form a background band: it sits
    # out the steps that carry a foreground prompt chunk (priority_bands.py); None: no band
    background_priority: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the setting and what it must be."""
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 or None, got {self.max_model_len}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0 disables the cap), "
                f"got {self.long_prefill_token_threshold}"
            )


@dataclass(slots=True)
class EngineStats:
    num_running: int  # sequences
    num_waiting: int  # sequences, including samples waiting for their prompt's blocks
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    num_preemptions: int  # total since start
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found
    prompt_tokens_total: int  # prompt tokens of admitted requests
    generation_tokens_total: int  # tokens sampled
    num_steps: int
    # background-only steps stopped between layers for a foreground request (set_step_yield)
    num_interrupted_steps: int = 0


class PromptTooLongError(ValueError):
    """The prompt plus max_tokens does not fit the model's context (never truncated)."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        super().__init__(
            f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
            f"{num_prompt_tokens + max_tokens} > max_model_len {max_model_len}; "
            "shorten the prompt or lower max_tokens"
        )
