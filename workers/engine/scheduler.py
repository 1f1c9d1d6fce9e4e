"""`Scheduler`: who computes how many tokens each step (policy only).

There are no prefill and decode phases. Each step every scheduled sequence computes a
chunk of its not-yet-computed tokens, so its `num_computed_tokens` catches up to
`num_tokens`; a long prompt spans several steps (chunked prefill). The KV blocks are the
`KVCacheManager`'s business: the scheduler asks for slots and, when the answer is None,
preempts by recompute.

Order: running sequences first, then waiting ones. Both queues are kept sorted by
`Sequence.sort_key` — priority (lower first), then preempted-before-fresh, then arrival —
so the running sequence to preempt is always the last one, and a preempted sequence goes
back to the front of the waiting sequences of its priority (the very front when every
request has the same priority).

Samples of one request (`n > 1`): sample 0 runs alone until its whole prompt is computed;
then the other samples join the waiting queue and take the prompt's full blocks from the
prefix cache (each recomputes only the partial last block). Without prefix caching they
compute the prompt themselves, which is correct, only slower.

A step whose forward pass raised (`step_failed`): the KV it was to write never becomes
findable, and `StepIsolation` (workers/engine/step_isolation.py) finds the request that
fails it by running the step's sequences alone; only that request fails.

KV storage below the device (tiers) is an optional `KVConnector`
(workers/engine/kv_connector.py): the scheduler asks it how many tokens it can supply
after the device hit and tells it what it allocated and which sequences ended. A
sequence whose lookup is in flight waits (`PendingLookups`, workers/engine/pending_lookups.py)
without holding back the sequences behind it.
A sequence whose structured-output grammar compiles waits in `WAITING_FOR_GRAMMAR`,
skipped the same way until its grammar is ready.

Priority bands (`PriorityBands`, workers/engine/priority_bands.py): a step that carries a
foreground sequence's prompt chunk leaves the running background-band sequences out (they
keep their KV) and admits no waiting background one; a ready foreground sequence that
finds every seat taken preempts the last running background sequence for its seat;
while background sequences run, waiting ones start together once a quarter of the seats
(at most 16) is free, so that most steps stay pure decode steps.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable
from itertools import islice
from typing import TYPE_CHECKING

from kvcache.kv_cache_manager import KVCacheManager
from workers.engine.pending_lookups import PendingLookups
from workers.engine.priority_bands import PriorityBands
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.step_io import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from workers.engine.step_isolation import StepIsolation

if TYPE_CHECKING:
    from workers.engine.kv_connector import KVConnector

logger = logging.getLogger(__name__)

# how long an idle step waits for a connector's lookup (nothing else could run)
IDLE_LOOKUP_WAIT_SECONDS = 0.01


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        long_prefill_token_threshold: int = 0,
        enable_prefix_caching: bool = True,
        kv_connector: KVConnector | None = None,
        background_priority: int | None = None,
    ) -> None:
        self.kv_manager = kv_manager
        # KV storage below the device (tiers): lookups on admission, offload of ended
        # sequences' blocks; None without. NOTE: blocks are named by their prefix hashes,
        # so a connector needs prefix caching.
        self.kv_connector = kv_connector if enable_prefix_caching else None
        self.block_size = kv_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.enable_prefix_caching = enable_prefix_caching
        # NOTE: both kept sorted by Sequence.sort_key (see the module docstring)
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        # sample-0 seq_id -> the request's other samples, held until its prompt is computed
        self.deferred: dict[int, list[Sequence]] = {}
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence by seq_id
        self.num_preemptions = 0
        self.lookups = PendingLookups(kv_manager)  # waiting on the connector's lookups
        self.isolation = StepIsolation()  # suspects of a step that raised
        # priorities >= background_priority give way to foreground prompt chunks
        self.bands = PriorityBands(background_priority, max_num_seqs)
        # prompt tokens looked up / found in the prefix cache, counted once per sequence
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    # ---- queues -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.seqs) - len(self.running)

    @property
    def num_waiting_for_kvs(self) -> int:
        """Waiting sequences whose connector lookup is in flight (each holds a seat)."""
        return self.lookups.num_waiting

    @property
    def suspects(self) -> set[int]:
        """seq_ids suspected of failing a step (they run alone until cleared)."""
        return self.isolation.suspects

    def has_unfinished_seqs(self) -> bool:
        return bool(self.seqs)

    def add_seqs(self, seqs: list[Sequence]) -> None:
        """Queue the samples of one request (sample 0 first)."""
        for seq in seqs:
            if seq.seq_id in self.seqs:
                raise ValueError(f"sequence {seq.seq_id} is already scheduled")
            self.seqs[seq.seq_id] = seq
        head, rest = seqs[0], seqs[1:]
        self._enqueue_waiting(head)
        if rest:
            self.deferred[head.seq_id] = rest

    def finish_seqs(self, seqs: Iterable[Sequence], status: SequenceStatus) -> None:
        """End sequences (finished or aborted): release their blocks and forget them."""
        for seq in seqs:
            if seq.is_finished:
                continue
            if seq.status == SequenceStatus.RUNNING:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            self.lookups.forget(seq)
            seq.status = status
            self.seqs.pop(seq.seq_id, None)
            self.isolation.forget(seq.seq_id)
            if self.kv_connector is not None:
                self.kv_connector.request_finished(
                    seq, self.kv_manager.get_unshared_full_blocks(seq.seq_id))
            self.kv_manager.free(seq.seq_id)
            seq.block_table = []
            # samples still held for this one's prompt start on their own now
            for sibling in self.deferred.pop(seq.seq_id, []):
                if not sibling.is_finished:
                    self._enqueue_waiting(sibling)
            for held in self.deferred.values():
                if seq in held:
                    held.remove(seq)

    def _enqueue_waiting(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_sort_key)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute policy: drop the KV, keep the tokens, wait at the front again."""
        self.running.remove(seq)
        self.kv_manager.free(seq.seq_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self._enqueue_waiting(seq)
        self.num_preemptions += 1
        logger.debug("preempted seq %d of request %s", seq.seq_id, seq.request_id)

    # ---- one step -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick each sequence's chunk for this step and allocate KV slots for it.

        Advances `num_computed_tokens` of every scheduled sequence by its chunk.
        """
        connector = self.kv_connector
        if connector is not None:
            self.lookups.resume_finished(connector, self.seqs)
        # NOTE: while suspects wait, only the first of them runs, alone (step_isolation.py)
        alone = (self.isolation.next_alone(self.running, self.seqs, _sort_key)
                 if self.isolation.suspects else None)
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[int] = []
        seated_out: list[int] = []  # background sequences preempted for foreground seats
        bs = self.block_size
        threshold = self.long_prefill_token_threshold
        bands = self.bands
        if alone is None and self.waiting:
            for victim in bands.seats_to_free(self.running, self.waiting,
                                              self._num_free_seats()):
                # NOTE: not in `preempted`: that stops admission, and these make room for it
                self._preempt(victim)
                seated_out.append(victim.seq_id)
        defer = alone is None and bands.defers_background(self.running, self.waiting,
                                                          self._can_admit)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if defer and bands.is_background(seq):
                break  # NOTE: running is sorted: every sequence from here on is background
            if alone is not None and seq is not alone:
                i += 1
                continue
            start = seq.num_computed_tokens
            num_new = len(seq.token_ids) - start
            if 0 < threshold < num_new:
                num_new = threshold
            num_new = min(num_new, budget)
            end = start + num_new
            block_table = seq.block_table
            # Fast path (most decode steps): the table already covers the chunk and no
            # block becomes full in it, so allocate_slots would change nothing.
            if end > len(block_table) * bs or end // bs != start // bs:
                while True:
                    allocated = self.kv_manager.allocate_slots(
                        seq.seq_id, seq.token_ids, start, num_new
                    )
                    if allocated is not None:
                        break
                    # NOTE: running is sorted, and the sequences before i are scheduled,
                    # so the victim (the last one) is never already in this step's batch.
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted.append(victim.seq_id)
                    if victim is seq:
                        break
                if allocated is None:
                    break  # seq itself was the last one left to preempt
                seq.block_table = block_table = allocated
            budget -= num_new
            # NOTE: block_table is the manager's fresh list for this sequence, never
            # mutated afterwards (the next allocation returns a new one): passed uncopied.
            scheduled.append(self._take_chunk(seq, num_new, block_table))
            i += 1

        # blocks whose KV this step writes: a waiting sequence must not take them as cached
        writing: set[int] = set()
        if self.waiting and self.enable_prefix_caching:
            for scheduled_seq in scheduled:
                writing.update(self._blocks_written(scheduled_seq))
        # NOTE: after a preemption, admitting waiting sequences would only churn the cache
        index = 0  # waiting[:index] stay waiting this step (their lookups are in flight)
        background_admitted: bool | None = None  # waiting background sequences start
        while (
            not preempted
            and index < len(self.waiting)
            and budget > 0
            and self._num_free_seats() > 0
        ):
            seq = self.waiting[index]
            if bands.is_background(seq):  # waiting is sorted: the rest is background too
                if background_admitted is None:  # decided once a step, for all of them
                    background_admitted = not defer and bands.admits_background(
                        self.running, islice(self.waiting, index, None),
                        self._num_free_seats())
                if not background_admitted:
                    break
            if seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS or (
                    alone is not None and seq is not alone):
                index += 1
                continue
            if seq.status == SequenceStatus.WAITING_FOR_GRAMMAR:
                if seq.grammar is None or not seq.grammar.is_ready:
                    index += 1  # compiling (or failed: the engine fails it)
                    continue
                seq.status = SequenceStatus.WAITING
            computed_blocks: list[int] = []
            num_cached = 0
            held = self.lookups.held(seq.seq_id)
            if self.enable_prefix_caching:
                computed_blocks, num_cached = self.kv_manager.get_computed_blocks(seq.token_ids)
                computed_blocks = _until_written(computed_blocks, writing)
                num_cached = min(num_cached, len(computed_blocks) * self.block_size)
                if held is not None and num_cached > held:
                    # the device got more of its prompt while it waited (another sequence
                    # loaded it): its hold goes, the longer hit is taken below
                    self.lookups.drop(seq)
                    held = None
            if held is not None:
                computed_blocks, num_cached = [], held  # its device hit is allocated already
            num_external = 0
            if connector is not None:
                matched, load_async = connector.get_num_new_matched_tokens(
                    seq, num_cached, self.kv_manager.num_free_blocks)
                if matched is None:
                    self.lookups.wait(seq, computed_blocks, num_cached)
                    index += 1
                    continue
                if load_async:
                    raise NotImplementedError(
                        "this scheduler loads connector blocks within the step; a connector "
                        "must answer get_num_new_matched_tokens with load_async=False")
                num_external = matched
            allocated = None
            if num_external:
                num_new = self._chunk_size(seq, num_cached + num_external, budget)
                allocated = self.kv_manager.allocate_slots(
                    seq.seq_id, seq.token_ids, num_cached + num_external, num_new,
                    computed_block_ids=computed_blocks,
                )
                if allocated is None:
                    num_external = 0  # no room to load them: compute instead, if that fits
                else:
                    num_cached += num_external
            if allocated is None:
                num_new = self._chunk_size(seq, num_cached, budget)
                allocated = self.kv_manager.allocate_slots(
                    seq.seq_id, seq.token_ids, num_cached, num_new,
                    computed_block_ids=computed_blocks
                )
            if allocated is None:
                break  # no room: waiting sequences never preempt running ones
            if connector is not None:
                connector.update_state_after_alloc(seq, allocated, num_external)
            self.waiting.pop(index)
            if held is not None:
                self.lookups.admitted(seq.seq_id)
            seq.block_table = allocated
            if not seq.admitted:
                seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
                seq.admitted = True
                self.prefix_queries_tokens += seq.num_prompt_tokens
                self.prefix_hits_tokens += seq.num_cached_tokens
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_sort_key)
            budget -= num_new
            scheduled.append(self._schedule_chunk(seq, num_new, allocated, writing))

        if self.lookups.holds_hits:
            self.lookups.release_answered(self.seqs)
        bands.step_built(defer, scheduled, self.seqs)
        output = SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.max_num_batched_tokens - budget,
            preempted_seq_ids=preempted + seated_out,
        )
        if connector is not None:
            connector.build_connector_meta(output)
            if not scheduled and self.num_waiting_for_kvs:
                connector.wait_for_lookups(IDLE_LOOKUP_WAIT_SECONDS)
        return output

    def step_failed(self, scheduler_output: SchedulerOutput) -> list[Sequence]:
        """The forward pass of `scheduler_output` raised. Returns the culprits whose
        requests must fail, or none while `StepIsolation` looks for them.

        NOTE: the KV the step was to write is dropped unregistered either way, so neither
        the prefix cache nor a tier ever serves it.
        """
        self.kv_manager.discard_uncommitted()
        failed = [(self.seqs[s.seq_id], s) for s in scheduler_output.scheduled
                  if s.seq_id in self.seqs]
        loaded = {block_id for block_id, _ in scheduler_output.blocks_to_load}
        return self.isolation.on_failure(failed, loaded, self._preempt)

    def step_interrupted(self, scheduler_output: SchedulerOutput) -> None:
        """The forward pass of `scheduler_output` stopped between layers (the engine's
        step yield): every chunk of it is to run again, from where it started. What the
        step wrote stays unregistered, as after a failed step; the blocks it allocated
        stay with their sequences for the chunk's next run."""
        self.kv_manager.discard_uncommitted()
        for scheduled in scheduler_output.scheduled:
            seq = self.seqs.get(scheduled.seq_id)
            if seq is not None:
                seq.num_computed_tokens = scheduled.start_pos

    def _can_admit(self, seq: Sequence) -> bool:
        """Whether `seq` would find a seat and KV blocks for its first chunk (counting no
        prefix-cache hit)."""
        if self._num_free_seats() <= 0:
            return False
        num_new = self._chunk_size(seq, 0, self.max_num_batched_tokens)
        return -(-num_new // self.block_size) <= self.kv_manager.num_free_blocks

    def _num_free_seats(self) -> int:
        """Seats no running sequence holds (a sequence whose lookup is in flight holds one)."""
        return self.max_num_seqs - len(self.running) - self.num_waiting_for_kvs

    def _chunk_size(self, seq: Sequence, num_computed: int, budget: int) -> int:
        num_new = seq.num_tokens - num_computed
        if self.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.long_prefill_token_threshold)
        return min(num_new, budget)

    def _schedule_chunk(
        self, seq: Sequence, num_new: int, block_table: list[int], writing: set[int]
    ) -> ScheduledSequence:
        scheduled = self._take_chunk(seq, num_new, block_table)
        writing.update(self._blocks_written(scheduled))
        return scheduled

    @staticmethod
    def _take_chunk(seq: Sequence, num_new: int, block_table: list[int]) -> ScheduledSequence:
        """The next `num_new` tokens of `seq` as this step's chunk; marks them computed."""
        start = seq.num_computed_tokens
        end = start + num_new
        seq.num_computed_tokens = end
        return ScheduledSequence(
            seq.seq_id,
            seq.token_ids[start:end],
            start,
            block_table,
            end == len(seq.token_ids),
            seq.params,
            seq.prompt_token_ids,
            seq.output_token_ids,
        )

    def _blocks_written(self, scheduled: ScheduledSequence) -> list[int]:
        start = scheduled.start_pos
        end = start + len(scheduled.token_ids)
        return scheduled.block_table[start // self.block_size : (end - 1) // self.block_size + 1]

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Sequence]:
        """Append the sampled tokens and finish sequences on token rules.

        Returns the sequences that sampled a token this step, in scheduled order; those
        that finished are already out of every queue with their blocks released. Stop
        strings are the engine's (they need the text) and end a sequence via `finish_seqs`.
        """
        # the forward pass succeeded: the KV it wrote becomes findable
        self.kv_manager.commit()
        if self.isolation.suspects:
            self.isolation.clear_passed(scheduler_output.scheduled, self.seqs)
        sampled: list[Sequence] = []
        seqs = self.seqs
        running = SequenceStatus.RUNNING
        for seq_id, token_id, logprobs in zip(
            runner_output.seq_ids, runner_output.sampled_token_ids, runner_output.logprobs
        ):
            seq = seqs.get(seq_id)
            if seq is None or seq.status != running:
                continue  # finished or aborted since it was scheduled
            seq.output_token_ids.append(token_id)
            seq.token_ids.append(token_id)
            seq.output_logprobs.append(logprobs)
            sampled.append(seq)
            status = self._check_stop(seq, token_id)
            if status is not None:
                self.finish_seqs([seq], status)
        if self.deferred:
            # other samples may start once sample 0's prompt blocks are computed and cached
            for head_id in [h for h in self.deferred if self._prompt_done(h)]:
                for sibling in self.deferred.pop(head_id):
                    self._enqueue_waiting(sibling)
        return sampled

    def _prompt_done(self, head_id: int) -> bool:
        head = self.seqs.get(head_id)
        return head is None or head.num_computed_tokens >= head.num_prompt_tokens

    def _check_stop(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        params = seq.params
        num_output = len(seq.output_token_ids)
        if num_output >= params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                return SequenceStatus.FINISHED_STOPPED
            if params.stop_token_ids and token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return SequenceStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None


def _sort_key(seq: Sequence) -> tuple[int, int, int]:
    return seq.sort_key


def _until_written(block_ids: list[int], writing: set[int]) -> list[int]:
    """The cached prefix up to the first block another sequence writes this step."""
    for i, block_id in enumerate(block_ids):
        if block_id in writing:
            return block_ids[:i]
    return block_ids
