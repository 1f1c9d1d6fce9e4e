"""An incremental reader of server-sent events from a streamed HTTP body.

Both the OpenAI streams (`data: {...}` ... `data: [DONE]`) and llmq's job events
(`id:`, `event:`, `data:`; `: ping` comments; `retry:`) are SSE; this turns the bytes as
they arrive into events, so each event is timed when its last byte came in.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

READ_SIZE = 65536  # bytes per read1(): whatever has arrived, up to this


@dataclass(slots=True)
class SseMessage:
    event: str  # "message" when the server named none
    data: str  # the data lines joined with "\n"
    id: str | None = None


class SseParser:
    """Feed decoded text; get back every event completed by it (comments dropped)."""

    def __init__(self) -> None:
        self._buffer = ""

    def feed(self, text: str) -> list[SseMessage]:
        self._buffer += text.replace("\r\n", "\n").replace("\r", "\n")
        messages = []
        while "\n\n" in self._buffer:
            block, self._buffer = self._buffer.split("\n\n", 1)
            message = _parse_block(block)
            if message is not None:
                messages.append(message)
        return messages


def _parse_block(block: str) -> SseMessage | None:
    event, data, event_id = "message", [], None
    for line in block.split("\n"):
        if not line or line.startswith(":"):
            continue  # a comment (`: ping`)
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        elif name == "id":
            event_id = value
    if not data:
        return None  # `retry:` alone, or only comments
    return SseMessage(event, "\n".join(data), event_id)


def iter_sse(response: Any) -> Iterator[SseMessage]:
    """Events of a `requests` response opened with `stream=True`, as they arrive.

    NOTE: `raw.read1` returns what has arrived (chunked or not); `iter_content` would
    wait for a full buffer or, without a chunk size, for the end of a non-chunked body.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    parser = SseParser()
    raw = response.raw
    while True:
        chunk = raw.read1(READ_SIZE)
        if not chunk:
            break
        yield from parser.feed(decoder.decode(chunk))
    yield from parser.feed(decoder.decode(b"", final=True) + "\n\n")
