"""Waiting sequences whose KV-connector lookup is in flight (mechanism for the `Scheduler`).

Such a sequence waits in `WAITING_FOR_REMOTE_KVS`, skipped without holding back the
sequences behind it, until the connector names its lookup finished. Meanwhile it holds a
seat of `max_num_seqs` (lookups run only for sequences about to be admitted: their
payloads wait in host memory) and references its device-hit blocks (the blocks the tiers
continue must not be evicted meanwhile). A hold lasts no longer than its lookup plus one
step, so it never keeps the sequences ahead of it from the room they need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache.kv_cache_manager import KVCacheManager
from workers.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from workers.engine.kv_connector import KVConnector


class PendingLookups:
    def __init__(self, kv_manager: KVCacheManager) -> None:
        self.kv_manager = kv_manager
        self.num_waiting = 0  # sequences in WAITING_FOR_REMOTE_KVS
        # seq_id -> device-hit tokens held (blocks referenced) while its lookup is in flight
        self._held_hits: dict[int, int] = {}

    @property
    def holds_hits(self) -> bool:
        return bool(self._held_hits)

    def held(self, seq_id: int) -> int | None:
        """Device-hit tokens `seq_id` already holds (its blocks are allocated), if any."""
        return self._held_hits.get(seq_id)

    def wait(self, seq: Sequence, computed_blocks: list[int], num_cached: int) -> None:
        """`seq`'s lookup is in flight: it waits, holding its device hit."""
        if seq.seq_id not in self._held_hits and computed_blocks:
            table = self.kv_manager.allocate_slots(
                seq.seq_id, seq.token_ids, num_cached, 0, computed_block_ids=computed_blocks)
            if table is not None:
                seq.block_table = table
                self._held_hits[seq.seq_id] = num_cached
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        self.num_waiting += 1

    def admitted(self, seq_id: int) -> None:
        self._held_hits.pop(seq_id, None)

    def drop(self, seq: Sequence) -> None:
        """`seq`'s held hit is freed (a longer one is about to be taken instead)."""
        del self._held_hits[seq.seq_id]
        self.kv_manager.free(seq.seq_id)
        seq.block_table = []

    def resume_finished(self, connector: KVConnector, seqs: dict[int, Sequence]) -> None:
        """Sequences whose lookup finished wait as before and are scheduled normally."""
        for seq_id in connector.take_finished_lookups():
            seq = seqs.get(seq_id)
            if seq is not None and seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS:
                # NOTE: the sort key stays the same (Sequence.sort_key)
                self.num_waiting -= 1
                seq.status = (SequenceStatus.PREEMPTED if seq.num_preemptions
                              else SequenceStatus.WAITING)

    def release_answered(self, seqs: dict[int, Sequence]) -> None:
        """Free the held hits of sequences whose lookup was answered but that were not
        admitted this step."""
        for seq_id in list(self._held_hits):
            seq = seqs[seq_id]
            if seq.status != SequenceStatus.WAITING_FOR_REMOTE_KVS:
                del self._held_hits[seq_id]
                self.kv_manager.free(seq_id)
                seq.block_table = []

    def forget(self, seq: Sequence) -> None:
        """`seq` ends (its blocks are freed by the caller)."""
        if seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS:
            self.num_waiting -= 1
        self._held_hits.pop(seq.seq_id, None)
