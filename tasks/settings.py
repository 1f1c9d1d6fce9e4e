"""One settings object for every process, built from `LLMQ_*` environment variables.

A `pydantic-settings` model: each field's type and range is checked when the object is
built, and `Settings.from_env()` turns a bad value into one message naming the variable
(`LLMQ_LEASE_SECONDS=-1: must be greater than 0`), so a process fails at start-up rather
than on first use.

Nothing happens at import time. `Settings(...)` builds from its arguments alone (tests
rely on that: no stray `LLMQ_*` variable of the shell leaks in); `Settings.from_env()`
reads the environment (or a mapping given to it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Annotated, Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict

# `llmq up` keeps its database, Redis data, demo model and logs here (relative to the
# directory it runs in); every other command finds the same database through it.
DEFAULT_STATE_DIR = ".llmq"
ENV_PREFIX = "LLMQ_"
MAX_N_LIMIT = 256  # tasks.params.MAX_N: the engine builds one sequence per sample

# the environment `from_env` reads; unset (direct construction) means none at all
_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("llmq_settings_environ",
                                                           default=None)


def sqlite_url_in(state_dir: str) -> str:
    """The URL of the SQLite database `llmq up` keeps in `state_dir`."""
    return f"sqlite:///{state_dir}/llmq.db"


class _MappingEnvSource(EnvSettingsSource):
    """`LLMQ_*` values from the mapping `from_env` was given (not `os.environ` directly)."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        environ = _ENVIRON.get()
        if environ is None:
            return {}
        return {key.lower(): value for key, value in environ.items()
                if key.upper().startswith(ENV_PREFIX)}


class Settings(BaseSettings):
    """Every setting of every process; README's configuration table lists them."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="forbid",
                                      case_sensitive=False, validate_default=True)

    # where `llmq up` keeps its state; the default database lives in it
    state_dir: str = Field(DEFAULT_STATE_DIR, min_length=1)
    # where the durable records live; the default is SQLite in the state directory (what
    # `llmq up` uses), so every command run in the same directory reads the same records
    database_url: str = Field(sqlite_url_in(DEFAULT_STATE_DIR), min_length=1)
    # broker, token streams, live load figures; empty means "start an embedded Redis" (llmq up)
    redis_url: str = "redis://127.0.0.1:6379/0"
    # every Redis key and channel of llmq starts with this (tests use a throwaway prefix)
    redis_prefix: str = Field("llmq", min_length=1)
    # ordered KV tier URLs: redis://host:port/db, file:///path?max_bytes=N (comma separated)
    kv_tiers: Annotated[tuple[str, ...], NoDecode] = ()
    # store a KV block to the tiers only once two sequences ended holding it
    kv_reuse_filter: bool = False
    # served models: name -> checkpoint directory (LLMQ_MODELS="demo=/path,other=/path2")
    models: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    auth_enabled: bool = False
    # with auth on, /v1/models and /metrics need a key too (they show checkpoint paths,
    # hosts and pids); false lets a scraper without a key read them
    metadata_requires_key: bool = True
    # job and stream behaviour
    lease_seconds: float = Field(30.0, gt=0)
    lease_renew_seconds: float = Field(5.0, gt=0)
    max_attempts: int = Field(3, ge=1)
    # a job queued this long with no generate message waiting in its model's queue gets
    # one again (a lost broker message, a dead worker's prefetch): no job is stranded
    queued_resend_seconds: float = Field(60.0, gt=0)
    # queued jobs per model before submissions are refused (429); 0: no limit
    max_queued_jobs: int = Field(10_000, ge=0)
    # a job still queued this long fails ("waited too long in the queue"); None: never
    queue_timeout_seconds: float | None = Field(None, gt=0)
    stream_ttl_seconds: int = Field(24 * 3600, ge=1)
    sse_heartbeat_seconds: float = Field(15.0, gt=0)
    # after a streaming job's first token, its token events go out at most once per this
    # many seconds per sample, each with every token made since (0: one event per step);
    # with steps slower than this nothing waits (workers/token_coalescer.py)
    stream_interval_seconds: float = Field(0.02, ge=0, le=1.0)
    # the batcher thread's nice value: below 0 its steps run ahead of the host's other
    # threads, taken only where the engine's threads leave cores to the rest of the host
    # (workers/thread_priority.py); 0: the process's own priority
    batcher_nice: int = Field(-20, ge=-20, le=19)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_n: int = Field(8, ge=1, le=MAX_N_LIMIT)
    # the Batch API: an uploaded file's size (OpenAI's 200 MB), a batch's lines (OpenAI's
    # 50,000), and how long a batch may run: OpenAI's only window is "24h"; tests shorten it
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1024)
    max_batch_lines: int = Field(50_000, ge=1)
    batch_completion_window_seconds: float = Field(24 * 3600.0, gt=0)
    # a batch's output and error files expire this long after it ends unless its create
    # asks otherwise (`output_expires_after`; OpenAI's default is 30 days); None: kept
    batch_output_expires_seconds: int | None = Field(30 * 24 * 3600, ge=1)
    # a running batch's counts and usage (one pass over its lines) are shared by every web
    # process for this long: clients that poll it often cost one pass a period (0: a pass
    # at every read)
    batch_progress_cache_seconds: float = Field(1.0, ge=0, le=60.0)
    # a web process validates a batch under a lease it renews; another takes it over once
    # the lease lapsed (the validating process died)
    batch_validation_lease_seconds: float = Field(60.0, gt=0)
    drain_grace_seconds: float = Field(30.0, ge=0)
    # circuit breaker of a device group: after this many consecutive failed steps, or a
    # step running longer than step_timeout_seconds (watchdog), the group stops claiming,
    # hands its jobs back without spending their attempts, reports itself unhealthy in
    # its heartbeat and exits non-zero
    max_consecutive_step_failures: int = Field(3, ge=1)
    step_timeout_seconds: float = Field(300.0, gt=0)
    # TEST ONLY: the batcher makes this many steps raise, as a failing device would
    # (the breaker's integration test; nothing else reads it)
    fault_inject_step_failures: int = Field(0, ge=0)
    # a non-streaming OpenAI request waits this long for its job, then cancels it (504)
    request_timeout_seconds: float = Field(600.0, gt=0)
    # engine defaults of a device-group worker
    device: str = Field("cpu", min_length=1)
    # "auto": bf16 on a CPU with native bf16, fp32 on other CPUs, the checkpoint's dtype on
    # an accelerator (workers/engine/loader.py `auto_dtype`)
    dtype: str = Field("auto", min_length=1)
    block_size: int = Field(16, ge=1)
    kv_cache_bytes: int = Field(512 * 1024 * 1024, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = True

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: Any,
                                   env_settings: Any, dotenv_settings: Any,
                                   file_secret_settings: Any) -> tuple[Any, ...]:
        return (init_settings, _MappingEnvSource(settings_cls))

    @field_validator("models", mode="before")
    @classmethod
    def _parse_models(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        result: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in value.split(","))):
            model, sep, path = item.partition("=")
            if not sep or not model.strip() or not path.strip():
                raise ValueError(f"expected name=/path/to/checkpoint, got {item!r}")
            result[model.strip()] = path.strip()
        return result

    @field_validator("kv_tiers", mode="before")
    @classmethod
    def _parse_tiers(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(p.strip() for p in value.split(",") if p.strip())
        return value

    @field_validator("max_model_len", "queue_timeout_seconds", mode="before")
    @classmethod
    def _none_words(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("", "none", "off"):
            return None
        return value

    @field_validator("kv_reuse_filter", "auth_enabled", "metadata_requires_key",
                     "enable_prefix_caching", mode="before")
    @classmethod
    def _empty_is_false(cls, value: Any) -> Any:
        return False if isinstance(value, str) and not value.strip() else value

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """The settings of `environ` (default `os.environ`), `overrides` on top.

        Raises ValueError naming the first bad variable, its value and the allowed range.
        """
        env = os.environ if environ is None else environ
        token = _ENVIRON.set(env)
        try:
            settings = cls(**overrides)
        except ValidationError as exc:
            raise ValueError(_explain(exc, env, overrides)) from None
        finally:
            _ENVIRON.reset(token)
        if "database_url" not in overrides and not env.get(ENV_PREFIX + "DATABASE_URL") \
                and settings.state_dir != DEFAULT_STATE_DIR:
            settings = settings.with_overrides(database_url=sqlite_url_in(settings.state_dir))
        return settings

    def with_overrides(self, **overrides: Any) -> Settings:
        """A copy with `overrides`, validated like the original."""
        values = {name: getattr(self, name) for name in type(self).model_fields}
        values.update(overrides)
        return type(self)(**values)

    def key(self, *parts: str) -> str:
        """A Redis key or channel name under this deployment's prefix."""
        return ":".join((self.redis_prefix, *parts))

    def queue_for(self, model: str) -> str:
        return f"{self.redis_prefix}.model.{model}"

    def effective(self) -> dict[str, Any]:
        """Every setting by its variable name, passwords in URLs masked (`llmq config`)."""
        shown: dict[str, Any] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if name.endswith("_url") and isinstance(value, str):
                value = mask_url_password(value)
            elif name == "kv_tiers":
                value = ",".join(mask_url_password(url) for url in value)
            elif name == "models":
                value = ",".join(f"{k}={v}" for k, v in value.items())
            shown[ENV_PREFIX + name.upper()] = value
        return shown


def mask_url_password(url: str) -> str:
    """`scheme://user:****@host/...` for a URL with a password; anything else unchanged."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return url
    if not password:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:****@{netloc[1]}"))


def _explain(exc: ValidationError, env: Mapping[str, str], overrides: dict[str, Any]) -> str:
    """`LLMQ_NAME='raw': what is wrong` for the first error."""
    error = exc.errors()[0]
    name = str(error["loc"][0]) if error["loc"] else "?"
    variable = ENV_PREFIX + name.upper()
    if name in overrides:
        raw = overrides[name]
        where = f"{name}={raw!r}"
    else:
        raw = next((v for k, v in env.items() if k.upper() == variable), None)
        where = f"{variable}={raw!r}" if raw is not None else variable
    message = str(error["msg"])
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if error["type"] == "bool_parsing":
        message = "not a boolean (use true or false)"
    return f"{where}: {message}"
