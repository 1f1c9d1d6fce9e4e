"""The KV tiers end to end in the offline `LLM`: Redis and disk below a small device cache.

Tiny Qwen3, fp32, greedy: every run must produce exactly the tokens of a run without tiers,
whether blocks come from the device, a tier, or are computed, and whatever the tier does
(dies, loses keys, hands back a corrupted blob).
"""

from __future__ import annotations

import random
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvcache.block_format import HEADER_SIZE
from tasks.params import SamplingParams
from tests.fixtures_services import start_redis_server
from workers.engine.llm import LLM

BLOCK_SIZE = 16
PREFIX_BLOCKS = 4  # 64-token shared prefixes
# tiny preset, fp32: 2 * 2 layers * 16 tokens * 2 kv heads * 16 dims * 4 bytes per block
KV_CACHE_BYTES = 24 * 4096  # 24 blocks: two or three requests at a time, then evictions
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def make_prompts(num_prefixes: int, per_prefix: int, seed: int = 0) -> list[list[int]]:
    """`per_prefix` prompts for each prefix, interleaved: a prefix returns after others."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 500) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)]
                for _ in range(num_prefixes)]
    return [prefixes[p] + [rng.randrange(1, 500) for _ in range(5)]
            for _ in range(per_prefix) for p in range(num_prefixes)]


def make_llm(model_dir: Path, tiers: list[str] | None = None, key_prefix: str = "llmq",
             **kwargs) -> LLM:
    return LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE,
               kv_cache_bytes=KV_CACHE_BYTES, max_num_seqs=2, max_num_batched_tokens=256,
               kv_tiers=tiers, kv_key_prefix=key_prefix, **kwargs)


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, PARAMS)]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(num_prefixes=3, per_prefix=3)


@pytest.fixture(scope="module")
def expected(tiny_qwen3_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens without tiers (same small cache)."""
    return run(make_llm(tiny_qwen3_dir), prompts)


@pytest.fixture
def redis_tier(redis_url: str) -> Iterator[tuple[str, str]]:
    """(tier URL, key prefix): database 2 of the test Redis, a throwaway key prefix."""
    base = redis_url.rsplit("/", 1)[0]
    url = f"{base}/2"
    key_prefix = f"llmqkvtest{uuid.uuid4().hex[:8]}"
    yield f"{url}?ttl_seconds=600", key_prefix
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=key_prefix + ":*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A redis-server child process of this test on a free port (the test may kill it)."""
    process, url = start_redis_server(tmp_path, "--maxmemory", "64mb",
                                      "--maxmemory-policy", "allkeys-lru")
    try:
        yield url, process
    finally:
        if process.poll() is None:
            process.terminate()
        process.wait(15)


def tier_stats(llm: LLM):
    assert llm.engine.kv_connector is not None
    return llm.engine.kv_connector.stats()


def second_round(llm: LLM, prompts: list[list[int]]) -> list:
    """Write what the first round queued, forget the device cache, run again."""
    assert llm.engine.kv_connector.flush(30)
    assert llm.engine.kv_manager.reset_prefix_cache()
    return llm.generate(prompts, PARAMS)


# --- exactness and hits ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["redis", "disk"])
def test_tiers_change_no_output_and_serve_evicted_prefixes(
        kind: str, tiny_qwen3_dir: Path, prompts, expected, redis_tier, tmp_path: Path) -> None:
    if kind == "redis":
        url, key_prefix = redis_tier
    else:
        url, key_prefix = f"file://{tmp_path}/kv?max_bytes=10000000", "llmq"
    llm = make_llm(tiny_qwen3_dir, [url], key_prefix)
    try:
        assert run(llm, prompts) == expected
        outs = second_round(llm, prompts)
        assert [o.token_ids for o in outs] == expected
        mine, tiers = tier_stats(llm)
        (tier,) = tiers.tiers
        # round 2 starts from an empty device cache: every prefix comes from the tier
        assert all(o.num_cached_tokens >= PREFIX_BLOCKS * BLOCK_SIZE for o in outs)
        assert tier.num_hit_blocks >= 3 * PREFIX_BLOCKS and tier.num_stored_blocks > 0
        # every hit reached the engine; a hit goes unloaded when the device got the prefix
        # while the lookup ran
        assert mine.num_found_blocks == tier.num_hit_blocks
        assert 3 * PREFIX_BLOCKS <= mine.num_loaded_blocks <= mine.num_found_blocks
        assert tier.num_lookup_errors == 0 and tier.num_bad_blobs == 0
        # blocks loaded from the tier are not read back from the device to be stored again
        assert mine.num_known_blocks >= 3 * PREFIX_BLOCKS
    finally:
        llm.close()


def test_a_prefix_is_a_hit_for_another_engine_after_device_eviction(
        tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    # many prefixes through a small device cache, two engines sharing a disk tier: the
    # second engine's device cache never saw them
    many = make_prompts(num_prefixes=6, per_prefix=2, seed=1)
    reference = run(make_llm(tiny_qwen3_dir), many)
    url = f"file://{tmp_path}/kv?max_bytes=10000000"
    first = make_llm(tiny_qwen3_dir, [url])
    assert run(first, many) == reference
    first.close()
    (tier,) = tier_stats(first)[1].tiers
    assert tier.num_stored_blocks >= 6 * PREFIX_BLOCKS
    second = make_llm(tiny_qwen3_dir, [url])
    try:
        outs = second.generate(many, PARAMS)
        assert [o.token_ids for o in outs] == reference
        assert outs[0].num_cached_tokens == PREFIX_BLOCKS * BLOCK_SIZE  # from the tier
        (tier,) = tier_stats(second)[1].tiers
        assert tier.num_hit_blocks >= 6 * PREFIX_BLOCKS
    finally:
        second.close()


def test_reuse_filter_stores_a_block_only_once_it_ended_twice(
        tiny_qwen3_dir: Path, prompts, expected, tmp_path: Path) -> None:
    llm = make_llm(tiny_qwen3_dir, [f"file://{tmp_path}/kv?max_bytes=10000000"],
                   kv_reuse_filter=True)
    try:
        once = [prompts[0]]  # one request: its blocks are seen once, nothing is stored
        assert run(llm, once) == expected[:1]
        assert llm.engine.kv_connector.flush(10)
        mine, tiers = tier_stats(llm)
        assert mine.num_filtered_blocks > 0 and tiers.num_stored_blocks == 0
        assert run(llm, prompts) == expected
        assert llm.engine.kv_connector.flush(10)
        assert tier_stats(llm)[1].num_stored_blocks >= PREFIX_BLOCKS
    finally:
        llm.close()


# --- faults: a miss, never wrong output --------------------------------------------------


def test_redis_stopped_mid_run(tiny_qwen3_dir: Path, prompts, expected, own_redis) -> None:
    url, process = own_redis
    llm = make_llm(tiny_qwen3_dir, [url])
    try:
        assert run(llm, prompts) == expected
        assert llm.engine.kv_connector.flush(30)
        process.kill()
        process.wait(10)
        outs = second_round(llm, prompts)  # lookups and stores against a dead server
        assert [o.token_ids for o in outs] == expected
        (tier,) = tier_stats(llm)[1].tiers
        assert tier.num_lookup_errors >= 1
        assert llm.engine.kv_connector.flush(30)  # failed writes are dropped, not retried
    finally:
        llm.close()


def test_keys_deleted_and_blobs_corrupted_are_misses(
        tiny_qwen3_dir: Path, prompts, expected, own_redis) -> None:
    url, _ = own_redis
    llm = make_llm(tiny_qwen3_dir, [url])
    client = redis.Redis.from_url(url)
    try:
        assert run(llm, prompts) == expected
        assert llm.engine.kv_connector.flush(30)
        keys = sorted(client.keys("llmq:kv:*"))
        assert len(keys) >= 3 * PREFIX_BLOCKS
        # NOTE: every block at once, so each prefix's first block is one: a lookup reads a
        # chain from its first block and stops at the first miss, so with a random share
        # deleted and another corrupted, a run could delete every chain's head first and
        # read no corrupted blob at all
        # flip a payload byte in every block: each is read, found bad and recomputed
        for key in keys:
            blob = bytearray(client.get(key))
            blob[HEADER_SIZE + 5] ^= 0xFF
            client.set(key, bytes(blob))
        outs = second_round(llm, prompts)
        assert [o.token_ids for o in outs] == expected
        (tier,) = tier_stats(llm)[1].tiers
        assert tier.num_bad_blobs >= 1
        # then delete every block (after the writes the last round queued): each lookup
        # is a miss, not an error, and nothing is loaded
        assert llm.engine.kv_connector.flush(30)
        client.delete(*client.keys("llmq:kv:*"))
        lookups, hit_blocks = tier.num_lookups, tier.num_hit_blocks
        assert llm.engine.kv_manager.reset_prefix_cache()
        outs = llm.generate(prompts, PARAMS)
        assert [o.token_ids for o in outs] == expected
        (tier,) = tier_stats(llm)[1].tiers
        assert tier.num_lookups > lookups and tier.num_hit_blocks == hit_blocks
        assert tier.num_lookup_errors == 0
    finally:
        client.close()
        llm.close()


def test_lookup_failures_and_wrong_length_payloads_are_misses(
        tiny_qwen3_dir: Path, prompts, expected, tmp_path: Path) -> None:
    llm = make_llm(tiny_qwen3_dir, [f"file://{tmp_path}/kv?max_bytes=10000000"])
    tiering = llm.engine.kv_connector
    real_lookup = tiering.offload.lookup
    try:
        assert run(llm, prompts) == expected
        # a payload one byte short (a tier with a bug): the run ends before it
        tiering.offload.lookup = lambda hashes: [  # type: ignore[method-assign]
            p if i != 1 else p[:-1] for i, p in enumerate(real_lookup(hashes))]
        outs = second_round(llm, prompts)
        assert [o.token_ids for o in outs] == expected
        mine, _ = tier_stats(llm)
        assert mine.num_bad_payloads >= 1
        assert outs[0].num_cached_tokens == BLOCK_SIZE  # only block 0 was loaded

        def broken(hashes):
            raise ConnectionError("tier on fire")

        tiering.offload.lookup = broken  # type: ignore[method-assign]
        outs = second_round(llm, prompts)
        assert [o.token_ids for o in outs] == expected
        assert tier_stats(llm)[0].num_lookup_failures >= 1
    finally:
        tiering.offload.lookup = real_lookup  # type: ignore[method-assign]
        llm.close()


# --- the scheduler's side, with a fake runner (exact block ids) ---------------------------


class FakeBlocks:
    """Block bytes keyed by id, like the runner's cache: read what `load` wrote."""

    bytes_per_block = 64

    def __init__(self) -> None:
        self.read: list[bytes] = []  # every payload read, in order

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        payloads = [bytes([i % 256, len(self.read) % 256]) * 32 for i in block_ids]
        self.read += payloads
        return payloads


def test_scheduler_loads_tier_blocks_into_fresh_blocks_and_asks_once(tmp_path: Path) -> None:
    from kvcache.block_format import BlockMeta
    from kvcache.kv_cache_manager import KVCacheManager
    from kvcache.offload import KVOffloadManager
    from workers.engine.scheduler import Scheduler
    from workers.engine.sequence import Sequence, SequenceStatus
    from workers.engine.tier_connector import TierConnector

    bs = 4
    meta = BlockMeta("f" * 16, "uint8", bs, (64,))
    offload = KVOffloadManager.from_urls([f"file://{tmp_path}/kv?max_bytes=1000000"], "t", meta)
    blocks = FakeBlocks()
    tiering = TierConnector(offload, blocks, bs)
    calls = []
    real_lookup = offload.lookup
    offload.lookup = lambda hashes: calls.append(len(hashes)) or real_lookup(hashes)

    def scheduler(num_blocks: int) -> Scheduler:
        return Scheduler(KVCacheManager(num_blocks, bs), max_num_seqs=4,
                         max_num_batched_tokens=64, max_model_len=64, kv_connector=tiering)

    def schedule(sched: Scheduler):
        """One step once the tier lookups it starts have answered (they run off the step)."""
        out = sched.schedule()
        while any(s.status == SequenceStatus.WAITING_FOR_REMOTE_KVS for s in sched.waiting):
            out = sched.schedule()
        return out

    params = SamplingParams(max_tokens=2)
    prompt = list(range(1, 18))  # 4 full blocks + 1 token

    # engine 1 computes the prompt; at its end blocks 0-3 go to the tier
    first = scheduler(8)
    seq = Sequence(0, "a", 0, prompt, params)
    first.add_seqs([seq])
    out = schedule(first)
    assert out.blocks_to_load == [] and calls == [4]
    first.kv_manager.commit()  # the step that computed it succeeded: its KV is written
    first.finish_seqs([seq], SequenceStatus.FINISHED_LENGTH)
    assert tiering.flush(10) and offload.stats().num_stored_blocks == 4
    stored = list(blocks.read)

    # engine 2: a cold device; while there is no room it asks nothing and waits
    second = scheduler(7)
    hog = Sequence(1, "hog", 0, list(range(100, 124)), params)  # 6 of the 7 blocks
    second.add_seqs([hog])
    schedule(second)
    assert calls == [4, 5]  # the hog's own admission
    seq = Sequence(2, "b", 0, prompt, params)
    second.add_seqs([seq])
    for _ in range(2):
        assert schedule(second).blocks_to_load == [] and seq.status == SequenceStatus.WAITING
    assert calls == [4, 5]  # no room: no lookup, none remembered
    second.finish_seqs([hog], SequenceStatus.FINISHED_ABORTED)
    out = schedule(second)
    table = seq.block_table
    # blocks 0-3 from the tier into fresh blocks; only the last token is computed
    assert [block_id for block_id, _ in out.blocks_to_load] == table[:4]
    assert [payload for _, payload in out.blocks_to_load] == stored
    (scheduled,) = out.scheduled
    assert scheduled.start_pos == 16 and scheduled.token_ids == [17]
    assert seq.num_cached_tokens == 16 and calls == [4, 5, 4]
    tiering.close()


class GatedTier:
    """A real tier store whose lookups wait until the test opens the gate (a slow Redis)."""

    def __init__(self, inner) -> None:
        import threading

        self.inner = inner
        self.name = inner.name
        self.gate = threading.Event()
        self.gate.set()
        self.num_waiting = 0

    def get_many(self, keys):
        self.num_waiting += 1
        assert self.gate.wait(30), "the test never opened the gate"
        return self.inner.get_many(keys)

    def put_many(self, items) -> None:
        self.inner.put_many(items)

    def contains_many(self, keys):
        return self.inner.contains_many(keys)

    def close(self) -> None:
        self.inner.close()


def test_a_slow_redis_lookup_never_blocks_the_step(redis_tier) -> None:
    import time

    from kvcache.block_format import BlockMeta
    from kvcache.kv_cache_manager import KVCacheManager
    from kvcache.offload import KVOffloadManager
    from kvcache.tiers import make_tier
    from workers.engine.scheduler import Scheduler
    from workers.engine.sequence import Sequence, SequenceStatus
    from workers.engine.tier_connector import TierConnector

    url, key_prefix = redis_tier
    bs = 4
    meta = BlockMeta("e" * 16, "uint8", bs, (64,))
    tier = GatedTier(make_tier(url, key_prefix))
    connector = TierConnector(KVOffloadManager([tier], meta), FakeBlocks(), bs)
    params = SamplingParams(max_tokens=2)
    prompt = list(range(1, 18))  # 4 full blocks + 1 token
    try:
        first = Scheduler(KVCacheManager(16, bs), max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=64, kv_connector=connector)
        seq = Sequence(0, "a", 0, prompt, params)
        first.add_seqs([seq])
        while seq.status != SequenceStatus.RUNNING:
            first.schedule()
        first.kv_manager.commit()  # the step that computed it succeeded: its KV is written
        first.finish_seqs([seq], SequenceStatus.FINISHED_LENGTH)
        assert connector.flush(10) and connector.offload.stats().num_stored_blocks == 4

        second = Scheduler(KVCacheManager(16, bs), max_num_seqs=4, max_num_batched_tokens=64,
                           max_model_len=64, kv_connector=connector)
        runner = Sequence(1, "r", 0, [200, 201, 202], params)  # no full block: no lookup
        second.add_seqs([runner])
        second.schedule()
        assert runner.status == SequenceStatus.RUNNING
        tier.gate.clear()  # Redis answers nothing until the gate opens
        seq = Sequence(2, "b", 0, prompt, params)
        second.add_seqs([seq])
        began = time.perf_counter()
        for _ in range(5):
            out = second.schedule()
            assert [s.seq_id for s in out.scheduled] == [1]  # the other keeps running
            runner.token_ids.append(7)  # it decodes a token per step
        assert time.perf_counter() - began < 5  # no step waited for the gated lookup
        assert seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS and tier.num_waiting == 1
        second.finish_seqs([runner], SequenceStatus.FINISHED_LENGTH)
        tier.gate.set()
        deadline = time.monotonic() + 10
        while seq.status != SequenceStatus.RUNNING and time.monotonic() < deadline:
            out = second.schedule()  # idle: waits a little for the lookup
        # a hit: blocks 0-3 load from Redis, only the last token is computed
        assert [block_id for block_id, _ in out.blocks_to_load] == seq.block_table[:4]
        chunk = next(s for s in out.scheduled if s.seq_id == 2)
        assert chunk.start_pos == 16 and seq.num_cached_tokens == 16
    finally:
        tier.gate.set()
        connector.close()


class OneByOneTier(GatedTier):
    """A real tier store that answers one lookup per `allow()` (lookups run in order)."""

    def __init__(self, inner) -> None:
        import threading

        super().__init__(inner)
        self.permits = threading.Semaphore(0)

    def allow(self) -> None:
        self.permits.release()

    def get_many(self, keys):
        self.num_waiting += 1
        assert self.permits.acquire(timeout=30), "the test never allowed this lookup"
        return self.inner.get_many(keys)


def _tier_scheduler_setup(tmp_path: Path):
    """A file tier answering one lookup per `allow()`, its connector, a scheduler factory
    and a prompt whose 4 full blocks are stored in the tier."""
    import time

    from kvcache.block_format import BlockMeta
    from kvcache.kv_cache_manager import KVCacheManager
    from kvcache.offload import KVOffloadManager
    from kvcache.tiers import make_tier
    from workers.engine.scheduler import Scheduler
    from workers.engine.sequence import Sequence, SequenceStatus
    from workers.engine.tier_connector import TierConnector

    bs = 4
    meta = BlockMeta("d" * 16, "uint8", bs, (64,))
    tier = OneByOneTier(make_tier(f"file://{tmp_path}/kv?max_bytes=1000000", "t"))
    connector = TierConnector(KVOffloadManager([tier], meta), FakeBlocks(), bs)
    prompt = list(range(1, 18))  # 4 full blocks + 1 token

    def scheduler() -> Scheduler:
        return Scheduler(KVCacheManager(16, bs), max_num_seqs=4, max_num_batched_tokens=64,
                         max_model_len=64, kv_connector=connector)

    def until_running(sched: Scheduler, seq: Sequence) -> list[int]:
        """Steps until `seq` runs (each step's KV written); the block ids loaded."""
        loaded: list[int] = []
        deadline = time.monotonic() + 10
        while seq.status != SequenceStatus.RUNNING and time.monotonic() < deadline:
            out = sched.schedule()  # idle: waits a little for the lookup
            loaded += [block_id for block_id, _ in out.blocks_to_load]
            sched.kv_manager.commit()
        assert seq.status == SequenceStatus.RUNNING
        return loaded

    first = scheduler()
    seq = Sequence(0, "a", 0, prompt, SamplingParams(max_tokens=2))
    first.add_seqs([seq])
    tier.allow()
    until_running(first, seq)
    first.finish_seqs([seq], SequenceStatus.FINISHED_LENGTH)
    assert connector.flush(10) and tier.num_waiting == 1
    return tier, connector, scheduler, until_running, prompt


@pytest.mark.parametrize("device_blocks", [0, 1])
def test_a_prefix_wanted_by_two_at_once_is_read_and_loaded_once(
        tmp_path: Path, device_blocks: int) -> None:
    """Two sequences of one prefix: the second waits for the first's lookup and admission,
    then takes the prefix from the device. One tier read, one load. With a device hit
    both hold it while they wait; the second's hold gives way to the longer hit."""
    from workers.engine.sequence import Sequence, SequenceStatus

    tier, connector, scheduler, until_running, prompt = _tier_scheduler_setup(tmp_path)
    params = SamplingParams(max_tokens=2)
    try:
        second = scheduler()
        if device_blocks:  # the device computes block 0 (loaded from the tier, here)
            head = Sequence(9, "h", 0, prompt[:4] + [99], params)
            second.add_seqs([head])
            tier.allow()
            until_running(second, head)
            second.finish_seqs([head], SequenceStatus.FINISHED_LENGTH)
        before, before_tiers = connector.stats()
        reads = tier.num_waiting
        seqs = [Sequence(1, "b", 0, prompt + [30], params),
                Sequence(2, "c", 0, prompt + [31], params)]
        for seq in seqs:
            second.add_seqs([seq])
        second.schedule()  # one lookup starts; the other sequence waits on it
        assert all(s.status == SequenceStatus.WAITING_FOR_REMOTE_KVS for s in seqs)
        assert all(len(s.block_table) == device_blocks for s in seqs)  # held hits
        tier.allow()
        loaded = until_running(second, seqs[0])
        assert loaded == seqs[0].block_table[device_blocks:4]
        assert until_running(second, seqs[1]) == []
        assert seqs[1].block_table[:4] == seqs[0].block_table[:4]  # the device's, shared
        assert all(s.num_cached_tokens == 16 for s in seqs)
        assert tier.num_waiting - reads == 1

        mine, tiers = connector.stats()
        assert mine.num_followed - before.num_followed == 1
        assert mine.num_found_blocks - before.num_found_blocks == 4 - device_blocks
        assert mine.num_loaded_blocks - before.num_loaded_blocks == 4 - device_blocks
        hits = tiers.tiers[0].num_hit_blocks - before_tiers.tiers[0].num_hit_blocks
        assert hits == 4 - device_blocks
    finally:
        for _ in range(3):
            tier.allow()
        connector.close()


def test_a_follower_looks_up_itself_when_its_leader_ends_and_an_ended_one_is_forgotten(
        tmp_path: Path) -> None:
    from workers.engine.sequence import Sequence, SequenceStatus

    tier, connector, scheduler, until_running, prompt = _tier_scheduler_setup(tmp_path)
    params = SamplingParams(max_tokens=2)
    try:
        second = scheduler()
        leader, gone, follower = (Sequence(i, str(i), 0, prompt + [30 + i], params)
                                  for i in (1, 2, 3))
        for seq in (leader, gone, follower):
            second.add_seqs([seq])
        second.schedule()
        assert connector.stats()[0].num_followed == 2
        # a follower ends while it waits, then the leader ends before its lookup answers
        second.finish_seqs([gone], SequenceStatus.FINISHED_ABORTED)
        second.finish_seqs([leader], SequenceStatus.FINISHED_ABORTED)
        tier.allow()  # the leader's lookup, cancelled or answered to nobody
        tier.allow()  # the follower's own
        loaded = until_running(second, follower)
        assert loaded == follower.block_table[:4] and follower.num_cached_tokens == 16
        second.schedule()  # the step after an admission: nothing waits on anything
        assert connector._following == {} and connector._followers == {}
    finally:
        for _ in range(3):
            tier.allow()
        connector.close()
