"""`Sequence`: one sample of one request — its token ids, progress and status.

A request with `n` samples becomes `n` sequences that share the prompt. The scheduler
moves sequences between queues; the engine reads their tokens to build deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from tasks.params import SamplingParams
from workers.engine.outputs import FinishReason
from workers.engine.step_io import TokenLogprobs

if TYPE_CHECKING:
    from workers.engine.detokenizer import IncrementalDetokenizer
    from workers.engine.structured.sequence_grammar import SequenceGrammar


class SequenceStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again after its KV blocks were taken back (recompute)
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5
    # waiting, while a KV connector looks its prefix up (workers/engine/kv_connector.py);
    # the scheduler skips it until the lookup finishes
    WAITING_FOR_REMOTE_KVS = 6
    # its request failed on its own: a model step that ran it alone raised
    FINISHED_ERROR = 7
    # waiting, while its structured-output grammar compiles (workers/engine/structured/);
    # the scheduler skips it until the grammar is ready
    WAITING_FOR_GRAMMAR = 8

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.CANCELLED,
    SequenceStatus.FINISHED_ERROR: FinishReason.ERROR,
}
_FINISHED = frozenset(_FINISH_REASONS)


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # sample index within the request, 0 <= index < params.n
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first
    arrival: int = 0  # engine-wide arrival counter; earlier runs first among equal priority
    output_token_ids: list[int] = field(default_factory=list)
    # prompt + output, kept as one list so a chunk is a slice and the KV manager hashes it
    token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # tokens whose KV is in the cache (or being written this step); catches up to num_tokens
    num_computed_tokens: int = 0
    # prompt tokens served from the prefix cache at first admission
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # the KV block table last returned by the manager (read-only here); empty when the
    # sequence holds no blocks (waiting, preempted, finished)
    block_table: list[int] = field(default_factory=list)
    admitted: bool = False  # scheduled at least once
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    detokenizer: IncrementalDetokenizer | None = None
    # set while the sequence is suspected of failing a step: it then runs alone until its
    # num_computed_tokens passes this position (the end of the chunk that failed)
    suspect_until: int | None = None
    num_failed_steps: int = 0  # model steps it was in that raised
    # its constraint's matcher (params.structured_outputs); None for free text
    grammar: SequenceGrammar | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Queue order: priority, then preempted before fresh, then arrival.

        NOTE: a waiting sequence's key must not change while it is queued: one that waits
        for a lookup after a preemption still sorts as preempted.
        """
        status = self.status
        preempted = status == SequenceStatus.PREEMPTED or (
            status == SequenceStatus.WAITING_FOR_REMOTE_KVS and self.num_preemptions > 0)
        fresh = 0 if preempted else 1
        return (self.priority, fresh, self.arrival)

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprobs)
