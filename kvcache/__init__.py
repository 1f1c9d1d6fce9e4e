"""Paged KV cache bookkeeping: block hashing, the block pool, and the per-sequence manager.

Mechanism only, no torch: the model runner owns the KV tensors, this package owns which
block ids hold what.
"""

from kvcache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from kvcache.hashing import BlockHash, ExtraKeys, hash_block, hash_full_blocks
from kvcache.kv_cache_manager import KVCacheManager, KVCacheStats

__all__ = [
    "BlockHash",
    "BlockPool",
    "ExtraKeys",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "KVCacheStats",
    "hash_block",
    "hash_full_blocks",
]
