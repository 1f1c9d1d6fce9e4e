"""Tier stores from URLs (`LLMQ_KV_TIERS`): redis://host:port/db, file:///path?max_bytes=N."""

from __future__ import annotations

from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from kvcache.tiers.base import TierStore
from kvcache.tiers.disk_store import DiskTierStore
from kvcache.tiers.redis_store import RedisTierStore, redacted_url

_EXAMPLES = "redis://host:6379/1 or file:///var/cache/llmq-kv?max_bytes=10000000000"


def make_tier(url: str, key_prefix: str) -> TierStore:
    """Build the tier store a URL names.

    * `redis://[:password@]host:port/db[?ttl_seconds=N]` (also `rediss://`, `unix://`): a
      `RedisTierStore` whose keys start with `key_prefix:`; other query options go to
      redis-py as usual.
    * `file:///absolute/path?max_bytes=N`: a `DiskTierStore` capped at N bytes (the
      directory is the namespace, so `key_prefix` is not used).

    Raises ValueError naming the URL for an unknown scheme or a missing/bad option.
    Does not connect: a tier that is down is a miss at lookup time, not a startup error.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("redis", "rediss", "unix"):
        query = parse_qs(parts.query, keep_blank_values=True)
        ttl_seconds = None
        if "ttl_seconds" in query:
            ttl_seconds = _positive_int(redacted_url(url), "ttl_seconds",
                                        query.pop("ttl_seconds"))
        rest = urlunsplit(parts._replace(query=urlencode(query, doseq=True)))
        return RedisTierStore(rest, key_prefix, ttl_seconds=ttl_seconds)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"KV tier URL {url!r}: a file URL needs an absolute local path "
                             "(three slashes: file:///path)")
        if not parts.path:
            raise ValueError(f"KV tier URL {url!r} has no directory path; use {_EXAMPLES}")
        query = parse_qs(parts.query, keep_blank_values=True)
        if "max_bytes" not in query:
            raise ValueError(f"KV tier URL {url!r} needs a byte cap: add ?max_bytes=N "
                             f"(e.g. {_EXAMPLES})")
        max_bytes = _positive_int(url, "max_bytes", query.pop("max_bytes"))
        if query:
            raise ValueError(f"KV tier URL {url!r}: unknown option(s) {sorted(query)}; "
                             "a file tier takes only max_bytes")
        return DiskTierStore(parts.path, max_bytes)
    raise ValueError(f"KV tier URL {redacted_url(url)!r}: unknown scheme {parts.scheme!r}; "
                     f"use {_EXAMPLES}")


def _positive_int(url: str, name: str, values: list[str]) -> int:
    try:
        value = int(values[-1])
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"KV tier URL {url!r}: {name} must be a positive integer, "
                         f"got {values[-1]!r}")
    return value
