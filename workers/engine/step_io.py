"""The contract between the scheduler and the model runner: plain data, no tensors.

The scheduler fills a `SchedulerOutput` each step; the runner turns it into ONE forward
pass over every scheduled token (prompt chunks and decodes together, flattened) and
returns a `ModelRunnerOutput` with one sampled token per sequence whose prompt is complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tasks.params import SamplingParams


@dataclass(slots=True)
class ScheduledSequence:
    seq_id: int
    token_ids: list[int]  # the tokens computed this step, at positions start_pos.. (a chunk)
    start_pos: int  # == the sequence's num_computed_tokens before this step
    block_table: list[int]  # KV block ids covering positions [0, start_pos + len(token_ids))
    # True when this chunk reaches the sequence's last token: sample one token after it.
    sample: bool
    params: SamplingParams
    # NOTE: references to the sequence's own lists (not copies); the runner only reads them.
    prompt_token_ids: list[int]  # for repetition penalty
    output_token_ids: list[int]  # for penalties, and seeded sampling (the seed stream
    # of a sequence is indexed by len(output_token_ids), so preemption and batching
    # never change which random numbers a seeded sequence draws)


@dataclass(slots=True)
class GrammarBitmask:
    """The allowed next tokens of the step's constrained sequences.

    NOTE: the one array that crosses the engine -> runner boundary. A constrained row
    allows a few hundred to a few thousand tokens of the vocabulary; Python lists of
    them per row per step would cost more than the step's sampling. Bit j of word w of a
    row allows token 32 * w + j.
    """

    seq_ids: list[int]  # row i constrains sequence seq_ids[i] (each samples this step)
    bitmask: np.ndarray  # [len(seq_ids), ceil(vocab / 32)] int32


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    num_batched_tokens: int  # sum of len(token_ids)
    preempted_seq_ids: list[int] = field(default_factory=list)
    # blocks to fill from a KV tier before the forward pass: (block_id, blob) pairs
    blocks_to_load: list[tuple[int, bytes]] = field(default_factory=list)
    # the token bitmask of the constrained sequences that sample this step (the engine's
    # structured-output manager fills it after scheduling); only the sampler reads it
    grammar_bitmask: GrammarBitmask | None = None


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first, len == params.logprobs


@dataclass(slots=True)
class ModelRunnerOutput:
    seq_ids: list[int]  # the sequences that sampled this step, in scheduled order
    sampled_token_ids: list[int]  # one per entry of seq_ids
    logprobs: list[TokenLogprobs | None]  # one per entry of seq_ids; None when not asked
