"""The checkpoint fingerprint covers every weight byte and caches file digests."""

from __future__ import annotations

import json
import os
from pathlib import Path

from workers.engine.fingerprint import fingerprint_files


def _checkpoint(root: Path, size: int = 3 << 20) -> tuple[Path, list[Path]]:
    root.mkdir(parents=True, exist_ok=True)
    config = root / "config.json"
    config.write_text('{"vocab_size": 8}')
    weights = root / "model.safetensors"
    weights.write_bytes(bytes(i % 251 for i in range(size)))
    return config, [weights]


def test_a_change_in_the_middle_of_the_weights_changes_the_fingerprint(tmp_path):
    config, files = _checkpoint(tmp_path / "ckpt")
    cache = tmp_path / "cache.json"
    before = fingerprint_files(config, files, "torch.float32", cache)
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # far from both ends: a fine-tuned middle tensor
    files[0].write_bytes(bytes(data))
    os.utime(files[0], ns=(1, 1))  # even with an mtime that matches nothing cached
    after = fingerprint_files(config, files, "torch.float32", cache)
    assert after != before
    assert fingerprint_files(config, files, "torch.bfloat16", cache) != after


def test_equal_checkpoints_in_two_places_share_the_fingerprint(tmp_path):
    a = _checkpoint(tmp_path / "a")
    b = _checkpoint(tmp_path / "b")
    assert (fingerprint_files(*a, "torch.float32", tmp_path / "c1.json")
            == fingerprint_files(*b, "torch.float32", tmp_path / "c2.json"))


def test_file_digests_are_cached_by_path_size_and_mtime(tmp_path):
    config, files = _checkpoint(tmp_path / "ckpt")
    cache = tmp_path / "cache.json"
    first = fingerprint_files(config, files, "torch.float32", cache)
    entries = json.loads(cache.read_text())
    (key,) = entries
    assert key.startswith(str(files[0].resolve()) + "|")
    # the cached digest is what the next start uses (the weights are not read again)...
    cache.write_text(json.dumps({key: "0" * 64}))
    assert fingerprint_files(config, files, "torch.float32", cache) != first
    # ...until the file changes on disk
    stat = files[0].stat()
    os.utime(files[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert fingerprint_files(config, files, "torch.float32", cache) == first


def test_an_unwritable_cache_is_no_error(tmp_path):
    config, files = _checkpoint(tmp_path / "ckpt", size=1024)
    blocker = tmp_path / "file"
    blocker.write_text("")
    fingerprint = fingerprint_files(config, files, "torch.float32", blocker / "c.json")
    assert len(fingerprint) == 16


def test_entries_of_deleted_files_leave_the_cache(tmp_path):
    cache = tmp_path / "cache.json"
    gone = _checkpoint(tmp_path / "gone", size=1024)
    fingerprint_files(*gone, "torch.float32", cache)
    gone[1][0].unlink()
    kept = _checkpoint(tmp_path / "kept", size=1024)
    fingerprint_files(*kept, "torch.float32", cache)
    (key,) = json.loads(cache.read_text())
    assert key.startswith(str(kept[1][0].resolve()) + "|")
