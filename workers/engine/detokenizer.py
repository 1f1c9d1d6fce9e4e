"""Incremental detokenization with stop strings: token ids in, safe text deltas out.

Two stages per call:

1. Decode. Only a short window of recent token ids is decoded (the "prefix offset / read
   offset" technique): the window starts at tokens whose text was already emitted, so
   decoders that depend on context (a SentencePiece leading space, a byte-level token that
   carries half a UTF-8 character) see enough of it, and the cost per call stays O(new
   tokens). While the window's text ends in U+FFFD, the last character is incomplete
   (its remaining bytes are in tokens not generated yet): that tail is held back; the text
   before it goes on.
2. Stop strings. Text that a stop string might still turn out to cover is held back (the
   longest suffix that is a prefix of some stop string). When a stop string appears, the
   delta ends just before it; the stop and anything after it are never emitted. If several
   stop strings appear in the same new text, the one that ends first wins (ties: the one
   that starts first), so the result never depends on how the text was split into tokens.

Decoding never applies `clean_up_tokenization_spaces`: that rewrite looks across tokens and
would make the streamed text differ from the text of the whole output.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first output token: enough for a leading
# space and for a character split over a few byte tokens.
_PROMPT_CONTEXT_TOKENS = 5


def _decoder_for(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """A `token ids -> text` function: the Rust backend directly when there is one (it is
    what `decode` calls, minus a Python layer that costs several times the decode)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text deltas, honouring stop strings.

    `tokenizer` is a `transformers` tokenizer. `output_text` is everything emitted so far.
    After a stop string matched (`matched_stop` is set) or after `flush()`, further tokens
    are ignored.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = _decoder_for(tokenizer, skip_special_tokens)
        self._stops = list(stop)
        # Every proper prefix of every stop string: what a held-back tail may be.
        self._stop_prefixes = {s[:i] for s in self._stops for i in range(1, len(s))}
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)

        # The decode window: token ids from the prefix offset on. Tokens before `_read`
        # are context whose text is already through; `_consumed` counts the characters of
        # decode(window) that went on to the stop stage.
        self._window: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)
        # NOTE: if the prompt ends inside a character, the character that output tokens
        # complete is counted as output (its replacement chars are not "consumed").
        self._consumed = len(self._decode(self._window).rstrip(REPLACEMENT_CHAR))

        self._held = ""  # passed decoding, held back as a possible stop-string prefix
        self.output_text = ""
        self.matched_stop: str | None = None
        self._finished = False

    @property
    def finished(self) -> bool:
        """True once a stop string matched or `flush()` ran."""
        return self._finished

    def add_tokens(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Feed newly sampled token ids; return `(text_delta, matched_stop)`.

        The delta never holds half a character nor text a stop string might still cover.
        `matched_stop` is the stop string found (the delta then ends just before it), else
        None.
        """
        if self._finished:
            logger.debug("ignoring %d token(s) after the end of the text", len(token_ids))
            return "", None
        self._window.extend(token_ids)
        return self._accept(self._decode_new_text())

    def flush(self) -> str:
        """At a finish for another reason (length, EOS, cancel): release held-back text.

        Text held as a possible stop-string prefix is released. An incomplete final
        character (its replacement char U+FFFD) is dropped: its bytes are not text, and the
        token ids stay available to a client that wants them. Consequence: a genuine
        U+FFFD generated as the very last character is dropped too.
        """
        if self._finished:
            return ""
        self._finished = True
        delta, self._held = self._held, ""
        self.output_text += delta
        return delta

    def _decode_new_text(self) -> str:
        """Decode the window; return its new complete text and slide the window on."""
        text = self._decode(self._window)
        incomplete = text.endswith(REPLACEMENT_CHAR)
        stable_end = len(text.rstrip(REPLACEMENT_CHAR)) if incomplete else len(text)
        fresh = text[self._consumed:stable_end]
        self._consumed = max(self._consumed, stable_end)
        if not incomplete and len(self._window) > self._read and fresh:
            # Everything decoded is through: the tokens just read become the context of the
            # next window. Decode them alone, since a window's first token may decode
            # differently (a SentencePiece leading space) than in the middle of one.
            self._window = self._window[self._read:]
            self._read = len(self._window)
            self._consumed = len(self._decode(self._window))
        return fresh

    def _accept(self, fresh: str) -> tuple[str, str | None]:
        """The stop-string stage: emit what is safe, hold back a possible stop prefix."""
        buffer = self._held + fresh
        if not buffer:
            return "", None
        match = self._first_stop(buffer)
        if match is not None:
            start, stop = match
            self._held = ""
            self._finished = True
            self.matched_stop = stop
            delta = buffer[:start]
            self.output_text += delta
            return delta, stop
        hold = self._held_suffix_len(buffer)
        delta = buffer[: len(buffer) - hold]
        self._held = buffer[len(buffer) - hold:]
        self.output_text += delta
        return delta, None

    def _first_stop(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop occurrence that ends first, if any.

        NOTE: no occurrence can start before `buffer`: its start would make a longer
        suffix of the earlier text a stop prefix than the one held back.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _held_suffix_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop."""
        for length in range(min(len(buffer), self._max_hold), 0, -1):
            if buffer[-length:] in self._stop_prefixes:
                return length
        return 0
