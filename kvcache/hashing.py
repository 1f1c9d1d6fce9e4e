"""Content hashes of KV blocks: the keys of the prefix cache on the device and in Redis.

A block's hash covers its own token ids AND, through `parent`, every token before it, so
equal hashes mean equal prefixes, not just equal blocks. The encoding is fixed (SHA-256 over
a versioned root seed, fixed-width little-endian integers, length-prefixed strings): the
same tokens give the same hash in every process, on every host, after every restart.
NOTE: never use Python's `hash()` here: it is salted per process (PYTHONHASHSEED).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)  # a 32-byte SHA-256 digest

# Extra keys separate caches that share token ids but not KV contents (an adapter name,
# a cache salt, ...). Every block of a chain carries them.
ExtraKeys = tuple[str | int, ...]

# The parent of a sequence's first block. Bump the version when the encoding changes, so
# blobs hashed the old way (in the Redis tier) are never taken for new ones.
_ROOT_HASH = hashlib.sha256(b"llmq.kvcache.block-hash.v1").digest()
_HASH_LEN = len(_ROOT_HASH)

_COUNT = struct.Struct("<I")
_INT = struct.Struct("<q")


def _encode_extra_keys(extra_keys: ExtraKeys) -> bytes:
    # Each key is tagged with its type so that 1 and "1" differ; strings are length-prefixed
    # so that ("ab", "c") and ("a", "bc") differ.
    parts = [_COUNT.pack(len(extra_keys))]
    for key in extra_keys:
        if isinstance(key, str):
            data = key.encode("utf-8")
            parts += [b"s", _COUNT.pack(len(data)), data]
        elif isinstance(key, int):
            parts += [b"i", _INT.pack(key)]
        else:
            raise TypeError(
                f"extra_keys may hold only str and int values, got {type(key).__name__}: "
                f"{key!r}; convert it to a string first"
            )
    return b"".join(parts)


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys = (),
) -> BlockHash:
    """Return the chained hash of one block.

    `parent` is the hash of the previous block of the sequence (None for the first block);
    `token_ids` are the block's tokens, each a non-negative id below 2**63.
    """
    if parent is not None and len(parent) != _HASH_LEN:
        raise ValueError(f"parent must be a {_HASH_LEN}-byte block hash, got {len(parent)} bytes")
    digest = hashlib.sha256(_ROOT_HASH if parent is None else parent)
    num_tokens = len(token_ids)
    digest.update(_COUNT.pack(num_tokens))
    digest.update(struct.pack(f"<{num_tokens}q", *token_ids))
    digest.update(_encode_extra_keys(extra_keys))
    return BlockHash(digest.digest())


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: ExtraKeys = (),
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Return one chained hash per FULL block of `token_ids`; a partial tail is not hashed.

    With `parent` set, `token_ids` continue a sequence whose last full block hashed to it
    (so `hash_full_blocks(ids[k * bs:], bs, parent=h[k - 1]) == h[k:]`).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
