"""`TierWriter`: writes blocks through to the tiers from its own thread.

The engine only enqueues (`enqueue` returns at once): a step never waits for a tier.
The thread takes batches of up to `batch_max_bytes`, skips blocks a tier is known to
hold, asks the tier which of the rest it already has (one round trip), and writes the
others in one round trip. A full queue drops blocks: a lost offload costs a recompute
later, a blocked engine more.

NOTE: a block becomes findable only through the tier's own `put_many`, which writes the
whole payload before the key exists; nothing here announces a block.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

from kvcache.block_format import HEADER_SIZE, block_key, encode_block
from kvcache.hashing import BlockHash
from kvcache.tier_book import TierBook

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StoreJob:
    block_hash: BlockHash
    data: bytes  # the runner's payload, or an encoded blob when `encoded`
    tier_indices: tuple[int, ...]  # where to write it (indices into TierBook.tiers)
    encoded: bool = False  # True for a promotion: the blob a lower tier returned

    @property
    def num_payload_bytes(self) -> int:
        return len(self.data) - HEADER_SIZE if self.encoded else len(self.data)


class TierWriter:
    """A bounded queue of `StoreJob`s and the thread that writes them. Thread-safe."""

    def __init__(self, book: TierBook, *, max_queue_bytes: int = 256 * 1024 * 1024,
                 batch_max_bytes: int = 32 * 1024 * 1024) -> None:
        self.book = book
        self.max_queue_bytes = max_queue_bytes
        self.batch_max_bytes = batch_max_bytes
        self._queue: deque[StoreJob] = deque()
        self._cond = threading.Condition()
        self._num_queued_bytes = 0
        self._num_pending = 0  # jobs queued or being written
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="llmq-kv-offload", daemon=True)
        self._thread.start()

    def enqueue(self, jobs: list[StoreJob]) -> None:
        """Queue jobs in order; those past `max_queue_bytes` are dropped (and counted)."""
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
            with self.book.lock:
                self.book.stats.num_dropped_blocks += dropped
            self.book.log_limited("queue", "KV offload queue full (%d bytes): dropped %d "
                                  "blocks; the tiers are slower than the engine frees blocks",
                                  self.max_queue_bytes, dropped)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._num_pending == 0, timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Write what is queued (up to `timeout`), then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            # what the timeout left unwritten is dropped (a cache may lose blocks)
            self._num_pending -= len(self._queue)
            self._num_queued_bytes = 0
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout)

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

    def _write(self, batch: list[StoreJob]) -> None:
        book = self.book
        meta = book.meta
        blobs: dict[BlockHash, bytes] = {}
        sizes = {job.block_hash: job.num_payload_bytes for job in batch}
        for job in batch:
            if job.block_hash in blobs:
                continue
            try:
                blobs[job.block_hash] = job.data if job.encoded else encode_block(job.data, meta)
            except ValueError as exc:  # the caller's payload does not match the layout
                book.log_limited("encode", "KV offload: not storing a block: %s", exc)
        for index, tier in enumerate(book.tiers):
            wanted = list(dict.fromkeys(job.block_hash for job in batch
                                        if index in job.tier_indices and job.block_hash in blobs))
            if not wanted:
                continue
            with book.lock:
                stale = {h for h in wanted if h in book.stale[index]}
                fresh = [h for h in wanted if h not in stale and h not in book.recent[index]]
                num_skipped = len(wanted) - len(fresh) - len(stale)
            if book.is_resting(index):
                with book.lock:
                    book.stats.tiers[index].num_store_errors += len(fresh) + len(stale)
                continue
            try:
                present = tier.contains_many([block_key(meta.fingerprint, h) for h in fresh])
                todo = [h for h, there in zip(fresh, present) if not there] + list(stale)
                num_skipped += len(fresh) + len(stale) - len(todo)
                tier.put_many([(block_key(meta.fingerprint, h), blobs[h]) for h in todo])
            except Exception as exc:  # noqa: BLE001  (a failed write only costs a recompute)
                book.tier_failed(index, "store", exc, len(fresh) + len(stale))
                continue
            with book.lock:
                stats = book.stats.tiers[index]
                stats.num_stored_blocks += len(todo)
                stats.num_stored_bytes += sum(sizes[h] for h in todo)
                stats.num_skipped_blocks += num_skipped
                for h in wanted:
                    book.recent[index].add(h)
                    book.stale[index].discard(h)
