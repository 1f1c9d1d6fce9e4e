"""Counters of the KV offload manager: per tier and in total, since the worker started."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TierStats:
    """Counters of one tier since start. Bytes are payload bytes (headers excluded)."""

    name: str
    num_lookups: int = 0  # lookup round trips sent to this tier
    num_lookup_errors: int = 0  # of those, failed (counted as misses)
    num_hit_blocks: int = 0  # blocks loaded from this tier
    num_loaded_bytes: int = 0
    load_seconds: float = 0.0  # wall time of this tier's lookup round trips + decoding
    num_bad_blobs: int = 0  # blobs refused by the format check (a miss from there on)
    num_stored_blocks: int = 0
    num_stored_bytes: int = 0
    num_skipped_blocks: int = 0  # not written: known or found to be stored already
    num_store_errors: int = 0  # blocks whose write failed or was skipped while down


@dataclass(slots=True)
class OffloadStats:
    """What `KVOffloadManager.stats()` returns: one `TierStats` per tier, in tier order."""

    tiers: list[TierStats] = field(default_factory=list)
    num_offered_blocks: int = 0  # blocks handed to store()
    num_filtered_blocks: int = 0  # held back by the reuse filter (offered once so far)
    num_dropped_blocks: int = 0  # not queued: the store queue was full

    @property
    def num_hit_blocks(self) -> int:
        return sum(t.num_hit_blocks for t in self.tiers)

    @property
    def num_loaded_bytes(self) -> int:
        return sum(t.num_loaded_bytes for t in self.tiers)

    @property
    def num_stored_blocks(self) -> int:
        return sum(t.num_stored_blocks for t in self.tiers)

    @property
    def num_stored_bytes(self) -> int:
        return sum(t.num_stored_bytes for t in self.tiers)

    @property
    def load_seconds(self) -> float:
        return sum(t.load_seconds for t in self.tiers)
