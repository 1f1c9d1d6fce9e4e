"""The one way llmq opens a Redis client (broker aside, which Celery/kombu manages)."""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

# A pub/sub reader blocks in get_message(timeout=...) with its own select timeout, so the
# socket timeout only bounds a single reply; it must exceed any XREAD BLOCK we issue.
SOCKET_TIMEOUT_SECONDS = 30.0
CONNECT_TIMEOUT_SECONDS = 3.0
HEALTH_CHECK_INTERVAL_SECONDS = 10


def make_redis(url: str) -> redis.Redis:
    """A client for `url` returning bytes (stream payloads and KV blobs are binary).

    Connections are health-checked when idle for a while (idle pub/sub connections get
    dropped by proxies), keep-alive is on, and a command is retried once on a broken
    connection before the error reaches the caller (who turns it into a 503).
    """
    return redis.Redis.from_url(
        url,
        decode_responses=False,
        socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
        socket_timeout=SOCKET_TIMEOUT_SECONDS,
        socket_keepalive=True,
        health_check_interval=HEALTH_CHECK_INTERVAL_SECONDS,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=1),
    )


def dedicated_connection(client: redis.Redis) -> Any:
    """A new connection with `client`'s settings, outside its pool, for one thread's use.

    NOTE: no client-side health check. It would send a PING and read the reply in
    whichever thread sends next, out of turn with a connection whose replies another
    thread reads (a pipelined sender) or that is subscribed (the reply is a push message).
    Its owner checks liveness itself.
    """
    pool = client.connection_pool
    return pool.connection_class(**{**pool.connection_kwargs, "health_check_interval": 0})


def as_text(value: str | bytes) -> str:
    """A Redis reply (bytes: clients here do not decode) as text."""
    return value.decode() if isinstance(value, bytes) else value
