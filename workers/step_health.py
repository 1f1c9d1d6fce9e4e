"""A device group's step health: what its circuit breaker, its watchdog and its lease
renewal read (DESIGN.md section 1).

The batcher runs every `engine.step()` through `StepHealth.run` and reports how it went.
A step fails when it raises, or when the engine isolated a failing request inside it (the
engine's `num_consecutive_failed_steps`); `max_consecutive_failed_steps` failures in a
row TRIP the group (`tripped` says why), and so does one device error (`trip`: a lost
tensor-parallel rank, a broken device; nothing to count). `step_started_at` lets the
runtime's watchdog see a step that hangs; `last_progress_at` lets the writer renew leases
only while steps complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class StepHealth:
    """Counters written by the batcher thread; the watchdog and the writer only read them."""

    def __init__(self, max_consecutive_failed_steps: int, *,
                 fault_inject_step_failures: int = 0) -> None:
        self.max_consecutive_failed_steps = max_consecutive_failed_steps
        self.num_consecutive_failed_steps = 0
        # time.monotonic() the running step started (None between steps)
        self.step_started_at: float | None = None
        # time.monotonic() a step last completed, or the batcher last waited idle
        self.last_progress_at = time.monotonic()
        self.tripped: str | None = None  # why the breaker tripped
        # TEST ONLY (LLMQ_FAULT_INJECT_STEP_FAILURES): this many steps raise, as a failing
        # device would; nothing else in the service reads it
        self._num_injected_failures = fault_inject_step_failures

    def run(self, step: Callable[[], T]) -> T:
        """Run one step, timed for the watchdog."""
        self.step_started_at = time.monotonic()
        try:
            if self._num_injected_failures > 0:
                self._num_injected_failures -= 1
                raise RuntimeError("injected step failure (LLMQ_FAULT_INJECT_STEP_FAILURES)")
            return step()
        finally:
            self.step_started_at = None

    def idle(self) -> None:
        """Nothing to run: as healthy as a completed step."""
        self.last_progress_at = time.monotonic()

    def step_raised(self, reason: str) -> bool:
        """A step raised; returns whether that tripped the breaker."""
        self.num_consecutive_failed_steps += 1
        if self.num_consecutive_failed_steps >= self.max_consecutive_failed_steps:
            self.tripped = (f"{self.num_consecutive_failed_steps} consecutive failed steps "
                            f"(last: {reason})")
        return self.tripped is not None

    def trip(self, reason: str) -> None:
        """The device group itself failed: trip at once (the first reason wins)."""
        if self.tripped is None:
            self.tripped = reason

    def step_completed(self, num_engine_failed_steps: int) -> bool:
        """A step returned; the engine counts the failed requests it isolated (0 after a
        step that succeeded). Returns whether that tripped the breaker."""
        self.last_progress_at = time.monotonic()
        self.num_consecutive_failed_steps = num_engine_failed_steps
        if num_engine_failed_steps >= self.max_consecutive_failed_steps:
            self.tripped = f"{num_engine_failed_steps} consecutive steps failed a request"
        return self.tripped is not None

    def seconds_since_progress(self) -> float:
        return time.monotonic() - self.last_progress_at
