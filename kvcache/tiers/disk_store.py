"""A tier store in a local directory: one file per key, a byte cap, LRU eviction.

For a host whose RAM is short but whose disk (NVMe) is fast: blocks evicted from Redis, or
never sent there, can still beat recomputing a long prefix.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

logger = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp-"
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-.")
# Well under the 255-byte limit of common file systems, escapes included.
_MAX_NAME_LEN = 200


def file_name_for(key: str) -> str:
    """A file name for `key`, distinct for distinct keys, never hidden, never a path.

    Characters outside [A-Za-z0-9.-] (and a leading dot) become `_xx` (hex of each UTF-8
    byte), so the mapping is one-to-one; an overlong result is replaced by its SHA-256.
    """
    out: list[str] = []
    for index, char in enumerate(key):
        if char in _SAFE and not (index == 0 and char == "."):
            out.append(char)
        else:
            out.extend(f"_{byte:02x}" for byte in char.encode("utf-8"))
    name = "".join(out)
    if not name or len(name) > _MAX_NAME_LEN:
        # "~" is outside the safe set, so no escaped name contains it: no collisions.
        name = "~" + hashlib.sha256(key.encode("utf-8")).hexdigest()
    return name


class DiskTierStore:
    """Files under `path`, at most `max_bytes` of payload in total, least recently used
    evicted first.

    Recency lives in an in-memory index (file name -> size, oldest first), rebuilt from the
    files' mtimes when the store opens; a hit moves the key to the newest end and touches
    the file's mtime so the order survives a restart. A payload is written to a temporary
    file and renamed into place, so a key that exists is complete. There is no fsync: a
    crash may leave a torn file, which the blob checksum (kvcache.block_format) rejects.
    NOTE: the cap is enforced by this process; two processes sharing a directory each
    count only what they wrote or read, so give each worker its own directory.
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.name = f"file://{self.path.resolve()}"
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, LRU first
        self._num_bytes = 0
        self._rebuild_index()
        with self._lock:
            self._evict_locked()

    @property
    def num_bytes(self) -> int:
        """Bytes of payload currently indexed."""
        return self._num_bytes

    def _rebuild_index(self) -> None:
        entries: list[tuple[int, str, int]] = []
        with os.scandir(self.path) as it:
            for entry in it:
                if not entry.is_file(follow_symlinks=False):
                    continue
                if entry.name.startswith(_TMP_PREFIX):
                    # left by a write that died before its rename: never visible, drop it
                    _unlink(Path(entry.path))
                    continue
                stat = entry.stat(follow_symlinks=False)
                entries.append((stat.st_mtime_ns, entry.name, stat.st_size))
        entries.sort()
        for _, name, size in entries:
            self._index[name] = size
            self._num_bytes += size
        logger.info("disk KV tier %s: %d blocks, %d of %d bytes", self.name, len(entries),
                    self._num_bytes, self.max_bytes)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        results: list[bytes | None] = []
        for key in keys:
            name = file_name_for(key)
            file_path = self.path / name
            try:
                data = file_path.read_bytes()
            except FileNotFoundError:
                results.append(None)
                continue
            results.append(data)
            self._touch(name, file_path, len(data))
        return results

    def _touch(self, name: str, file_path: Path, size: int) -> None:
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
            else:  # written by another process sharing the directory: count it from now on
                self._index[name] = size
                self._num_bytes += size
        try:
            os.utime(file_path)
        except OSError:
            pass  # evicted meanwhile; recency on disk is only a hint for the next start

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        for key, payload in items:
            if len(payload) > self.max_bytes:
                logger.warning("disk KV tier %s: a %d-byte blob exceeds the whole cap of %d "
                               "bytes, not stored; raise max_bytes", self.name, len(payload),
                               self.max_bytes)
                continue
            name = file_name_for(key)
            tmp_path = self.path / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
            try:
                with open(tmp_path, "wb") as f:
                    f.write(payload)
                os.replace(tmp_path, self.path / name)
            except BaseException:
                _unlink(tmp_path)
                raise
            with self._lock:
                self._num_bytes -= self._index.pop(name, 0)
                self._index[name] = len(payload)
                self._num_bytes += len(payload)
                self._evict_locked()

    def _evict_locked(self) -> None:
        while self._num_bytes > self.max_bytes and self._index:
            name, size = self._index.popitem(last=False)
            self._num_bytes -= size
            _unlink(self.path / name)

    def contains_many(self, keys: list[str]) -> list[bool]:
        return [(self.path / file_name_for(key)).is_file() for key in keys]

    def close(self) -> None:
        pass  # no open handles between calls

    def __repr__(self) -> str:
        return f"DiskTierStore({str(self.path)!r}, max_bytes={self.max_bytes})"


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
