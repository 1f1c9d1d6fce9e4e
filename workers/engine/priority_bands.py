"""`PriorityBands`: a background band of priorities that gives way to prompt chunks.

Sequences whose priority is at least `background_priority` (the service sets it to the
Batch API's band) are background; every other sequence is foreground. A step that carries
a foreground sequence's prompt chunk (a new interactive request's prefill, or the
recompute of a preempted one) leaves the running background sequences out, and admits no
waiting background sequence: the prompt chunk then runs about as fast as on an idle
engine, which is what an interactive client's time to first token waits for. The
background sequences lose that one step; they keep their KV blocks and their seats (they
are not preempted), and their tokens are the same, only later.

Seats: a foreground sequence that is ready while every seat is taken takes the seat of
the last running background sequence (`seats_to_free`): that one is preempted by
recompute (its full blocks stay in the prefix cache, so it mostly recomputes its last
partial block when a seat frees) and waits at the front of the background band. So a
group may fill every seat with background work and still start an interactive request
at once.

The decision is taken before the step is built (`defers_background`). Background
sequences never starve: after `MAX_DEFERRED_IN_A_ROW` deferred steps (a long prompt in
chunks, or prompts arriving every step) the next step carries them, and when a deferred
step turned out to carry no foreground prompt chunk after all (no KV room, a lookup in
flight), the next one does not defer either (`step_built`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.step_io import ScheduledSequence

_READY = (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
# deferred steps in a row before one carries the background band again
MAX_DEFERRED_IN_A_ROW = 4
# while background sequences run, waiting ones start together once this many seats are
# free (at most a quarter of the seats; or once all of them fit): see `admits_background`
BACKGROUND_ADMIT_SEATS = 16


class PriorityBands:
    """The scheduler's policy for the background band; `background_priority` None: none."""

    def __init__(self, background_priority: int | None = None, max_num_seqs: int = 0) -> None:
        self.background_priority = background_priority
        # free seats that admit waiting background sequences while others run (1: any)
        self.admit_seats = max(1, min(BACKGROUND_ADMIT_SEATS, max_num_seqs // 4))
        # deferred steps in a row; at MAX_DEFERRED_IN_A_ROW the next step does not defer
        self._num_deferred_in_a_row = 0
        self.num_deferred_steps = 0  # steps that left background sequences out

    def is_background(self, seq: Sequence) -> bool:
        return self.background_priority is not None and seq.priority >= self.background_priority

    def defers_background(self, running: list[Sequence], waiting: list[Sequence],
                          can_admit: Callable[[Sequence], bool]) -> bool:
        """Whether this step leaves background sequences out: a running foreground
        sequence has prompt tokens to compute, or the first waiting foreground sequence
        that may start can be admitted. `running` and `waiting` are sorted by priority."""
        if self.background_priority is None:
            return False
        if self._num_deferred_in_a_row >= MAX_DEFERRED_IN_A_ROW:
            self._num_deferred_in_a_row = 0
            return False
        if not running or not self.is_background(running[-1]):
            return False  # nothing to leave out
        for seq in running:
            if self.is_background(seq):
                break
            if seq.num_tokens - seq.num_computed_tokens > 1:
                return True
        for seq in waiting:
            if self.is_background(seq):
                return False
            if _is_ready(seq):
                return can_admit(seq)
        return False

    def admits_background(self, running: list[Sequence], waiting: Iterable[Sequence],
                          num_free_seats: int) -> bool:
        """Whether this step admits waiting background sequences (`waiting`: the
        background part of the waiting list). While background sequences run, waiting
        ones start together: once `admit_seats` seats are free (a quarter of the seats, at
        most `BACKGROUND_ADMIT_SEATS`), or every ready one fits. Each admission puts prompt
        chunks in a step, and a step with any takes the per-layer path instead of the
        native decoder's one call over every layer: batch lines admitted one or two a
        step as seats free (the served Batch API: each line ends at its own step) made
        nearly every step such a step, 22% more CPU per token than the same lines run in
        waves (`small`, 2,000 lines, AMD EPYC Zen 3, docs/benchmarks.md). A few seats
        wait a few steps instead."""
        if not running or not self.is_background(running[-1]):  # sorted by priority
            return True  # no background work runs: nothing to keep on the decoder
        if num_free_seats >= self.admit_seats:
            return True
        ready = 0
        for seq in waiting:
            if _is_ready(seq):
                ready += 1
                if ready > num_free_seats:
                    return False
        return True  # every ready one fits (a batch's last lines)

    def seats_to_free(self, running: list[Sequence], waiting: list[Sequence],
                      num_free_seats: int) -> list[Sequence]:
        """The running background sequences to preempt so that every ready foreground
        sequence waiting finds a seat: the last ones first (`running` and `waiting` are
        sorted by priority)."""
        if self.background_priority is None:
            return []
        victims: list[Sequence] = []
        last = len(running) - 1
        for seq in waiting:
            if self.is_background(seq):
                break
            if not _is_ready(seq):
                continue
            if num_free_seats > 0:
                num_free_seats -= 1
                continue
            if last < 0 or not self.is_background(running[last]):
                break  # every seat holds foreground work: it waits
            victims.append(running[last])
            last -= 1
        return victims

    def step_built(self, deferred: bool, scheduled: list[ScheduledSequence],
                   seqs: dict[int, Sequence]) -> None:
        """After a step was built with `deferred` as decided: count the deferrals in a
        row; one that carried no foreground prompt chunk ends the row at once."""
        if not deferred:
            self._num_deferred_in_a_row = 0
            return
        self.num_deferred_steps += 1
        self._num_deferred_in_a_row += 1
        if not any(_is_prompt_chunk(s) and not self.is_background(seqs[s.seq_id])
                   for s in scheduled if s.seq_id in seqs):
            self._num_deferred_in_a_row = MAX_DEFERRED_IN_A_ROW


def _is_ready(seq: Sequence) -> bool:
    """Whether a waiting sequence could start this step (a seat and blocks given)."""
    return seq.status in _READY or (seq.status == SequenceStatus.WAITING_FOR_GRAMMAR
                                    and seq.grammar is not None and seq.grammar.is_ready)


def _is_prompt_chunk(scheduled: ScheduledSequence) -> bool:
    """A chunk that computes prompt tokens (or recomputes more than the last token)."""
    return (len(scheduled.token_ids) > 1
            or scheduled.start_pos < len(scheduled.prompt_token_ids))
