"""KVCacheManager: prefix hits with exact block ids, all-or-nothing allocation, tail-first
frees, growth at block boundaries, KV of a failed step never findable, and a state machine
checking the invariants."""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvcache.hashing import hash_full_blocks
from kvcache.kv_cache_manager import KVCacheManager

BS = 4  # block size of these tests


class StepManager(KVCacheManager):
    """Every allocation's step succeeds at once: the blocks it fills are committed, as the
    scheduler commits after a forward pass that did not raise (the tests at the end of
    this file cover a step that raised)."""

    def allocate_slots(self, *args, **kwargs):
        table = super().allocate_slots(*args, **kwargs)
        self.commit()
        return table


def free_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue]


def admit(manager: KVCacheManager, seq_id: int, token_ids: list[int]) -> list[int] | None:
    """What the scheduler does for a new sequence whose whole prompt fits in one step."""
    hit_ids, num_computed = manager.get_computed_blocks(token_ids)
    return manager.allocate_slots(
        seq_id, token_ids, num_computed, len(token_ids) - num_computed, hit_ids
    )


def test_prefix_hit_across_two_sequences_exact_block_ids():
    manager = StepManager(num_blocks=10, block_size=BS)
    prompt_a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 2 full blocks + 2 tokens
    assert manager.get_computed_blocks(prompt_a) == ([], 0)
    assert manager.allocate_slots(0, prompt_a, 0, 10) == [0, 1, 2]

    prompt_b = [1, 2, 3, 4, 5, 6, 7, 8, 99, 98, 97]  # shares a's 2 full blocks
    assert manager.get_computed_blocks(prompt_b) == ([0, 1], 8)
    assert manager.allocate_slots(1, prompt_b, 8, 3, [0, 1]) == [0, 1, 3]
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert manager.num_free_blocks == 6

    # A different first block: no hit even though block 2's tokens match (hashes chain).
    assert manager.get_computed_blocks([0, 0, 0, 0, 5, 6, 7, 8, 1]) == ([], 0)
    # Other extra keys: no hit.
    assert manager.get_computed_blocks(prompt_a, extra_keys=("adapter",)) == ([], 0)
    assert manager.stats.prefix_queries == 4
    assert manager.stats.prefix_queries_tokens == 10 + 11 + 9 + 10
    assert manager.stats.prefix_hits_tokens == 8


def test_hit_after_free_reuses_the_freed_blocks():
    manager = StepManager(num_blocks=6, block_size=BS)
    prompt = list(range(100, 109))  # 2 full blocks + 1
    assert admit(manager, 0, prompt) == [0, 1, 2]
    manager.free(0)
    assert free_ids(manager) == [3, 4, 5, 2, 1, 0]
    # Freed blocks keep their hashes: a later prompt hits them, and they leave the queue.
    assert admit(manager, 1, prompt + [7]) == [0, 1, 3]
    assert free_ids(manager) == [4, 5, 2]


def test_full_prompt_hit_keeps_the_last_block_to_compute():
    manager = StepManager(num_blocks=10, block_size=BS)
    prompt = list(range(8))  # exactly 2 full blocks
    assert admit(manager, 0, prompt) == [0, 1]
    # The whole prompt is cached, but the last block is recomputed so there is a forward pass
    # to sample the first output token from.
    assert manager.get_computed_blocks(prompt) == ([0], 4)
    assert manager.allocate_slots(1, prompt, 4, 4, [0]) == [0, 2]
    # The recomputed block 2 holds block 1's contents: both are cached, lookups find the
    # older one while it lasts and block 2 after it is evicted.
    assert manager.block_pool.blocks[2].block_hash == manager.block_pool.blocks[1].block_hash
    assert manager.get_computed_blocks(prompt + [9]) == ([0, 1], 8)
    manager.free(0)
    assert free_ids(manager) == [3, 4, 5, 6, 7, 8, 9, 1]
    manager.allocate_slots(2, [5] * 32, 0, 32)  # takes all 8 free blocks, evicting 1
    assert manager.get_computed_blocks(prompt + [9]) == ([0, 2], 8)
    # A one-token prompt can never hit.
    assert manager.get_computed_blocks([0]) == ([], 0)
    assert manager.get_computed_blocks([]) == ([], 0)


def test_allocate_slots_returns_none_and_changes_nothing_when_out_of_blocks():
    manager = StepManager(num_blocks=5, block_size=BS)
    prompt = list(range(8))
    assert admit(manager, 0, prompt) == [0, 1]
    manager.free(0)  # blocks 0 and 1: free but cached
    assert admit(manager, 1, [50] * 9) == [2, 3, 4]
    assert free_ids(manager) == [1, 0]

    def books():
        pool = manager.block_pool
        return (
            free_ids(manager),
            manager.get_block_ids(1),
            [(block.ref_cnt, block.block_hash) for block in pool.blocks],
            dict(pool.cached_blocks),
            pool.num_evicted_blocks,
        )

    before = books()
    # seq 2 hits both free cached blocks and needs 1 more: 1 new block <= 2 free, but
    # touching the hits takes them out of the free queue, so 3 are needed: None.
    assert manager.get_computed_blocks(prompt + [1]) == ([0, 1], 8)
    assert manager.allocate_slots(2, prompt + [1], 8, 1, [0, 1]) is None
    # Growth of seq 1 by 3 blocks with 2 free: None.
    assert manager.allocate_slots(1, [50] * 21, 9, 12) is None
    assert books() == before
    assert manager.get_block_ids(2) == []
    assert manager.get_computed_blocks(prompt + [1]) == ([0, 1], 8)  # still cached

    # The same prompt without its tail token hits block 0 only (the last block is computed):
    # touch 0, take 1 from the front (evicting it, then caching the same contents again).
    assert manager.get_computed_blocks(prompt) == ([0], 4)
    assert manager.allocate_slots(2, prompt, 4, 4, [0]) == [0, 1]
    assert manager.num_free_blocks == 0
    assert manager.stats.num_evicted_blocks == 1
    assert manager.get_computed_blocks(prompt + [1]) == ([0, 1], 8)


def test_free_releases_tail_first_and_unknown_is_a_no_op():
    manager = StepManager(num_blocks=8, block_size=BS)
    assert admit(manager, 0, list(range(12))) == [0, 1, 2]
    assert admit(manager, 1, list(range(20, 30))) == [3, 4, 5]
    manager.free(0)
    assert free_ids(manager) == [6, 7, 2, 1, 0]
    manager.free(7)  # unknown
    manager.free(0)  # already freed
    assert free_ids(manager) == [6, 7, 2, 1, 0]
    assert manager.get_block_ids(0) == []
    manager.free(1)
    assert free_ids(manager) == [6, 7, 2, 1, 0, 5, 4, 3]
    assert manager.num_free_blocks == 8 and manager.usage == 0.0


def test_growth_during_decode_allocates_exactly_at_block_boundaries():
    manager = StepManager(num_blocks=6, block_size=BS)
    tokens = [1, 2, 3]
    assert admit(manager, 0, tokens) == [0]
    tables = []
    # Decode: each step computes the last sampled token (1 new token at position len - 1).
    for next_token in range(10, 20):
        tokens.append(next_token)
        tables.append(manager.allocate_slots(0, tokens, len(tokens) - 1, 1))
    # Positions 0..3 in block 0, 4..7 in block 1, 8..11 in block 2, 12 in block 3.
    assert tables == [[0]] + [[0, 1]] * 4 + [[0, 1, 2]] * 4 + [[0, 1, 2, 3]]
    assert manager.usage == pytest.approx(4 / 6)
    # Every block that became full is cached, with the chain of the whole sequence.
    expected = hash_full_blocks(tokens, BS)
    assert manager.get_block_hashes(0) == expected
    assert [manager.block_pool.blocks[i].block_hash for i in range(3)] == expected


def test_chunked_prefill_registers_blocks_as_they_are_scheduled():
    manager = StepManager(num_blocks=8, block_size=BS)
    prompt = list(range(40, 54))  # 14 tokens
    assert manager.allocate_slots(0, prompt, 0, 6) == [0, 1]
    assert manager.get_block_hashes(0) == hash_full_blocks(prompt, BS)[:1]
    assert manager.get_computed_blocks(prompt) == ([0], 4)  # usable from the next step
    assert manager.allocate_slots(0, prompt, 6, 8) == [0, 1, 2, 3]
    assert manager.get_block_hashes(0) == hash_full_blocks(prompt, BS)
    assert manager.get_computed_blocks(prompt) == ([0, 1, 2], 12)


def test_tokens_loaded_from_a_lower_tier_get_fresh_blocks_that_are_cached():
    # Device hit on block 0; blocks 1 and 2 come from a lower tier (loaded into fresh blocks
    # before the forward pass); the rest is computed.
    manager = StepManager(num_blocks=8, block_size=BS)
    prompt = list(range(60, 74))  # 14 tokens
    assert manager.allocate_slots(0, prompt[:4], 0, 4) == [0]
    hit_ids, num_hit = manager.get_computed_blocks(prompt)
    assert (hit_ids, num_hit) == ([0], 4)
    table = manager.allocate_slots(1, prompt, num_hit + 2 * BS, 2, hit_ids)
    assert table == [0, 1, 2, 3]
    assert manager.get_block_hashes(1) == hash_full_blocks(prompt, BS)
    assert manager.get_computed_blocks(prompt + [0]) == ([0, 1, 2], 12)


def test_unshared_full_blocks_are_what_a_finished_sequence_leaves_evictable():
    manager = StepManager(num_blocks=8, block_size=BS)
    prompt = list(range(10))
    assert admit(manager, 0, prompt) == [0, 1, 2]
    assert admit(manager, 1, prompt[:8] + [99, 98]) == [0, 1, 3]
    hashes = hash_full_blocks(prompt, BS)
    assert manager.get_unshared_full_blocks(0) == []  # 0 and 1 shared, 2 not full
    manager.allocate_slots(0, prompt + [5, 6], 10, 2)  # block 2 becomes full
    assert manager.get_unshared_full_blocks(0) == [(2, hash_full_blocks(prompt + [5, 6], BS)[2])]
    manager.free(0)
    assert manager.get_unshared_full_blocks(1) == [(0, hashes[0]), (1, hashes[1])]
    assert manager.get_unshared_full_blocks(0) == []


def test_stale_computed_blocks_are_an_error_not_a_wrong_hit():
    manager = StepManager(num_blocks=3, block_size=BS)
    prompt = list(range(9))
    admit(manager, 0, prompt)
    manager.free(0)
    hit_ids, num_computed = manager.get_computed_blocks(prompt)
    assert hit_ids == [0, 1]
    admit(manager, 1, [7] * 12)  # evicts blocks 2, 1, 0
    with pytest.raises(ValueError, match="no longer holds its prefix"):
        manager.allocate_slots(2, prompt, num_computed, 1, hit_ids)
    with pytest.raises(ValueError, match="first allocate_slots"):
        manager.allocate_slots(1, [7] * 12, 12, 0, [0])


def test_can_fit_counts_cached_free_blocks_as_evictable():
    manager = StepManager(num_blocks=4, block_size=BS)
    admit(manager, 0, list(range(8)))
    assert manager.can_fit(8) and not manager.can_fit(9)
    manager.free(0)
    assert manager.can_fit(16) and not manager.can_fit(17)


def test_prefix_caching_disabled():
    manager = StepManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(9))
    assert admit(manager, 0, prompt) == [0, 1, 2]
    assert admit(manager, 1, prompt) == [3, 4, 5]
    assert manager.stats.prefix_hits_tokens == 0 and manager.stats.prefix_queries_tokens == 18
    assert manager.block_pool.cached_blocks == {}


def test_reset_prefix_cache():
    manager = StepManager(num_blocks=4, block_size=BS)
    prompt = list(range(9))
    admit(manager, 0, prompt)
    assert manager.reset_prefix_cache() is False
    manager.free(0)
    assert manager.get_computed_blocks(prompt) == ([0, 1], 8)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(prompt) == ([], 0)


# ---------------------------------------------------------------------------------------
# Random operations, invariants after every step.

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]


class KVCacheMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.manager = StepManager(num_blocks=12, block_size=BS)
        self.tokens: dict[int, list[int]] = {}  # live sequences' tokens, all computed
        self.next_seq_id = 0

    @rule(
        target=seqs,
        prefix=st.sampled_from(PREFIXES + [[]]),
        suffix=st.lists(st.integers(0, 3), max_size=10),
    )
    def allocate(self, prefix, suffix):
        token_ids = prefix + suffix
        if not token_ids:
            token_ids = [0]
        seq_id = self.next_seq_id
        self.next_seq_id += 1
        hit_ids, num_computed = self.manager.get_computed_blocks(token_ids)
        assert num_computed == len(hit_ids) * BS < len(token_ids)
        for index, block_id in enumerate(hit_ids):
            block = self.manager.block_pool.blocks[block_id]
            assert block.token_ids == tuple(token_ids[index * BS : (index + 1) * BS])
        before = self._snapshot()
        table = self.manager.allocate_slots(
            seq_id, token_ids, num_computed, len(token_ids) - num_computed, hit_ids
        )
        if table is None:
            assert self._snapshot() == before
            return seq_id  # not admitted; freeing it later is a no-op
        assert table[: len(hit_ids)] == hit_ids
        assert len(table) == -(-len(token_ids) // BS)
        self.tokens[seq_id] = token_ids
        return seq_id

    @rule(seq_id=seqs, num_new=st.integers(1, 6), token=st.integers(0, 3))
    def grow(self, seq_id, num_new, token):
        if seq_id not in self.tokens:
            return
        token_ids = self.tokens[seq_id]
        before = self._snapshot()
        num_computed = len(token_ids)
        new_tokens = token_ids + [token] * num_new
        table = self.manager.allocate_slots(seq_id, new_tokens, num_computed, num_new)
        if table is None:
            assert self._snapshot() == before
            return
        assert len(table) == -(-len(new_tokens) // BS)
        assert table[: len(before[1][seq_id])] == before[1][seq_id]
        self.tokens[seq_id] = new_tokens

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id):
        pool = self.manager.block_pool
        table = self.manager.get_block_ids(seq_id)
        unshared = self.manager.get_unshared_full_blocks(seq_id)
        self.manager.free(seq_id)
        self.tokens.pop(seq_id, None)
        assert self.manager.get_block_ids(seq_id) == []
        # Blocks released by this free sit at the back of the queue, tail first...
        released = [b for b in reversed(table) if pool.blocks[b].ref_cnt == 0]
        free = [block.block_id for block in pool.free_block_queue]
        assert free[len(free) - len(released) :] == released
        assert {b for b, _ in unshared} <= set(released)
        # ...and keep their hashes: still prefix-cache hits until reused.
        for block_id, block_hash in unshared:
            block = pool.blocks[block_id]
            assert block.block_hash == block_hash
            assert pool.get_cached_block(block_hash, block.token_ids) is not None

    def _snapshot(self):
        pool = self.manager.block_pool
        return (
            [block.block_id for block in pool.free_block_queue],
            {seq_id: self.manager.get_block_ids(seq_id) for seq_id in self.tokens},
            [(block.ref_cnt, block.block_hash) for block in pool.blocks],
        )

    @invariant()
    def books_balance(self):
        pool = self.manager.block_pool
        refs = Counter(b for seq_id in self.tokens for b in self.manager.get_block_ids(seq_id))
        free = [block.block_id for block in pool.free_block_queue]
        assert len(free) == len(set(free)) == self.manager.num_free_blocks
        for block in pool.blocks:
            assert block.ref_cnt == refs[block.block_id]
            assert (block.block_id in free) == (block.ref_cnt == 0)
        assert self.manager.num_free_blocks + len(refs) == self.manager.num_blocks
        assert self.manager.num_seqs == len(self.tokens)
        # Every cached entry points at a block that holds it, with tokens that hash to it.
        for block_hash, same_hash in pool.cached_blocks.items():
            assert same_hash
            for block_id, block in same_hash.items():
                assert block.block_id == block_id and block.block_hash == block_hash
                assert block.token_ids is not None
        # A live sequence's full blocks are all cached under their chained hashes.
        for seq_id, token_ids in self.tokens.items():
            hashes = hash_full_blocks(token_ids, BS)
            assert self.manager.get_block_hashes(seq_id) == hashes
            table = self.manager.get_block_ids(seq_id)
            for index, block_hash in enumerate(hashes):
                block = pool.blocks[table[index]]
                assert block.block_hash == block_hash
                assert block.block_id in pool.cached_blocks[block_hash]
                cached = pool.get_cached_block(block_hash, token_ids[index * BS : (index + 1) * BS])
                assert cached is not None

    def teardown(self):
        for seq_id in list(self.tokens):
            self.manager.free(seq_id)
        assert self.manager.num_free_blocks == self.manager.num_blocks
        assert self.manager.num_seqs == 0
        assert all(block.ref_cnt == 0 for block in self.manager.block_pool.blocks)
        assert self.manager.usage == 0.0


KVCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase


# --- a step that raised -----------------------------------------------------------------


def test_blocks_become_findable_only_when_their_step_commits():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(1, 10))  # 2 full blocks + 1 token
    assert manager.allocate_slots(0, prompt, 0, 9) == [0, 1, 2]
    assert manager.get_computed_blocks(prompt + [0]) == ([], 0)  # the step has not run
    assert manager.get_block_hashes(0) == []
    manager.commit()
    assert manager.get_computed_blocks(prompt + [0]) == ([0, 1], 8)
    assert manager.get_block_hashes(0) == hash_full_blocks(prompt, BS)


def test_a_failed_step_leaves_nothing_findable_and_the_retry_registers_it():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(1, 10))
    manager.allocate_slots(0, prompt[:4], 0, 4)
    manager.commit()  # block 0 was written by a step that succeeded
    manager.allocate_slots(0, prompt, 4, 5)  # fills block 1 ...
    manager.discard_uncommitted()  # ... but that step raised
    assert manager.get_computed_blocks(prompt + [0]) == ([0], 4)
    assert manager.get_unshared_full_blocks(0) == [(0, hash_full_blocks(prompt, BS)[0])]
    # the sequence is preempted (freed): its unwritten block goes back without a hash
    manager.free(0)
    assert all(manager.block_pool.blocks[i].block_hash is None for i in (1, 2))
    # recomputed by a step that succeeds, it registers as usual
    hit_ids, num_computed = manager.get_computed_blocks(prompt)
    assert (hit_ids, num_computed) == ([0], 4)
    table = manager.allocate_slots(1, prompt, num_computed, 5, hit_ids)
    manager.commit()
    assert manager.get_computed_blocks(prompt + [0]) == (table[:2], 8)


def test_a_sequence_freed_before_its_step_commits_registers_nothing():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(1, 9))
    manager.allocate_slots(0, prompt, 0, 8)
    manager.free(0)
    manager.commit()
    assert manager.get_computed_blocks(prompt + [0]) == ([], 0)
