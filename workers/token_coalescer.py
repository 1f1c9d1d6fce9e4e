"""`TokenCoalescer`: one job's token events merged into fewer, larger ones.

Every token event costs the batcher its encoding, Redis an `XADD` and a `PUBLISH`, the web
process a message to parse and a write to its client, and the client a read. When a step
takes a few milliseconds, a token event per step per job is most of the host's work
beside the model. So token events are held and merged, by one of two rules:

* a count (batch lines, whose streams are rarely read while they run): an event goes out
  once it carries `num_tokens` tokens;
* an interval (streaming jobs, `LLMQ_STREAM_INTERVAL_SECONDS`): a sample's first token
  goes out at once (the time to first token is not touched), and after that at most one
  event per `interval` seconds carries what the steps produced in between. With steps
  slower than the interval nothing is held.

A subscriber still receives every token of the job, in order, before its terminal event
(the batcher flushes what is held before it hands the result on); it only receives them
in larger pieces. A job handed back or lost drops what is held: its `restart` tells
subscribers to start over anyway.
"""

from __future__ import annotations

from typing import Any

from tasks.protocol import EventType, JobEvent


class TokenCoalescer:
    """Held token events of one job, per sample index."""

    __slots__ = ("num_tokens", "interval", "_held", "_sent_at")

    def __init__(self, num_tokens: int = 0, interval: float = 0.0) -> None:
        """`num_tokens` > 0: the count rule; else `interval` > 0: the interval rule."""
        if (num_tokens > 0) == (interval > 0):
            raise ValueError("a coalescer merges by a count or by an interval, not both")
        self.num_tokens = num_tokens  # tokens an event gathers before it goes out
        self.interval = interval  # seconds between a sample's events
        self._held: dict[int, JobEvent] = {}  # sample index -> merged token event
        self._sent_at: dict[int, float] = {}  # sample index -> when its last event went out

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def add(self, event: JobEvent, now: float) -> JobEvent | None:
        """Hold a token `event` (made at `now`, monotonic seconds); returns its sample's
        merged event if it is due."""
        assert event.type is EventType.TOKEN, event.type
        return self.add_tokens(event.index, event.text, event.token_ids, event.logprobs, now)

    def add_tokens(self, index: int, text: str, token_ids: list[int],
                   logprobs: list[dict[str, Any]] | None, now: float) -> JobEvent | None:
        """`add` of the token event these parts make, which is only made when the sample
        holds none (the batcher calls this once per job per step)."""
        held = self._held.get(index)
        if held is None:
            held = self._held[index] = JobEvent(EventType.TOKEN, index=index, text=text,
                                                token_ids=list(token_ids), logprobs=logprobs)
        else:
            held.text += text
            held.token_ids.extend(token_ids)
            if logprobs is not None:
                held.logprobs = (held.logprobs or []) + logprobs
        if self.num_tokens:
            if len(held.token_ids) < self.num_tokens:
                return None
        elif not self._interval_passed(index, now):
            return None
        return self._send(index, now)

    def due(self, now: float) -> list[JobEvent]:
        """The held events whose interval has passed by `now` (the interval rule; the
        batcher asks after every step, so a sample that produced nothing since is not
        left holding)."""
        if self.num_tokens or not self._held:
            return []
        return [self._send(index, now) for index in sorted(self._held)
                if self._interval_passed(index, now)]

    def flush(self) -> list[JobEvent]:
        """Every held event, by sample index; holds nothing after."""
        events = [self._held[index] for index in sorted(self._held)]
        self._held.clear()
        return events

    def _interval_passed(self, index: int, now: float) -> bool:
        """True when sample `index` sent nothing yet or its last event is `interval` old."""
        sent_at = self._sent_at.get(index)
        return sent_at is None or now - sent_at >= self.interval

    def _send(self, index: int, now: float) -> JobEvent:
        self._sent_at[index] = now
        return self._held.pop(index)
