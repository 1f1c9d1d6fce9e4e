"""`KVOffloadManager`: the KV tiers below the device, as one object the engine holds.

Mooncake's flow (DESIGN section 5): on admission the engine looks a prompt's blocks up on
the device first and hands the hashes it did NOT find to `lookup`, which walks the tiers
in order (Redis, then disk, ...) for the longest consecutive run (`kvcache.tier_lookup`);
when a sequence finishes, the engine hands its full blocks to `store`, which queues them
for every tier (write-through) on the writer thread (`kvcache.tier_writer`), off the
step's critical path. What is known of each tier lives in `kvcache.tier_book`.

Failure policy: any tier error is a miss for that tier (logged, rate limited), never an
exception to the engine and never wrong output (kvcache.block_format checks every blob).
Nothing here imports torch: payloads are the runner's bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from kvcache.block_format import (  # noqa: F401  (block_key, make_fingerprint: re-exported)
    BlockMeta,
    block_key,
    make_fingerprint,
)
from kvcache.hashing import BlockHash
from kvcache.offload_stats import OffloadStats
from kvcache.tier_book import LRUCounter, TierBook
from kvcache.tier_lookup import lookup_run
from kvcache.tier_writer import StoreJob, TierWriter
from kvcache.tiers.base import TierStore
from kvcache.tiers.factory import make_tier

logger = logging.getLogger(__name__)


class KVOffloadManager:
    """Looks block runs up in, and writes blocks through to, an ordered list of tiers.

    `lookup` blocks its caller (one round trip per tier consulted): run it off the
    engine's step. `store` only enqueues. Promotion: blocks found in a lower tier are
    queued for the tiers above it, so the next hit is the cheap one. Thread-safe.
    """

    def __init__(
        self,
        tiers: list[TierStore],
        meta: BlockMeta,
        reuse_filter: bool = False,
        *,
        promote: bool = True,
        max_queue_bytes: int = 256 * 1024 * 1024,
        batch_max_bytes: int = 32 * 1024 * 1024,
        recent_capacity: int = 65536,
        reuse_capacity: int = 131072,
        retry_after_seconds: float = 5.0,
        log_interval_seconds: float = 60.0,
    ) -> None:
        self.meta = meta
        self.reuse_filter = reuse_filter
        self.promote = promote
        self.book = TierBook(tiers, meta, recent_capacity=recent_capacity,
                             retry_after_seconds=retry_after_seconds,
                             log_interval_seconds=log_interval_seconds)
        self.writer = TierWriter(self.book, max_queue_bytes=max_queue_bytes,
                                 batch_max_bytes=batch_max_bytes)
        self._offers = LRUCounter(reuse_capacity)  # the reuse filter's sightings
        self._offers_lock = threading.Lock()

    @classmethod
    def from_urls(cls, urls: Iterable[str], key_prefix: str, meta: BlockMeta,
                  reuse_filter: bool = False, **options: object) -> KVOffloadManager:
        """Tiers from `Settings.kv_tiers` URLs, in order; see kvcache.tiers.make_tier."""
        tiers = [make_tier(url, key_prefix) for url in urls]
        for tier in tiers:
            check = getattr(tier, "warn_if_unbounded", None)
            if check is not None:
                check()
        return cls(tiers, meta, reuse_filter, **options)  # type: ignore[arg-type]

    @property
    def tiers(self) -> list[TierStore]:
        return self.book.tiers

    @property
    def enabled(self) -> bool:
        return bool(self.book.tiers)

    def lookup(self, block_hashes: list[BlockHash]) -> list[bytes]:
        """Payloads of the longest consecutive run of `block_hashes` found in the tiers.

        `block_hashes` are the chained hashes after the device-tier hit; payload i belongs
        to block_hashes[i]. Blocks (one round trip per tier consulted).
        NOTE: the whole remainder is fetched at once, so pass no more hashes than the device
        has free blocks to load them into.
        """
        payloads, promotions = lookup_run(self.book, block_hashes, self.promote)
        if promotions:
            self.writer.enqueue(promotions)
        return payloads

    def store(self, items: list[tuple[BlockHash, bytes]]) -> None:
        """Queue full blocks (hash, payload) for every tier; returns at once, never raises.

        Blocks a tier is known to hold are skipped; with `reuse_filter`, a block is queued
        only once its hash has been offered twice (most blocks are never reused). A full
        queue drops blocks: a lost offload costs a recompute later, a blocked engine more.
        """
        if not self.book.tiers or not items:
            return
        everywhere = tuple(range(len(self.book.tiers)))
        num_offered = len(items)
        if self.reuse_filter:
            with self._offers_lock:
                items = [item for item in items if self._offers.add(item[0]) >= 2]
        with self.book.lock:
            self.book.stats.num_offered_blocks += num_offered
            self.book.stats.num_filtered_blocks += num_offered - len(items)
        self.writer.enqueue([StoreJob(h, payload, everywhere) for h, payload in items])

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or failed); False on timeout."""
        return self.writer.flush(timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Write what is queued (up to `timeout`), stop the writer, close the tiers."""
        self.writer.close(timeout)
        for tier in self.book.tiers:
            try:
                tier.close()
            except Exception as exc:  # noqa: BLE001  (shutting down: nothing left to protect)
                logger.debug("closing KV tier %s: %s", tier.name, exc)

    def stats(self) -> OffloadStats:
        """A snapshot of the counters since start."""
        return self.book.snapshot()
