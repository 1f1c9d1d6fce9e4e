"""The Celery application shared by the web (sender), device-group workers and beat.

Celery carries admission only: `generate(job_id)` claims a job and hands it to the
batcher, so tasks are short, results are ignored and messages are acked on receipt.
Running jobs are protected by leases in Postgres (see `tasks.maintenance`), never by
late acks: the Redis broker would redeliver a long task after `visibility_timeout`.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, cast

from celery import Celery
from kombu.transport import redis as kombu_redis

from tasks.protocol import (
    BATCH_SWEEP_TASK,
    EXPIRE_STREAMS_TASK,
    GENERATE_TASK,
    RECLAIM_TASK,
    RESEND_QUEUED_TASK,
)
from tasks.settings import Settings

logger = logging.getLogger(__name__)

# Only unacked messages are subject to redelivery; with acks on receipt this just bounds
# how long a message fetched by a worker that died before acking waits to come back.
VISIBILITY_TIMEOUT_SECONDS = 3600
EXPIRE_STREAMS_INTERVAL_SECONDS = 60.0
BATCH_SWEEP_INTERVAL_SECONDS = 5.0  # finalize batches nobody polls; expire overdue ones
# The web must answer 503 quickly when the broker is down, not retry for minutes.
PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0.0, "interval_step": 0.2,
                        "interval_max": 0.5}


class _RestoreGuardQoS(kombu_redis.QoS):
    """Kombu's Redis QoS, except that giving prefetched messages back cannot crash.

    NOTE (kombu's known failure): when the broker connection drops, the consumer closes
    the transport and then its channel; the channel's close gives unacked (prefetched)
    messages back with `restore_unacked`, which opens a new pool from the transport's
    connection info, already gone: "AttributeError: 'NoneType' object has no attribute
    'hostname'", an "Unrecoverable error" that ends the worker. Here that failure is
    logged instead. The messages stay in the broker's unacked index (kombu restores them
    after `visibility_timeout`), and beat's resend pass gives every queued job without a
    waiting message a new one well before that (tasks/maintenance.py).
    """

    def restore_unacked(self, client: object = None) -> object:
        try:
            return super().restore_unacked(client)
        except (AttributeError, *self.channel.connection_errors) as exc:
            # (kombu declares `_delivered` as None on the class; a channel holds a dict)
            delivered = cast(dict[Any, Any], self._delivered)
            logger.warning("could not give %d prefetched messages back to the broker (%s); "
                           "beat's resend pass re-sends their jobs", len(delivered), exc)
            delivered.clear()
            return None


class _RestoreGuardChannel(kombu_redis.Channel):
    """Kombu's Redis channel with `_RestoreGuardQoS`, and one client for its plain
    commands.

    Kombu builds a new redis-py client object for every plain command of a channel (each
    publish's `LPUSH`, each ack), and a client's constructor fills its table of ~170
    response callbacks: with one kept, `send_generate` costs 0.41-0.46 ms of CPU against
    0.50-0.61 (500 publishes, alternated). The client is a handle on the channel's
    connection pool (connections are taken from the pool per command, so threads may
    share it); the channel keeps one for as long as that pool lives, and builds a new one
    when kombu replaces the pool (after a fork or a reconnect)."""

    QoS = _RestoreGuardQoS
    _plain_client: object = None

    def _create_client(self, asynchronous: bool = False) -> object:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        client = self._plain_client
        if client is None or getattr(client, "connection_pool", None) is not pool:
            client = self._plain_client = super()._create_client()
        return client


class RedisTransport(kombu_redis.Transport):
    """The Redis transport every llmq Celery app uses (see `_RestoreGuardChannel`)."""

    Channel = _RestoreGuardChannel


def maintenance_queue(settings: Settings) -> str:
    """The queue beat's own worker consumes (device-group workers never do)."""
    return f"{settings.redis_prefix}.maintenance"


def create_celery(settings: Settings, *, beat: bool = False) -> Celery:
    """A Celery app on `settings.redis_url`, its keys under `<redis_prefix>:celery:`.

    `beat=True` adds the periodic maintenance schedule (lease reclaim, stream expiry);
    the caller registers the task bodies (`register_maintenance_tasks`, the worker's
    `generate`). Building the app connects to nothing.
    """
    app = Celery("llmq", set_as_current=False)
    app.conf.update(
        broker_url=settings.redis_url,
        broker_transport=RedisTransport,
        broker_transport_options={
            # NOTE: every deployment / test run gets its own broker keyspace.
            "global_keyprefix": settings.redis_prefix + ":celery:",
            "visibility_timeout": VISIBILITY_TIMEOUT_SECONDS,
            "socket_connect_timeout": 3,
            "socket_timeout": 10,
            "health_check_interval": 10,
        },
        # NOTE: a worker never gives up on the broker: a Redis restart or blip must not end
        # it (its running jobs go on; admission waits). Kombu retries with a growing
        # interval (at most 30 s apart).
        broker_connection_retry=True,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        broker_connection_timeout=3,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        result_backend=None,
        worker_prefetch_multiplier=1,
        task_acks_late=False,
        task_publish_retry_policy=PUBLISH_RETRY_POLICY,
        task_default_queue=maintenance_queue(settings),
        task_routes={
            RECLAIM_TASK: {"queue": maintenance_queue(settings)},
            RESEND_QUEUED_TASK: {"queue": maintenance_queue(settings)},
            EXPIRE_STREAMS_TASK: {"queue": maintenance_queue(settings)},
            BATCH_SWEEP_TASK: {"queue": maintenance_queue(settings)},
        },
        worker_hijack_root_logger=False,
        timezone="UTC",
        enable_utc=True,
    )
    if beat:
        app.conf.beat_schedule = beat_schedule(settings)
        app.conf.beat_schedule_filename = str(
            Path(tempfile.gettempdir()) / f"{settings.redis_prefix}-celerybeat-schedule"
        )
    return app


def beat_schedule(settings: Settings) -> dict[str, dict[str, object]]:
    """Reclaim about as often as workers renew leases, look for stranded queued jobs a few
    times per `queued_resend_seconds`, expire streams every minute, finalize and expire
    batches every few seconds."""
    return {
        "reclaim-expired-leases": {
            "task": RECLAIM_TASK,
            "schedule": max(1.0, settings.lease_renew_seconds),
            "options": {"queue": maintenance_queue(settings), "expires": 60},
        },
        "resend-stranded-jobs": {
            "task": RESEND_QUEUED_TASK,
            "schedule": max(1.0, settings.queued_resend_seconds / 4),
            "options": {"queue": maintenance_queue(settings), "expires": 60},
        },
        "expire-streams": {
            "task": EXPIRE_STREAMS_TASK,
            "schedule": EXPIRE_STREAMS_INTERVAL_SECONDS,
            "options": {"queue": maintenance_queue(settings), "expires": 300},
        },
        "sweep-batches": {
            "task": BATCH_SWEEP_TASK,
            "schedule": BATCH_SWEEP_INTERVAL_SECONDS,
            "options": {"queue": maintenance_queue(settings), "expires": 60},
        },
    }


def send_generate(app: Celery, settings: Settings, job_id: str, model: str) -> None:
    """Enqueue `generate(job_id)` on the model's queue (the body lives in workers/).

    Raises kombu/redis connection errors when the broker is unreachable.
    """
    # the args' repr given (the same text): Celery's own `saferepr` took 0.05 ms of it
    app.send_task(GENERATE_TASK, args=[job_id], queue=settings.queue_for(model),
                  argsrepr=repr([job_id]), kwargsrepr="{}")
    logger.debug("sent %s for job %s to %s", GENERATE_TASK, job_id, settings.queue_for(model))
