"""The hand-off between admission and the batcher: one claimed job as plain values.

Admission builds an `AdmittedJob` from the claimed row; the batcher queues it, and the
job's `JobState` keeps it for the job's life. It lives in its own module so that the
batcher, the job state and admission all import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.params import SamplingParams


@dataclass(slots=True)
class AdmittedJob:
    """A claimed job as the batcher needs it: ids and plain values, no ORM row."""

    job_id: str
    prompt: str | list[int]  # token ids when the web tokenized it, else the prompt text
    params: SamplingParams
    priority: int = 0
    attempt: int = 1  # this claim's number (jobs.attempts after the claim)
    created_at: float | None = None  # unix seconds the API stored the job (metrics)
    claimed_at: float | None = None  # unix seconds this group claimed it (metrics)
    batch_id: str | None = None  # the batch it is a line of: its result may finish the batch

    @property
    def num_samples(self) -> int:
        """What this job counts against the group's capacity (at least one)."""
        return max(1, self.params.n)
