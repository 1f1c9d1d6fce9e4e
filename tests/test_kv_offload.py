"""The block blob format and the offload policy over a real Redis and a disk tier."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from kvcache.block_format import (
    HEADER_SIZE,
    BlockMeta,
    decode_block,
    encode_block,
    make_fingerprint,
)
from kvcache.hashing import BlockHash, hash_full_blocks
from kvcache.offload import KVOffloadManager, block_key
from kvcache.tiers import DiskTierStore, RedisTierStore
from tests.fixtures_services import free_port, start_redis_server

BLOCK_SIZE = 4
FINGERPRINT = make_fingerprint("weights-sha", "float16", BLOCK_SIZE, tp_size=1, tp_rank=0)
# [2, num_layers, block_size, num_kv_heads, head_dim] of float16: 256 bytes per block
META = BlockMeta(FINGERPRINT, "float16", BLOCK_SIZE, (2, 2, BLOCK_SIZE, 2, 4))


def blocks(num_blocks: int, seed: int = 0) -> list[tuple[BlockHash, bytes]]:
    """(hash, payload) of the full blocks of one prompt; payloads differ block to block."""
    token_ids = [seed * 1000 + i for i in range(num_blocks * BLOCK_SIZE)]
    hashes = hash_full_blocks(token_ids, BLOCK_SIZE)
    return [(h, os.urandom(META.num_bytes)) for h in hashes]


# --- blob format ----------------------------------------------------------------------


def test_blob_round_trip() -> None:
    payload = os.urandom(META.num_bytes)
    blob = encode_block(payload, META)
    assert len(blob) == HEADER_SIZE + META.num_bytes and HEADER_SIZE % 16 == 0
    assert decode_block(blob, META) == payload
    assert decode_block(blob, BlockMeta(FINGERPRINT, "torch.float16", 4, [2, 2, 4, 2, 4])) \
        == payload  # the torch spelling of the dtype and a list shape mean the same


def _flip(blob: bytes, index: int) -> bytes:
    return blob[:index] + bytes([blob[index] ^ 0x01]) + blob[index + 1:]


@pytest.mark.parametrize("corrupt", [
    lambda b: b[:HEADER_SIZE + 10],  # truncated payload
    lambda b: b[:50],  # truncated header
    lambda b: b"",
    lambda b: b + b"\x00",  # trailing bytes
    lambda b: _flip(b, HEADER_SIZE + 17),  # flipped payload byte
    lambda b: _flip(b, len(b) - 1),  # flipped last payload byte
    lambda b: _flip(b, 0),  # magic
    lambda b: _flip(b, 4),  # format version
    lambda b: _flip(b, HEADER_SIZE - 9),  # checksum field
], ids=["truncated", "header-only", "empty", "trailing", "payload-bit", "last-bit", "magic",
        "version", "checksum"])
def test_corrupted_blobs_are_refused(corrupt: Callable[[bytes], bytes]) -> None:
    blob = encode_block(os.urandom(META.num_bytes), META)
    assert decode_block(corrupt(blob), META) is None


@pytest.mark.parametrize("other", [
    BlockMeta(make_fingerprint("other-weights", "float16", 4, 1, 0), "float16", 4,
              (2, 2, 4, 2, 4)),
    BlockMeta(FINGERPRINT, "bfloat16", 4, (2, 2, 4, 2, 4)),
    BlockMeta(FINGERPRINT, "float16", 4, (2, 2, 4, 4, 2)),  # same bytes, other shape
    BlockMeta(FINGERPRINT, "float16", 4, (2, 4, 2, 4)),
    BlockMeta(FINGERPRINT, "float16", 8, (2, 2, 4, 2, 4)),
], ids=["fingerprint", "dtype", "shape", "ndim", "block-size"])
def test_blobs_of_another_layout_are_refused(other: BlockMeta) -> None:
    payload = os.urandom(other.num_bytes)
    assert decode_block(encode_block(payload, other), other) == payload
    assert decode_block(encode_block(payload, other), META) is None


def test_encode_checks_the_payload_length_and_meta_validates() -> None:
    with pytest.raises(ValueError, match="256 bytes"):
        encode_block(b"\x00" * 255, META)
    with pytest.raises(ValueError, match="dtype"):
        BlockMeta(FINGERPRINT, "complex64", 4, (2, 2))
    with pytest.raises(ValueError, match="fingerprint"):
        BlockMeta("x" * 33, "float16", 4, (2, 2))


def test_fingerprint_covers_every_part_of_the_layout() -> None:
    base = ("weights-sha", "float16", 16, 2, 0)
    variants = [base, ("weights-shb", "float16", 16, 2, 0), ("weights-sha", "bfloat16", 16, 2, 0),
                ("weights-sha", "float16", 32, 2, 0), ("weights-sha", "float16", 16, 4, 0),
                ("weights-sha", "float16", 16, 2, 1)]
    prints = [make_fingerprint(*v) for v in variants]
    assert len(set(prints)) == len(prints)
    assert all(len(p) == 16 and int(p, 16) >= 0 for p in prints)
    assert make_fingerprint("weights-sha", "torch.float16", 16, 2, 0) == prints[0]
    with pytest.raises(ValueError, match="tp_rank"):
        make_fingerprint("w", "float16", 16, 2, 2)


# --- offload manager --------------------------------------------------------------------


@pytest.fixture
def raw_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def make_manager() -> Iterator[Callable[..., KVOffloadManager]]:
    managers: list[KVOffloadManager] = []

    def make(urls: list[str], key_prefix: str, **options: object) -> KVOffloadManager:
        manager = KVOffloadManager.from_urls(urls, key_prefix, META, **options)
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.close()


def redis_key(prefix: str, block_hash: BlockHash) -> str:
    return f"{prefix}:kv:{FINGERPRINT}:{block_hash.hex()}"


def test_store_then_lookup_returns_the_payloads_in_order(
        make_manager, redis_url: str, kv_prefix: str, raw_redis: redis.Redis) -> None:
    manager = make_manager([redis_url], kv_prefix)
    items = blocks(6)
    manager.store(items)
    assert manager.flush(10)
    assert raw_redis.exists(redis_key(kv_prefix, items[0][0]))  # the documented key layout
    assert block_key(FINGERPRINT, items[0][0]) == f"kv:{FINGERPRINT}:{items[0][0].hex()}"
    hashes = [h for h, _ in items]
    assert manager.lookup(hashes) == [p for _, p in items]
    assert manager.lookup(hashes[2:]) == [p for _, p in items[2:]]
    assert manager.lookup([h for h, _ in blocks(3, seed=9)]) == []  # another prompt
    stats = manager.stats()
    assert stats.num_offered_blocks == 6 and stats.num_stored_blocks == 6
    assert stats.num_stored_bytes == 6 * META.num_bytes
    (tier,) = stats.tiers
    assert tier.num_lookups == 3 and tier.num_hit_blocks == 10
    assert tier.num_loaded_bytes == 10 * META.num_bytes and tier.load_seconds > 0


def test_lookup_stops_at_the_first_miss(make_manager, redis_url: str, kv_prefix: str,
                                        raw_redis: redis.Redis) -> None:
    manager = make_manager([redis_url], kv_prefix)
    items = blocks(5)
    manager.store(items[:2] + items[3:])  # block 2 never stored
    assert manager.flush(10)
    assert manager.lookup([h for h, _ in items]) == [items[0][1], items[1][1]]
    # deleted between store and lookup (Redis evicted it): a shorter run
    raw_redis.delete(redis_key(kv_prefix, items[1][0]))
    assert manager.lookup([h for h, _ in items]) == [items[0][1]]


def test_a_run_split_across_redis_and_disk_is_found(
        make_manager, redis_url: str, kv_prefix: str, tmp_path: Path,
        raw_redis: redis.Redis) -> None:
    items = blocks(5)
    hashes = [h for h, _ in items]
    # Redis holds blocks 0-1, disk holds 2-4 (and not 0-1)
    red = RedisTierStore(redis_url, kv_prefix)
    red.put_many([(block_key(FINGERPRINT, h), encode_block(p, META)) for h, p in items[:2]])
    red.close()
    DiskTierStore(tmp_path, 10**6).put_many(
        [(block_key(FINGERPRINT, h), encode_block(p, META)) for h, p in items[2:]])
    manager = make_manager([redis_url, f"file://{tmp_path}?max_bytes=1000000"], kv_prefix)

    assert manager.lookup(hashes) == [p for _, p in items]
    redis_stats, disk_stats = manager.stats().tiers
    assert (redis_stats.num_hit_blocks, disk_stats.num_hit_blocks) == (2, 3)
    assert disk_stats.num_lookups == 1
    # the disk hits were promoted to Redis: the next lookup is Redis alone
    assert manager.flush(10)
    assert all(raw_redis.exists(redis_key(kv_prefix, h)) for h in hashes)
    assert manager.lookup(hashes) == [p for _, p in items]
    redis_stats, disk_stats = manager.stats().tiers
    assert (redis_stats.num_hit_blocks, disk_stats.num_hit_blocks) == (7, 3)
    assert disk_stats.num_lookups == 1  # not consulted: Redis had the whole run


def test_a_corrupted_blob_in_redis_is_a_miss_from_there_on(
        make_manager, redis_url: str, kv_prefix: str, tmp_path: Path,
        raw_redis: redis.Redis) -> None:
    items = blocks(4)
    hashes = [h for h, _ in items]
    redis_only = make_manager([redis_url], kv_prefix)
    redis_only.store(items)
    assert redis_only.flush(10)
    key = redis_key(kv_prefix, hashes[1])
    blob = raw_redis.get(key)
    raw_redis.set(key, _flip(blob, HEADER_SIZE + 3))
    assert redis_only.lookup(hashes) == [items[0][1]]
    assert redis_only.stats().tiers[0].num_bad_blobs == 1

    both = make_manager([redis_url, f"file://{tmp_path}?max_bytes=1000000"], kv_prefix)
    DiskTierStore(tmp_path, 10**6).put_many(
        [(block_key(FINGERPRINT, h), encode_block(p, META)) for h, p in items])
    assert both.lookup(hashes) == [p for _, p in items]  # disk takes over at block 1
    assert both.stats().tiers[1].num_hit_blocks == 3
    # the good copy from disk replaced the bad one in Redis
    assert both.flush(10)
    assert raw_redis.get(key) == blob


def test_an_unreachable_redis_is_a_miss_and_store_does_not_raise(
        make_manager, tmp_path: Path) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    items = blocks(3)
    hashes = [h for h, _ in items]
    manager = make_manager([dead], "llmqtest-dead", retry_after_seconds=0.0)
    manager.store(items)
    assert manager.flush(10)
    assert manager.lookup(hashes) == []
    (tier,) = manager.stats().tiers
    assert tier.num_lookup_errors == 1 and tier.num_store_errors == 3
    assert tier.num_stored_blocks == 0

    # a dead first tier does not hide the tier behind it
    with_disk = make_manager([dead, f"file://{tmp_path}?max_bytes=1000000"], "llmqtest-dead")
    with_disk.store(items)
    assert with_disk.flush(10)
    assert with_disk.lookup(hashes) == [p for _, p in items]
    dead_stats, disk_stats = with_disk.stats().tiers
    assert disk_stats.num_stored_blocks == 3 and disk_stats.num_hit_blocks == 3
    assert dead_stats.num_hit_blocks == 0


def test_reuse_filter_stores_a_block_on_its_second_offer(
        make_manager, redis_url: str, kv_prefix: str, raw_redis: redis.Redis) -> None:
    manager = make_manager([redis_url], kv_prefix, reuse_filter=True)
    items = blocks(3)
    manager.store(items[:2])
    assert manager.flush(10)
    assert not any(raw_redis.exists(redis_key(kv_prefix, h)) for h, _ in items)
    manager.store(items)  # second offer of blocks 0-1, first of block 2
    assert manager.flush(10)
    assert [bool(raw_redis.exists(redis_key(kv_prefix, h))) for h, _ in items] == \
        [True, True, False]
    stats = manager.stats()
    assert stats.num_offered_blocks == 5 and stats.num_filtered_blocks == 3
    assert stats.num_stored_blocks == 2


def test_already_stored_blocks_are_skipped(make_manager, redis_url: str, kv_prefix: str,
                                           tmp_path: Path) -> None:
    tiers = [redis_url, f"file://{tmp_path}?max_bytes=1000000"]
    manager = make_manager(tiers, kv_prefix)
    items = blocks(4)
    manager.store(items)
    assert manager.flush(10)
    manager.store(items[:3])  # known from this manager's own writes
    assert manager.flush(10)
    for tier in manager.stats().tiers:
        assert (tier.num_stored_blocks, tier.num_skipped_blocks) == (4, 3)

    # another worker: nothing in memory, but contains_many finds them in both tiers
    other = make_manager(tiers, kv_prefix)
    other.store(items + blocks(1, seed=5))
    assert other.flush(10)
    for tier in other.stats().tiers:
        assert (tier.num_stored_blocks, tier.num_skipped_blocks) == (1, 4)


def test_a_full_queue_drops_blocks_and_bad_payloads_are_not_stored(
        make_manager, redis_url: str, kv_prefix: str) -> None:
    manager = make_manager([redis_url], kv_prefix, max_queue_bytes=2 * META.num_bytes)
    manager.store(blocks(5))  # one call enqueues under one lock: room for exactly two
    assert manager.flush(10)
    stats = manager.stats()
    assert stats.num_dropped_blocks == 3 and stats.num_stored_blocks == 2

    (h, _), = blocks(1, seed=7)
    manager.store([(h, b"too short")])
    assert manager.flush(10)
    assert manager.stats().num_stored_blocks == 2
    assert manager.lookup([h]) == []


def test_close_writes_what_is_queued(redis_url: str, kv_prefix: str) -> None:
    manager = KVOffloadManager.from_urls([redis_url], kv_prefix, META)
    items = blocks(8)
    manager.store(items)
    manager.close()
    reader = KVOffloadManager.from_urls([redis_url], kv_prefix, META)
    try:
        assert reader.lookup([h for h, _ in items]) == [p for _, p in items]
    finally:
        reader.close()
    manager.store(items)  # after close: ignored, no error


def test_no_tiers_is_a_disabled_manager() -> None:
    manager = KVOffloadManager.from_urls([], "llmq", META)
    assert not manager.enabled
    manager.store(blocks(2))
    assert manager.lookup([h for h, _ in blocks(2)]) == []
    manager.close()


# --- a Redis tier with a memory limit ---------------------------------------------------


@pytest.fixture
def capped_redis_url(tmp_path: Path) -> Iterator[str]:
    """A redis-server of our own with maxmemory 4 MB and allkeys-lru, as docs/kv-tiers.md
    tells an operator to run the KV tier."""
    process, url = start_redis_server(tmp_path, "--maxmemory", "4mb",
                                      "--maxmemory-policy", "allkeys-lru")
    try:
        yield url
    finally:
        process.terminate()
        process.wait(15)


def test_a_capped_redis_tier_evicts_old_blocks_and_never_fails(capped_redis_url: str) -> None:
    # 64 KiB blocks; 10 prompts of 20 blocks are 13 MB through a 4 MB Redis
    meta = BlockMeta(FINGERPRINT, "float16", BLOCK_SIZE, (2, 4, BLOCK_SIZE, 8, 64))
    manager = KVOffloadManager.from_urls([capped_redis_url], "llmq", meta)
    prompts = []
    try:
        for seed in range(10):
            hashes = hash_full_blocks([seed * 1000 + i for i in range(20 * BLOCK_SIZE)],
                                      BLOCK_SIZE)
            items = [(h, os.urandom(meta.num_bytes)) for h in hashes]
            manager.store(items)
            assert manager.flush(10)
            prompts.append(items)
        (tier,) = manager.stats().tiers
        assert tier.num_stored_blocks == 200 and tier.num_store_errors == 0
        client = redis.Redis.from_url(capped_redis_url)
        assert client.info("memory")["used_memory"] <= 4 * 1024 * 1024 * 1.05
        assert client.info("stats")["evicted_keys"] > 100

        runs = [manager.lookup([h for h, _ in items]) for items in prompts]
        for run, items in zip(runs, prompts):
            assert run == [p for _, p in items][:len(run)]  # a prefix, never wrong bytes
        # NOTE: Redis's LRU is approximate (it samples keys), so any single block, even one
        # of the newest prompt, may be gone; what holds is that old prompts lost more.
        def surviving(items: list[tuple[BlockHash, bytes]]) -> int:
            keys = [f"llmq:{block_key(FINGERPRINT, h)}" for h, _ in items]
            return sum(client.exists(key) for key in keys)

        assert len(runs[0]) < 20  # the oldest prompt lost blocks to LRU
        assert surviving(prompts[-1]) > surviving(prompts[0])

        # the same server without eviction: writes fail once full; store still never raises
        client.config_set("maxmemory-policy", "noeviction")
        client.close()
        manager.store([(h, os.urandom(meta.num_bytes))
                       for h in hash_full_blocks(list(range(80 * BLOCK_SIZE)), BLOCK_SIZE)])
        assert manager.flush(10)
        assert manager.stats().tiers[0].num_store_errors > 0
    finally:
        manager.close()


# --- with the model runner: a tier hit is the same KV as a recompute --------------------


def test_blocks_loaded_from_the_tier_give_the_same_logits_as_recompute(
        tiny_qwen3_dir: Path, redis_url: str, kv_prefix: str, tmp_path: Path) -> None:
    import torch

    from tasks.params import SamplingParams
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import ModelRunner
    from workers.engine.step_io import ScheduledSequence, SchedulerOutput

    loaded = load_checkpoint(tiny_qwen3_dir, dtype="float32")
    config = loaded.config
    block_size = 4
    prompt = [(7 * i + 3) % 200 + 5 for i in range(3 * block_size + 2)]  # 3 full blocks

    def step(tokens: list[int], start_pos: int, block_table: list[int],
             blocks_to_load: list[tuple[int, bytes]]) -> SchedulerOutput:
        seq = ScheduledSequence(seq_id=1, token_ids=tokens, start_pos=start_pos,
                                block_table=block_table, sample=True,
                                params=SamplingParams(temperature=0.0),
                                prompt_token_ids=prompt, output_token_ids=[])
        return SchedulerOutput(scheduled=[seq], num_batched_tokens=len(tokens),
                               blocks_to_load=blocks_to_load)

    def manager_for(runner: ModelRunner) -> KVOffloadManager:
        meta = BlockMeta(make_fingerprint(loaded.fingerprint, str(runner.dtype),
                                          runner.block_size, 1, 0),
                         str(runner.dtype), runner.block_size,
                         (2, config.num_layers, runner.block_size, config.num_kv_heads,
                          config.head_dim))
        assert meta.num_bytes == runner.bytes_per_block
        return KVOffloadManager([RedisTierStore(redis_url, kv_prefix),
                                 DiskTierStore(tmp_path, 10**8)], meta)

    # worker A computes the whole prompt and offloads its full blocks
    first = ModelRunner(loaded, block_size=block_size, kv_cache_bytes=1 << 20)
    full = first.forward_logits(step(prompt, 0, [0, 1, 2, 3], []))
    hashes = hash_full_blocks(prompt, block_size)
    offload_a = manager_for(first)
    offload_a.store(list(zip(hashes, first.read_blocks([0, 1, 2]))))
    assert offload_a.flush(10)
    offload_a.close()

    # worker B finds the 3 blocks in the tier, loads them into other block ids and
    # computes only the last 2 tokens: the same logits as computing everything
    second = ModelRunner(loaded, block_size=block_size, kv_cache_bytes=1 << 20)
    offload_b = manager_for(second)
    payloads = offload_b.lookup(hashes)
    assert len(payloads) == 3
    tail = second.forward_logits(step(prompt[12:], 12, [5, 6, 7, 8],
                                      list(zip([5, 6, 7], payloads))))
    torch.testing.assert_close(tail, full[12:], rtol=1e-5, atol=1e-5)
    assert int(tail[-1].argmax()) == int(full[-1].argmax())
    offload_b.close()

    # a worker with another block size has another fingerprint: nothing to share
    other = ModelRunner(loaded, block_size=2 * block_size, kv_cache_bytes=1 << 20)
    offload_c = manager_for(other)
    assert offload_c.lookup(hash_full_blocks(prompt, 2 * block_size)) == []
    offload_c.close()
