"""`lookup_run`: the longest consecutive run of blocks the tiers hold, tier by tier.

Blocking (one round trip per tier consulted: a Redis MGET of consecutive keys, a disk
read): call it from a lookup thread, never from the engine's step
(`workers.engine.tier_connector` does). Every blob is checked by
`kvcache.block_format.decode_block`; a bad one ends the run there.
"""

from __future__ import annotations

import time

from kvcache.block_format import block_key, decode_block
from kvcache.hashing import BlockHash
from kvcache.tier_book import TierBook
from kvcache.tier_writer import StoreJob


def lookup_run(book: TierBook, block_hashes: list[BlockHash],
               promote: bool) -> tuple[list[bytes], list[StoreJob]]:
    """(payloads of the longest run found, promotions to queue for the tiers above).

    `block_hashes` are chained hashes; payload i belongs to block_hashes[i]. Each tier
    gets one round trip for the hashes still missing and contributes blobs up to its
    first miss or bad blob; the next tier continues there. Never raises for a tier
    failure (a miss, counted, and the tier rests).
    """
    meta = book.meta
    payloads: list[bytes] = []
    promotions: list[StoreJob] = []
    for index, tier in enumerate(book.tiers):
        start = len(payloads)
        if start == len(block_hashes):
            break
        if book.is_resting(index):
            continue
        wanted = block_hashes[start:]
        keys = [block_key(meta.fingerprint, h) for h in wanted]
        began = time.perf_counter()
        try:
            blobs = tier.get_many(keys)
        except Exception as exc:  # noqa: BLE001  (any tier failure is a miss, not an error)
            book.tier_failed(index, "lookup", exc, len(keys))
            continue
        found: list[tuple[bytes, bytes]] = []  # (blob, payload)
        bad = False
        for blob in blobs:
            if blob is None:
                break
            payload = decode_block(blob, meta)
            if payload is None:
                bad = True
                break
            found.append((blob, payload))
        elapsed = time.perf_counter() - began
        payloads.extend(payload for _, payload in found)
        above = tuple(i for i in range(index) if not book.is_resting(i))
        if promote and above:
            promotions += [StoreJob(h, blob, above, encoded=True)
                           for h, (blob, _) in zip(wanted, found)]
        with book.lock:
            stats = book.stats.tiers[index]
            stats.num_lookups += 1
            stats.num_hit_blocks += len(found)
            stats.num_loaded_bytes += sum(len(p) for _, p in found)
            stats.load_seconds += elapsed
            stats.num_bad_blobs += int(bad)
            for h, blob in zip(wanted, blobs):
                if blob is None:  # evicted (or never there): rewrite it when offered
                    book.recent[index].discard(h)
                else:
                    book.recent[index].add(h)
            if bad:
                book.stale[index].add(wanted[len(found)])
                book.recent[index].discard(wanted[len(found)])
    return payloads, promotions
