"""One settings object for every process, built from `LLMQ_*` environment variables.

Nothing happens at import time: call `Settings.from_env()` (or build one in a test).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

# `llmq up` keeps its database, Redis data, demo model and logs here (relative to the
# directory it runs in); every other command finds the same database through it.
DEFAULT_STATE_DIR = ".llmq"


def sqlite_url_in(state_dir: str) -> str:
    """The URL of the SQLite database `llmq up` keeps in `state_dir`."""
    return f"sqlite:///{state_dir}/llmq.db"


def _parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {value!r} (use true or false)")


@dataclass(frozen=True, slots=True)
class Settings:
    # where `llmq up` keeps its state; the default database lives in it
    state_dir: str = DEFAULT_STATE_DIR
    # where the durable records live; the default is SQLite in the state directory (what
    # `llmq up` uses), so every command run in the same directory reads the same records
    database_url: str = sqlite_url_in(DEFAULT_STATE_DIR)
    # broker, token streams, live load figures; empty means "start an embedded Redis" (llmq up)
    redis_url: str = "redis://127.0.0.1:6379/0"
    # every Redis key and channel of llmq starts with this (tests use a throwaway prefix)
    redis_prefix: str = "llmq"
    # ordered KV tier URLs: redis://host:port/db, file:///path?max_bytes=N
    kv_tiers: tuple[str, ...] = ()
    # store a KV block to the tiers only once two sequences ended holding it
    kv_reuse_filter: bool = False
    # served models: name -> checkpoint directory (LLMQ_MODELS="demo=/path,other=/path2")
    models: dict[str, str] = field(default_factory=dict)
    auth_enabled: bool = False
    # job and stream behaviour
    lease_seconds: float = 30.0
    lease_renew_seconds: float = 5.0
    max_attempts: int = 3
    # a job queued this long with no generate message waiting in its model's queue gets
    # one again (a lost broker message, a dead worker's prefetch): no job is stranded
    queued_resend_seconds: float = 60.0
    stream_ttl_seconds: int = 24 * 3600
    sse_heartbeat_seconds: float = 15.0
    max_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 8
    drain_grace_seconds: float = 30.0
    # circuit breaker of a device group: after this many consecutive failed steps, or a
    # step running longer than step_timeout_seconds (watchdog), the group stops claiming,
    # hands its jobs back without spending their attempts, reports itself unhealthy in
    # its heartbeat and exits non-zero
    max_consecutive_step_failures: int = 3
    step_timeout_seconds: float = 300.0
    # TEST ONLY: the batcher makes this many steps raise, as a failing device would
    # (the breaker's integration test; nothing else reads it)
    fault_inject_step_failures: int = 0
    # a non-streaming OpenAI request waits this long for its job, then cancels it (504)
    request_timeout_seconds: float = 600.0
    # engine defaults of a device-group worker
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int = 512 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> "Settings":
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get("LLMQ_" + f.name.upper())
            if raw is None:
                continue
            values[f.name] = _convert(f.name, f.type, raw)
        values.update(overrides)
        if "database_url" not in values and "state_dir" in values:
            values["database_url"] = sqlite_url_in(values["state_dir"])
        return cls(**values)

    def with_overrides(self, **overrides: Any) -> "Settings":
        return replace(self, **overrides)

    def key(self, *parts: str) -> str:
        """A Redis key or channel name under this deployment's prefix."""
        return ":".join((self.redis_prefix, *parts))

    def queue_for(self, model: str) -> str:
        return f"{self.redis_prefix}.model.{model}"


def _convert(name: str, type_name: Any, raw: str) -> Any:
    type_text = str(type_name)
    try:
        if name == "models":
            result: dict[str, str] = {}
            for item in filter(None, (p.strip() for p in raw.split(","))):
                model, sep, path = item.partition("=")
                if not sep or not model or not path:
                    raise ValueError(f"expected name=/path/to/checkpoint, got {item!r}")
                result[model.strip()] = path.strip()
            return result
        if name == "kv_tiers":
            return tuple(p.strip() for p in raw.split(",") if p.strip())
        if type_text.startswith("bool"):
            return _parse_bool(raw)
        if type_text.startswith("int | None"):
            return None if raw.strip().lower() in ("", "none") else int(raw)
        if type_text.startswith("int"):
            return int(raw)
        if type_text.startswith("float"):
            return float(raw)
        return raw
    except ValueError as exc:
        raise ValueError(f"LLMQ_{name.upper()}={raw!r}: {exc}") from None
