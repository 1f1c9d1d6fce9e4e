"""The checkpoint fingerprint: which KV blocks may be shared with which workers.

KV blocks computed by one worker are reused by every worker whose fingerprint is equal
(the KV tier keys carry it), so it must change whenever any weight changes: a fine-tune
that touches only middle tensors must not share blocks with its base. It is the SHA-256
of `config.json`, the serving dtype and, per weights file, its name, size and the digest
of ALL its bytes. Hashing a large checkpoint takes seconds per GB, so each file's digest is
cached under the user's cache directory, keyed by (absolute path, size, mtime in ns): a
restart of an unchanged checkpoint reads no weights for this.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 8 << 20


def default_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmq" / "file-digests.json"


def fingerprint_files(config_path: Path, weight_files: list[Path], dtype: str,
                           cache_path: Path | None = None) -> str:
    """16 hex chars naming the checkpoint's weights and the serving dtype."""
    cache = _DigestCache(cache_path or default_cache_path())
    digest = hashlib.sha256()
    digest.update(config_path.read_bytes())
    digest.update(dtype.encode())
    for path in weight_files:
        digest.update(f"{path.name}:{path.stat().st_size}:{cache.file_digest(path)}".encode())
    cache.save()
    return digest.hexdigest()[:16]


class _DigestCache:
    """File digests by (path, size, mtime_ns), in one JSON file; unwritable is fine."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.changed = False
        try:
            self.entries: dict[str, str] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}

    def file_digest(self, path: Path) -> str:
        stat = path.stat()
        key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        found = self.entries.get(key)
        if found is not None:
            return found
        with open(path, "rb") as f:
            value = hashlib.file_digest(f, "sha256").hexdigest()
        logger.info("hashed %s (%.1f MB) for the checkpoint fingerprint", path,
                    stat.st_size / 1e6)
        self.entries[key] = value
        self.changed = True
        return value

    def save(self) -> None:
        if not self.changed:
            return
        # files that are gone (a deleted checkpoint) leave the cache, so it never grows
        # beyond the checkpoints on this machine
        self.entries = {key: value for key, value in self.entries.items()
                        if Path(key.split("|", 1)[0]).exists()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.entries))
            tmp.replace(self.path)  # NOTE: atomic, so concurrent workers never read half
        except OSError as exc:
            logger.debug("file digest cache not written (%s): %s", self.path, exc)
