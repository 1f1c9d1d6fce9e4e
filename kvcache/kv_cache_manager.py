"""Per-sequence KV block tables over a `BlockPool`, with prefix caching on the device tier.

Mechanism only: the scheduler decides who runs and whom to preempt; this class answers
"which blocks are cached for this prompt", "give this sequence room for N more tokens, or
tell me there is none" and "this sequence is gone".

A scheduler step for a sequence, in the order the calls must come:

    block_ids, num_computed = manager.get_computed_blocks(token_ids)  # first time only
    table = manager.allocate_slots(seq_id, token_ids, num_computed, num_new, block_ids)
    if table is None: preempt someone (manager.free(victim)) and retry, or wait
    ... the step's forward pass writes the KV ...
    manager.commit()  # it succeeded: the blocks it filled become findable
    (or manager.discard_uncommitted() when it raised: they never do)
    manager.free(seq_id)  # finished or preempted

Not thread-safe: one engine thread owns the manager.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvcache.block_pool import BlockPool, KVCacheBlock
from kvcache.hashing import BlockHash, ExtraKeys, hash_block

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KVCacheStats:
    """Counters since start; prefix hit rate = prefix_hits_tokens / prefix_queries_tokens."""

    prefix_queries: int = 0  # get_computed_blocks calls
    prefix_queries_tokens: int = 0  # prompt tokens looked up
    prefix_hits_tokens: int = 0  # of those, tokens found in cached blocks
    num_evicted_blocks: int = 0  # cached blocks reused for other contents

    @property
    def prefix_hit_rate(self) -> float:
        if self.prefix_queries_tokens == 0:
            return 0.0
        return self.prefix_hits_tokens / self.prefix_queries_tokens


@dataclass(slots=True)
class _SeqState:
    blocks: list[KVCacheBlock]  # the block table, position order
    block_ids: list[int]  # the same table as ids: copied out every step, so kept ready
    block_hashes: list[BlockHash]  # chained hashes of blocks[:len(block_hashes)], all full
    extra_keys: ExtraKeys
    # (hash, tokens) of the blocks after those, full once this step's forward pass has
    # written them: registered by commit(), dropped by discard_uncommitted()
    pending: list[tuple[BlockHash, tuple[int, ...]]] = field(default_factory=list)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables of the running sequences, keyed by `seq_id`.

    Invariants: a block's ref_cnt equals the number of tables holding it; a block is free
    (in the pool's free queue) exactly when its ref_cnt is 0; a freed block keeps its hash
    until it is reused.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.stats = KVCacheStats()
        self._seqs: dict[int, _SeqState] = {}
        self._uncommitted: set[int] = set()  # seq_ids with pending hashes

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references, cached ones included (they are evictable)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running sequences, in [0, 1]."""
        return self.block_pool.usage

    @property
    def num_seqs(self) -> int:
        """Sequences holding a block table (allocated and not yet freed)."""
        return len(self._seqs)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a new sequence of `num_tokens` tokens fits if every free block is used."""
        return _cdiv(num_tokens, self.block_size) <= self.num_free_blocks

    def get_computed_blocks(
        self, token_ids: list[int], extra_keys: ExtraKeys = ()
    ) -> tuple[list[int], int]:
        """The longest run of cached full blocks matching a prefix of `token_ids`.

        Returns (block ids, num_computed_tokens == len(block ids) * block_size). Takes no
        references: pass the ids to `allocate_slots` in the same scheduling pass, before any
        other allocation can evict them.
        NOTE: at most (len(token_ids) - 1) // block_size blocks, so at least one prompt token
        is computed: the first output token is sampled from a forward pass.
        """
        self.stats.prefix_queries += 1
        self.stats.prefix_queries_tokens += len(token_ids)
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = max(0, (len(token_ids) - 1) // self.block_size)
        block_ids: list[int] = []
        parent: BlockHash | None = None
        for index in range(max_blocks):
            block_tokens = token_ids[index * self.block_size : (index + 1) * self.block_size]
            parent = hash_block(parent, block_tokens, extra_keys)
            block = self.block_pool.get_cached_block(parent, block_tokens)
            if block is None:
                break
            block_ids.append(block.block_id)
        num_computed_tokens = len(block_ids) * self.block_size
        self.stats.prefix_hits_tokens += num_computed_tokens
        return block_ids, num_computed_tokens

    def allocate_slots(
        self,
        seq_id: int,
        token_ids: list[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        computed_block_ids: list[int] | None = None,
        extra_keys: ExtraKeys = (),
    ) -> list[int] | None:
        """Make `seq_id` own blocks for positions [0, num_computed_tokens + num_new_tokens).

        `token_ids` are all the sequence's known tokens (prompt + output). On the first call
        for a sequence, `computed_block_ids` (from `get_computed_blocks`) become the head of
        its table and `extra_keys` are fixed for its hashes; later calls must not pass ids.
        Returns the whole block table, or None when too few blocks are free, and then
        nothing has changed (preempt someone and retry).
        Full blocks among the first min(len(token_ids), num_computed_tokens +
        num_new_tokens) tokens are hashed here and registered in the prefix cache by the
        next `commit()`, once the forward pass that writes them succeeded (NOTE: KV of a
        step that raised is never findable, here or in a tier). A block whose contents are
        already cached elsewhere is registered too, behind the existing entry (lookups keep
        returning the older block).
        """
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got num_computed_tokens={num_computed_tokens}, "
                f"num_new_tokens={num_new_tokens}"
            )
        num_tokens = num_computed_tokens + num_new_tokens
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._admit(
                seq_id,
                token_ids,
                num_computed_tokens,
                num_tokens,
                computed_block_ids or [],
                extra_keys,
            )
            if state is None:
                return None
        elif computed_block_ids:
            raise ValueError(
                f"seq {seq_id} already has a block table; pass computed_block_ids only "
                "on its first allocate_slots call"
            )
        else:
            # The hot path (every running sequence, every step): usually nothing to do, so
            # it is kept free of helper calls.
            num_to_allocate = -(-num_tokens // self.block_size) - len(state.block_ids)
            if num_to_allocate > 0:
                if num_to_allocate > self.block_pool.num_free_blocks:
                    return None
                self._append_new_blocks(state, num_to_allocate)
        num_full = min(len(token_ids), num_tokens) // self.block_size
        if num_full > len(state.block_hashes) + len(state.pending):
            self._hash_full_blocks(seq_id, state, token_ids, num_full)
        return state.block_ids.copy()

    def _admit(
        self,
        seq_id: int,
        token_ids: list[int],
        num_computed_tokens: int,
        num_tokens: int,
        computed_block_ids: list[int],
        extra_keys: ExtraKeys,
    ) -> _SeqState | None:
        """First allocation of a sequence: take its prefix hits, then fresh blocks."""
        hit_blocks: list[KVCacheBlock] = []
        hit_hashes: list[BlockHash] = []
        if computed_block_ids:
            hit_blocks, hit_hashes = self._check_computed_blocks(
                seq_id, token_ids, num_computed_tokens, computed_block_ids, extra_keys
            )
        num_to_allocate = max(0, _cdiv(num_tokens, self.block_size) - len(hit_blocks))
        # Touching a hit block that sits in the free queue takes it out of the free count.
        num_hits_free = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        if num_to_allocate + num_hits_free > self.block_pool.num_free_blocks:
            return None
        # NOTE: touch before allocating, or get_new_blocks could pop (and evict) a hit.
        self.block_pool.touch(hit_blocks)
        state = _SeqState(hit_blocks, [b.block_id for b in hit_blocks], hit_hashes, extra_keys)
        self._seqs[seq_id] = state
        if num_to_allocate:
            self._append_new_blocks(state, num_to_allocate)
        return state

    def _append_new_blocks(self, state: _SeqState, num_blocks: int) -> None:
        new_blocks = self.block_pool.get_new_blocks(num_blocks)
        state.blocks.extend(new_blocks)
        state.block_ids.extend(block.block_id for block in new_blocks)
        self.stats.num_evicted_blocks = self.block_pool.num_evicted_blocks

    def _check_computed_blocks(
        self,
        seq_id: int,
        token_ids: list[int],
        num_computed_tokens: int,
        computed_block_ids: list[int],
        extra_keys: ExtraKeys,
    ) -> tuple[list[KVCacheBlock], list[BlockHash]]:
        """Resolve hit block ids, checking they still hold this prompt's prefix.

        They may not if another allocation evicted them since `get_computed_blocks`; using
        them then would read another prefix's KV, so this is an error, not a miss.
        """
        bs = self.block_size
        if len(computed_block_ids) * bs > min(num_computed_tokens, len(token_ids)):
            raise ValueError(
                f"seq {seq_id}: {len(computed_block_ids)} computed blocks cover more than "
                f"num_computed_tokens={num_computed_tokens} (block_size={bs})"
            )
        blocks: list[KVCacheBlock] = []
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for index, block_id in enumerate(computed_block_ids):
            block_tokens = token_ids[index * bs : (index + 1) * bs]
            parent = hash_block(parent, block_tokens, extra_keys)
            block = self.block_pool.blocks[block_id]
            if block.block_hash != parent or block.token_ids != tuple(block_tokens):
                raise ValueError(
                    f"seq {seq_id}: computed block {block_id} no longer holds its prefix "
                    "(evicted since get_computed_blocks); call get_computed_blocks and "
                    "allocate_slots for a sequence with no allocation in between"
                )
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    def _hash_full_blocks(self, seq_id: int, state: _SeqState, token_ids: list[int],
                          num_full: int) -> None:
        # Hash only blocks not hashed before: O(new blocks) per call.
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        if state.pending:
            parent: BlockHash | None = state.pending[-1][0]
        else:
            parent = state.block_hashes[-1] if state.block_hashes else None
        for index in range(len(state.block_hashes) + len(state.pending), num_full):
            block_tokens = token_ids[index * bs : (index + 1) * bs]
            parent = hash_block(parent, block_tokens, state.extra_keys)
            state.pending.append((parent, tuple(block_tokens)))
        self._uncommitted.add(seq_id)

    def commit(self) -> None:
        """The step's forward pass wrote its KV: register the blocks it filled."""
        for seq_id in self._uncommitted:
            state = self._seqs.get(seq_id)
            if state is None:
                continue  # freed since (preempted, finished): nothing to register
            for block_hash, block_tokens in state.pending:
                block = state.blocks[len(state.block_hashes)]
                self.block_pool.cache_full_block(block, block_hash, block_tokens)
                state.block_hashes.append(block_hash)
            state.pending.clear()
        self._uncommitted.clear()

    def discard_uncommitted(self) -> None:
        """The step's forward pass raised: what it was to write stays unfindable."""
        for seq_id in self._uncommitted:
            state = self._seqs.get(seq_id)
            if state is not None:
                state.pending.clear()
        self._uncommitted.clear()

    def free(self, seq_id: int) -> None:
        """Release every block of `seq_id`, tail first, and forget it. Unknown ids: no-op."""
        state = self._seqs.pop(seq_id, None)
        if state is None:
            return
        # NOTE: its blocks not yet committed go back unregistered
        self._uncommitted.discard(seq_id)
        self.block_pool.free_blocks(reversed(state.blocks))

    def get_block_ids(self, seq_id: int) -> list[int]:
        """The sequence's block table (a copy); empty for an unknown sequence."""
        state = self._seqs.get(seq_id)
        return [] if state is None else list(state.block_ids)

    def get_block_hashes(self, seq_id: int) -> list[BlockHash]:
        """Chained hashes of the sequence's full blocks so far (e.g. keys for a KV tier).

        Empty with prefix caching disabled: then nothing is hashed.
        """
        state = self._seqs.get(seq_id)
        return [] if state is None else list(state.block_hashes)

    def get_unshared_full_blocks(self, seq_id: int) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the sequence's full blocks that no other sequence holds.

        Call it right before `free(seq_id)`: these are the blocks that become evictable,
        i.e. what is worth writing to a lower KV tier when the sequence finishes.
        """
        state = self._seqs.get(seq_id)
        if state is None:
            return []
        return [
            (block.block_id, block_hash)
            for block, block_hash in zip(state.blocks, state.block_hashes)
            if block.ref_cnt == 1
        ]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and nothing done) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()
