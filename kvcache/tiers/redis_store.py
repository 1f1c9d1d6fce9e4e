"""A tier store in a Redis database: the shared CPU tier of the KV cache.

Every device group of a model talks to the same database, so a block computed on one
group is a hit on all of them. The database should be its own (or a separate instance)
with `maxmemory` and `maxmemory-policy allkeys-lru`: Redis then evicts the least recently
used blocks itself and KV blobs never push out broker messages or token streams
(docs/kv-tiers.md).
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit, urlunsplit

import redis

logger = logging.getLogger(__name__)

# The tier sits on the admission path of the engine: a slow Redis must cost a miss, not a
# stalled batch. A refused connection fails at once; these bound a silent one.
CONNECT_TIMEOUT_SECONDS = 0.5
SOCKET_TIMEOUT_SECONDS = 2.0


def redacted_url(url: str) -> str:
    """`url` without user name or password, for logs and tier names."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class RedisTierStore:
    """Keys live at `<key_prefix>:<key>` in the database named by `url` (redis://host:port/db).

    Opens its own connection pool (no retries: a failed command is a miss for the caller).
    With `ttl_seconds`, each block also expires that long after it was last written, a
    bound for a Redis that has no memory limit; LRU under `maxmemory` is the normal bound.
    NOTE: never FLUSHes anything; other data may share the database.
    """

    def __init__(
        self,
        url: str,
        key_prefix: str = "",
        *,
        ttl_seconds: int | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_SECONDS,
        socket_timeout: float = SOCKET_TIMEOUT_SECONDS,
    ) -> None:
        if ttl_seconds is not None and ttl_seconds < 1:
            raise ValueError(f"ttl_seconds must be >= 1 or None, got {ttl_seconds}")
        self.name = redacted_url(url)
        self.key_prefix = key_prefix
        self.ttl_seconds = ttl_seconds
        self._client = redis.Redis.from_url(
            url,
            decode_responses=False,
            socket_connect_timeout=connect_timeout,
            socket_timeout=socket_timeout,
            socket_keepalive=True,
        )

    def _full_key(self, key: str) -> str:
        return f"{self.key_prefix}:{key}" if self.key_prefix else key

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        # One MGET: consecutive blocks of a prefix come back in a single round trip.
        # decode_responses=False: every value is bytes or None
        return self._client.mget([self._full_key(k) for k in keys])  # type: ignore[return-value]

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        if not items:
            return
        # One SET per block carries the whole blob, so a key that exists is complete.
        pipe = self._client.pipeline(transaction=False)
        for key, payload in items:
            pipe.set(self._full_key(key), payload, ex=self.ttl_seconds)
        pipe.execute()

    def contains_many(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._full_key(key))
        return [bool(n) for n in pipe.execute()]

    def memory_policy(self) -> tuple[int, str]:
        """(maxmemory in bytes, maxmemory-policy) of the server; raises if CONFIG is denied."""
        config = {_text(k): _text(v) for k, v in self._client.config_get("maxmemory*").items()}
        return int(config.get("maxmemory", "0")), config.get("maxmemory-policy", "")

    def warn_if_unbounded(self) -> None:
        """Log a WARNING when the server has no memory limit or does not evict by LRU.

        Best effort: an unreachable server or a denied CONFIG command logs at DEBUG only.
        """
        try:
            maxmemory, policy = self.memory_policy()
        except redis.RedisError as exc:
            logger.debug("KV tier %s: cannot read its memory policy: %s", self.name, exc)
            return
        if maxmemory == 0 and self.ttl_seconds is None:
            logger.warning(
                "KV tier %s has no memory limit: KV blocks will grow until Redis runs out of "
                "memory; give the tier its own Redis with maxmemory and "
                "maxmemory-policy allkeys-lru (docs/kv-tiers.md)", self.name)
        evicting = {"allkeys-lru", "allkeys-lfu"}
        if self.ttl_seconds is not None:  # volatile-* policies evict only keys with a TTL
            evicting |= {"volatile-lru", "volatile-lfu", "volatile-ttl"}
        if maxmemory and policy not in evicting:
            logger.warning(
                "KV tier %s uses maxmemory-policy %s: once full, writes of new blocks fail "
                "or the wrong keys go; set maxmemory-policy allkeys-lru (docs/kv-tiers.md)",
                self.name, policy)

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"RedisTierStore({self.name!r}, key_prefix={self.key_prefix!r})"


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")
