"""`SequenceGrammar`: one sequence's constraint — its compiled grammar (a future while the
compile thread works) and its matcher, which follows the sequence's output tokens."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.engine.structured.backend import GrammarMatcher, XgrammarBackend


class SequenceGrammar:
    """A sequence's grammar state. The scheduler reads `is_ready`; the structured-output
    manager fills bitmask rows from the matcher and advances it with accepted tokens.

    NOTE: the matcher is built on first use and replays the sequence's output tokens, so
    a sequence that already has output (a request resumed by a new engine) starts at the
    right place. A preempted sequence keeps its output and its matcher: nothing to redo.
    """

    __slots__ = ("_backend", "_future", "_matcher", "num_accepted")

    def __init__(self, backend: XgrammarBackend, future: Future[Any]) -> None:
        self._backend = backend
        self._future = future
        self._matcher: GrammarMatcher | None = None
        self.num_accepted = 0  # output tokens the matcher has taken

    @property
    def is_ready(self) -> bool:
        """The grammar compiled: the sequence may be scheduled."""
        return self._future.done() and self._future.exception() is None

    @property
    def error(self) -> str | None:
        """Why the grammar did not compile (None while compiling or when it did)."""
        if not self._future.done():
            return None
        exc = self._future.exception()
        return None if exc is None else str(exc)

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for the compile to end (success or failure)."""
        try:
            self._future.exception(timeout=timeout)
        except TimeoutError:
            pass

    def advance(self, output_token_ids: list[int]) -> GrammarMatcher | None:
        """Catch the matcher up with `output_token_ids` (building it on first use);
        returns it, or None when the grammar rejected one of the new tokens."""
        if self._matcher is None:
            self._matcher = self._backend.new_matcher(self._future.result())
            self.num_accepted = 0
        matcher = self._matcher
        while self.num_accepted < len(output_token_ids):
            token_id = output_token_ids[self.num_accepted]
            self.num_accepted += 1
            if not matcher.accept_token(token_id):
                return None
        return matcher

    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()
