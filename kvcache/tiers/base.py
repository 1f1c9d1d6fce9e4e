"""The tier store interface: bytes in, bytes out, nothing else.

A tier store is mechanism only. It does not know what a block is, how keys are made, or
which blocks deserve storing: `kvcache.offload.KVOffloadManager` decides that. Each batch
method is one round trip to the backing store, so the policy can count its cost.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class TierStore(Protocol):
    """A key -> bytes store that may lose any entry at any time (a cache, not a database).

    Keys are short ASCII strings chosen by the caller. Implementations may raise on
    backend failure (connection refused, timeout, full disk); the caller treats a failure
    as a miss. `put_many` never makes a key visible before its whole payload is written.
    """

    # for logs and metrics, e.g. "redis://127.0.0.1:6379/1" or "file:///var/cache/llmq-kv";
    # never carries a password
    name: str

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """The payload of each key, in order, None where absent. One round trip."""
        ...

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        """Store every (key, payload); an existing key is overwritten. One round trip."""
        ...

    def contains_many(self, keys: list[str]) -> list[bool]:
        """Whether each key is present, in order, without reading payloads. One round trip."""
        ...

    def close(self) -> None:
        """Release connections and files; the store is unusable afterwards."""
        ...
