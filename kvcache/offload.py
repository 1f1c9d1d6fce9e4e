"""Offload policy for the KV tiers below the device: what to load, what to store, where.

Mooncake's flow (DESIGN section 5): on admission the engine looks a prompt's blocks up on
the device first and hands the hashes it did NOT find to `lookup`, which walks the tiers
in order (Redis, then disk, ...) for the longest consecutive run; when a sequence
finishes, the engine hands its full blocks to `store`, which writes them to every tier
(write-through) from a background thread, off the step's critical path.

Failure policy: any tier error is a miss for that tier (logged, rate limited), never an
exception to the engine and never wrong output (kvcache.block_format checks every blob).
Nothing here imports torch: payloads are the runner's bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

from kvcache.block_format import (  # noqa: F401  (block_key, make_fingerprint: re-exported)
    HEADER_SIZE,
    BlockMeta,
    block_key,
    decode_block,
    encode_block,
    make_fingerprint,
)
from kvcache.hashing import BlockHash
from kvcache.offload_stats import OffloadStats, TierStats
from kvcache.tiers.base import TierStore
from kvcache.tiers.factory import make_tier

logger = logging.getLogger(__name__)


class _LRUCounter:
    """A bounded map of recently seen hashes to a count; the least recent is forgotten."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def add(self, key: bytes) -> int:
        count = self._counts.pop(key, 0) + 1
        self._counts[key] = count
        if len(self._counts) > self.capacity:
            self._counts.popitem(last=False)
        return count

    def __contains__(self, key: bytes) -> bool:
        return key in self._counts

    def discard(self, key: bytes) -> None:
        self._counts.pop(key, None)


@dataclass(slots=True)
class _StoreJob:
    block_hash: BlockHash
    data: bytes  # the runner's payload, or an encoded blob when `encoded`
    tier_indices: tuple[int, ...]  # where to write it
    encoded: bool = False  # True for a promotion: the blob a lower tier returned

    @property
    def num_payload_bytes(self) -> int:
        return len(self.data) - HEADER_SIZE if self.encoded else len(self.data)


class KVOffloadManager:
    """Looks block runs up in, and writes blocks through to, an ordered list of tiers.

    `lookup` runs in the caller's thread (one round trip per tier consulted); `store`
    only enqueues. Promotion: blocks found in a lower tier are queued for the tiers above
    it, so the next hit is the cheap one. Thread-safe.
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
        self.tiers = list(tiers)
        self.meta = meta
        self.reuse_filter = reuse_filter
        self.promote = promote
        self.max_queue_bytes = max_queue_bytes
        self.batch_max_bytes = batch_max_bytes
        self.retry_after_seconds = retry_after_seconds
        self.log_interval_seconds = log_interval_seconds
        self._stats = OffloadStats(tiers=[TierStats(t.name) for t in self.tiers])
        self._lock = threading.Lock()  # stats, filters, circuit state
        # per tier: hashes written or seen there lately (skip rewriting them); hashes whose
        # blob there was refused (rewrite without asking whether the key exists)
        self._recent = [_LRUCounter(recent_capacity) for _ in self.tiers]
        self._stale = [_LRUCounter(recent_capacity) for _ in self.tiers]
        self._offers = _LRUCounter(reuse_capacity)
        self._down_until = [0.0] * len(self.tiers)  # monotonic; a failed tier rests a while
        self._last_logged: dict[str, float] = {}
        self._queue: deque[_StoreJob] = deque()
        self._cond = threading.Condition()
        self._num_queued_bytes = 0
        self._num_pending = 0  # jobs queued or being written
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="llmq-kv-offload", daemon=True)
        self._thread.start()

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
    def enabled(self) -> bool:
        return bool(self.tiers)

    # --- lookup -------------------------------------------------------------------------

    def lookup(self, block_hashes: list[BlockHash]) -> list[bytes]:
        """Payloads of the longest consecutive run of `block_hashes` found in the tiers.

        `block_hashes` are the chained hashes after the device-tier hit; payload i belongs
        to block_hashes[i]. Each tier gets one round trip for the hashes still missing and
        contributes blobs up to its first miss or bad blob; the next tier continues there.
        NOTE: the whole remainder is fetched at once, so pass no more hashes than the device
        has free blocks to load them into.
        """
        payloads: list[bytes] = []
        promotions: list[_StoreJob] = []
        for index, tier in enumerate(self.tiers):
            start = len(payloads)
            if start == len(block_hashes):
                break
            if self._is_resting(index):
                continue
            wanted = block_hashes[start:]
            keys = [block_key(self.meta.fingerprint, h) for h in wanted]
            began = time.perf_counter()
            try:
                blobs = tier.get_many(keys)
            except Exception as exc:  # noqa: BLE001  (any tier failure is a miss, not an error)
                self._tier_failed(index, "lookup", exc, len(keys))
                continue
            found: list[tuple[bytes, bytes]] = []  # (blob, payload)
            bad = False
            for blob in blobs:
                if blob is None:
                    break
                payload = decode_block(blob, self.meta)
                if payload is None:
                    bad = True
                    break
                found.append((blob, payload))
            elapsed = time.perf_counter() - began
            payloads.extend(payload for _, payload in found)
            above = tuple(i for i in range(index) if not self._is_resting(i))
            if self.promote and above:
                promotions += [_StoreJob(h, blob, above, encoded=True)
                               for h, (blob, _) in zip(wanted, found)]
            with self._lock:
                stats = self._stats.tiers[index]
                stats.num_lookups += 1
                stats.num_hit_blocks += len(found)
                stats.num_loaded_bytes += sum(len(p) for _, p in found)
                stats.load_seconds += elapsed
                stats.num_bad_blobs += int(bad)
                for h, blob in zip(wanted, blobs):
                    if blob is None:  # evicted (or never there): rewrite it when offered
                        self._recent[index].discard(h)
                    else:
                        self._recent[index].add(h)
                if bad:
                    self._stale[index].add(wanted[len(found)])
                    self._recent[index].discard(wanted[len(found)])
        if promotions:
            self._enqueue(promotions)
        return payloads

    # --- store --------------------------------------------------------------------------

    def store(self, items: list[tuple[BlockHash, bytes]]) -> None:
        """Queue full blocks (hash, payload) for every tier; returns at once, never raises.

        Blocks a tier is known to hold are skipped; with `reuse_filter`, a block is queued
        only once its hash has been offered twice (most blocks are never reused). A full
        queue drops blocks: a lost offload costs a recompute later, a blocked engine more.
        """
        if not self.tiers or not items:
            return
        everywhere = tuple(range(len(self.tiers)))
        with self._lock:
            self._stats.num_offered_blocks += len(items)
            if self.reuse_filter:
                kept = [item for item in items if self._offers.add(item[0]) >= 2]
                self._stats.num_filtered_blocks += len(items) - len(kept)
                items = kept
        self._enqueue([_StoreJob(h, payload, everywhere) for h, payload in items])

    def _enqueue(self, jobs: list[_StoreJob]) -> None:
        dropped = 0
        with self._cond:
            if self._closed:
                return
            for job in jobs:
                size = len(job.data)
                if self._num_queued_bytes + size > self.max_queue_bytes:
                    dropped += 1
                    continue
                self._queue.append(job)
                self._num_queued_bytes += size
                self._num_pending += 1
            self._cond.notify_all()
        if dropped:
            with self._lock:
                self._stats.num_dropped_blocks += dropped
            self._log_limited("queue", "KV offload queue full (%d bytes): dropped %d "
                              "blocks; the tiers are slower than the engine frees blocks",
                              self.max_queue_bytes, dropped)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                batch = [self._queue.popleft()]
                batch_bytes = len(batch[0].data)
                while self._queue and batch_bytes + len(self._queue[0].data) <= \
                        self.batch_max_bytes:
                    batch.append(self._queue.popleft())
                    batch_bytes += len(batch[-1].data)
                self._num_queued_bytes -= batch_bytes
            try:
                self._write(batch)
            except Exception:  # a bug here must not kill the writer thread
                logger.exception("KV offload: writing a batch of %d blocks failed", len(batch))
            finally:
                with self._cond:
                    self._num_pending -= len(batch)
                    self._cond.notify_all()

    def _write(self, batch: list[_StoreJob]) -> None:
        blobs: dict[BlockHash, bytes] = {}
        sizes = {job.block_hash: job.num_payload_bytes for job in batch}
        for job in batch:
            if job.block_hash in blobs:
                continue
            try:
                blobs[job.block_hash] = (job.data if job.encoded
                                         else encode_block(job.data, self.meta))
            except ValueError as exc:  # the caller's payload does not match the layout
                self._log_limited("encode", "KV offload: not storing a block: %s", exc)
        for index, tier in enumerate(self.tiers):
            wanted = list(dict.fromkeys(job.block_hash for job in batch
                                        if index in job.tier_indices and job.block_hash in blobs))
            if not wanted:
                continue
            with self._lock:
                stale = {h for h in wanted if h in self._stale[index]}
                fresh = [h for h in wanted if h not in stale and h not in self._recent[index]]
                num_skipped = len(wanted) - len(fresh) - len(stale)
            if self._is_resting(index):
                with self._lock:
                    self._stats.tiers[index].num_store_errors += len(fresh) + len(stale)
                continue
            try:
                present = tier.contains_many([block_key(self.meta.fingerprint, h)
                                              for h in fresh])
                todo = [h for h, there in zip(fresh, present) if not there] + list(stale)
                num_skipped += len(fresh) + len(stale) - len(todo)
                tier.put_many([(block_key(self.meta.fingerprint, h), blobs[h]) for h in todo])
            except Exception as exc:  # noqa: BLE001  (a failed write only costs a recompute)
                self._tier_failed(index, "store", exc, len(fresh) + len(stale))
                continue
            with self._lock:
                stats = self._stats.tiers[index]
                stats.num_stored_blocks += len(todo)
                stats.num_stored_bytes += sum(sizes[h] for h in todo)
                stats.num_skipped_blocks += num_skipped
                for h in wanted:
                    self._recent[index].add(h)
                    self._stale[index].discard(h)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._num_pending == 0, timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Write what is queued (up to `timeout`), stop the writer, close the tiers."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            # what the timeout left unwritten is dropped (a cache may lose blocks)
            self._num_pending -= len(self._queue)
            self._num_queued_bytes = 0
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout)
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as exc:  # noqa: BLE001  (shutting down: nothing left to protect)
                logger.debug("closing KV tier %s: %s", tier.name, exc)

    # --- stats and failures -------------------------------------------------------------

    def stats(self) -> OffloadStats:
        """A snapshot of the counters since start."""
        with self._lock:
            return replace(self._stats, tiers=[replace(t) for t in self._stats.tiers])

    def _is_resting(self, index: int) -> bool:
        return time.monotonic() < self._down_until[index]

    def _tier_failed(self, index: int, what: str, exc: Exception, num_blocks: int) -> None:
        with self._lock:
            self._down_until[index] = time.monotonic() + self.retry_after_seconds
            stats = self._stats.tiers[index]
            if what == "lookup":
                stats.num_lookups += 1
                stats.num_lookup_errors += 1
            else:
                stats.num_store_errors += num_blocks
        self._log_limited(f"{what}:{index}", "KV tier %s failed a %s of %d blocks (%s: %s); "
                          "treating it as a miss and leaving it alone for %.0fs",
                          self.tiers[index].name, what, num_blocks, type(exc).__name__, exc,
                          self.retry_after_seconds)

    def _log_limited(self, topic: str, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last_logged.get(topic)
            if last is not None and now - last < self.log_interval_seconds:
                return
            self._last_logged[topic] = now
        logger.warning(message, *args)

