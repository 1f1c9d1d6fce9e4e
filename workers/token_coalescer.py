"""`TokenCoalescer`: one job's token events merged into fewer, larger ones.

A batch line's stream is rarely read while it runs, yet a token event per step per line
costs the batcher its encoding and Redis an `XADD` and a `PUBLISH`. So a batch line's
token events are held and merged: one event per sample carries the text, token ids and
logprobs of up to `num_tokens` steps, in order. A subscriber still receives every token
of the job, in order, before its terminal event (the batcher flushes what is held before
it hands the result on); it only receives them in larger pieces. A line handed back or
lost drops what is held: its `restart` tells subscribers to start over anyway.
"""

from __future__ import annotations

from tasks.protocol import EventType, JobEvent


class TokenCoalescer:
    """Held token events of one job, per sample index."""

    __slots__ = ("num_tokens", "_held")

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens  # tokens an event gathers before it goes out
        self._held: dict[int, JobEvent] = {}  # sample index -> merged token event

    def add(self, event: JobEvent) -> JobEvent | None:
        """Hold a token `event`; returns the merged event of its sample once it carries
        `num_tokens` tokens."""
        assert event.type is EventType.TOKEN, event.type
        held = self._held.get(event.index)
        if held is None:
            held = self._held[event.index] = event
        else:
            held.text += event.text
            held.token_ids.extend(event.token_ids)
            if event.logprobs is not None:
                held.logprobs = (held.logprobs or []) + event.logprobs
        if len(held.token_ids) < self.num_tokens:
            return None
        del self._held[event.index]
        return held

    def flush(self) -> list[JobEvent]:
        """Every held event, by sample index; holds nothing after."""
        events = [self._held[index] for index in sorted(self._held)]
        self._held.clear()
        return events
