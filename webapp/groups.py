"""The device groups serving each model, as their heartbeats describe them.

`live_groups` reads the groups' heartbeats (only those whose alive key still exists);
`context_len` is the longest request a live group of a model can hold, so the API refuses
with a 400 what no group could ever run instead of accepting it and failing in a worker.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis

from tasks.protocol import group_alive_key, groups_key
from webapp.model_registry import ServedModel
from webapp.services import services

logger = logging.getLogger(__name__)

CONTEXT_CACHE_SECONDS = 2.0  # how long a model's group limits are reused between requests
# (redis prefix, model) -> (expires, group limit)
_context_cache: dict[tuple[str, str], tuple[float, int | None]] = {}


def live_groups(names: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Per model: the heartbeats of its device groups whose alive key still exists."""
    svc = services()
    pipe = svc.redis.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(groups_key(svc.settings, name))
    heartbeats: list[dict[bytes, bytes]] = pipe.execute()
    pipe = svc.redis.pipeline(transaction=False)
    candidates = [(name, group_id.decode()) for name, groups in zip(names, heartbeats)
                  for group_id in groups]
    for name, group_id in candidates:
        pipe.exists(group_alive_key(svc.settings, name, group_id))
    alive = {candidate for candidate, exists in zip(candidates, pipe.execute()) if exists}
    return {name: [_group(group_id.decode(), raw) for group_id, raw in sorted(groups.items())
                   if (name, group_id.decode()) in alive]
            for name, groups in zip(names, heartbeats)}


def context_len(model: ServedModel) -> int:
    """prompt + max_tokens a request to `model` may have: the largest `max_model_len` its
    live groups publish (a group clamps it to what its KV cache holds), never more than the
    checkpoint's; the checkpoint's when no group is up (the job then waits queued) or the
    heartbeats cannot be read."""
    now = time.monotonic()
    key = (services().settings.redis_prefix, model.name)
    cached = _context_cache.get(key)
    if cached is None or cached[0] < now:
        try:
            groups = live_groups([model.name])[model.name]
            limits = [g["max_model_len"] for g in groups
                      if isinstance(g.get("max_model_len"), int)]
            cached = (now + CONTEXT_CACHE_SECONDS, max(limits) if limits else None)
        except redis.RedisError as exc:
            logger.warning("reading the groups of %s failed (%s); using the checkpoint's "
                           "context length", model.name, exc)
            cached = (now + CONTEXT_CACHE_SECONDS, None)
        _context_cache[key] = cached
    group_limit = cached[1]
    return model.max_model_len if group_limit is None else min(model.max_model_len,
                                                                group_limit)


def _group(group_id: str, raw: bytes) -> dict[str, Any]:
    try:
        info = json.loads(raw)
    except ValueError:
        info = {}
    if not isinstance(info, dict):
        info = {}
    return {"id": group_id, **info}
