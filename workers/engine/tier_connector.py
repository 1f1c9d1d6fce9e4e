"""`TierConnector`: the KV tiers (Redis, disk) below the device cache, as a `KVConnector`.

Policy lives here, mechanism in `kvcache.offload.KVOffloadManager` (bytes in and out of
the tiers) and `kvcache.kv_cache_manager` (which device block holds what).

* Lookup: the first time the scheduler asks about a waiting sequence, the blocks after
  its device hit are hashed and looked up on the connector's lookup thread (one round
  trip per tier: a Redis MGET of consecutive keys); the scheduler hears `None` and the
  sequence waits in `WAITING_FOR_REMOTE_KVS` while the others run. Once the lookup
  finishes, `take_finished_lookups` names it; asked again, the connector answers from the
  result, which it keeps until the sequence is admitted (a sequence that waits for room
  does not ask the tiers again every step; a preempted one asks again when re-admitted).
  Nothing is looked up while the device has no free block to load into.
* One read per prefix: a sequence whose lookup would start where another waiting
  sequence's did, after the same tokens, and read the same first `LEAD_BLOCKS` blocks,
  does not read the tiers too. It waits until that sequence is admitted and its step has
  run, then asks again: the device holds the shared prefix by then (the scheduler takes
  the longer device hit), and only what lies beyond it is looked up.
* Load: after allocation, the found payloads go with their fresh device blocks into
  `SchedulerOutput.blocks_to_load`; the runner writes them before the forward pass.
* Offload: when a sequence ends, right before its blocks are freed, its full blocks no
  running sequence holds are read from the device (`runner.read_blocks`, a device->host
  copy done in the step: it touches only blocks not known to be in the tiers, a few MiB
  at most per finished sequence) and handed to `KVOffloadManager.store`, which writes
  them from its own thread.

Failure is a miss, never wrong output and never an exception in the step: a lookup that
raises, or a payload of the wrong length, ends the run there (logged once per reason);
the rest of the prompt is computed.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvcache.block_format import BlockMeta, make_fingerprint
from kvcache.hashing import BlockHash, hash_full_blocks
from kvcache.offload import KVOffloadManager
from kvcache.offload_stats import OffloadStats
from kvcache.tier_book import LRUCounter

if TYPE_CHECKING:
    from workers.engine.sequence import Sequence
    from workers.engine.step_io import SchedulerOutput

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
    """What the connector needs of the model runner (`workers.engine.model_runner.ModelRunner`)."""

    @property
    def bytes_per_block(self) -> int: ...

    def read_blocks(self, block_ids: list[int]) -> list[bytes]: ...


@dataclass(slots=True)
class _Found:
    start: int  # block index of payloads[0] in the sequence
    hashes: list[BlockHash]  # hash of each block in payloads
    payloads: list[bytes]  # consecutive blocks found in the tiers


# A sequence's tokens up to the end of its lookup's first blocks (the device hit, then up
# to LEAD_BLOCKS blocks): another sequence's lookup with the same key reads at least those
# blocks, so this one waits for it
_LeadKey = tuple[int, ...]
LEAD_BLOCKS = 4


@dataclass(slots=True)
class _Lookup:
    future: Future[_Found]  # done once the lookup thread answered (never an exception)
    key: _LeadKey  # followers wait on it until this sequence is admitted
    # the device hit, in blocks, when the scheduler last asked: the first loaded block
    first_block: int = 0


@dataclass(slots=True)
class TierConnectorStats:
    """The engine side's counters since start (the tiers' own are in `offload`)."""

    num_lookups: int = 0  # sequence admissions that asked the tiers
    # admissions that waited for another sequence's lookup of the same blocks instead
    num_followed: int = 0
    # blocks the lookups found; a found block goes unloaded when the device got it meanwhile
    # (another sequence loaded or computed it while the lookup ran)
    num_found_blocks: int = 0
    num_loaded_blocks: int = 0  # blocks handed to the scheduler to load
    num_bad_payloads: int = 0  # payloads of the wrong length (a miss from there on)
    num_lookup_failures: int = 0  # lookups that raised (a miss)
    num_offered_blocks: int = 0  # full blocks of ended sequences, candidates to store
    num_known_blocks: int = 0  # of those, not read: known to be in the tiers already
    num_filtered_blocks: int = 0  # of those, not read: seen once so far (reuse filter)
    num_stored_blocks: int = 0  # of those, read and handed to the offload manager
    num_read_failures: int = 0  # device reads that raised (blocks not stored)


class TierConnector:
    """Looks prefixes up in, and offloads ended sequences' blocks to, the KV tiers.

    Called from the engine's thread only, except `stats`/`figures` (any thread); the
    lookups run on the connector's own thread.
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
        self._lookups: dict[int, _Lookup] = {}  # seq_id -> lookup, until admitted or ended
        # key -> seq ids waiting for the sequence whose lookup has that key to be admitted
        self._followers: dict[_LeadKey, list[int]] = {}
        self._following: dict[int, _LeadKey] = {}  # follower seq id -> the key it waits on
        # keys whose sequence was admitted this step: later askers wait for the next step
        self._settling: set[_LeadKey] = set()
        # seq ids whose lookup finished, appended by the lookup thread (deque: thread-safe)
        self._finished: deque[int] = deque()
        self._finished_event = threading.Event()
        # NOTE: one thread: lookups run in the order asked, so a sequence admitted earlier
        # is answered earlier
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmq-kv-lookup")
        self._to_load: list[tuple[int, bytes]] = []  # this step's (block id, payload)
        # hashes stored (or loaded from a tier) lately: not worth a device read again
        self._known = LRUCounter(known_capacity)
        self._seen_once = LRUCounter(known_capacity)  # the reuse filter's first sightings
        self._stats = TierConnectorStats()
        self._lock = threading.Lock()  # the stats, for readers on other threads
        self._logged: set[str] = set()

    @classmethod
    def from_urls(cls, urls: Iterable[str], key_prefix: str, runner: Any,
                  model_fingerprint: str, *, tp_size: int = 1, tp_rank: int = 0,
                  reuse_filter: bool = False) -> TierConnector:
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

    # --- admission (KVConnector) --------------------------------------------------------

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int,
                                   num_free_blocks: int) -> tuple[int | None, bool]:
        bs = self.block_size
        num_device = num_computed_tokens // bs
        # the tiers continue the device hit, into fresh blocks the free ones can hold
        # (one stays free for the computed tail); the last prompt token is always computed
        max_blocks = min((seq.num_tokens - 1) // bs, num_device + num_free_blocks - 1)
        seq_id = seq.seq_id
        if seq_id in self._following:
            return None, False
        lookup = self._lookups.get(seq_id)
        if lookup is None:
            if max_blocks <= num_device:
                return 0, False  # nothing to look up now (no room): ask when there is
            key = tuple(seq.token_ids[:min(max_blocks, num_device + LEAD_BLOCKS) * bs])
            if key in self._followers:
                self._follow(seq_id, key)
                return None, False
            self._followers[key] = []
            future = self._executor.submit(self._lookup, seq.token_ids[:max_blocks * bs],
                                           num_device, max_blocks)
            self._lookups[seq_id] = _Lookup(future, key)
            future.add_done_callback(lambda _: self._lookup_done(seq_id))
            return None, False
        if not lookup.future.done():
            return None, False
        found = lookup.future.result()
        lookup.first_block = num_device
        if num_device < found.start:
            return 0, False  # the device lost blocks before the run: it would not be consecutive
        skip = num_device - found.start
        num_blocks = max(0, min(len(found.payloads) - skip, max_blocks - num_device))
        return num_blocks * bs, False

    def update_state_after_alloc(self, seq: Sequence, blocks: list[int],
                                 num_external_tokens: int) -> None:
        lookup = self._lookups.pop(seq.seq_id, None)
        if lookup is not None:
            # its followers ask again once this step has run: the device has the blocks
            self._release_followers(lookup.key)
            self._settling.add(lookup.key)
        num_loaded = num_external_tokens // self.block_size
        if lookup is None or not num_loaded:
            return
        found = lookup.future.result()
        first = lookup.first_block
        skip = first - found.start
        self._to_load.extend(zip(blocks[first:first + num_loaded],
                                 found.payloads[skip:skip + num_loaded]))
        # loaded blocks are in the tiers: no device read when the sequence ends
        for block_hash in found.hashes[skip:skip + num_loaded]:
            self._known.add(block_hash)
        with self._lock:
            self._stats.num_loaded_blocks += num_loaded

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> None:
        if self._to_load:
            scheduler_output.blocks_to_load = self._to_load
            self._to_load = []

    def take_finished_lookups(self) -> list[int]:
        # NOTE: called at the start of a step: the last step has written the blocks of
        # the sequences admitted in it, so their keys lead nobody any more (their
        # followers were released at the admission, or as they came: `_follow`)
        for key in self._settling:
            del self._followers[key]
        self._settling.clear()
        if not self._finished:
            return []
        self._finished_event.clear()
        finished: list[int] = []
        while self._finished:
            finished.append(self._finished.popleft())
        return finished

    def wait_for_lookups(self, timeout: float) -> None:
        """Block up to `timeout` seconds until some lookup finishes (for an idle step)."""
        if not self._finished:
            self._finished_event.wait(timeout)

    def _lookup_done(self, seq_id: int) -> None:
        self._finished.append(seq_id)
        self._finished_event.set()

    def _follow(self, seq_id: int, key: _LeadKey) -> None:
        """`seq_id` waits for the lookup of `key`'s sequence (or the step admitting it)."""
        self._followers[key].append(seq_id)
        self._following[seq_id] = key
        with self._lock:
            self._stats.num_followed += 1
        if key in self._settling:  # admitted this step: ask again at the next one
            self._release_followers(key)

    def _release_followers(self, key: _LeadKey) -> None:
        """The sequences waiting on `key` are named finished: they ask again."""
        followers = self._followers.get(key)
        if not followers:
            return
        for seq_id in followers:
            del self._following[seq_id]
            self._lookup_done(seq_id)
        followers.clear()

    def _lookup(self, token_ids: list[int], start: int, max_blocks: int) -> _Found:
        """On the lookup thread: the payloads of blocks start.. found in the tiers."""
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
            self._stats.num_found_blocks += len(payloads)
        return _Found(start, hashes[:len(payloads)], payloads)

    # --- end of a sequence (KVConnector) ------------------------------------------------

    def request_finished(self, seq: Sequence, blocks: list[tuple[int, BlockHash]]) -> None:
        lookup = self._lookups.pop(seq.seq_id, None)
        if lookup is not None:
            lookup.future.cancel()  # not started yet: never runs
            self._release_followers(lookup.key)  # they look up for themselves
            del self._followers[lookup.key]
        key = self._following.pop(seq.seq_id, None)
        if key is not None:
            self._followers[key].remove(seq.seq_id)
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

    # --- figures and shutdown -----------------------------------------------------------

    def stats(self) -> tuple[TierConnectorStats, OffloadStats]:
        """Snapshots of the engine side's and the tiers' counters."""
        with self._lock:
            mine = TierConnectorStats(*(getattr(self._stats, f) for f in
                                        TierConnectorStats.__dataclass_fields__))
        return mine, self.offload.stats()

    def figures(self) -> dict[str, dict[str, float]]:
        """Cumulative per-tier counters for the heartbeat: {tier name: {figure: value}}."""
        return {tier.name: {figure: getattr(tier, attr) for figure, attr in TIER_FIGURES.items()}
                for tier in self.offload.stats().tiers}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued blocks are written; False on timeout."""
        return self.offload.flush(timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Drop lookups not started, write what is queued (up to `timeout`), close the tiers."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.offload.close(timeout)

    def _log_once(self, topic: str, message: str, *args: object) -> None:
        level = logging.DEBUG if topic in self._logged else logging.WARNING
        self._logged.add(topic)
        logger.log(level, message, *args)
