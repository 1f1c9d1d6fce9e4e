"""`KVTiering`: the engine's side of the KV tiers (Redis, disk) below the device cache.

Policy lives here, mechanism in `kvcache.offload.KVOffloadManager` (bytes in and out of
the tiers) and `kvcache.kv_cache_manager` (which device block holds what). The scheduler
calls two hooks:

* on admission, after the device prefix hit, `find_prefix(...)`: the payloads of the
  blocks that follow the device hit, found in the tiers (one round trip per tier). The
  scheduler gives them fresh device blocks, counts them as computed, and puts
  `(block_id, payload)` in `SchedulerOutput.blocks_to_load`, which the runner writes
  into the cache before the step's forward pass. The result is remembered per sequence
  until it is admitted, so a sequence that waits for room does not ask the tiers again
  every step; a preempted sequence asks again when it is re-admitted.
* when a sequence ends (finished or aborted), right before its blocks are freed,
  `offload(seq_id, blocks)`: the full blocks no running sequence holds are read from the
  device (`runner.read_blocks`, a device->host copy done in the step: it touches only
  blocks not known to be in the tiers, a few MiB at most per finished sequence) and handed
  to `KVOffloadManager.store`, which writes them from its own thread.

Failure is a miss, never wrong output and never an exception in the step: a lookup that
raises, or a payload of the wrong length, ends the run there (logged once per reason);
the rest of the prompt is computed.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from kvcache.block_format import BlockMeta, make_fingerprint
from kvcache.hashing import BlockHash, hash_full_blocks
from kvcache.offload import KVOffloadManager
from kvcache.offload_stats import OffloadStats

logger = logging.getLogger(__name__)

# Per-tier counters exported as metrics: figure name -> TierStats attribute.
TIER_FIGURES: dict[str, str] = {
    "lookups": "num_lookups",
    "lookup_errors": "num_lookup_errors",
    "hit_blocks": "num_hit_blocks",
    "loaded_bytes": "num_loaded_bytes",
    "load_seconds": "load_seconds",
    "bad_blobs": "num_bad_blobs",
    "stored_blocks": "num_stored_blocks",
    "stored_bytes": "num_stored_bytes",
    "store_errors": "num_store_errors",
}


class BlockIO(Protocol):
    """What the tiering needs of the model runner (`workers.engine.model_runner.ModelRunner`)."""

    @property
    def bytes_per_block(self) -> int: ...

    def read_blocks(self, block_ids: list[int]) -> list[bytes]: ...


@dataclass(slots=True)
class _Found:
    start: int  # block index of payloads[0] in the sequence
    hashes: list[BlockHash]  # hash of each block in payloads
    payloads: list[bytes]  # consecutive blocks found in the tiers


@dataclass(slots=True)
class KVTieringStats:
    """The engine side's counters since start (the tiers' own are in `offload`)."""

    num_lookups: int = 0  # sequence admissions that asked the tiers
    num_loaded_blocks: int = 0  # blocks handed to the scheduler to load
    num_bad_payloads: int = 0  # payloads of the wrong length (a miss from there on)
    num_lookup_failures: int = 0  # lookups that raised (a miss)
    num_offered_blocks: int = 0  # full blocks of ended sequences, candidates to store
    num_known_blocks: int = 0  # of those, not read: known to be in the tiers already
    num_filtered_blocks: int = 0  # of those, not read: seen once so far (reuse filter)
    num_stored_blocks: int = 0  # of those, read and handed to the offload manager
    num_read_failures: int = 0  # device reads that raised (blocks not stored)


class _LRUSet:
    """A bounded set; the least recently added or touched key is forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys


class KVTiering:
    """Looks prefixes up in, and offloads ended sequences' blocks to, the KV tiers.

    Called from the engine's thread only, except `stats`/`figures` (any thread).
    """

    def __init__(self, offload: KVOffloadManager, runner: BlockIO, block_size: int, *,
                 reuse_filter: bool = False, known_capacity: int = 65536) -> None:
        if offload.meta.num_bytes != runner.bytes_per_block:
            raise ValueError(
                f"KV tier blocks of {offload.meta.num_bytes} bytes do not match the runner's "
                f"{runner.bytes_per_block}-byte blocks; build the BlockMeta from the runner")
        self.offload = offload
        self.runner = runner
        self.block_size = block_size
        self.reuse_filter = reuse_filter
        self._found: dict[int, _Found] = {}  # seq_id -> lookup result, until admitted
        # hashes stored (or loaded from a tier) lately: not worth a device read again
        self._known = _LRUSet(known_capacity)
        self._seen_once = _LRUSet(known_capacity)  # the reuse filter's first sightings
        self._stats = KVTieringStats()
        self._lock = threading.Lock()  # the stats, for readers on other threads
        self._logged: set[str] = set()

    @classmethod
    def from_urls(cls, urls: Iterable[str], key_prefix: str, runner: Any,
                  model_fingerprint: str, *, tp_size: int = 1, tp_rank: int = 0,
                  reuse_filter: bool = False) -> KVTiering:
        """Tiers from `Settings.kv_tiers` URLs for a `ModelRunner`'s KV layout.

        The key fingerprint names weights, dtype, block size and TP layout, so only
        workers whose KV bytes are interchangeable share blocks.
        """
        dtype = str(runner.dtype).removeprefix("torch.")
        block_size = runner.block_size
        fingerprint = make_fingerprint(model_fingerprint, dtype, block_size, tp_size, tp_rank)
        meta = BlockMeta(fingerprint, dtype, block_size, runner.block_shape)
        offload = KVOffloadManager.from_urls(list(urls), key_prefix, meta)
        logger.info("KV tiers %s, fingerprint %s, reuse filter %s",
                    [t.name for t in offload.tiers], fingerprint, "on" if reuse_filter else "off")
        return cls(offload, runner, block_size, reuse_filter=reuse_filter)

    # --- admission ----------------------------------------------------------------------

    def find_prefix(self, seq_id: int, token_ids: list[int], num_device_blocks: int,
                    max_blocks: int) -> list[bytes]:
        """Payloads of the blocks right after the device hit, found in the tiers.

        `num_device_blocks` full blocks of `token_ids` are device hits; the result holds
        payloads for blocks num_device_blocks, num_device_blocks + 1, ... (consecutive),
        never reaching block index `max_blocks`. Asks the tiers once per admission: until
        `admitted(seq_id)`, later calls reuse the first answer.
        """
        found = self._found.get(seq_id)
        if found is None:
            if max_blocks <= num_device_blocks:
                return []  # nothing to look up now (no room): ask when there is
            found = self._lookup(token_ids, num_device_blocks, max_blocks)
            self._found[seq_id] = found
        if num_device_blocks < found.start:
            return []  # the device lost blocks before the run: it would not be consecutive
        skip = num_device_blocks - found.start
        return found.payloads[skip:skip + max(0, max_blocks - num_device_blocks)]

    def admitted(self, seq_id: int, first_block: int, num_loaded: int) -> None:
        """The sequence got its blocks, `num_loaded` of them from the tiers from block
        index `first_block` on: forget the lookup, and remember the loaded blocks as
        stored (no device read when the sequence ends)."""
        found = self._found.pop(seq_id, None)
        if found is None or not num_loaded:
            return
        skip = first_block - found.start
        for block_hash in found.hashes[skip:skip + num_loaded]:
            self._known.add(block_hash)
        with self._lock:
            self._stats.num_loaded_blocks += num_loaded

    def _lookup(self, token_ids: list[int], start: int, max_blocks: int) -> _Found:
        if max_blocks <= start:
            return _Found(start, [], [])
        bs = self.block_size
        hashes = hash_full_blocks(token_ids[:max_blocks * bs], bs)[start:]
        try:
            payloads = self.offload.lookup(hashes)
        except Exception as exc:  # noqa: BLE001  (a tier problem is a miss, never an error)
            self._log_once("lookup", "KV tier lookup failed (%s: %s); computing the prompt",
                           type(exc).__name__, exc)
            with self._lock:
                self._stats.num_lookups += 1
                self._stats.num_lookup_failures += 1
            return _Found(start, [], [])
        size = self.runner.bytes_per_block
        for index, payload in enumerate(payloads):
            if len(payload) != size:
                self._log_once("length", "KV tier payload of %d bytes, expected %d; treating "
                               "it as a miss", len(payload), size)
                with self._lock:
                    self._stats.num_bad_payloads += 1
                payloads = payloads[:index]
                break
        with self._lock:
            self._stats.num_lookups += 1
        return _Found(start, hashes[:len(payloads)], payloads)

    # --- end of a sequence --------------------------------------------------------------

    def offload_blocks(self, seq_id: int, blocks: list[tuple[int, BlockHash]]) -> None:
        """Store an ended sequence's unshared full blocks `(block id, hash)` to the tiers.

        Call it right before the device blocks are freed (their bytes are read here).
        Never raises.
        """
        self._found.pop(seq_id, None)
        if not blocks:
            return
        wanted: list[tuple[int, BlockHash]] = []
        num_known = num_filtered = 0
        for block_id, block_hash in blocks:
            if block_hash in self._known:
                num_known += 1
            elif self.reuse_filter and block_hash not in self._seen_once:
                self._seen_once.add(block_hash)
                num_filtered += 1
            else:
                wanted.append((block_id, block_hash))
        payloads: list[bytes] = []
        if wanted:
            try:
                payloads = self.runner.read_blocks([block_id for block_id, _ in wanted])
            except Exception as exc:  # noqa: BLE001  (a lost offload only costs a recompute)
                self._log_once("read", "reading KV blocks for the tiers failed (%s: %s); "
                               "not storing them", type(exc).__name__, exc)
                with self._lock:
                    self._stats.num_read_failures += len(wanted)
                wanted = []
        items = [(block_hash, payload) for (_, block_hash), payload in zip(wanted, payloads)]
        for block_hash, _ in items:
            self._known.add(block_hash)
        self.offload.store(items)
        with self._lock:
            stats = self._stats
            stats.num_offered_blocks += len(blocks)
            stats.num_known_blocks += num_known
            stats.num_filtered_blocks += num_filtered
            stats.num_stored_blocks += len(items)

    def forget(self, seq_id: int) -> None:
        """Drop what was remembered for a sequence that holds no blocks."""
        self._found.pop(seq_id, None)

    # --- figures and shutdown -----------------------------------------------------------

    def stats(self) -> tuple[KVTieringStats, OffloadStats]:
        """Snapshots of the engine side's and the tiers' counters."""
        with self._lock:
            mine = KVTieringStats(*(getattr(self._stats, f) for f in
                                    KVTieringStats.__dataclass_fields__))
        return mine, self.offload.stats()

    def figures(self) -> dict[str, dict[str, float]]:
        """Cumulative per-tier counters for the heartbeat: {tier name: {figure: value}}."""
        return {tier.name: {figure: getattr(tier, attr) for figure, attr in TIER_FIGURES.items()}
                for tier in self.offload.stats().tiers}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued blocks are written; False on timeout."""
        return self.offload.flush(timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Write what is queued (up to `timeout`), then close the tiers."""
        self.offload.close(timeout)

    def _log_once(self, topic: str, message: str, *args: object) -> None:
        level = logging.DEBUG if topic in self._logged else logging.WARNING
        self._logged.add(topic)
        logger.log(level, message, *args)
