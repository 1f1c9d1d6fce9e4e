"""`StructuredOutputManager`: compiles constraints off the step, fills each step's token
bitmask rows, and advances the matchers with the accepted tokens (vLLM v1's shape: the
matchers live on the engine side; the runner only receives the bitmask).

Lifecycle of a constrained request:
1. `Engine.add_request` calls `check()` (cheap parse: a malformed schema, regex or
   grammar is refused there) and `add()`: each sample gets a `SequenceGrammar` whose
   compiled grammar comes from the LRU cache or from the compile thread, and waits in
   `WAITING_FOR_GRAMMAR` (skipped by the scheduler, holding nobody back) until it is ready.
2. Before each schedule, `take_failed()` names the sequences whose grammar did not
   compile; the engine fails their requests alone with the backend's message.
3. After scheduling, `fill_bitmask()` writes one row per scheduled constrained sequence
   that samples this step into `SchedulerOutput.grammar_bitmask`.
4. After a step that succeeded (never after one that raised), `advance()` feeds each
   sampled token to its matcher; a matcher that terminated (it accepted EOS) ends its
   sequence with `stop`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tasks.structured import StructuredOutputs
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.step_io import GrammarBitmask, SchedulerOutput
from workers.engine.structured.backend import XgrammarBackend
from workers.engine.structured.sequence_grammar import SequenceGrammar

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 128  # compiled grammars kept (a 20-field schema: ~100 KB-1 MB each)


class StructuredOutputManager:
    def __init__(self, backend: XgrammarBackend, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.backend = backend
        self.cache_size = cache_size
        # spec key (StructuredOutputs.key()) -> compiled grammar, most recent last.
        # NOTE: the manager serves one tokenizer and vocabulary (its backend's), so the
        # spec alone names a compiled grammar here.
        self._cache: OrderedDict[str, Future[Any]] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: dict[int, Sequence] = {}  # seq_id -> sequence waiting for its grammar
        self.num_compiles = 0
        self.num_cache_hits = 0
        # seq ids whose grammar could only end at this step's sample while min_tokens held
        # the end back (see fill_bitmask)
        self._must_end: set[int] = set()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # ---- requests -----------------------------------------------------------------

    def check(self, spec: StructuredOutputs) -> None:
        """Raise InvalidStructuredOutputsError (a ValueError) for a constraint the backend
        cannot parse; cheap enough for `add_request`."""
        self.backend.check(spec)

    def add(self, seqs: list[Sequence], spec: StructuredOutputs) -> None:
        """Give each sample its grammar; those whose grammar is still compiling wait in
        WAITING_FOR_GRAMMAR. Call before the sequences reach the scheduler."""
        future = self._compiled(spec)
        for seq in seqs:
            seq.grammar = SequenceGrammar(self.backend, future)
            if not seq.grammar.is_ready:
                seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
                self._pending[seq.seq_id] = seq

    def _compiled(self, spec: StructuredOutputs) -> Future[Any]:
        key = spec.key()
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            return future
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="grammar-compile")
        future = self._executor.submit(self.backend.compile, spec)
        self.num_compiles += 1
        self._cache[key] = future
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return future

    def take_failed(self) -> list[Sequence]:
        """The waiting sequences whose grammar failed to compile (each named once);
        forgets those whose grammar is ready or that ended meanwhile."""
        if not self._pending:
            return []
        failed: list[Sequence] = []
        for seq_id, seq in list(self._pending.items()):
            grammar = seq.grammar
            assert grammar is not None
            if seq.is_finished or grammar.is_ready:
                del self._pending[seq_id]
            elif grammar.error is not None:
                del self._pending[seq_id]
                failed.append(seq)
        return failed

    def wait_for_compiles(self, timeout: float) -> None:
        """Block up to `timeout` seconds for a pending compile (an idle step: nothing else
        could run)."""
        for seq in self._pending.values():
            if seq.grammar is not None and not seq.grammar.is_ready:
                seq.grammar.wait(timeout)
                return

    # ---- one step -----------------------------------------------------------------

    def fill_bitmask(self, out: SchedulerOutput, seqs_by_id: dict[int, Sequence]) -> None:
        """Set `out.grammar_bitmask`: one row per scheduled constrained sequence that
        samples this step (None when there is none). Reads the matchers, never moves them."""
        rows: list[tuple[int, SequenceGrammar, list[int]]] = []
        for scheduled in out.scheduled:
            if scheduled.sample and scheduled.params.structured_outputs is not None:
                seq = seqs_by_id[scheduled.seq_id]
                assert seq.grammar is not None
                rows.append((seq.seq_id, seq.grammar, seq.output_token_ids))
        if not rows:
            out.grammar_bitmask = None
            return
        bitmask = self.backend.allocate_bitmask(len(rows))
        self._must_end.clear()
        for i, (seq_id, grammar, output_token_ids) in enumerate(rows):
            matcher = grammar.advance(output_token_ids)
            if matcher is None:  # advance() caught up with a token it rejects: a bug
                raise RuntimeError(f"sequence {seq_id}: its output left its grammar")
            matcher.fill_next_token_bitmask(bitmask, i)
            seq = seqs_by_id[seq_id]
            if len(output_token_ids) < seq.params.min_tokens and self._only_stops(
                    bitmask[i], seq.params.stop_token_ids):
                # NOTE: the grammar is complete but min_tokens masks every end token: a
                # row with nothing to sample. The grammar wins: the row samples freely
                # this once and `advance` ends the sequence with `stop` instead of
                # feeding that token (which, like EOS, stays out of the text).
                bitmask[i] = -1
                self._must_end.add(seq_id)
        out.grammar_bitmask = GrammarBitmask(seq_ids=[r[0] for r in rows], bitmask=bitmask)

    def _only_stops(self, row: np.ndarray, stop_token_ids: list[int]) -> bool:
        """Whether a bitmask row (int32 words) allows nothing but end tokens (EOS, stop
        token ids)."""
        rest = row.view(np.uint32).copy()
        for token_id in (*self.backend.eos_token_ids, *stop_token_ids):
            if token_id < 32 * len(rest):
                rest[token_id // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (token_id % 32)))
        return not rest.any()

    def advance(self, sampled: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Feed each constrained sequence's new token to its matcher, after a step that
        succeeded. Returns (terminated, rejected): the sequences whose grammar is
        complete (they end with `stop`), and those whose token the grammar refused."""
        terminated: list[Sequence] = []
        rejected: list[Sequence] = []
        for seq in sampled:
            grammar = seq.grammar
            if grammar is None:
                continue
            if seq.seq_id in self._must_end:
                self._must_end.discard(seq.seq_id)
                terminated.append(seq)
                continue
            matcher = grammar.advance(seq.output_token_ids)
            if matcher is None:
                rejected.append(seq)
            elif matcher.is_terminated():
                terminated.append(seq)
        return terminated, rejected
