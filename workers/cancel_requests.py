"""Cancel requests on their way to the batcher loop: the new ones and a recent memory.

A cancel can arrive before its job reaches the engine (the job still waits for room in
admission, or is in the inbox), so every request is remembered for
`EARLY_CANCEL_SECONDS`: the loop ends such a job as it arrives, without running it.
"""

from __future__ import annotations

# how long a cancel for a job this group has not seen yet is remembered
EARLY_CANCEL_SECONDS = 300.0
# the memory is pruned only once it holds this many requests (pruning walks all of it)
PRUNE_ABOVE = 1024


class CancelRequests:
    """New cancel requests for the next loop, and every recent one by job id.

    NOTE: not thread-safe by itself; `JobInbox` guards it with its lock.
    """

    __slots__ = ("_new", "_requested_at")

    def __init__(self) -> None:
        self._new: set[str] = set()  # not yet taken by the loop
        self._requested_at: dict[str, float] = {}  # job id -> time.monotonic() of the request

    @property
    def has_new(self) -> bool:
        return bool(self._new)

    def add(self, job_id: str, now: float) -> None:
        """Record a cancel request for `job_id` made at `now` (time.monotonic())."""
        self._new.add(job_id)
        self._requested_at[job_id] = now

    def take_new(self) -> set[str]:
        """The requests since the last call (the loop applies them to its running jobs)."""
        new, self._new = self._new, set()
        return new

    def __contains__(self, job_id: object) -> bool:
        """Whether `job_id` was cancelled recently (whether or not it was taken)."""
        return job_id in self._requested_at

    def __len__(self) -> int:
        return len(self._requested_at)

    def prune(self, now: float) -> None:
        """Forget requests older than EARLY_CANCEL_SECONDS once the memory grows large."""
        if len(self._requested_at) < PRUNE_ABOVE:
            return
        horizon = now - EARLY_CANCEL_SECONDS
        self._requested_at = {k: t for k, t in self._requested_at.items() if t > horizon}
