"""Finding the request that makes a model step raise (policy, used by the `Scheduler`).

When a step of several requests raises, its sequences become suspects: while any waits,
each step runs ONE suspect alone (the others wait), until it has computed past the chunk
that failed. A suspect whose solo step raises again is the culprit, and only its request
fails. A step of one request needs no second run: that request is the culprit. A
sequence in `MAX_FAILED_STEPS` failed steps fails itself, even in company: a fault that
needs a combination of requests is never found by running them alone.

A suspect keeps its blocks (its chunk rewrites their positions) unless the failed step
was loading tier blocks into them: those may be half written, so it recomputes from the
start (preempted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from workers.engine.sequence import Sequence
from workers.engine.step_io import ScheduledSequence

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3


class StepIsolation:
    def __init__(self) -> None:
        self.suspects: set[int] = set()  # seq_ids (Sequence.suspect_until is set)

    def next_alone(self, running: list[Sequence], seqs: dict[int, Sequence],
                   sort_key: Callable[[Sequence], tuple[int, int, int]]) -> Sequence | None:
        """The one sequence this step may run, or None when no suspect waits: a running
        suspect first (part-way through its solo run), else the first in queue order."""
        if not self.suspects:
            return None
        for seq in running:
            if seq.seq_id in self.suspects:
                return seq
        return min((seqs[seq_id] for seq_id in self.suspects), key=sort_key)

    def on_failure(self, failed: list[tuple[Sequence, ScheduledSequence]],
                   loaded_block_ids: set[int],
                   preempt: Callable[[Sequence], None]) -> list[Sequence]:
        """A step of `failed` (each sequence with its chunk) raised. Returns the culprits,
        or none, and then every sequence of the step is a suspect, its chunk to run again."""
        for seq, _ in failed:
            seq.num_failed_steps += 1
        if len({seq.request_id for seq, _ in failed}) <= 1:
            return [seq for seq, _ in failed]
        repeat = [seq for seq, _ in failed if seq.num_failed_steps >= MAX_FAILED_STEPS]
        if repeat:
            return repeat
        for seq, scheduled in failed:
            seq.suspect_until = scheduled.start_pos + len(scheduled.token_ids)
            self.suspects.add(seq.seq_id)
            if loaded_block_ids.intersection(scheduled.block_table):
                preempt(seq)
            else:
                seq.num_computed_tokens = scheduled.start_pos
        logger.warning("a step of %d sequences failed; running them alone to find the one "
                       "that fails it", len(failed))
        return []

    def clear_passed(self, scheduled: list[ScheduledSequence],
                     seqs: dict[int, Sequence]) -> None:
        """After a step that succeeded: suspects that ran past their failed chunk are
        innocent."""
        for chunk in scheduled:
            seq = seqs.get(chunk.seq_id)
            if (seq is not None and seq.suspect_until is not None
                    and seq.num_computed_tokens >= seq.suspect_until):
                seq.suspect_until = None
                self.suspects.discard(seq.seq_id)

    def forget(self, seq_id: int) -> None:
        self.suspects.discard(seq_id)
