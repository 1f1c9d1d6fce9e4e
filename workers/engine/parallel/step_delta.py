"""Each step's input to the other TP ranks as a delta against what they already hold.

In the manner of vLLM v1's `NewRequestData` / `CachedRequestData`: rank 0's
`StepEncoder` remembers what it has told the ranks about each sequence, and each rank's
`StepDecoder` holds the same (block table, next position, params) by seq_id. A step then
carries a sequence the ranks do not hold as a `NewSequence` (its chunk, start position,
whole block table, params), and one they hold as a `CachedSequence` (its chunk — one
sampled token when decoding — and the block ids appended to its table since its last
step). The decoder rebuilds exactly the `SchedulerOutput` the rank's `ModelRunner` took
before deltas (token histories empty: the ranks never sample), so model code is unchanged.

Rules both sides follow (the encoder decides, the message says it, the decoder obeys):
* A held sequence is sent as a `CachedSequence` only when nothing but appending changed:
  this step starts where its last chunk ended, its old block table is a prefix of the new
  one, and its params are the same object. Anything else — a sequence resumed after
  preemption (recomputed from position 0 in fresh blocks), a table rewritten in place —
  is sent whole again as a `NewSequence`.
* The ranks hold exactly the sequences of the last step: a held sequence the step does
  not schedule (finished, aborted, preempted, or left out by the token budget) is named
  in `dropped_seq_ids` and forgotten; if it comes back it is sent whole. (The runner
  protocol does not tell rank 0 which sequences finished; this bounds every cache by
  `max_num_seqs` without it.)
* `step_index` counts the messages; a decoder that sees a gap, a `CachedSequence` it
  does not hold, or a drop of one it does not hold raises `StepDeltaError` (the rank then
  fails and the group stops: it never runs a forward on a guessed block table).
* `StepEncoder.reset()` forgets everything: the next delta has `reset=True`, every
  sequence in it is new, and the decoder clears its cache first. The driver resets after
  any step that raised, when it cannot know which ranks received the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.params import SamplingParams
from workers.engine.step_io import ScheduledSequence, SchedulerOutput


class StepDeltaError(RuntimeError):
    """A rank's cache of sequences disagrees with rank 0's view: the rank must not run
    the step."""


@dataclass(slots=True)
class NewSequence:
    """A sequence the ranks do not hold: everything their forward reads of it."""

    seq_id: int
    token_ids: list[int]  # this step's chunk, at positions start_pos..
    start_pos: int
    block_table: list[int]  # the whole table: KV block ids covering [0, start_pos + chunk)
    sample: bool
    params: SamplingParams


@dataclass(slots=True)
class CachedSequence:
    """A sequence the ranks hold, scheduled again where its last chunk ended."""

    seq_id: int
    token_ids: list[int]  # this step's chunk (one sampled token when decoding)
    new_block_ids: list[int]  # appended to the held block table; usually empty
    sample: bool


@dataclass(slots=True)
class StepDelta:
    """One step for the ranks; `StepDecoder.decode` turns it back into the step."""

    step_index: int  # 0, 1, 2, ... per encoder: a gap means a lost message
    reset: bool  # forget every held sequence before applying this step
    dropped_seq_ids: list[int]  # held sequences this step does not schedule: forget them
    scheduled: list[NewSequence | CachedSequence]  # in SchedulerOutput.scheduled order
    num_batched_tokens: int  # == SchedulerOutput.num_batched_tokens
    preempted_seq_ids: list[int]  # == SchedulerOutput.preempted_seq_ids


@dataclass(slots=True)
class HeldSequence:
    """What both sides remember of a sequence between its steps."""

    block_table: list[int]  # never mutated: appending makes a new list
    next_pos: int  # where its next chunk starts if nothing but appending changes
    params: SamplingParams


class StepEncoder:
    """Rank 0's side: what the ranks hold, and the delta that brings them to a step."""

    def __init__(self) -> None:
        self._held: dict[int, HeldSequence] = {}
        self._next_index = 0
        self._reset = False

    @property
    def num_held(self) -> int:
        return len(self._held)

    def reset(self) -> None:
        """Forget what the ranks hold: the next delta resets them and sends all whole."""
        self._held = {}
        self._reset = True

    def encode(self, out: SchedulerOutput) -> StepDelta:
        """The delta of `out` against the previous step; assumes every rank receives it
        (call `reset` when that is not certain). `out.blocks_to_load` is not included:
        the driver sends each rank its own slabs."""
        held = self._held
        now: dict[int, HeldSequence] = {}
        entries: list[NewSequence | CachedSequence] = []
        for seq in out.scheduled:
            if seq.seq_id in now:
                raise ValueError(f"sequence {seq.seq_id} is scheduled twice in one step")
            table = seq.block_table
            prev = held.get(seq.seq_id)
            if (prev is not None and prev.next_pos == seq.start_pos
                    and prev.params is seq.params and _extends(table, prev.block_table)):
                entries.append(CachedSequence(seq.seq_id, seq.token_ids,
                                              table[len(prev.block_table):], seq.sample))
            else:
                entries.append(NewSequence(seq.seq_id, seq.token_ids, seq.start_pos, table,
                                           seq.sample, seq.params))
            # NOTE: a copy: the comparison next step must not see later edits of the list
            now[seq.seq_id] = HeldSequence(list(table), seq.start_pos + len(seq.token_ids),
                                           seq.params)
        delta = StepDelta(
            step_index=self._next_index,
            reset=self._reset,
            dropped_seq_ids=[seq_id for seq_id in held if seq_id not in now],
            scheduled=entries,
            num_batched_tokens=out.num_batched_tokens,
            preempted_seq_ids=list(out.preempted_seq_ids),
        )
        self._held = now
        self._next_index += 1
        self._reset = False
        return delta


class StepDecoder:
    """A rank's side: the sequences it holds, and the step a delta stands for."""

    def __init__(self) -> None:
        self._held: dict[int, HeldSequence] = {}
        self._next_index = 0

    @property
    def num_held(self) -> int:
        return len(self._held)

    def decode(self, delta: StepDelta,
               blocks_to_load: list[tuple[int, bytes]]) -> SchedulerOutput:
        """The `SchedulerOutput` this rank runs (token histories empty), with
        `blocks_to_load` (this rank's slabs) as its loads. Raises `StepDeltaError` when
        the delta does not apply to what this rank holds."""
        held = self._held
        if delta.reset:
            held.clear()
        elif delta.step_index != self._next_index:
            raise StepDeltaError(f"step {delta.step_index} arrived, expected step "
                                 f"{self._next_index}: a step message was lost")
        for seq_id in delta.dropped_seq_ids:
            if held.pop(seq_id, None) is None:
                raise StepDeltaError(f"step {delta.step_index} drops sequence {seq_id}, "
                                     "which this rank does not hold")
        scheduled: list[ScheduledSequence] = []
        for entry in delta.scheduled:
            if isinstance(entry, NewSequence):
                table, start, params = entry.block_table, entry.start_pos, entry.params
            else:
                prev = held.get(entry.seq_id)
                if prev is None:
                    raise StepDeltaError(f"step {delta.step_index} continues sequence "
                                         f"{entry.seq_id}, which this rank does not hold")
                table, start, params = prev.block_table, prev.next_pos, prev.params
                if entry.new_block_ids:
                    table = table + entry.new_block_ids
            held[entry.seq_id] = HeldSequence(table, start + len(entry.token_ids), params)
            scheduled.append(ScheduledSequence(entry.seq_id, entry.token_ids, start, table,
                                               entry.sample, params, [], []))
        if len(held) != len(scheduled):
            raise StepDeltaError(f"after step {delta.step_index} this rank holds {len(held)} "
                                 f"sequences, the step schedules {len(scheduled)}")
        self._next_index = delta.step_index + 1
        return SchedulerOutput(scheduled, delta.num_batched_tokens,
                               list(delta.preempted_seq_ids), blocks_to_load)


def _extends(table: list[int], old: list[int]) -> bool:
    """True when `old` is a prefix of `table` (blocks were only appended)."""
    n = len(old)
    return len(table) >= n and (table == old if len(table) == n else table[:n] == old)
