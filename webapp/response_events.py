"""A job's events -> the stream events of its response, each with a stable
`sequence_number`.

The numbering is a pure function of the job's stored Redis Stream (plus the final row), so
any web process, after any restart, numbers the same events the same way and
`starting_after=N` resumes exactly after event N:

* 0..3: `response.created`, `response.in_progress`, `response.output_item.added`,
  `response.content_part.added` (fixed, whatever the job is doing);
* then one `response.output_text.delta` per token event that adds text, in stream order;
* then `response.output_text.done`, `response.content_part.done`,
  `response.output_item.done` and the terminal `response.completed` (or `.incomplete`,
  `.failed`, `.cancelled`).

NOTE: a `restart` event (the job re-runs after its worker died) cannot take back text a
client already has, so the re-run's tokens become deltas only past the text sent before
(as the chat completions stream does): the client sees each character once, in order. A
job's seed is pinned at submission (`tasks.schema.pin_seed`), so the re-run repeats the
first attempt's text. Should the final text still differ from what was sent, the
`output_text.done` event and the final response carry the stored text, which is the truth.

When the job's stream has expired (`LLMQ_STREAM_TTL_SECONDS`) the events are rebuilt
from the row: the same preamble, one delta with the whole text, the same ending. The
numbers after 3 then differ from the live stream's (fewer deltas).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tasks.protocol import EventType, JobEvent
from webapp.response_objects import output_message, output_text

NUM_PREAMBLE_EVENTS = 4  # sequence numbers 0..3


@dataclass(slots=True)
class SentText:
    """The text a client has across a job's attempts: after a `restart`, the re-run's
    tokens add only what goes past it (see the NOTE above)."""

    text: str = ""
    produced: int = 0  # characters of the current attempt seen so far

    def add(self, event: JobEvent) -> str:
        """The new text of one job event ("" for none); sample 0 only."""
        if event.type is EventType.RESTART:
            self.produced = 0
            return ""
        if event.type is not EventType.TOKEN or event.index != 0:
            return ""
        start = self.produced
        self.produced += len(event.text)
        new = event.text[max(0, len(self.text) - start):]
        self.text += new
        return new


def text_so_far(events: Iterable[JobEvent]) -> str:
    """What a stream of these events has sent: the text a poll answers while the job runs
    (it never shrinks, not even when the job restarts)."""
    sent = SentText()
    for event in events:
        sent.add(event)
    return sent.text


@dataclass(slots=True)
class ResponseEvents:
    """Numbers a response's events while it reads its job's events once, in order."""

    item_id: str  # msg_<job id hex>
    # status -> the response object as it starts (no output yet): the preamble's snapshot
    snapshot: Callable[[str], dict[str, Any]]
    created_status: str  # queued (background) or in_progress
    next_sequence: int = 0
    sent: SentText = field(default_factory=SentText)  # text sent as deltas so far

    def preamble(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.snapshot(self.created_status)),
            self._event("response.in_progress", response=self.snapshot("in_progress")),
            self._event("response.output_item.added", output_index=0, item={
                "id": self.item_id, "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}),
            self._event("response.content_part.added", **self._where(), part=output_text("")),
        ]

    def feed(self, event: JobEvent) -> list[dict[str, Any]]:
        """The stream events of one token or restart event of the job (sample 0 only)."""
        text = self.sent.add(event)
        if not text:
            return []  # no text, or a re-run still repeating what the client has
        return [self._event("response.output_text.delta", **self._where(), delta=text)]

    def finish(self, final: dict[str, Any]) -> list[dict[str, Any]]:
        """The closing events, given the final response object (`response_object`)."""
        message = final["output"][0] if final["output"] else None
        sent = self.sent.text
        text = message["content"][0]["text"] if message else sent
        events = []
        if len(text) > len(sent) and text.startswith(sent):
            # text the stream never carried (a rebuild from the row, a lost publish)
            events.append(self._event("response.output_text.delta", **self._where(),
                                      delta=text[len(sent):]))
            self.sent.text = text
        item = message or output_message(self.item_id, text, final["status"])
        events += [
            self._event("response.output_text.done", **self._where(), text=text),
            self._event("response.content_part.done", **self._where(), part=output_text(text)),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event(f"response.{final['status']}", response=final),
        ]
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def _event(self, event_type: str, **fields: Any) -> dict[str, Any]:
        event = {"type": event_type, "sequence_number": self.next_sequence, **fields}
        self.next_sequence += 1
        return event


def sse_lines(events: Iterable[dict[str, Any]], starting_after: int) -> Iterator[str]:
    """Server-sent events of the events numbered after `starting_after`."""
    for event in events:
        if event["sequence_number"] > starting_after:
            data = json.dumps(event, separators=(",", ":"))
            yield f"event: {event['type']}\ndata: {data}\n\n"
