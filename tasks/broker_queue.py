"""What waits in a model's Celery queue: the job ids of its pending `generate` messages.

Read-only knowledge of how the Redis transport stores a queue (kombu): one list per
priority step (`<queue>` and `<queue>\\x06\\x16<step>`), under the deployment's
`global_keyprefix`, each element a JSON message whose base64 body is the task's
`[args, kwargs, embed]`. Messages a worker has fetched but not finished live in the
transport's `unacked` hash instead; they are not pending here (a dead worker's prefetched
message would otherwise look alive until the visibility timeout).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging

from redis import Redis

from tasks.settings import Settings

logger = logging.getLogger(__name__)

# kombu's Redis transport: priority steps and the separator of their list names
PRIORITY_STEPS = (0, 3, 6, 9)
PRIORITY_SEPARATOR = "\x06\x16"


def queue_keys(settings: Settings, model: str) -> list[str]:
    """The Redis lists holding `model`'s pending messages, one per priority step."""
    base = f"{settings.redis_prefix}:celery:{settings.queue_for(model)}"
    return [base if step == 0 else f"{base}{PRIORITY_SEPARATOR}{step}" for step in PRIORITY_STEPS]


def pending_job_ids(redis: Redis, settings: Settings, model: str) -> set[str]:
    """Job ids with a `generate` message waiting in `model`'s queue."""
    pipe = redis.pipeline(transaction=False)
    for key in queue_keys(settings, model):
        pipe.lrange(key, 0, -1)
    found: set[str] = set()
    for raw_messages in pipe.execute():
        for raw in raw_messages:
            job_id = _job_id_of(raw)
            if job_id is not None:
                found.add(job_id)
    return found


def _job_id_of(raw: bytes | str) -> str | None:
    """The first task argument of one stored message, or None if it is not ours."""
    try:
        message = json.loads(raw)
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return str(args[0]) if args else None
    except (ValueError, KeyError, TypeError, IndexError, binascii.Error):
        logger.debug("skipping a queue element that is not a task message")
        return None
