"""Tier stores: Redis (real server) and disk, and the URL factory. Bytes in, bytes out."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvcache.tiers import DiskTierStore, RedisTierStore, TierStore, make_tier
from kvcache.tiers.disk_store import file_name_for


@pytest.fixture
def redis_store(redis_url: str, kv_prefix: str) -> Iterator[RedisTierStore]:
    store = RedisTierStore(redis_url, kv_prefix)
    yield store
    store.close()


# --- Redis ----------------------------------------------------------------------------


def test_redis_round_trip_under_the_key_prefix(redis_store: RedisTierStore, redis_url: str,
                                               kv_prefix: str) -> None:
    assert isinstance(redis_store, TierStore)
    redis_store.put_many([("a", b"\x00payload-a\xff"), ("b", b"payload-b")])
    assert redis_store.get_many(["a", "missing", "b"]) == [b"\x00payload-a\xff", None,
                                                           b"payload-b"]
    assert redis_store.contains_many(["b", "missing", "a"]) == [True, False, True]
    redis_store.put_many([("a", b"new")])
    assert redis_store.get_many(["a"]) == [b"new"]
    assert redis_store.get_many([]) == [] and redis_store.contains_many([]) == []

    raw = redis.Redis.from_url(redis_url)
    assert raw.get(f"{kv_prefix}:b") == b"payload-b"
    assert raw.get("b") != b"payload-b"  # nothing written outside the prefix
    assert raw.ttl(f"{kv_prefix}:b") == -1  # no TTL unless asked for
    raw.close()
    assert "@" not in redis_store.name and redis_store.name.startswith("redis://")


def test_redis_ttl_from_the_url(redis_url: str, kv_prefix: str) -> None:
    store = make_tier(redis_url + "?ttl_seconds=100", kv_prefix)
    assert isinstance(store, RedisTierStore) and store.ttl_seconds == 100
    store.put_many([("t", b"x")])
    raw = redis.Redis.from_url(redis_url)
    assert 90 <= raw.ttl(f"{kv_prefix}:t") <= 100
    raw.close()
    store.close()


def test_redis_get_many_is_a_single_mget(redis_store: RedisTierStore, redis_url: str,
                                         kv_prefix: str) -> None:
    keys = [f"k{i}" for i in range(6)]
    redis_store.put_many([(key, key.encode()) for key in keys[:4]])
    watcher = redis.Redis.from_url(redis_url, socket_timeout=10)
    other = redis.Redis.from_url(redis_url)
    marker = f"{kv_prefix}:end-of-test"
    commands: list[str] = []
    try:
        with watcher.monitor() as monitor:
            assert redis_store.get_many(keys) == [b"k0", b"k1", b"k2", b"k3", None, None]
            # sent after get_many returned, so MONITOR shows it after get_many's commands
            other.echo(marker)
            while True:
                command = monitor.next_command()["command"]
                if marker in command:
                    break
                if kv_prefix in command:
                    commands.append(command)
    finally:
        other.close()
        watcher.close()
    assert len(commands) == 1, commands
    assert commands[0].split()[0].upper() == "MGET"
    assert all(f"{kv_prefix}:{key}" in commands[0] for key in keys)


# --- disk -----------------------------------------------------------------------------


def test_disk_round_trip_and_safe_names(tmp_path: Path) -> None:
    store = DiskTierStore(tmp_path / "kv", max_bytes=10_000)
    assert isinstance(store, TierStore)
    tricky = ["kv:abc:00ff", "../escape", ".hidden", "a/b", "kv_3aabc_3a00ff", "ü"]
    store.put_many([(key, key.encode()) for key in tricky])
    assert store.get_many(tricky + ["absent"]) == [key.encode() for key in tricky] + [None]
    assert store.contains_many(["absent", "a/b"]) == [False, True]
    names = sorted(p.name for p in (tmp_path / "kv").iterdir())
    assert len(names) == len(tricky)  # one file per key, no collisions
    assert all(not n.startswith(".") and "/" not in n for n in names)
    assert not (tmp_path / "escape").exists()
    assert store.num_bytes == sum(len(k.encode()) for k in tricky)
    assert file_name_for("x" * 500) != file_name_for("x" * 501)
    assert len(file_name_for("x" * 500)) < 255


def test_disk_byte_cap_evicts_least_recently_used(tmp_path: Path) -> None:
    store = DiskTierStore(tmp_path, max_bytes=300)
    store.put_many([("a", b"a" * 100), ("b", b"b" * 100), ("c", b"c" * 100)])
    assert store.get_many(["a"]) == [b"a" * 100]  # a is now the most recent
    store.put_many([("d", b"d" * 100)])
    assert store.contains_many(["a", "b", "c", "d"]) == [True, False, True, True]
    store.put_many([("e", b"e" * 100)])  # c is the oldest now
    assert store.contains_many(["a", "c", "d", "e"]) == [True, False, True, True]
    store.put_many([("f", b"f" * 250)])  # needs room for 250: a, d and e go, oldest first
    assert store.contains_many(["a", "d", "e", "f"]) == [False, False, False, True]
    assert store.num_bytes == 250
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) == 250
    store.put_many([("huge", b"h" * 301)])  # bigger than the whole cap: refused
    assert store.contains_many(["huge", "f"]) == [False, True]


def test_disk_index_is_rebuilt_from_mtimes(tmp_path: Path) -> None:
    store = DiskTierStore(tmp_path, max_bytes=1000)
    store.put_many([(key, key.encode() * 50) for key in ("old", "mid", "new")])
    for age, key in ((300, "old"), (200, "mid"), (100, "new")):
        stamp = 1_700_000_000 - age
        os.utime(tmp_path / file_name_for(key), (stamp, stamp))
    (tmp_path / ".tmp-deadbeef").write_bytes(b"torn write")
    store.close()

    reopened = DiskTierStore(tmp_path, max_bytes=350)  # 3 x 150 bytes: one must go
    assert not (tmp_path / ".tmp-deadbeef").exists()
    assert reopened.contains_many(["old", "mid", "new"]) == [False, True, True]
    reopened.get_many(["mid"])  # a hit makes mid the most recent, on disk too
    reopened.close()
    again = DiskTierStore(tmp_path, max_bytes=200)
    assert again.contains_many(["mid", "new"]) == [True, False]


# --- factory --------------------------------------------------------------------------


def test_make_tier_builds_each_kind(tmp_path: Path, redis_url: str) -> None:
    disk = make_tier(f"file://{tmp_path}/tier?max_bytes=1234", "ignored")
    assert isinstance(disk, DiskTierStore)
    assert disk.max_bytes == 1234 and disk.path == tmp_path / "tier"
    red = make_tier(redis_url, "pfx")
    assert isinstance(red, RedisTierStore) and red.key_prefix == "pfx"
    red.close()


@pytest.mark.parametrize("url, words", [
    ("file:///var/tmp/kv", "max_bytes"),
    ("file:///var/tmp/kv?max_bytes=lots", "positive integer"),
    ("file:///var/tmp/kv?max_bytes=0", "positive integer"),
    ("file:///var/tmp/kv?max_bytes=10&mode=fast", "unknown option"),
    ("file://host/var/tmp/kv?max_bytes=10", "absolute local path"),
    ("s3://bucket/kv", "unknown scheme"),
    ("/var/tmp/kv", "unknown scheme"),
    ("redis://127.0.0.1:6379/1?ttl_seconds=-5", "positive integer"),
])
def test_make_tier_rejects_bad_urls(url: str, words: str) -> None:
    with pytest.raises(ValueError) as info:
        make_tier(url, "llmq")
    assert words in str(info.value)
    assert url.split("?")[0].split("//")[-1].split("/")[0] in str(info.value)
