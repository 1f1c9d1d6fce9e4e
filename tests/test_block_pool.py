"""BlockPool and FreeBlockQueue: exact block ids, free-queue order, eviction, collisions."""

import pytest

from kvcache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from kvcache.hashing import BlockHash, hash_block


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def test_free_queue_append_popleft_and_remove_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue] == [0, 1, 2, 3, 4] and len(queue) == 5
    queue.remove(blocks[2])  # middle
    queue.remove(blocks[0])  # head
    queue.remove(blocks[4])  # tail
    assert [b.block_id for b in queue] == [1, 3] and len(queue) == 2
    assert blocks[2] not in queue and blocks[1] in queue
    queue.append(blocks[0])
    assert queue.popleft() is blocks[1]
    assert [b.block_id for b in queue] == [3, 0]
    assert queue.popleft() is blocks[3] and queue.popleft() is blocks[0]
    assert len(queue) == 0 and list(queue) == []
    with pytest.raises(IndexError):
        queue.popleft()
    queue.append(blocks[4])  # an emptied queue works again
    assert [b.block_id for b in queue] == [4]


def test_all_blocks_free_at_start_in_id_order():
    pool = BlockPool(6)
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 6 and pool.usage == 0.0


def test_get_new_blocks_exact_ids_and_refs():
    pool = BlockPool(6)
    first = pool.get_new_blocks(2)
    second = pool.get_new_blocks(3)
    assert ids(first) == [0, 1] and ids(second) == [2, 3, 4]
    assert all(block.ref_cnt == 1 for block in first + second)
    assert free_ids(pool) == [5]
    assert pool.usage == pytest.approx(5 / 6)
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [5]  # the failed call took nothing


def test_free_blocks_appends_in_given_order_tail_first():
    pool = BlockPool(6)
    seq_a = pool.get_new_blocks(3)  # 0 1 2
    seq_b = pool.get_new_blocks(2)  # 3 4
    pool.free_blocks(reversed(seq_a))
    assert free_ids(pool) == [5, 2, 1, 0]
    pool.free_blocks(reversed(seq_b))
    assert free_ids(pool) == [5, 2, 1, 0, 4, 3]
    # Reuse follows that order: never-used 5 first, a's tail before its head.
    assert ids(pool.get_new_blocks(3)) == [5, 2, 1]


def test_shared_block_is_freed_only_when_its_last_reference_goes():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.touch(blocks[:1])
    assert blocks[0].ref_cnt == 2
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [2, 3, 1]
    pool.free_blocks(blocks[:1])
    assert free_ids(pool) == [2, 3, 1, 0]
    with pytest.raises(AssertionError):
        pool.free_blocks(blocks[:1])


def test_cached_block_is_found_after_free_and_evicted_on_reuse():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    h = hash_block(None, [7, 8])
    assert pool.cache_full_block(block, h, [7, 8])
    assert pool.get_cached_block(h, [7, 8]) is block
    pool.free_blocks([block])
    # Freed but not reused: still a prefix-cache hit.
    assert block.block_hash == h and pool.get_cached_block(h, [7, 8]) is block
    assert free_ids(pool) == [1, 2, 0]
    reused = pool.get_new_blocks(3)
    assert ids(reused) == [1, 2, 0]
    assert block.block_hash is None and block.token_ids is None
    assert pool.get_cached_block(h, [7, 8]) is None
    assert h not in pool.cached_blocks
    assert pool.num_evicted_blocks == 1


def test_collision_guard_same_hash_different_tokens_is_a_miss():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    h = hash_block(None, [1, 2])
    pool.cache_full_block(block, h, [1, 2])
    assert pool.get_cached_block(h, [1, 2]) is block
    assert pool.get_cached_block(h, [1, 3]) is None
    # Two contents under one hash (a collision): each lookup finds its own tokens.
    (other,) = pool.get_new_blocks(1)
    pool.cache_full_block(other, h, [1, 3])
    assert pool.get_cached_block(h, [1, 3]) is other
    assert pool.get_cached_block(h, [1, 2]) is block


def test_existing_cache_entry_stays_first_and_a_duplicate_outlives_it():
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2)
    h = hash_block(None, [4, 4])
    assert pool.cache_full_block(first, h, [4, 4])
    assert pool.cache_full_block(second, h, [4, 4])  # same contents computed twice
    assert pool.get_cached_block(h, [4, 4]) is first
    assert pool.cache_full_block(first, h, [4, 4])  # registering again is a no-op
    assert list(pool.cached_blocks[h]) == [0, 1]
    with pytest.raises(AssertionError):
        pool.cache_full_block(first, BlockHash(bytes(32)), [4, 4])
    pool.free_blocks([first])
    pool.get_new_blocks(2)  # 2, then 0: evicts the first registration
    assert first.block_hash is None
    assert pool.get_cached_block(h, [4, 4]) is second


def test_touch_of_a_cached_free_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    h = hash_block(None, [1])
    pool.cache_full_block(blocks[1], h, [1])
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [2, 3, 1, 0] and pool.num_free_blocks == 4
    hit = pool.get_cached_block(h, [1])
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and free_ids(pool) == [2, 3, 0] and pool.num_free_blocks == 3
    assert hit.block_hash == h  # a hit keeps its hash
    assert ids(pool.get_new_blocks(3)) == [2, 3, 0]


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    h = hash_block(None, [1])
    assert not pool.cache_full_block(block, h, [1])
    assert pool.get_cached_block(h, [1]) is None and block.block_hash is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    h = hash_block(None, [1])
    pool.cache_full_block(block, h, [1])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h, [1]) is block
    pool.free_blocks([block])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h, [1]) is None and block.block_hash is None
    assert pool.num_free_blocks == 2


def test_zero_blocks_is_a_configuration_error():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
