"""Tier stores of the KV cache below the device: Redis (shared CPU tier) and local disk.

Mechanism only (bytes in, bytes out); `kvcache.offload` holds the policy.
"""

from kvcache.tiers.base import TierStore
from kvcache.tiers.disk_store import DiskTierStore
from kvcache.tiers.factory import make_tier
from kvcache.tiers.redis_store import RedisTierStore

__all__ = ["DiskTierStore", "RedisTierStore", "TierStore", "make_tier"]
