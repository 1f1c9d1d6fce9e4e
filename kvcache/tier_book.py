"""`TierBook`: what the offload manager knows of each tier, shared by lookups and writes.

Per tier: its counters, the hashes written or seen there lately (not worth rewriting),
the hashes whose blob there was refused (rewrite without asking whether the key exists),
and a rest period after a failure (a dead tier is not asked again every step). Lookups
run on the connector's lookup thread and writes on the writer thread, so every field is
read and changed under `lock`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import replace

from kvcache.block_format import BlockMeta
from kvcache.offload_stats import OffloadStats, TierStats
from kvcache.tiers.base import TierStore

logger = logging.getLogger(__name__)


class LRUCounter:
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


class TierBook:
    """The tiers in order, with their counters, recent hashes and failure state."""

    def __init__(self, tiers: list[TierStore], meta: BlockMeta, *,
                 recent_capacity: int = 65536, retry_after_seconds: float = 5.0,
                 log_interval_seconds: float = 60.0) -> None:
        self.tiers = list(tiers)
        self.meta = meta
        self.retry_after_seconds = retry_after_seconds
        self.log_interval_seconds = log_interval_seconds
        self.lock = threading.Lock()  # every field below
        self.stats = OffloadStats(tiers=[TierStats(t.name) for t in self.tiers])
        self.recent = [LRUCounter(recent_capacity) for _ in self.tiers]
        self.stale = [LRUCounter(recent_capacity) for _ in self.tiers]
        self._down_until = [0.0] * len(self.tiers)  # monotonic; a failed tier rests a while
        self._last_logged: dict[str, float] = {}

    def snapshot(self) -> OffloadStats:
        """A copy of the counters since start."""
        with self.lock:
            return replace(self.stats, tiers=[replace(t) for t in self.stats.tiers])

    def is_resting(self, index: int) -> bool:
        return time.monotonic() < self._down_until[index]

    def tier_failed(self, index: int, what: str, exc: Exception, num_blocks: int) -> None:
        """Count a failed lookup or store and rest the tier for `retry_after_seconds`."""
        with self.lock:
            self._down_until[index] = time.monotonic() + self.retry_after_seconds
            stats = self.stats.tiers[index]
            if what == "lookup":
                stats.num_lookups += 1
                stats.num_lookup_errors += 1
            else:
                stats.num_store_errors += num_blocks
        self.log_limited(f"{what}:{index}", "KV tier %s failed a %s of %d blocks (%s: %s); "
                         "treating it as a miss and leaving it alone for %.0fs",
                         self.tiers[index].name, what, num_blocks, type(exc).__name__, exc,
                         self.retry_after_seconds)

    def log_limited(self, topic: str, message: str, *args: object) -> None:
        """A warning at most once per `log_interval_seconds` per topic."""
        now = time.monotonic()
        with self.lock:
            last = self._last_logged.get(topic)
            if last is not None and now - last < self.log_interval_seconds:
                return
            self._last_logged[topic] = now
        logger.warning(message, *args)
