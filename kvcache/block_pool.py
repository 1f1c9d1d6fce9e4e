"""The pool of KV cache blocks: reference counts, the free queue, and the prefix-cache map.

Mechanism only. A block is either referenced (ref_cnt > 0, owned by one or more sequences)
or free (ref_cnt == 0, in the free queue). The free queue is in LRU order and doubles as
the prefix cache: a freed full block keeps its hash and stays findable until
`get_new_blocks` pops it for reuse, which evicts it. Callers free a sequence's blocks tail
first, so the head blocks of a prompt (the most shareable) are evicted last.

Not thread-safe: one engine thread owns the pool.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvcache.hashing import BlockHash

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One fixed-size block of KV slots. Compared by identity."""

    block_id: int  # 0 <= block_id < num_blocks; indexes the KV tensors
    ref_cnt: int = 0  # number of sequences whose block table holds this block
    # Set while the block is registered in the prefix-cache map; kept after free until reuse.
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # the block's tokens, checked on a hit
    # Links of the free queue; both None when the block is not in it (or is its only entry).
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly-linked list of free blocks: O(1) popleft, append and remove from the middle.

    Front = least recently freed = evicted first.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head: KVCacheBlock | None = None
        self._tail: KVCacheBlock | None = None
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Front to back (eviction order)."""
        block = self._head
        while block is not None:
            yield block
            block = block.next_free

    def __contains__(self, block: object) -> bool:
        if not isinstance(block, KVCacheBlock):
            return False
        return block.prev_free is not None or self._head is block

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the back (evicted last)."""
        assert block not in self, f"block {block.block_id} is already in the free queue"
        block.prev_free = self._tail
        block.next_free = None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        self._len += 1

    def popleft(self) -> KVCacheBlock:
        """Take the block at the front (the next one to evict)."""
        block = self._head
        if block is None:
            raise IndexError("pop from an empty free block queue")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from anywhere in the queue."""
        assert block in self, f"block {block.block_id} is not in the free queue"
        if block.prev_free is None:
            self._head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self._tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = None
        block.next_free = None
        self._len -= 1


class BlockPool:
    """All KV blocks of one device group, ids 0..num_blocks-1, all free at start in id order."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"num_blocks must be >= 1, got {num_blocks}: give the KV cache more memory"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # hash -> {block_id: block}, oldest registration first. Several blocks may hold the
        # same contents (two sequences missed at once, or a full-prompt hit recomputing its
        # last block); all stay registered so the prefix outlives the eviction of any one,
        # and a lookup returns the oldest.
        self.cached_blocks: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.num_evicted_blocks = 0  # cached blocks dropped from the map for reuse, ever

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references (cached or not): what `get_new_blocks` can hand out."""
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the front of the free queue, each with ref_cnt 1.

        A block that still carried a hash is evicted from the prefix cache first. Raises
        ValueError when fewer blocks are free: callers check `num_free_blocks` first.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} KV blocks: only {self.num_free_blocks} are free"
            )
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, f"free block {block.block_id} has refs"
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        same_hash = self.cached_blocks[block.block_hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        self.num_evicted_blocks += 1

    def get_cached_block(
        self, block_hash: BlockHash, token_ids: Sequence[int]
    ) -> KVCacheBlock | None:
        """The (oldest) block cached under `block_hash`, or None on a miss.

        Blocks whose stored tokens differ from `token_ids` (a hash collision, or a caller
        bug) are skipped: a hit must never hand out another prefix's KV.
        """
        if not self.enable_caching:
            return None
        same_hash = self.cached_blocks.get(block_hash)
        if same_hash is None:
            return None
        wanted = tuple(token_ids)
        for block in same_hash.values():
            if block.token_ids == wanted:
                return block
        logger.warning(
            "KV block hash %s is cached with different tokens; treating it as a miss",
            block_hash.hex()[:16],
        )
        return None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block; a free (cached) block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(
        self, block: KVCacheBlock, block_hash: BlockHash, token_ids: Sequence[int]
    ) -> bool:
        """Register a full, referenced block under `block_hash` so later prompts can hit it.

        Returns whether the block is cached (False only with caching disabled). Blocks
        already cached under the hash stay first in line for lookups; registering a block
        again is a no-op.
        """
        if not self.enable_caching:
            return False
        if block.block_hash is not None:
            # NOTE: a block enters a table either fresh (hash cleared by eviction) or as a
            # prefix hit (same tokens, same chain), so a registered block's hash cannot change.
            assert block.block_hash == block_hash, (
                f"block {block.block_id} is already cached under another hash"
            )
            return True
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached_blocks.setdefault(block_hash, {})[block.block_id] = block
        return True

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the back of the free
        queue in the given order (pass a sequence's blocks tail first)."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no block is in use; returns False otherwise."""
        num_used = self.num_blocks - self.num_free_blocks
        if num_used:
            logger.warning(
                "not resetting the prefix cache: %d KV blocks are still in use; "
                "retry when no sequence is running",
                num_used,
            )
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self.cached_blocks.clear()
        return True
